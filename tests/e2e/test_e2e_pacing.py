"""Servers advertise their room (RateLimit headers), clients pace from it: over loopback.

The reference server and the gateway put the room on answers, streams, 429s and /v1/models; an
AsyncClient (asyncio and trio) that paces collects fewer 429s than one that does not, under the
same overload, counted by the server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from kvclient import AsyncClient, RetryPolicy
from kvclient._pacing import Pacer
from kvclient.headers import RoomHint, parse_ratelimit
from reference_server import RunningServer, running_server
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
from tests.helpers.servers import at_zero, wait_for

CONFIG: dict[str, Any] = {
    "kv_tokens": 4096,  # usable 3686: four requests of 912 KV tokens fit at once, not five
    "context_window": 2048,
    "decode_rate": 8000.0,
    "mean_output_tokens": 1e6,  # always run to the cap
    "tick_seconds": 0.005,
}
BODY = {"prompt": "x", "max_tokens": 900}  # 1 + 900 tokens, 912 in blocks of 16
LARGE = {"prompt": "x", "max_tokens": 2000}  # 2016: two do not fit together
#: For the bursts: each request holds its room for 0.45 s, long beside the spread with which a
#: loaded machine starts twelve threads or tasks, so they really arrive together.
BURST_CONFIG: dict[str, Any] = {**CONFIG, "decode_rate": 2000.0}


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with running_server(**CONFIG) as running:
        yield running


def test_answers_streams_and_429s_carry_the_room(server: RunningServer) -> None:
    url = server.base_url + "/v1/completions"
    with httpx.Client(timeout=10) as http:
        answer = http.post(url, json=BODY)
        hint = parse_ratelimit(answer.headers)
        assert answer.headers["RateLimit-Policy"] == '"kv";q=3686;kvtok'
        # Its own reservation is released as the answer goes: all of the budget is free.
        assert hint is not None
        assert (hint.quota, hint.remaining, hint.reset) == (3686, 3686, 0.0)
        with http.stream("POST", url, json={**LARGE, "stream": True}) as stream:
            during = parse_ratelimit(stream.headers)
            assert during is not None
            assert during.remaining == 3686 - 2016  # the stream holds its room while it runs
            assert during.reset is not None
            assert 0.1 < during.reset <= 0.25 + 0.035  # 2000 / 8000 s + the release margin
            refused = http.post(url, json=LARGE)
            stream.read()
        assert refused.status_code == 429
        busy = parse_ratelimit(refused.headers)
        assert busy is not None
        assert busy.remaining == 3686 - 2016
    wait_for(lambda: at_zero(server))  # the stream's room goes back just after its last byte
    metrics = server.metrics()
    assert metrics["kv_free_tokens"] == 3686
    assert metrics["kv_next_release_seconds"] == 0.0


def test_the_gateway_advertises_its_own_room_and_not_the_upstreams() -> None:
    with (
        running_server(**{**CONFIG, "kv_tokens": 8192}) as upstream,
        running_gateway(
            # Refusing at once, as this test's 429 shows (by default the gateway queues).
            GatewayConfig(
                upstreams=(upstream.base_url,),
                kv_tokens=(4096,),
                decode_rate=8000.0,
                max_queue_wait=0.0,
            )
        ) as gateway,
        httpx.Client(timeout=10) as http,
    ):
        url = gateway.base_url + "/v1/completions"
        answer = http.post(url, json=BODY)
        assert answer.headers.get_list("RateLimit-Policy") == ['"kv";q=3686;kvtok']
        assert answer.headers.get_list("RateLimit") == ['"kv";r=3686;t=0;tms=0']
        with http.stream("POST", url, json={**LARGE, "stream": True}) as stream:
            hint = parse_ratelimit(stream.headers)
            assert hint is not None
            assert hint.remaining == 3686 - 2016
            refused = http.post(url, json=LARGE)
            stream.read()
        assert refused.status_code == 429
        assert parse_ratelimit(refused.headers) is not None


async def _burst(server: RunningServer, *, pace: bool, n: int = 12) -> float:
    """One client: a first request (it learns the room), then ``n`` at once. The server's 429s."""
    policy = RetryPolicy(pace=pace, deadline=30)
    async with AsyncClient(base_url=server.base_url, context_window=2048, retry=policy) as client:
        await client.complete("x", max_tokens=900)
        async with anyio.create_task_group() as group:
            for _ in range(n):
                group.start_soon(lambda: client.complete("x", max_tokens=900))
    with anyio.fail_after(5):
        while not at_zero(server):  # noqa: ASYNC110 - polling state the server thread owns
            await anyio.sleep(0.005)
    return server.metrics()["kv_rejected_total"]


@pytest.mark.anyio
async def test_a_paced_client_collects_fewer_429s_than_an_unpaced_one() -> None:
    with running_server(**BURST_CONFIG) as server:
        unpaced = await _burst(server, pace=False)
    with running_server(**BURST_CONFIG) as server:
        paced = await _burst(server, pace=True)
        admitted = server.metrics()["kv_admitted_total"]
    assert unpaced >= 5  # four of twelve fit at once: most of the rest heard "no" first
    assert paced < unpaced
    assert paced <= 1
    assert admitted == 13


async def _first_burst(url: str, n: int = 12) -> None:
    """One client, given no model and no window: ``n`` requests at once, its first. It reads
    /v1/models before any of them goes (discovery), and that answer carries the room."""
    policy = RetryPolicy(deadline=30)
    async with AsyncClient(base_url=url, retry=policy) as client:
        async with anyio.create_task_group() as group:
            for _ in range(n):
                group.start_soon(lambda: client.complete("x", max_tokens=900))
        assert client.context_window is not None  # discovered


