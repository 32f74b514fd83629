"""The client against real loopback servers that misbehave, and
against advice that keeps being too short.

Deadlines here are real time (0.6 s), since what is tested is what sockets do; every
hostile script would run for many seconds more, so a client that does not stop at its deadline
fails the test by the time it takes, not by luck.
"""

from __future__ import annotations

import base64
import logging
import socket
import time
import warnings
from typing import Any

import anyio.lowlevel
import httpx
import pytest

from kvclient import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    Client,
    RetryEvent,
    RetryPolicy,
    ServerBusyError,
)
from tests.helpers.client import (
    BASE_URL,
    COUNTER,
    MODEL,
    busy,
    make_async_client,
    make_client,
    new_server,
    ok_completion,
)
from tests.helpers.hostile import (
    HostileServer,
    chat_events,
    hold_open,
    json_answer,
    ping_forever,
    sse_answer,
    trickle_json,
)

DEADLINE = 0.6
# How long past its deadline a call may end: one read of a trickled byte plus scheduling.
SLACK = 1.5
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
ANSWER = {
    "id": "c",
    "model": MODEL,
    "choices": [{"index": 0, "text": "a fine answer " * 4, "finish_reason": "stop"}],
}


def _options(server: HostileServer, **overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "base_url": server.base_url,
        "model": MODEL,
        "context_window": 1000,
        "counter": COUNTER,
        "retry": RetryPolicy(deadline=DEADLINE),
    }
    options.update(overrides)
    return options


def _trickle() -> HostileServer:
    return HostileServer(default=trickle_json(ANSWER, interval=0.1, seconds=8.0))


def _pings() -> HostileServer:
    return HostileServer(default=ping_forever(interval=0.1, seconds=8.0))


# --- 12.7: the deadline bounds the whole call --------------------------------------------------


def test_sync_trickled_body_fails_at_the_deadline() -> None:
    with _trickle() as server, Client(**_options(server)) as client:
        started = time.monotonic()
        with pytest.raises(APITimeoutError, match="deadline"):
            client.complete("Hi", max_tokens=5)
        took = time.monotonic() - started
    assert took < DEADLINE + SLACK


@pytest.mark.anyio
async def test_async_trickled_body_fails_at_the_deadline() -> None:
    with _trickle() as server:
        async with AsyncClient(**_options(server)) as client:
            started = time.monotonic()
            with pytest.raises(APITimeoutError, match="deadline"):
                await client.complete("Hi", max_tokens=5)
            took = time.monotonic() - started
    assert took < DEADLINE + SLACK


def test_sync_stream_of_pings_without_a_first_event_fails_at_the_deadline() -> None:
    with _pings() as server, Client(**_options(server)) as client:
        started = time.monotonic()
        with pytest.raises(APITimeoutError, match="deadline"):
            client.chat_stream(MESSAGES, max_tokens=5).__enter__()
        took = time.monotonic() - started
    assert took < DEADLINE + SLACK


@pytest.mark.anyio
async def test_async_stream_of_pings_without_a_first_event_fails_at_the_deadline() -> None:
    with _pings() as server:
        async with AsyncClient(**_options(server)) as client:
            started = time.monotonic()
            with pytest.raises(APITimeoutError, match="deadline"):
                async with client.chat_stream(MESSAGES, max_tokens=5):
                    pass
            took = time.monotonic() - started
    assert took < DEADLINE + SLACK


def _first_event_then_pings() -> HostileServer:
    first = chat_events({"role": "assistant", "content": "Once"})[0].replace(b'"stop"', b"null")
    pings = [b": ping\n\n"] * 40
    return HostileServer(default=sse_answer([first, *pings], pause=0.2))


def test_sync_stream_after_its_first_event_is_bounded_by_the_read_timeout() -> None:
    # The deadline is long here: after the first event, the read timeout bounds each event.
    options = _options(_server := _first_event_then_pings())
    options.update(retry=RetryPolicy(deadline=30.0), timeout=httpx.Timeout(30.0, read=0.4))
    with _server, Client(**options) as client:
        started = time.monotonic()
        with client.chat_stream(MESSAGES, max_tokens=5) as stream:
            assert next(stream).text == "Once"
            with pytest.raises(APITimeoutError, match="read timeout"):
                next(stream)
        took = time.monotonic() - started
    assert took < 0.4 + SLACK


@pytest.mark.anyio
async def test_async_stream_after_its_first_event_is_bounded_by_the_read_timeout() -> None:
    options = _options(_server := _first_event_then_pings())
    options.update(retry=RetryPolicy(deadline=30.0), timeout=httpx.Timeout(30.0, read=0.4))
    with _server:
        async with AsyncClient(**options) as client:
            started = time.monotonic()
            async with client.chat_stream(MESSAGES, max_tokens=5) as stream:
                assert (await stream.__anext__()).text == "Once"
                with pytest.raises(APITimeoutError, match="read timeout"):
                    await stream.__anext__()
            took = time.monotonic() - started
    assert took < 0.4 + SLACK


# --- 12.8: a stream left without `with` gives its send-window room back -------------------------


def _abandoned_then_busy() -> HostileServer:
    """A stream that sends one event and stays open; then a 429 (10 ms), then answers."""
    first = chat_events({"content": "Once"})[0].replace(b'"stop"', b"null")
    refusal = {"error": {"message": "KV cache full", "type": "server_overloaded"}}
    return HostileServer(
        scripts=[
            hold_open([first], seconds=10.0),
            json_answer(429, refusal, {"Retry-After": "1", "retry-after-ms": "10"}),
        ],
        default=json_answer(200, ANSWER),
    )


