"""Gateways on one real Redis (``--ledger``) under the peak rule: in front of the scripted
lockstep engine of ``test_gateway_peak.py``, each publishes its holders' progress and a
newcomer at one is admitted beside the other's holders whose whole caps would have left no
room; in front of the reference server admitting on prompts, three never make it OOM; prompts
that share a prefix count it once across gateways where the engine shares it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.gateway.config import public_url
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_peak import _ENGINE
from tests.gateway.test_gateway_shared import OOMING, _overload, gateway_process, shared_reserved
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import at_zero, wait_for
from tests.helpers.upstreams import RATE, LockstepUpstream, scripted_upstream

pytestmark = pytest.mark.redis


def _complete(base: str, name: str, cap: int, out: dict[str, Any]) -> None:
    out[name] = httpx.post(
        base + "/v1/completions", json={"prompt": name, "max_tokens": cap}, timeout=30
    )


@pytest.fixture
def engine() -> Iterator[tuple[LockstepUpstream, str]]:
    scripted = LockstepUpstream()
    with scripted_upstream(scripted.app()) as up:
        yield scripted, up.base_url


@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_a_newcomer_at_one_gateway_runs_beside_the_others_holders(
    engine: tuple[LockstepUpstream, str], redis_server: RedisServer, rule: str
) -> None:
    """1,200 KV tokens; requests of 3 + 400. A through the first gateway, then B through the
    second when A is halfway, then C through the first: on whole caps (3 x 403) C waits for A's
    end; by the peak of both gateways' holders it starts once B's first token is published."""
    scripted, url = engine
    config = GatewayConfig(
        upstreams=(url,), safety_fraction=1.0, decode_rate=RATE, speed_interval=0.1,
        admission_rule=rule, relay_lag=0.1, ledger=redis_server.url,
    )  # fmt: skip
    answers: dict[str, Any] = {}
    with running_gateway(config) as one, running_gateway(config) as two:
        a = threading.Thread(target=_complete, args=(one.base_url, "A", 400, answers))
        a.start()
        wait_for(lambda: scripted.made.get("A", 0) >= 200, timeout=10)  # A halfway
        b = threading.Thread(target=_complete, args=(two.base_url, "B", 400, answers))
        b.start()
        wait_for(lambda: "B" in scripted.started, timeout=10)
        c = threading.Thread(target=_complete, args=(one.base_url, "C", 400, answers))
        c.start()
        for thread in (a, b, c):
            thread.join(30)
        healths = [httpx.get(g.base_url + "/health").json()["upstreams"][0] for g in (one, two)]
        wait_for(lambda: shared_reserved(redis_server.url, url) == (0, 0))
    assert all(answers[n].status_code == 200 for n in "ABC")
    assert all(answers[n].json()["usage"]["completion_tokens"] == 400 for n in "ABC")
    assert [h["admission"] for h in healths] == [rule, rule]
    if rule == "peak":
        assert [h["caps_reason"] for h in healths] == [None, None]
    made_by_a = scripted.made_at_start["C"]["A"]
    if rule == "caps":
        assert made_by_a == 400
    else:
        assert made_by_a < 400 - 40  # well before A's end (0.2 s of its tokens)


@pytest.mark.slow
def test_three_gateways_by_the_shared_peak_never_oom_an_engine_that_admits_on_prompts(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The seed's mix at overload through three gateway processes on one Redis, in front of the
    reference server admitting on prompt length alone (it OOMs when overrun) and running 16
    sequences at once: by the peak of every gateway's holders, no OOM, and the ledger at 0."""
    with running_server(**OOMING, max_running=16) as upstream, ExitStack() as stack:
        urls = [
            stack.enter_context(
                gateway_process(
                    upstream.base_url, "--ledger", redis_server.url, "--max-queue-wait", "30"
                )
            )[1]
            for _ in range(3)
        ]
        healths = [httpx.get(url + "/health").json()["upstreams"][0] for url in urls]
        summaries = _overload(urls, tmp_path)
        wait_for(lambda: at_zero(upstream), timeout=30)
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
        metrics = upstream.metrics()
    assert [h["admission"] for h in healths] == ["peak"] * 3, healths
    assert all(s["failed"] == 0 for s in summaries), summaries
    assert metrics["kv_oom_events_total"] == 0


@contextmanager
def most_shared(redis_url: str, upstream: str, *, reserved: bool = False) -> Iterator[list[int]]:
    """The most reservations (``reserved``: tokens reserved) every gateway held at once in the
    shared ledger of ``upstream``, read every 5 ms while the block runs (in the list yielded,
    once it ends)."""
    most = [0]
    done = threading.Event()
    index = 0 if reserved else 1

    def watch() -> None:
        while not done.wait(0.005):
            most[0] = max(most[0], shared_reserved(redis_url, upstream)[index])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield most
    finally:
        done.set()
        watcher.join(5)


def _burst_over(bases: list[str], bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Every body at once, dealt in turn to the gateways at ``bases``."""
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def one(base: str, body: dict[str, Any]) -> None:
        answer = httpx.post(base + "/v1/completions", json=body, timeout=120)
        with lock:
            answers.append(answer)

    threads = [
        threading.Thread(target=one, args=(bases[i % len(bases)], body))
        for i, body in enumerate(bodies)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    return answers


@pytest.mark.slow
def test_prompts_that_share_a_prefix_count_it_once_across_gateways(
    redis_server: RedisServer,
) -> None:
    """Prompts of one 400-word prefix and a suffix of their own, 100 tokens each, dealt in turn
    to two gateways on one Redis in front of the reference server: with its prefix caching on,
    a newcomer at either gateway borrows the prefix's blocks from a holder of either past its
    prefill, and more run at once; without it, each counts its whole prompt. Never an
    overflow, and nothing of the prefix records left."""
    prefix = " ".join(["river"] * 400)
    bodies = [{"prompt": f"{prefix} {i}", "max_tokens": 100, "ignore_eos": True} for i in range(16)]
    most: dict[bool, int] = {}
    for sharing in (False, True):
        # Counted by request only (its own prompt admission would refuse these long prompts).
        engine = {
            **_ENGINE, "kv_tokens": 2400, "prefix_caching": sharing,
            "admission": "concurrency", "max_concurrency": 64,
        }  # fmt: skip
        with running_server(**engine) as upstream:
            url = upstream.base_url
            config = GatewayConfig(
                upstreams=(url,), decode_rate=400.0, max_queue_wait=120.0, relay_lag=0.05,
                ledger=redis_server.url,
            )  # fmt: skip
            with running_gateway(config) as one, running_gateway(config) as two:
                with most_shared(redis_server.url, url) as held:
                    answers = _burst_over([one.base_url, two.base_url], bodies)
                healths = [
                    httpx.get(g.base_url + "/health").json()["upstreams"][0] for g in (one, two)
                ]
                wait_for(lambda: shared_reserved(redis_server.url, url) == (0, 0))  # noqa: B023
            metrics = upstream.metrics()
        client = redis.Redis.from_url(redis_server.url)
        try:
            tag = "{kvclient:" + public_url(url) + "}"
            left = [client.hlen(f"{tag}:prefixes"), client.hlen(f"{tag}:blocks")]
        finally:
            client.close()
        assert [a.status_code for a in answers] == [200] * 16, sharing
        assert [h["admission"] for h in healths] == ["peak", "peak"], healths
        assert metrics["kv_oom_events_total"] == 0, sharing
        assert left == [0, 0]
        most[sharing] = held[0]
    assert most[True] > most[False]
