"""Gateways on one real Redis (``--ledger``) under the peak rule: in front of the scripted
lockstep engine of ``test_gateway_peak.py``, each publishes its holders' progress and a
newcomer at one is admitted beside the other's holders whose whole caps would have left no
room; in front of the reference server admitting on prompts, three never make it OOM."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
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
