"""Fair shares through the gateway in front of the reference server (`kvclient serve`, the
simulated engine): a tenant at its limit is refused while others are admitted; an interactive
request goes ahead of every queued batch request and batch is refused first under overload;
a light tenant beside a flooding one waits far less than in the FIFO queue. (The contract suite
with fairness on: ``test_gateway.py``; weights measured by what tenants get: ``unit/
test_fair_peak.py`` on a clock of its own, ``bench/tenant_fairness.py`` through the gateway.)
Every load is bounded in count and in time; ratios are measured within one run."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from kvclient.engines.metrics import prometheus_samples
from kvclient.headers import PRIORITY_HEADER, parse_ratelimit
from reference_server import RunningServer, running_server
from reference_server.admission.fair_queue import FairQueue
from reference_server.admission.fairness import FairPolicy, Tenant, Waiter
from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for

TENANT = "X-Tenant"
#: Answers run to their caps (no end token), in small ticks.
ENGINE = {
    "mean_output_tokens": 1e6,
    "tick_seconds": 0.005,
    "context_window": 1024,
    "safety_fraction": 1.0,
}


def _state(gateway: RunningServer) -> GatewayState:
    state: GatewayState = gateway.app.state.gateway
    return state


def _queue(gateway: RunningServer) -> FairQueue:
    known = _state(gateway).known
    assert known, "not discovered yet"
    queue = known[0].queue
    assert isinstance(queue, FairQueue)
    return queue


def _held(gateway: RunningServer) -> int:
    known = _state(gateway).known
    return known[0].ledger.stats().reserved_tokens if known else -1


@contextmanager
def _stack(
    policy: FairPolicy | None, *, kv_tokens: int = 4096, decode_rate: float = 400.0, **gw: Any
) -> Iterator[RunningServer]:
    with (
        running_server(**ENGINE, kv_tokens=kv_tokens, decode_rate=decode_rate) as upstream,
        running_gateway(
            GatewayConfig(
                upstreams=(upstream.base_url,),
                safety_fraction=1.0,
                decode_rate=decode_rate,
                max_queue_wait=30.0,
                fairness=policy,
                tenant_header=TENANT if policy is not None else None,
                **gw,
            )
        ) as gateway,
    ):
        httpx.get(gateway.base_url + "/v1/models", timeout=10)  # discover
        yield gateway
        wait_for(lambda: _held(gateway) == 0, timeout=30)


def _post(
    base: str, cap: int, *, tenant: str = "", priority: int | None = None, timeout: float = 60
) -> httpx.Response:
    headers = {TENANT: tenant} if tenant else {}
    if priority is not None:
        headers[PRIORITY_HEADER] = str(priority)
    return httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": cap},
        headers=headers,
        timeout=timeout,
    )


def _in_thread(results: list[httpx.Response], *args: Any, **kwargs: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(_post(*args, **kwargs)), daemon=True)
    thread.start()
    return thread


def test_a_tenant_over_its_limit_gets_429_while_others_are_admitted() -> None:
    policy = FairPolicy(tenants={"a": Tenant(max_share=0.25, max_queue_wait=0.0), "b": Tenant()})
    with _stack(policy, decode_rate=200.0) as gateway:
        running: list[httpx.Response] = []
        threads = [_in_thread(running, gateway.base_url, 400, tenant="a") for _ in range(2)]
        wait_for(lambda: _queue(gateway).fair.held("a") >= 800, timeout=10)
        refused = _post(gateway.base_url, 400, tenant="a")
        admitted = _post(gateway.base_url, 50, tenant="b")
        for thread in threads:
            thread.join(30)
        metrics = httpx.get(gateway.base_url + "/metrics").text
        health = httpx.get(gateway.base_url + "/health").json()
    assert refused.status_code == 429, refused.text
    assert float(refused.headers["Retry-After"]) >= 1
    room = parse_ratelimit(refused.headers)
    assert room is not None
    assert room.quota == 1024  # its own limit: a quarter of 4,096
    assert room.remaining < 416  # not room for another of its requests
    assert admitted.status_code == 200, admitted.text
    assert [r.status_code for r in running] == [200, 200]
    assert 'kv_tenant_rejected_total{tenant="a"} 1.0' in metrics
    assert 'kv_tenant_admitted_total{tenant="b"} 1.0' in metrics
    assert "kv_fairness_enabled 1.0" in metrics
    assert health["fairness"] == {"enabled": True, "tenants": 2, "tenant_from": f"header {TENANT}"}


def test_an_interactive_request_goes_ahead_of_queued_batch_which_is_refused_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch (granted class 10) fills the budget and the queue (4 waiting at most); an interactive
    request (class 0) arrives: the newest batch waiter is refused, and the interactive one is
    the next admitted, ahead of every queued batch request."""
    policy = FairPolicy(tenants={"batch": Tenant(priorities=(10,)), "chat": Tenant()}, max_queued=4)
    with _stack(policy, decode_rate=400.0) as gateway:
        queue = _queue(gateway)
        admitted: list[Waiter] = []
        dispatch = queue.fair.dispatch

        def recording(now: float, try_admit: Any) -> Any:
            done = dispatch(now, try_admit)
            admitted.extend(w for w, _ in done)
            return done

        monkeypatch.setattr(queue.fair, "dispatch", recording)
        batch: list[httpx.Response] = []
        threads = []
        for i in range(8):  # 4 hold the budget (1,008 tokens each), 4 wait
            threads.append(_in_thread(batch, gateway.base_url, 990, tenant="batch", priority=10))
            wait_for(lambda n=i + 1: len(admitted) + queue.waiting >= n, timeout=10)
        assert queue.waiting == 4, (len(admitted), queue.ledger.stats(), batch)
        chat = _post(gateway.base_url, 50, tenant="chat", priority=0)
        for thread in threads:
            thread.join(60)
    assert chat.status_code == 200, chat.text
    statuses = sorted(r.status_code for r in batch)
    assert statuses == [200] * 7 + [429]
    refused = next(r for r in batch if r.status_code == 429)
    assert float(refused.headers["Retry-After"]) >= 1
    later = [w.priority for w in admitted[4:]]
    assert later[0] == 0, later  # the first admitted after the budget filled
    assert later[1:] == [10, 10, 10]


