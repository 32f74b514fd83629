"""The client against a scripted fake server (httpx.MockTransport), on a fake clock.

The source of tests/client/_sync/test_client.py: ``python scripts/unasync.py`` writes the sync
tests from these (``--check`` fails when they differ), so every behaviour is tested on
``AsyncClient`` (asyncio and trio) and on ``Client``. Edit this file.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import respx

import kvclient
from kvclient import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    InsufficientQuotaError,
    KVClientError,
    PromptTooLongError,
    RateLimitError,
    RetryBudget,
    RetryEvent,
    ServerBusyError,
    ServiceUnavailableError,
)
from kvclient._replicas import Call
from tests.helpers.client import (
    BASE_URL,
    CONTEXT,
    COUNTER,
    MODEL,
    BrokenStream,
    FakeServer,
    busy,
    make_async_client,
    models,
    new_server,
    ok_chat,
    ok_completion,
    sse,
    text_events,
)

PROMPT = "Write a haiku about KV caches."
MESSAGES = [{"role": "user", "content": "Hello there"}]


pytestmark = pytest.mark.anyio


@pytest.fixture
def server() -> FakeServer:
    return new_server()


# --- the body: an explicit, clamped max_tokens, always ---------------------------------------


async def test_complete_sends_explicit_max_tokens_when_unset(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    counted = COUNTER.count(PROMPT)
    assert server.posts[0].path == "/v1/completions"
    assert server.posts[0].body == {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": CONTEXT - counted,
    }
    assert result.max_tokens == CONTEXT - counted
    assert result.prompt_tokens == counted
    assert result.text == "hello"
    assert result.finish_reason == "stop"
    assert result.usage == kvclient.Usage(5, 1, 6)
    assert result.attempts == 1
    assert result.retry_wait == 0
    assert result.history == ()
    assert (result.model, result.id) == (MODEL, "cmpl-1")


async def test_complete_clamps_a_cap_larger_than_what_remains(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        await client.complete(PROMPT, max_tokens=50_000, temperature=0.2)
    body = server.posts[0].body
    assert body["max_tokens"] == CONTEXT - COUNTER.count(PROMPT)
    assert body["temperature"] == 0.2


async def test_complete_keeps_a_cap_that_fits(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT, max_tokens=16)
    assert server.posts[0].body["max_tokens"] == 16
    assert result.max_tokens == 16


async def test_chat_counts_the_framing_and_clamps(server: FakeServer) -> None:
    server.default = ok_chat()
    async with make_async_client(server) as client:
        result = await client.chat(MESSAGES, max_tokens=10_000, top_p=0.9)
    counted = COUNTER.count_messages(MESSAGES)
    assert server.posts[0].path == "/v1/chat/completions"
    assert server.posts[0].body == {
        "model": MODEL,
        "messages": MESSAGES,
        "top_p": 0.9,
        "max_tokens": CONTEXT - counted,
    }
    assert result.text == "hi there"
    assert result.usage == kvclient.Usage(9, 2, 11)


async def test_chat_takes_max_completion_tokens_as_the_request(server: FakeServer) -> None:
    server.default = ok_chat()
    async with make_async_client(server) as client:
        await client.chat(MESSAGES, max_completion_tokens=12)
    body = server.posts[0].body
    assert body["max_tokens"] == 12
    assert "max_completion_tokens" not in body


async def test_prompt_that_fills_the_context_is_refused_locally(server: FakeServer) -> None:
    long_prompt = "token " * (CONTEXT + 10)
    async with make_async_client(server) as client:
        with pytest.raises(PromptTooLongError) as info:
            await client.complete(long_prompt)
    assert server.seen == []  # not a byte sent
    assert info.value.context_window == CONTEXT
    assert info.value.prompt_tokens == COUNTER.count(long_prompt)
    assert "nothing was sent" in str(info.value)


async def test_safety_margin_keeps_the_clamp_on_the_safe_side(server: FakeServer) -> None:
    counted = COUNTER.count(PROMPT)
    async with make_async_client(server, safety_margin=0.5) as client:
        result = await client.complete(PROMPT)
    assert result.max_tokens == CONTEXT - -(-counted * 3 // 2)
    assert result.max_tokens < CONTEXT - counted
    # A prompt that only fits without the margin is refused.
    prompt = "token " * 700
    async with make_async_client(server, safety_margin=0.5) as client:
        with pytest.raises(PromptTooLongError):
            await client.complete(prompt)


async def test_reserved_keys_cannot_bypass_the_clamp(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        with pytest.raises(TypeError, match="stream"):
            await client.complete(PROMPT, stream=True)
    async with make_async_client(server) as client:
        with pytest.raises(TypeError, match="model"):
            await client.complete(PROMPT, model="other")


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
async def test_invalid_max_tokens_is_a_value_error(server: FakeServer, bad: object) -> None:
    async with make_async_client(server) as client:
        with pytest.raises(ValueError, match="max_tokens"):
            await client.complete(PROMPT, max_tokens=bad)  # type: ignore[arg-type]
    assert server.seen == []


# --- context window discovery ----------------------------------------------------------------


async def test_context_window_is_discovered_once_from_v1_models(server: FakeServer) -> None:
    server.add(
        "/v1/models",
        models({"id": "other", "max_model_len": 50}, {"id": MODEL, "max_model_len": 300}),
    )
    async with make_async_client(server, context_window=None) as client:
        first = await client.complete(PROMPT)
        await client.complete(PROMPT)
    assert [s.path for s in server.seen] == ["/v1/models", "/v1/completions", "/v1/completions"]
    assert client.context_window == 300
    assert first.max_tokens == 300 - COUNTER.count(PROMPT)


async def test_discovery_adopts_the_first_model_when_none_is_given(server: FakeServer) -> None:
    server.add("/v1/models", models({"id": "served", "max_model_len": 200}))
    async with make_async_client(server, model=None, context_window=None) as client:
        await client.complete(PROMPT)
    assert client.model == "served"
    assert server.posts[0].body["model"] == "served"


async def test_discovery_without_any_window_says_what_it_tried(server: FakeServer) -> None:
    server.add("/v1/models", models({"id": MODEL, "object": "model"}))
    for path in ("/props", "/info", "/get_model_info", "/get_server_info", "/api/show"):
        server.add(path, httpx.Response(404, json={"detail": "Not Found"}))
    async with make_async_client(server, context_window=None) as client:
        with pytest.raises(KVClientError, match="context_window=") as caught:
            await client.complete(PROMPT)
    assert "GET /props -> 404" in str(caught.value)
    assert "POST /api/show -> 404" in str(caught.value)
    assert [s.path for s in server.posts] == ["/api/show"]  # nothing generated


async def test_discovery_of_an_unknown_model_names_the_served_ones(server: FakeServer) -> None:
    server.add("/v1/models", models({"id": "a", "max_model_len": 10}))
    async with make_async_client(server, context_window=None) as client:
        with pytest.raises(KVClientError, match="serves: a"):
            await client.complete(PROMPT)


async def test_discovery_is_retried_like_any_call(server: FakeServer) -> None:
    server.add("/v1/models", busy("1"), models())
    async with make_async_client(server, context_window=None) as client:
        await client.complete(PROMPT)
    assert client.context_window == CONTEXT


@pytest.mark.parametrize("url", [BASE_URL, BASE_URL + "/", BASE_URL + "/v1", BASE_URL + "/v1/"])
async def test_base_url_with_or_without_v1(server: FakeServer, url: str) -> None:
    async with make_async_client(server, base_url=url) as client:
        await client.complete(PROMPT)
    assert str(server.seen[0].headers["host"]) == "kv.test"
    assert server.posts[0].path == "/v1/completions"


async def test_base_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="http"):
        AsyncClient(base_url="kv.test:8000", model=MODEL, context_window=CONTEXT)


async def test_discover_with_verify_checks_a_server_when_nothing_is_left_to_learn(
    server: FakeServer,
) -> None:
    server.add("/v1/models", models(), models({"id": "other", "max_model_len": 10}))
    async with make_async_client(server) as client:
        await client.discover()  # model and window given: nothing is asked
        assert server.seen == []
        await client.discover(verify=True)  # the server serves the model
        with pytest.raises(KVClientError, match="serves: other"):
            await client.discover(verify=True)
    assert [s.path for s in server.seen] == ["/v1/models", "/v1/models"]


# --- the send path, as kvclient's adapters use it ---------------------------------------------


async def test_clamp_gives_the_cap_to_send_or_refuses(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        assert client.clamp(None, 10) == CONTEXT - 10
        assert client.clamp(50, 10) == 50
        with pytest.raises(PromptTooLongError):
            client.clamp(None, CONTEXT)


async def test_send_routes_stamps_and_holds_a_streamed_answers_slot_until_closed(
    server: FakeServer,
) -> None:
    server.add("/v1/completions", busy("1"), sse(*text_events("hi")))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}

    def build(call: Call) -> httpx.Request:
        return httpx.Request("POST", call.replica.base_url + "/v1/completions", json=body)

    async with make_async_client(server) as client:
        call = client.new_call(100)
        response = await client.send(call, build, stream=True)
        assert response.status_code == 200
        assert call.attempts == 2  # the 429 was retried on the same path
        # An answer already in memory (as MockTransport's are) has nothing left to hold for.
        assert client._window.requests == 0
        call = client.new_call(100)
        server.add("/v1/completions", httpx.Response(200, stream=BrokenStream([b"data: {}"])))
        response = await client.send(call, build, stream=True)
        assert client._window.requests == 1  # held while the answer is read
        await response.aclose()
        assert client._window.requests == 0
    first, second, _other_call = server.posts
    assert first.headers["idempotency-key"] == second.headers["idempotency-key"]
    assert [first.headers["x-retry-count"], second.headers["x-retry-count"]] == ["0", "1"]


# --- headers ---------------------------------------------------------------------------------


async def test_headers_user_agent_auth_extra_idempotency_and_retry_count(
    server: FakeServer,
) -> None:
    server.add("/v1/completions", busy("1"), busy("1"), ok_completion())
    async with make_async_client(server, api_key="sk-test", headers={"X-Team": "kv"}) as client:
        await client.complete(PROMPT)
    first, second, third = (s.headers for s in server.posts)
    assert first["user-agent"] == f"kvclient/{kvclient.__version__}"
    assert first["authorization"] == "Bearer sk-test"
    assert first["x-team"] == "kv"
    assert first["content-type"] == "application/json"
    keys = {h["idempotency-key"] for h in (first, second, third)}
    assert len(keys) == 1  # one key reused by every retry of the call
    assert [h["x-retry-count"] for h in (first, second, third)] == ["0", "1", "2"]


async def test_each_attempt_says_how_long_it_will_wait_for_an_answer(server: FakeServer) -> None:
    # RFC 7240 Prefer: wait=N, N under the attempt's read timeout and the call's time left: a
    # server that queues answers 429 before the attempt would give up on it.
    server.add("/v1/completions", ok_completion(), ok_completion())
    async with make_async_client(server, timeout=30.0) as client:
        await client.complete(PROMPT)
    async with make_async_client(server, headers={"Prefer": "wait=3"}) as client:
        await client.complete(PROMPT)
    mine, theirs = (s.headers for s in server.posts)
    assert mine["prefer"] == "wait=29"
    assert theirs["prefer"] == "wait=3"  # the caller's own preference is kept


async def test_an_injected_http_client_sends_the_same_headers(server: FakeServer) -> None:
    # An httpx client kvclient creates carries the constant headers as its defaults; one passed
    # in gets them with every request. The server must not see the difference.
    options = {"api_key": "sk-test", "headers": {"X-Team": "kv", "Accept-Encoding": "identity"}}
    events = text_events("hi")
    server.add("/v1/completions", ok_completion(), sse(*events), ok_completion(), sse(*events))
    async with make_async_client(server, **options) as client:
        await client.complete(PROMPT)
        async with client.complete_stream(PROMPT) as stream:
            [chunk async for chunk in stream]
    http = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
    async with make_async_client(server, http_client=http, **options) as client:
        await client.complete(PROMPT)
        async with client.complete_stream(PROMPT) as stream:
            [chunk async for chunk in stream]
    await http.aclose()

    def seen(index: int) -> dict[str, str]:
        headers = dict(server.posts[index].headers)
        assert headers.pop("idempotency-key")
        assert headers.pop("prefer").startswith("wait=")  # each client's own read timeout
        return headers

    owned_plain, owned_stream, injected_plain, injected_stream = map(seen, range(4))
    assert owned_plain == injected_plain
    assert owned_stream == injected_stream
    assert owned_plain["accept"] == "application/json"
    assert owned_stream["accept"] == "text/event-stream"
    assert owned_plain["accept-encoding"] == "identity"
    assert owned_plain["authorization"] == "Bearer sk-test"


async def test_priority_goes_as_x_priority_only_when_set() -> None:
    options = {"base_url": BASE_URL, "model": MODEL, "context_window": CONTEXT, "counter": COUNTER}
    with respx.mock(base_url=BASE_URL + "/v1") as router:
        texts = router.post("/completions").mock(side_effect=lambda request: ok_completion())
        chats = router.post("/chat/completions").mock(
            side_effect=[ok_chat(), sse(*text_events("hi", chat=True))]
        )
        async with AsyncClient(**options) as client:
            await client.complete(PROMPT)
            await client.complete(PROMPT, priority=2)
        async with AsyncClient(**options, priority=-1) as client:
            await client.complete(PROMPT)
            await client.complete(PROMPT, priority=0)  # a call's own wins, 0 included
            await client.chat(MESSAGES)
            async with client.chat_stream(MESSAGES, priority=5) as stream:
                [chunk async for chunk in stream]
    assert [c.request.headers.get("x-priority") for c in texts.calls] == [None, "2", "-1", "0"]
    assert [c.request.headers.get("x-priority") for c in chats.calls] == ["-1", "5"]
    bodies = [json.loads(c.request.content) for c in [*texts.calls, *chats.calls]]
    assert not any("priority" in body for body in bodies)  # a header, never a body field


@pytest.mark.parametrize("bad", [True, 1.5, "1"])
async def test_priority_must_be_an_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="priority must be an integer"):
        AsyncClient(base_url=BASE_URL, priority=bad)  # type: ignore[arg-type]
    async with AsyncClient(base_url=BASE_URL, model=MODEL, context_window=CONTEXT) as client:
        with pytest.raises(ValueError, match="priority must be an integer"):
            await client.complete(PROMPT, priority=bad)  # type: ignore[arg-type]


async def test_each_call_has_its_own_idempotency_key(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        await client.complete(PROMPT)
        await client.complete(PROMPT)
    assert server.posts[0].headers["idempotency-key"] != server.posts[1].headers["idempotency-key"]


# --- what is retried -------------------------------------------------------------------------


def _reset() -> httpx.ReadError:
    """What httpx raises when the peer resets the connection, the request unread in its socket."""
    reset = httpx.ReadError("")
    reset.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    return reset


@pytest.mark.parametrize("how", ["hung up", "reset"])
async def test_a_closed_keep_alive_connection_is_resent_at_once(
    server: FakeServer, how: str
) -> None:
    """llama.cpp closes a keep-alive connection after each stream, uvicorn one idle for 5 s (a
    reset when the request was in its socket already): no backoff, no attempt."""
    if how == "reset":
        closed: httpx.HTTPError = _reset()
    else:
        closed = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    server.add("/v1/completions", closed, closed, ok_completion())
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    assert len(server.posts) == 3
    assert (result.attempts, result.history, server.clock.sleeps) == (1, (), [])


async def test_a_server_that_keeps_closing_connections_takes_the_retry_path(
    server: FakeServer,
) -> None:
    closed = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    server.add("/v1/completions", closed, closed, closed, ok_completion())
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    assert len(server.posts) == 4
    assert result.attempts == 2
    assert len(server.clock.sleeps) == 1


@pytest.mark.parametrize(
    "failure",
    [
        busy("1"),
        busy(None),
        httpx.Response(503, json={"error": {"message": "starting", "type": "unavailable"}}),
        httpx.Response(502, text="<html>Bad Gateway</html>"),
        httpx.Response(504, text="upstream timed out"),
        httpx.ConnectError("connection refused"),
        httpx.ConnectTimeout("connect timed out"),
        httpx.ReadTimeout("no answer in time"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message"),
        httpx.ReadError("not a reset"),
    ],
    ids=[
        "429",
        "429-no-header",
        "503",
        "502",
        "504",
        "refused",
        "connect-timeout",
        "read-timeout",
        "protocol-error",
        "read-error",
    ],
)
async def test_retryable_failures_are_retried(server: FakeServer, failure: object) -> None:
    server.add("/v1/completions", failure, failure, ok_completion())  # type: ignore[arg-type]
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    assert len(server.posts) == 3
    assert result.attempts == 3
    assert len(result.history) == 2
    assert result.retry_wait == pytest.approx(sum(server.clock.sleeps))
    assert all(s.body == server.posts[0].body for s in server.posts)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, {"error": {"message": "bad temperature", "type": "invalid_request_error"}}),
        (401, {"error": {"message": "bad key", "type": "authentication_error"}}),
        (403, {"error": {"message": "forbidden", "type": "permission_error"}}),
        (404, {"error": {"message": "no such model", "type": "not_found_error"}}),
        (
            422,
            {
                "error": "Input validation error: `temperature` must be strictly positive",
                "error_type": "validation",
            },
        ),
        (500, {"error": {"message": "boom", "type": "internal_error"}}),
        (
            400,
            {
                "error": {
                    "message": "request can never fit the KV budget",
                    "type": "invalid_request_error",
                    "code": "request_too_large",
                }
            },
        ),
    ],
)
async def test_client_errors_are_not_retried(server: FakeServer, status: int, body: object) -> None:
    server.add("/v1/completions", httpx.Response(status, json=body))
    async with make_async_client(server) as client:
        with pytest.raises(kvclient.APIStatusError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert info.value.status_code == status
    assert not info.value.retryable
    assert info.value.attempts == 1
    assert server.clock.sleeps == []


async def test_our_413_is_prompt_too_long_and_not_retried(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        httpx.Response(
            413,
            json={
                "error": {
                    "message": "prompt of 1200 tokens exceeds the context window of 1000",
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                }
            },
        ),
    )
    async with make_async_client(server) as client:
        with pytest.raises(PromptTooLongError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert info.value.status_code == 413
    assert info.value.code == "context_length_exceeded"


async def test_insufficient_quota_429_is_not_retried(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        httpx.Response(
            429,
            headers={"Retry-After": "1"},
            json={
                "error": {
                    "message": "You exceeded your current quota",
                    "type": "insufficient_quota",
                    "code": "insufficient_quota",
                }
            },
        ),
    )
    async with make_async_client(server) as client:
        with pytest.raises(InsufficientQuotaError):
            await client.complete(PROMPT)
    assert len(server.posts) == 1


async def test_read_error_after_the_answer_started_is_not_retried(server: FakeServer) -> None:
    server.add("/v1/completions", httpx.Response(200, stream=BrokenStream([b'{"choices": ['])))
    async with make_async_client(server) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert not info.value.retryable
    assert "while reading the answer" in str(info.value)


async def test_connection_errors_exhausted_raise_the_connection_error(server: FakeServer) -> None:
    server.default = httpx.ConnectTimeout("timed out")
    async with make_async_client(server, retry=server.clock.policy(max_attempts=3)) as client:
        with pytest.raises(APITimeoutError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 3
    assert info.value.attempts == 3
    assert len(info.value.history) == 2


# --- how long to wait ------------------------------------------------------------------------


async def test_waits_honor_retry_after_ms_then_seconds_with_jitter_above(
    server: FakeServer,
) -> None:
    server.add("/v1/completions", busy("3", ms="1500"), busy("2"), busy(None), ok_completion())
    policy = server.clock.policy(random=lambda: 0.5)
    async with make_async_client(server, retry=policy) as client:
        result = await client.complete(PROMPT)
    waits = [event.wait for event in result.history]
    assert waits[0] == pytest.approx(1.5 + 0.5 * (0.1 * 1.5 + 0.1))
    assert waits[1] == pytest.approx(2.0 + 0.5 * (0.1 * 2.0 + 0.1))
    # No advice: full-jitter backoff for attempt 3: uniform up to 0.5 * 2**2.
    assert waits[2] == pytest.approx(0.05 + (2.0 - 0.05) * 0.5)
    assert [event.retry_after for event in result.history] == [1.5, 2.0, None]
    assert server.clock.sleeps == waits


async def test_http_date_retry_after_is_read_against_the_wall_clock(server: FakeServer) -> None:
    from email.utils import formatdate

    date = formatdate(server.clock.wall() + 4, usegmt=True)
    server.add("/v1/completions", busy(date), ok_completion())
    async with make_async_client(server, retry=server.clock.policy(random=lambda: 0.0)) as client:
        result = await client.complete(PROMPT)
    assert result.history[0].retry_after == pytest.approx(4, abs=1)
    assert result.history[0].wait >= result.history[0].retry_after


async def test_wait_longer_than_the_cap_fails_at_once(server: FakeServer) -> None:
    server.add("/v1/completions", busy("120"))
    async with make_async_client(server, retry=server.clock.policy(max_wait=30)) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert info.value.retry_after == 120
    assert info.value.attempts == 1
    assert isinstance(info.value.last_error, RateLimitError)
    assert server.clock.sleeps == []  # no hopeless sleep


async def test_wait_past_the_deadline_fails_at_once(server: FakeServer) -> None:
    server.add("/v1/completions", busy("4"), busy("4"), busy("4"))
    policy = server.clock.policy(deadline=10, max_wait=60, random=lambda: 0.0)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    # t=0 429 (4s left ok) -> t=4 429 -> t=8: 4s wait would end past the 10s deadline
    assert len(server.posts) == 3
    assert info.value.attempts == 3
    assert "deadline" in str(info.value)
    assert server.clock.now == pytest.approx(8)


async def test_attempts_exhausted_is_server_busy_with_history(server: FakeServer) -> None:
    server.default = busy("1")
    async with make_async_client(server, retry=server.clock.policy(max_attempts=4)) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 4
    assert info.value.attempts == 4
    assert [event.attempt for event in info.value.history] == [1, 2, 3]
    assert info.value.retry_after == 1


async def test_on_retry_hook_and_log_event(
    server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[RetryEvent] = []
    server.add("/v1/completions", busy("1"), httpx.Response(503), ok_completion())
    with caplog.at_level(logging.INFO, logger="kvclient"):
        async with make_async_client(server, on_retry=events.append) as client:
            await client.complete(PROMPT)
    assert [(e.attempt, e.status_code) for e in events] == [(1, 429), (2, 503)]
    assert all(e.wait > 0 for e in events)
    records = [r for r in caplog.records if hasattr(r, "kvclient_retry")]
    assert [r.kvclient_retry for r in records] == events  # type: ignore[attr-defined]


# --- no storms: the client-wide cooldown -----------------------------------------------------


async def test_a_429_cools_the_whole_client_down(server: FakeServer) -> None:
    server.add("/v1/completions", busy("5"))
    policy = server.clock.policy(max_attempts=1)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
        result = await client.complete(PROMPT)  # started during the cooldown
    assert server.posts[1].at >= 5.0  # held until the server's time had passed
    assert result.retry_wait >= 5.0
    assert result.attempts == 1


async def test_a_429_holds_smaller_requests_too_by_default(server: FakeServer) -> None:
    server.add("/v1/completions", busy("5"))
    async with make_async_client(server, retry=server.clock.policy(max_attempts=1)) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT, max_tokens=800)
        small = await client.complete(PROMPT, max_tokens=50)
    assert server.posts[1].at >= 5.0
    assert small.retry_wait >= 5.0


async def test_cooldown_by_size_holds_only_requests_at_least_as_large_as_the_refused_one(
    server: FakeServer,
) -> None:
    """A 429 for 2 + 800 tokens says that much does not fit; a 2 + 50 request may, and goes at
    once, while another 2 + 800 (or larger) one waits out the server's time."""
    server.add("/v1/completions", busy("5"))
    policy = server.clock.policy(max_attempts=1, cooldown_by_size=True)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT, max_tokens=800)
        small = await client.complete(PROMPT, max_tokens=50)
        assert server.posts[1].at < 5.0  # not held
        large = await client.complete(PROMPT, max_tokens=900)
    assert server.posts[2].at >= 5.0
    assert small.retry_wait == 0
    assert large.retry_wait >= 5.0