@pytest.mark.anyio
async def test_a_clients_first_burst_is_paced_by_the_room_its_discovery_read() -> None:
    """No answer to a request yet, only discovery's: four of the twelve fit, the rest are held
    until answers show room (before /v1/models carried it: seven or eight 429s)."""
    with running_server(**BURST_CONFIG) as server:
        await _first_burst(server.base_url)
        with anyio.fail_after(5):
            while not at_zero(server):  # noqa: ASYNC110 - polling state the server thread owns
                await anyio.sleep(0.005)
        metrics = server.metrics()
    assert metrics["kv_admitted_total"] == 12
    assert metrics["kv_rejected_total"] <= 1


@pytest.mark.anyio
async def test_a_clients_first_burst_through_the_gateway_is_paced_too() -> None:
    with (
        running_server(**{**BURST_CONFIG, "kv_tokens": 8192}) as upstream,
        running_gateway(
            GatewayConfig(
                upstreams=(upstream.base_url,),
                kv_tokens=(4096,),
                decode_rate=2000.0,
                max_queue_wait=0.0,  # refusing at once: every request that does not fit is a 429
            )
        ) as gateway,
    ):
        await _first_burst(gateway.base_url)
        with anyio.fail_after(5):
            while not at_zero(upstream):  # noqa: ASYNC110 - polling state the server thread owns
                await anyio.sleep(0.005)
        refused = sum(
            u.known.ledger.stats().rejected_total
            for u in gateway.app.state.gateway.upstreams
            if u.known is not None
        )
        admitted = upstream.metrics()["kv_admitted_total"]
    assert admitted == 12
    assert refused <= 1


class _SpyPacer(Pacer):
    """A Pacer that records every hold it decides (0.0: sent at once)."""

    __slots__ = ("holds",)

    def __init__(self, holds: list[float]) -> None:
        super().__init__()
        self.holds = holds

    def take(self, now: float, need: int, key: Any = None) -> float:
        wait = super().take(now, need, key)
        self.holds.append(wait)
        return wait


def first_hint(server: RunningServer) -> RoomHint:
    """The room a queueing server advertises on an answer."""
    answer = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    hint = parse_ratelimit(answer.headers)
    assert hint is not None
    assert answer.headers["RateLimit-Policy"].endswith(";kvqueue")
    return hint


@pytest.mark.anyio
async def test_a_server_that_queues_says_so_and_paced_requests_join_its_line() -> None:
    """With a FIFO queue (``max_queue_wait``) the policy carries ``kvqueue``: a paced client
    sends at once and its requests wait in the server's line, none held locally (before
    ``kvqueue`` they were held on the room net of the queue and lost their places: 80 requests
    through a queueing gateway took 61 s paced against 14 s unpaced)."""
    held: list[float] = []
    with running_server(**BURST_CONFIG, max_queue_wait=30.0) as server:
        policy = RetryPolicy(deadline=30)
        async with AsyncClient(
            base_url=server.base_url, context_window=2048, retry=policy
        ) as client:
            first = await client.complete("x", max_tokens=900)
            assert first.attempts == 1
            spy = _SpyPacer(held)
            spy.observe(time.monotonic(), first_hint(server))
            client._replicas[0].pacer = spy  # type: ignore[attr-defined]
            client._pacer = spy  # type: ignore[attr-defined]
            async with anyio.create_task_group() as group:
                for _ in range(12):
                    group.start_soon(lambda: client.complete("x", max_tokens=900))
        metrics = server.metrics()
    assert held
    assert all(wait == 0.0 for wait in held)  # never held: the server queues
    assert metrics["kv_admitted_total"] == 14  # the hint's probe, the first, the twelve
    assert metrics["kv_rejected_total"] == 0


def test_metrics_expose_the_room(server: RunningServer) -> None:
    text = httpx.get(server.base_url + "/metrics").text
    assert "kv_free_tokens 3686.0" in text
    assert "kv_next_release_seconds 0.0" in text
    wait_for(lambda: at_zero(server))


def _sdk_burst(server: RunningServer, *, pace: bool, n: int = 12) -> float:
    """As :func:`_burst`, through the official openai SDK on kvclient's transport."""
    import concurrent.futures

    from kvclient.openai import OpenAI

    client = OpenAI(
        base_url=server.base_url + "/v1",
        api_key="k",
        context_window=2048,
        retry=RetryPolicy(pace=pace, deadline=30),
    )
    # All n calls start together whatever the machine's load (threads started on a busy
    # machine otherwise trickle in, and an unpaced burst then meets few refusals).
    together = threading.Barrier(n)

    def call() -> Any:
        together.wait(timeout=30)
        return client.completions.create(model=server.config.model, prompt="x", max_tokens=900)

    with client:
        client.completions.create(model=server.config.model, prompt="x", max_tokens=900)
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            calls = [pool.submit(call) for _ in range(n)]
            for call in calls:
                call.result()
    wait_for(lambda: at_zero(server))
    return server.metrics()["kv_rejected_total"]


def test_the_openai_sdk_through_kvclient_paces_too() -> None:
    with running_server(**BURST_CONFIG) as server:
        unpaced = _sdk_burst(server, pace=False)
    with running_server(**BURST_CONFIG) as server:
        paced = _sdk_burst(server, pace=True)
        admitted = server.metrics()["kv_admitted_total"]
    assert unpaced >= 5
    assert paced < unpaced
    assert admitted == 13