#: Nine of A's reservations (a 1-token prompt and a 400-token cap, in blocks of 16) and no more:
#: B's request waits for one of them to end.
FLOOD_BUDGET = 9 * 416


def light_latencies(
    base: str, *, flood: int, light: int, flood_base: str | None = None
) -> tuple[list[float], list[float]]:
    """B's latencies alone (``light`` short requests one after the other), then beside tenant
    A keeping ``flood`` requests of 400-token caps in flight (each holds about a second; nine
    of them fill the budget, leaving no room): once A is backlogged, B sends ``light`` short
    requests a second apart, whether the one before has been answered or not. A sends through
    ``flood_base`` when given (another gateway sharing the budget), else through ``base``."""

    def light_one(into: list[float]) -> None:
        began = time.monotonic()
        answer = _post(base, 10, tenant="b")
        assert answer.status_code == 200, answer.text
        into.append(time.monotonic() - began)

    alone: list[float] = []
    for _ in range(light):
        light_one(alone)
    stop = threading.Event()
    sent: list[int] = []

    def flooder(i: int) -> None:
        time.sleep(i / flood)  # started over one holding: A's holdings end one by one
        with httpx.Client(base_url=flood_base or base, timeout=60) as http:
            for _ in range(20):  # bounded: 20 requests per flooding client at most
                if stop.is_set():
                    return
                sent.append(i)
                http.post(
                    "/v1/completions",
                    json={"prompt": "flood", "max_tokens": 400},
                    headers={TENANT: "a"},
                )

    threads = [threading.Thread(target=flooder, args=(i,), daemon=True) for i in range(flood)]
    for thread in threads:
        thread.start()
    # A holds the budget (nine in flight) and its queue is deep (every flooder has sent).
    wait_for(lambda: len(set(sent)) == flood and _in_flight(flood_base or base) >= 9, 30)
    beside: list[float] = []
    lights = []
    try:
        for _ in range(light):
            lights.append(threading.Thread(target=light_one, args=(beside,), daemon=True))
            lights[-1].start()
            time.sleep(1.0)
        for thread in lights:
            thread.join(60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert len(beside) == light
    return alone, beside


def _in_flight(base: str) -> float:
    """Requests a gateway holds reservations for, as its /metrics says."""
    page = httpx.get(base + "/metrics").text
    return sum(v for _, v in prometheus_samples(page, "kv_inflight_requests"))


def test_a_light_tenant_beside_a_flooding_one_waits_far_less_than_in_fifo() -> None:
    """Weights 1:1. Under FIFO B waits behind A's whole queue; fairly, within twice its
    latency alone plus one of A's holdings (400 tokens at 400 tokens/s). Both measured in this
    run, compared as ratios."""
    with _stack(None, kv_tokens=FLOOD_BUDGET) as gateway:
        _, fifo = light_latencies(gateway.base_url, flood=40, light=4)
    policy = FairPolicy(tenants={"a": Tenant(), "b": Tenant()})
    with _stack(policy, kv_tokens=FLOOD_BUDGET) as gateway:
        alone, fair = light_latencies(gateway.base_url, flood=40, light=4)
    holding = 400 / 400.0
    assert max(fair) <= 2 * max(alone) + holding, (alone, fair)
    assert statistics.median(fair) < statistics.median(fifo) / 3, (fair, fifo)
