"""A misbehaving server: every fault is a typed KVClientError, never a hang or a hot loop.

The source of tests/client/_sync/test_faults.py (``python scripts/unasync.py``): edit this
file. The property-based check of any Retry-After is in tests/client/test_client_faults.py.
"""

from __future__ import annotations

import time
from email.utils import formatdate

import httpx
import pytest

from kvclient import (
    APIConnectionError,
    APIResponseError,
    ServerBusyError,
)
from tests.helpers.client import (
    busy,
    make_async_client,
    new_server,
    sse,
    text_events,
)

PROMPT = "hello"
YEAR = 365 * 24 * 3600

pytestmark = pytest.mark.anyio


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
async def test_malformed_success_body_is_an_api_response_error(body: bytes) -> None:
    server = new_server(default=httpx.Response(200, content=body))
    started = time.monotonic()
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError) as info:
            await client.complete(PROMPT)
    assert time.monotonic() - started < 1
    assert len(server.posts) == 1  # a broken answer is not retried blindly
    assert info.value.message


async def test_malformed_json_message_is_clear() -> None:
    server = new_server(default=httpx.Response(200, content=b"{not json"))
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError, match="not JSON"):
            await client.complete(PROMPT)


async def test_truncated_stream_is_an_api_response_error() -> None:
    server = new_server(default=sse(*text_events("a", "b", usage=False)[:1], done=False))
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError, match="cut"):
            [chunk async for chunk in client.complete_stream(PROMPT)]


async def test_a_server_that_always_closes_the_connection() -> None:
    server = new_server(
        default=httpx.RemoteProtocolError("Server disconnected without sending a response.")
    )
    started = time.monotonic()
    async with make_async_client(server) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.complete(PROMPT)
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
async def test_garbage_retry_after_falls_back_to_backoff(value: str) -> None:
    server = new_server(default=busy(value))
    started = time.monotonic()
    async with make_async_client(server) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert time.monotonic() - started < 1
    assert len(server.posts) == 6
    assert info.value.retry_after is None
    sleeps = server.clock.sleeps
    assert len(sleeps) == 5
    assert all(0.05 <= wait <= 10 for wait in sleeps)  # backoff: bounded, never zero


async def test_garbage_retry_after_ms_also_falls_back() -> None:
    server = new_server(default=busy(None, ms="-5"))
    policy = server.clock.policy(max_attempts=3)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
    assert all(0.05 <= wait <= 10 for wait in server.clock.sleeps)


async def test_a_date_in_the_past_is_not_a_zero_delay_retry() -> None:
    server = new_server()
    server.default = busy(formatdate(server.clock.wall() - 3600, usegmt=True))
    policy = server.clock.policy(max_attempts=4)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
    assert len(server.clock.sleeps) == 3
    assert all(wait >= 0.05 for wait in server.clock.sleeps)


@pytest.mark.parametrize(
    "value",
    [str(YEAR), "99999999999999999999", "86400.5"],
    ids=["a-year", "huge-int", "a-day"],
)
async def test_absurd_retry_after_fails_at_once(value: str) -> None:
    server = new_server(default=busy(value))
    async with make_async_client(server) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert server.clock.sleeps == []
    assert info.value.retry_after == float(value)
    assert "wait cap" in str(info.value)


async def test_a_date_a_year_ahead_fails_at_once() -> None:
    server = new_server()
    server.default = busy(formatdate(server.clock.wall() + YEAR, usegmt=True))
    async with make_async_client(server) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
    assert server.clock.sleeps == []