def _abandon_by_break(client: Client) -> None:
    for chunk in client.chat_stream(MESSAGES, max_tokens=5):
        assert chunk.text == "Once"
        break


def _abandon_by_dropping(client: Client) -> None:
    stream = client.chat_stream(MESSAGES, max_tokens=5)
    assert next(stream).text == "Once"
    del stream  # CPython frees it here, as it would a stream dropped in a loop


@pytest.mark.parametrize("abandon", [_abandon_by_break, _abandon_by_dropping])
def test_sync_abandoned_stream_gives_back_its_window_room(abandon: Any) -> None:
    with _abandoned_then_busy() as server, Client(**_options(server)) as client:
        abandon(client)
        # Without its room back, the window (closed by the 429 to what else is in flight)
        # would hold this retry until the deadline: ServerBusyError.
        completion = client.complete("Hi", max_tokens=5)
    assert completion.attempts == 2
    assert client._window.requests == 0


@pytest.mark.anyio
async def test_async_abandoned_stream_gives_back_its_window_room() -> None:
    with _abandoned_then_busy() as server:
        async with AsyncClient(**_options(server)) as client:
            with warnings.catch_warnings():
                # trio warns when it collects httpx's unfinished generators under the dropped
                # stream (use `async with` to avoid that); the room must come back regardless.
                warnings.simplefilter("ignore", ResourceWarning)
                async for chunk in client.chat_stream(MESSAGES, max_tokens=5):
                    assert chunk.text == "Once"
                    break
                assert client._window.requests == 0  # given back at once, when dropped
                for _ in range(20):  # let trio finalize the generators while warnings are off
                    await anyio.lowlevel.checkpoint()
            completion = await client.complete("Hi", max_tokens=5)
    assert completion.attempts == 2
    assert client._window.requests == 0


# --- 12.11: credentials in the base URL never show ----------------------------------------------


def test_a_password_in_the_base_url_never_appears_in_errors_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as probe:  # a port nobody listens on: connecting fails, is retried
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    events: list[RetryEvent] = []
    retry = RetryPolicy(deadline=5.0, max_attempts=2, backoff_initial=0.01)
    with (
        caplog.at_level(logging.DEBUG, logger="kvclient"),
        Client(
            base_url=url.replace("http://", "http://alice:hunter2@"),
            model=MODEL,
            context_window=1000,
            counter=COUNTER,
            retry=retry,
            on_retry=events.append,
        ) as c,
        pytest.raises(APIConnectionError) as info,
    ):
        c.complete("Hi", max_tokens=5)
    shown = [str(info.value), repr(info.value), c.base_url, *(e.error for e in events)]
    shown += [record.getMessage() for record in caplog.records]
    assert events
    assert all("hunter2" not in text for text in shown)
    assert url in str(info.value)
    with pytest.raises(ValueError, match="ftp") as bad:
        Client(base_url="ftp://bob:hunter2@example.test", model=MODEL, context_window=10)
    assert "hunter2" not in str(bad.value)


def test_credentials_in_the_base_url_are_still_sent_as_basic_auth() -> None:
    server = new_server()
    with make_client(server, base_url=BASE_URL.replace("http://", "http://alice:s%40cret@")) as c:
        c.complete("Hi", max_tokens=5)
    seen = server.posts[0]
    assert seen.headers["authorization"] == "Basic " + base64.b64encode(b"alice:s@cret").decode()
    assert "cret" not in c.base_url


# --- 12.11 and 12.1: several Retry-After headers; advice that keeps being too short -----------


def test_two_retry_after_headers_wait_the_larger() -> None:
    server = new_server()
    refusal = httpx.Response(
        429,
        headers=[("Retry-After", "1"), ("Retry-After", "2")],
        json={"error": {"message": "full", "type": "server_overloaded"}},
    )
    server.add("/v1/completions", refusal, ok_completion())
    with make_client(server) as client:
        completion = client.complete("Hi", max_tokens=5)
    assert completion.history[0].retry_after == 2.0
    assert completion.history[0].wait >= 2.0


def test_advice_that_keeps_being_too_short_does_not_burn_every_attempt() -> None:
    # A server that always says "retry in 1 ms" while it stays full.
    server = new_server(default=busy("1", ms="1"))
    policy = server.clock.policy(deadline=30.0, random=lambda: 0.5)
    with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError) as info:
        client.complete("Hi", max_tokens=5)
    waits = [event.wait for event in info.value.history]
    assert info.value.attempts == 6
    # The first retry trusts the advice; later ones back off as if there were none.
    assert waits[0] < 0.2
    assert waits == sorted(waits)
    assert sum(waits) > 5.0  # not six attempts in half a second
    times = [seen.at for seen in server.posts]
    assert times[-1] - times[0] > 5.0


@pytest.mark.anyio
async def test_async_advice_that_keeps_being_too_short_does_not_burn_every_attempt() -> None:
    server = new_server(default=busy("1", ms="1"))
    policy = server.clock.policy(deadline=30.0, random=lambda: 0.5)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete("Hi", max_tokens=5)
    assert sum(event.wait for event in info.value.history) > 5.0


def test_backoff_floor_still_stops_at_the_deadline() -> None:
    server = new_server(default=busy("1", ms="1"))
    policy = server.clock.policy(deadline=2.0, max_attempts=50, random=lambda: 0.5)
    with (
        make_client(server, retry=policy) as client,
        pytest.raises(ServerBusyError, match="deadline"),
    ):
        client.complete("Hi", max_tokens=5)
    assert server.clock.now < 2.0
