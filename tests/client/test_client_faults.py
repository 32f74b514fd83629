"""A misbehaving server: every fault is a typed KVClientError, never a hang or a hot loop."""

from __future__ import annotations

import math
import time
from email.utils import formatdate

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvclient import (
    APIConnectionError,
    APIResponseError,
    KVClientError,
    RateLimitError,
    ServerBusyError,
    parse_retry_after,
)
from tests.helpers.client import (
    busy,
    make_async_client,
    make_client,
    new_server,
    sse,
    text_events,
)

PROMPT = "hello"
YEAR = 365 * 24 * 3600


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"<html>oops</html>",
        b"[]",
        b'"a string"',
        b'{"choices": []}',
        b'{"choices": "nope"}',
    ],
)
def test_malformed_success_body_is_an_api_response_error(body: bytes) -> None:
    server = new_server(default=httpx.Response(200, content=body))
    started = time.monotonic()
    with make_client(server) as client, pytest.raises(APIResponseError) as info:
        client.complete(PROMPT)
    assert time.monotonic() - started < 1
    assert len(server.posts) == 1  # a broken answer is not retried blindly
    assert info.value.message


def test_malformed_json_message_is_clear() -> None:
    server = new_server(default=httpx.Response(200, content=b"{not json"))
    with make_client(server) as client, pytest.raises(APIResponseError, match="not JSON"):
        client.complete(PROMPT)


def test_truncated_stream_is_an_api_response_error() -> None:
    server = new_server(default=sse(*text_events("a", "b", usage=False)[:1], done=False))
    with make_client(server) as client, pytest.raises(APIResponseError, match="cut"):
        list(client.complete_stream(PROMPT))


def test_a_server_that_always_closes_the_connection() -> None:
    server = new_server(
        default=httpx.RemoteProtocolError("Server disconnected without sending a response.")
    )
    started = time.monotonic()
    with make_client(server) as client, pytest.raises(APIConnectionError) as info:
        client.complete(PROMPT)
    assert time.monotonic() - started < 1
    # The default max_attempts, plus the two immediate re-sends a call may spend on
    # connections the server closed; no more.
    assert len(server.posts) == 6 + 2
    assert info.value.retryable
    assert "disconnected" in str(info.value)
    assert all(wait >= 0.05 for wait in server.clock.sleeps)  # never a zero-delay retry


HOSTILE_GARBAGE = [
    "-1",
    "-0.001",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "Infinity",
    "1e309",
    "2 seconds",
    "Mon, 32 Foo 2026 25:61:61 GMT",
    "9" * 1_000_000,
    "3; DROP TABLE",
    "0x10",
    "",
]


@pytest.mark.parametrize("value", HOSTILE_GARBAGE, ids=lambda v: repr(v)[:20])
def test_garbage_retry_after_falls_back_to_backoff(value: str) -> None:
    server = new_server(default=busy(value))
    started = time.monotonic()
    with make_client(server) as client, pytest.raises(ServerBusyError) as info:
        client.complete(PROMPT)
    assert time.monotonic() - started < 1
    assert len(server.posts) == 6
    assert info.value.retry_after is None
    sleeps = server.clock.sleeps
    assert len(sleeps) == 5
    assert all(0.05 <= wait <= 10 for wait in sleeps)  # backoff: bounded, never zero


def test_garbage_retry_after_ms_also_falls_back() -> None:
    server = new_server(default=busy(None, ms="-5"))
    policy = server.clock.policy(max_attempts=3)
    with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError):
        client.complete(PROMPT)
    assert all(0.05 <= wait <= 10 for wait in server.clock.sleeps)


def test_a_date_in_the_past_is_not_a_zero_delay_retry() -> None:
    server = new_server()
    server.default = busy(formatdate(server.clock.wall() - 3600, usegmt=True))
    policy = server.clock.policy(max_attempts=4)
    with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError):
        client.complete(PROMPT)
    assert len(server.clock.sleeps) == 3
    assert all(wait >= 0.05 for wait in server.clock.sleeps)


@pytest.mark.parametrize(
    "value",
    [str(YEAR), "99999999999999999999", "86400.5"],
    ids=["a-year", "huge-int", "a-day"],
)
def test_absurd_retry_after_fails_at_once(value: str) -> None:
    server = new_server(default=busy(value))
    with make_client(server) as client, pytest.raises(ServerBusyError) as info:
        client.complete(PROMPT)
    assert len(server.posts) == 1
    assert server.clock.sleeps == []
    assert info.value.retry_after == float(value)
    assert "wait cap" in str(info.value)


def test_a_date_a_year_ahead_fails_at_once() -> None:
    server = new_server()
    server.default = busy(formatdate(server.clock.wall() + YEAR, usegmt=True))
    with make_client(server) as client, pytest.raises(ServerBusyError):
        client.complete(PROMPT)
    assert server.clock.sleeps == []


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(header=st.text(max_size=40) | st.from_regex(r"\d{1,6}(\.\d{1,3})?", fullmatch=True))
def test_any_retry_after_waits_within_advice_and_cap(header: str) -> None:
    """Whatever the header: the wait is >= the server's advice and <= the cap, or no wait."""
    server = new_server()
    try:
        response = busy(header)
    except (UnicodeEncodeError, ValueError):
        return  # not a header httpx can even send
    server.add("/v1/completions", response)
    policy = server.clock.policy(max_wait=30.0)
    advice = parse_retry_after(response.headers, now=server.clock.wall())
    if advice is not None and advice > 30.0:
        with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError) as info:
            client.complete(PROMPT)
        assert server.clock.sleeps == []
        assert info.value.retry_after == advice
        return
    with make_client(server, retry=policy) as client:
        result = client.complete(PROMPT)
    (wait,) = server.clock.sleeps
    assert math.isfinite(wait)
    assert 0 < wait <= 30.0
    if advice:
        assert wait >= advice
    assert result.attempts == 2


# --- async ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_faults_are_typed() -> None:
    server = new_server(default=httpx.Response(200, content=b"{not json"))
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError):
            await client.complete(PROMPT)
    server = new_server(default=httpx.ReadError("connection reset by peer"))
    async with make_async_client(server, retry=server.clock.policy(max_attempts=3)) as client:
        with pytest.raises(APIConnectionError, match="reset"):
            await client.complete(PROMPT)
    assert len(server.posts) == 3
    server = new_server(default=busy("inf"))
    async with make_async_client(server, retry=server.clock.policy(max_attempts=2)) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert isinstance(info.value.last_error, RateLimitError)
    assert isinstance(info.value, KVClientError)
    assert server.clock.sleeps
    assert all(w >= 0.05 for w in server.clock.sleeps)