async def test_cooldown_longer_than_the_cap_fails_other_requests_at_once(
    server: FakeServer,
) -> None:
    server.add("/v1/completions", busy("50"))
    async with make_async_client(server, retry=server.clock.policy(max_wait=10)) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
        with pytest.raises(ServerBusyError, match="cooling down") as info:
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert info.value.attempts == 0


# --- retry budget ----------------------------------------------------------------------------


async def test_retry_budget_bounds_retries_when_the_server_keeps_failing(
    server: FakeServer,
) -> None:
    budget = RetryBudget(max_tokens=4, token_ratio=0.5)
    server.default = httpx.Response(503)
    policy = server.clock.policy(retry_budget=budget, max_attempts=100)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError, match="retry budget") as info:
            await client.complete(PROMPT)
        assert len(server.posts) == 2  # 4 -> 3 (retry) -> 2 (not > half): stop
        assert isinstance(info.value.last_error, ServiceUnavailableError)
        with pytest.raises(ServerBusyError, match="retry budget"):
            await client.complete(PROMPT)
        assert len(server.posts) == 3  # no retry at all now
        # Successes earn the budget back.
        server.default = ok_completion()
        for _ in range(4):
            await client.complete(PROMPT)
        assert budget.allows_retry()


async def test_retry_budget_lets_a_pacing_server_through(server: FakeServer) -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=1)
    policy = server.clock.policy(retry_budget=budget)
    async with make_async_client(server, retry=policy) as client:
        for _ in range(20):
            server.add("/v1/completions", busy("1"), ok_completion())
            assert (await client.complete(PROMPT)).attempts == 2


