"""Two gateways on one real Redis (``--ledger``) count holders by the forecast of outputs, in front
of the reference server's engine that preempts: more run at once than by the exact rule, every
gateway says the same of the forecast, and what was admitted ends with the ledger at zero."""

from __future__ import annotations

import random
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_forecast import _ENGINE, _send
from tests.gateway.test_gateway_shared import shared_reserved
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

#: The engine of the one-gateway test at a quarter of its speed: requests long enough that the
#: pool binds, not the rate at which two gateways in one process admit.
ENGINE: dict[str, Any] = {**_ENGINE, "decode_rate": 100.0}


def _most_held(redis_url: str, upstream: str, stop: threading.Event, most: list[int]) -> None:
    """The most holders the shared ledger of ``upstream`` had at once, read until ``stop``."""
    deadline = time.monotonic() + 150
    while not stop.is_set() and time.monotonic() < deadline:
        most[0] = max(most[0], shared_reserved(redis_url, upstream)[1])
        stop.wait(0.01)


def _through_both(urls: list[str], bodies: list[dict[str, Any]], threads: int) -> list[int]:
    """``bodies`` dealt in turn to the gateways, sent at once; every status."""
    statuses: list[int] = []
    senders = [
        threading.Thread(
            target=lambda i=i: statuses.extend(
                _send(urls[i], bodies[i :: len(urls)], threads // len(urls))
            )
        )
        for i in range(len(urls))
    ]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(160)
    return statuses


def test_two_gateways_by_the_shared_forecast_run_more_at_once_within_the_budget(
    redis_server: RedisServer,
) -> None:
    rng = random.Random(3)
    learn = [{"prompt": f"learn {i}", "max_tokens": rng.randint(300, 600)} for i in range(96)]
    burst = [{"prompt": f"burst {i}", "max_tokens": rng.randint(300, 600)} for i in range(40)]
    most: dict[float, int] = {}
    for budget in (0.0, 100.0):
        with running_server(**ENGINE) as upstream, ExitStack() as stack:
            config = GatewayConfig(
                upstreams=(upstream.base_url,), decode_rate=100.0, max_queue_wait=120.0,
                speed_interval=0.2, relay_lag=0.05, preemption_budget=(budget,),
                ledger=redis_server.url,
            )  # fmt: skip
            gateways = [stack.enter_context(running_gateway(config)) for _ in range(2)]
            urls = [g.base_url for g in gateways]
            assert set(_through_both(urls, learn, threads=4)) == {200}
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
            stop, held = threading.Event(), [0]
            watcher = threading.Thread(
                target=_most_held, args=(redis_server.url, upstream.base_url, stop, held)
            )
            watcher.start()
            try:
                assert set(_through_both(urls, burst, threads=40)) == {200}
            finally:
                stop.set()
                watcher.join(10)
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
            healths = [httpx.get(u + "/health").json()["upstreams"][0] for u in urls]
            metrics = upstream.metrics()
        assert metrics["kv_oom_events_total"] == 0
        assert [h["admission"] for h in healths] == ["peak", "peak"]
        assert [h["caps_reason"] for h in healths] == [None, None]
        quantiles = [h["forecast"]["quantile"] for h in healths]
        if budget:
            assert quantiles[0] is not None
            assert quantiles[0] == quantiles[1]  # the same budget, the same readings
            assert [h["forecast"]["preemption_budget"] for h in healths] == [budget, budget]
        else:
            assert quantiles == [None, None]
            assert metrics["kv_engine_preemptions_total"] == 0  # the exact rule never overflows
        most[budget] = held[0]
    assert most[100.0] > most[0.0]
