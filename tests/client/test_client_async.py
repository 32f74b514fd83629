"""The AsyncClient on asyncio and trio (the anyio_backend fixture runs each test on both)."""

from __future__ import annotations

import anyio
import httpx
import pytest

import kvclient
from kvclient import (
    APIConnectionError,
    AsyncClient,
    InsufficientQuotaError,
    PromptTooLongError,
    RetryBudget,
    RetryEvent,
    ServerBusyError,
)
from tests.helpers.client import (
    BASE_URL,
    CONTEXT,
    COUNTER,
    MODEL,
    FakeServer,
    busy,
    make_async_client,
    models,
    new_server,
    ok_chat,
    ok_completion,
)

pytestmark = pytest.mark.anyio

PROMPT = "Write a haiku about KV caches."
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def server() -> FakeServer:
    return new_server()


async def test_complete_and_chat_send_explicit_clamped_max_tokens(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
        server.default = ok_chat()
        chat = await client.chat(MESSAGES, max_tokens=99_999)
    assert server.posts[0].body == {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": CONTEXT - COUNTER.count(PROMPT),
    }
    assert server.posts[1].body["max_tokens"] == CONTEXT - COUNTER.count_messages(MESSAGES)
    assert result.max_tokens == server.posts[0].body["max_tokens"]
    assert chat.text == "hi there"
    assert chat.usage == kvclient.Usage(9, 2, 11)


async def test_prompt_too_long_sends_nothing(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        with pytest.raises(PromptTooLongError):
            await client.complete("token " * (CONTEXT + 1))
    assert server.seen == []


async def test_headers_and_idempotency_key_across_retries(server: FakeServer) -> None:
    server.add("/v1/completions", busy("1"), httpx.Response(502), ok_completion())
    async with make_async_client(server, api_key="k") as client:
        result = await client.complete(PROMPT)
    headers = [s.headers for s in server.posts]
    assert len({h["idempotency-key"] for h in headers}) == 1
    assert [h["x-retry-count"] for h in headers] == ["0", "1", "2"]
    assert headers[0]["user-agent"].startswith("kvclient/")
    assert headers[0]["authorization"] == "Bearer k"
    assert result.attempts == 3
    assert [e.status_code for e in result.history] == [429, 502]


@pytest.mark.parametrize(
    "failure",
    [
        busy("1"),
        httpx.Response(503, json={"error": "server busy, please try again."}),
        httpx.Response(504),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
    ],
    ids=["429", "503", "504", "refused", "timeout"],
)
async def test_retryable_failures_are_retried(server: FakeServer, failure: object) -> None:
    server.add("/v1/completions", failure, ok_completion())  # type: ignore[arg-type]
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    assert result.attempts == 2
    assert result.retry_wait == pytest.approx(sum(server.clock.sleeps))


async def test_a_closed_keep_alive_connection_is_resent_at_once(server: FakeServer) -> None:
    closed = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    server.add("/v1/completions", closed, closed, ok_completion())
    async with make_async_client(server) as client:
        result = await client.complete(PROMPT)
    assert len(server.posts) == 3
    assert (result.attempts, result.history, server.clock.sleeps) == (1, (), [])


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
async def test_client_errors_are_not_retried(server: FakeServer, status: int) -> None:
    server.add("/v1/completions", httpx.Response(status, json={"error": {"message": "no"}}))
    async with make_async_client(server) as client:
        with pytest.raises(kvclient.KVClientError):
            await client.complete(PROMPT)
    assert len(server.posts) == 1
    assert server.clock.sleeps == []


async def test_insufficient_quota_is_not_retried(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        httpx.Response(429, json={"error": {"message": "quota", "code": "insufficient_quota"}}),
    )
    async with make_async_client(server) as client:
        with pytest.raises(InsufficientQuotaError):
            await client.complete(PROMPT)
    assert len(server.posts) == 1


async def test_cap_and_deadline_fail_at_once(server: FakeServer) -> None:
    server.add("/v1/completions", busy("90"))
    async with make_async_client(server, retry=server.clock.policy(max_wait=60)) as client:
        with pytest.raises(ServerBusyError) as info:
            await client.complete(PROMPT)
    assert info.value.retry_after == 90
    assert server.clock.sleeps == []

    server = new_server()
    server.add("/v1/completions", busy("30"))
    policy = server.clock.policy(deadline=20, max_wait=60)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError, match="deadline"):
            await client.complete(PROMPT)
    assert server.clock.sleeps == []


async def test_connection_errors_exhausted(server: FakeServer) -> None:
    server.default = httpx.ConnectError("refused")
    async with make_async_client(server, retry=server.clock.policy(max_attempts=2)) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.complete(PROMPT)
    assert info.value.attempts == 2


async def test_on_retry_hook(server: FakeServer) -> None:
    events: list[RetryEvent] = []
    server.add("/v1/completions", busy("2"), ok_completion())
    async with make_async_client(server, on_retry=events.append) as client:
        await client.complete(PROMPT)
    assert len(events) == 1
    assert events[0].status_code == 429
    assert events[0].retry_after == 2
    assert events[0].wait >= 2


async def test_concurrent_requests_hold_during_the_cooldown(server: FakeServer) -> None:
    """One task gets 429 Retry-After 3; tasks started meanwhile wait it out without sending."""
    got_429 = anyio.Event()

    def first(request: httpx.Request) -> httpx.Response:
        got_429.set()
        return busy("3")

    def answer(request: httpx.Request) -> httpx.Response:
        # A request arriving before the cooldown ended would be a storm: answer it with 429 too.
        return busy("3") if server.clock.now < 3.0 else ok_completion()

    # Every sleeper falls asleep at the same virtual moment, then all wake at their own end
    # time: deterministic interleaving on both backends.
    clock = server.clock
    all_asleep = anyio.Event()
    asleep = 0

    async def sleep(seconds: float) -> None:
        nonlocal asleep
        until = clock.now + seconds
        clock.sleeps.append(seconds)
        asleep += 1
        if asleep == 6:
            all_asleep.set()
        await all_asleep.wait()
        clock.now = max(clock.now, until)

    server.add("/v1/completions", first)
    server.default = answer
    results: list[kvclient.Completion] = []
    async with make_async_client(server, retry=clock.policy(async_sleep=sleep)) as client:

        async def later() -> None:
            await got_429.wait()
            results.append(await client.complete(PROMPT))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(later)
            results.append(await client.complete(PROMPT))
    assert len(results) == 6
    statuses = [s.at >= 3.0 for s in server.posts]
    assert statuses == [False] + [True] * 6  # one 429, then everything after the cooldown
    held = [r for r in results if r.attempts == 1]
    assert len(held) == 5  # the five later tasks each sent once, after holding
    assert all(3.0 <= r.retry_wait <= 3.0 + 0.1 * 3 + 0.1 for r in held)
    assert sorted(r.attempts for r in results) == [1] * 5 + [2]  # the 429's task retried once


async def test_cooldown_longer_than_cap_fails_other_tasks_at_once(server: FakeServer) -> None:
    server.add("/v1/completions", busy("100"))
    async with make_async_client(server, retry=server.clock.policy(max_wait=10)) as client:
        with pytest.raises(ServerBusyError):
            await client.complete(PROMPT)
        with pytest.raises(ServerBusyError, match="cooling down"):
            await client.complete(PROMPT)
    assert len(server.posts) == 1


async def test_retry_budget(server: FakeServer) -> None:
    budget = RetryBudget(max_tokens=2, token_ratio=1)
    server.default = httpx.Response(503)
    policy = server.clock.policy(retry_budget=budget, max_attempts=50)
    async with make_async_client(server, retry=policy) as client:
        with pytest.raises(ServerBusyError, match="retry budget"):
            await client.complete(PROMPT)
    assert len(server.posts) == 1  # 2 -> 1: not more than half, no retry


async def test_discovery_once_across_tasks(server: FakeServer) -> None:
    server.add("/v1/models", models({"id": "served", "max_model_len": 400}))
    async with (
        make_async_client(server, model=None, context_window=None) as client,
        anyio.create_task_group() as tg,
    ):
        for _ in range(6):
            tg.start_soon(client.complete, PROMPT)
    assert [s.path for s in server.seen].count("/v1/models") == 1
    assert client.model == "served"
    assert client.context_window == 400
    assert all(s.body["model"] == "served" for s in server.posts)


async def test_discovery_is_retried_like_any_call(server: FakeServer) -> None:
    server.add("/v1/models", busy("1"), models())
    async with make_async_client(server, context_window=None) as client:
        await client.complete(PROMPT)
    assert client.context_window == CONTEXT


async def test_context_manager_closes(server: FakeServer) -> None:
    async with make_async_client(server) as client:
        pass
    assert client._http.is_closed


async def test_injected_http_client_stays_open(server: FakeServer) -> None:
    http = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
    async with make_async_client(server, base_url=BASE_URL + "/v1", http_client=http) as client:
        await client.complete(PROMPT)
    assert not http.is_closed
    await http.aclose()


async def test_real_anyio_sleep_is_used_by_default(server: FakeServer) -> None:
    """The default policy sleeps through anyio (a few ms here), on asyncio and on trio."""
    server.add("/v1/completions", busy(None, ms="5"), ok_completion())
    async with make_async_client(server, retry=kvclient.RetryPolicy(jitter_absolute=0.001)) as c:
        result = await c.complete(PROMPT)
    assert result.attempts == 2
    assert 0.005 <= result.retry_wait < 0.05


async def test_cancellation_is_not_retried_nor_swallowed(server: FakeServer) -> None:
    """A cancelled call stops at once: cancellation is never taken for a retryable failure."""
    sends = 0

    async def hang(request: httpx.Request) -> httpx.Response:
        nonlocal sends
        sends += 1
        await anyio.sleep(10)
        return ok_completion()

    client = AsyncClient(
        base_url=BASE_URL,
        model=MODEL,
        context_window=CONTEXT,
        counter=COUNTER,
        retry=server.clock.policy(),
        transport=httpx.MockTransport(hang),
    )
    async with client:
        with anyio.move_on_after(0.01) as scope:
            await client.complete(PROMPT)
    assert scope.cancelled_caught
    assert sends == 1
    assert server.clock.sleeps == []