# --- lifecycle -------------------------------------------------------------------------------


async def test_context_manager_closes_owned_connections(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        pass
    assert client._http.is_closed


async def test_an_injected_http_client_is_not_closed(server: FakeServer) -> None:
    http = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
    async with make_async_client(server, http_client=http) as client:
        await client.complete(PROMPT)
    assert not http.is_closed
    await http.aclose()


async def test_default_counter_is_tiktoken() -> None:
    client = AsyncClient(base_url=BASE_URL, model=MODEL, context_window=CONTEXT)
    assert isinstance(client.counter, kvclient.TiktokenCounter)
    await client.aclose()


async def test_each_attempt_times_out_before_the_deadline(server: FakeServer) -> None:
    timeouts: list[dict[str, float]] = []

    def record(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return busy("4") if len(timeouts) == 1 else ok_completion()

    server.default = record
    policy = server.clock.policy(deadline=10, random=lambda: 0.0)
    async with make_async_client(
        server, retry=policy, timeout=httpx.Timeout(30, connect=2)
    ) as client:
        await client.complete(PROMPT)
    assert timeouts[0] == {"connect": 2, "read": 10, "write": 10, "pool": 10}
    assert timeouts[1] == {"connect": 2, "read": 6, "write": 6, "pool": 6}


async def test_a_failing_on_retry_hook_does_not_change_the_call(
    server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_hook(event: RetryEvent) -> None:
        raise RuntimeError("observer bug")

    server.add("/v1/completions", busy("1"), ok_completion())
    async with make_async_client(server, on_retry=broken_hook) as client:
        assert (await client.complete(PROMPT)).attempts == 2
    assert "on_retry hook raised" in caplog.text


async def test_a_wrong_url_scheme_is_not_retried() -> None:
    async with AsyncClient(
        base_url="http://kv.test", model=MODEL, context_window=CONTEXT
    ) as client:
        client.base_url = "ftp://kv.test"
        with pytest.raises(APIConnectionError) as info:
            await client.complete(PROMPT)
    assert not info.value.retryable
    assert info.value.attempts == 1
