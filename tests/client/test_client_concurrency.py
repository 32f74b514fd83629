"""What only one flavour of client can express: threads sharing a ``Client``, tasks sharing an
``AsyncClient`` (asyncio and trio), cancellation. Every other client behaviour is tested on both
in tests/client/_async/test_client.py and its generated sync twin."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest

import kvclient
from kvclient import AsyncClient
from tests.helpers.client import (
    BASE_URL,
    CONTEXT,
    COUNTER,
    MODEL,
    FakeServer,
    busy,
    make_async_client,
    make_client,
    models,
    new_server,
    ok_completion,
)

PROMPT = "Write a haiku about KV caches."


@pytest.fixture
def server() -> FakeServer:
    return new_server()


# --- threads: Client -------------------------------------------------------------------------


def test_discovery_is_thread_safe(server: FakeServer) -> None:
    server.default = None
    server.add("/v1/models", models())
    with make_client(server, context_window=None) as client:
        threads = [threading.Thread(target=client.complete, args=(PROMPT,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [s.path for s in server.seen].count("/v1/models") == 1
    assert len(server.posts) == 8


def test_cooldown_holds_other_threads(server: FakeServer) -> None:
    first_429 = threading.Event()

    def first(request: httpx.Request) -> httpx.Response:
        first_429.set()
        return busy("3")

    server.add("/v1/completions", first)
    results: list[object] = []
    with make_client(server) as client:

        def other() -> None:
            first_429.wait(5)
            results.append(client.complete(PROMPT))

        thread = threading.Thread(target=other)
        thread.start()
        results.append(client.complete(PROMPT))
        thread.join()
    assert len(results) == 2
    # Exactly one 429: the other thread did not discover the overload with its own request.
    assert len(server.posts) == 3
    assert all(s.at >= 3.0 for s in server.posts[1:])


# --- tasks: AsyncClient ----------------------------------------------------------------------


@pytest.mark.anyio
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


@pytest.mark.anyio
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


@pytest.mark.anyio
async def test_real_anyio_sleep_is_used_by_default(server: FakeServer) -> None:
    """The default policy sleeps through anyio (a few ms here), on asyncio and on trio."""
    server.add("/v1/completions", busy(None, ms="5"), ok_completion())
    async with make_async_client(server, retry=kvclient.RetryPolicy(jitter_absolute=0.001)) as c:
        result = await c.complete(PROMPT)
    assert result.attempts == 2
    assert 0.005 <= result.retry_wait < 0.05


@pytest.mark.anyio
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
