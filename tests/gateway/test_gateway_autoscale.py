"""What an autoscaler reads of an upstream in the gateway's ``/metrics``: the requests waiting,
the KV tokens they ask for, the room a newcomer may take and the age of the view they come
from; this gateway's own with an in-process ledger, every gateway's (and the same at each) on a
shared one. The preemption rate shown whether or not a forecast runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack

import httpx
import pytest

from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.gateway.config import public_url
from reference_server.gateway.watch import PreemptionRate
from reference_server.testing import running_gateway
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import RATE, LockstepUpstream, scripted_upstream

#: 36 s of decoding for the holder: it lasts the whole test (the engine's pool, 7,000 tokens,
#: is budgeted whole).
SLOW = {"decode_rate": 100.0, "tick_seconds": 0.01, "kv_tokens": 7000, "context_window": 4096}
HOLDER = {"prompt": "hi", "max_tokens": 3600, "stream": True, "ignore_eos": True}
#: Does not fit beside the holder: it waits in the queue.
WAITER = {"prompt": "hi", "max_tokens": 3500, "stream": True}
NAMES = (
    "kv_upstream_shared_reserved_tokens",
    "kv_upstream_shared_inflight_requests",
    "kv_upstream_shared_queued_requests",
    "kv_upstream_shared_queued_tokens",
    "kv_upstream_shared_room_tokens",
    "kv_upstream_shared_view_age_seconds",
    "kv_upstream_preemptions_per_1000",
)


def gauges(base_url: str, upstream: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    found = {}
    for name in NAMES:
        prefix = f'{name}{{upstream="{public_url(upstream)}"}} '
        line = next(line for line in text.splitlines() if line.startswith(prefix))
        found[name] = float(line[len(prefix) :])
    return found


def _wait(url: str, statuses: list[int]) -> None:
    """A request that queues; gone as soon as it is admitted (its status is kept)."""
    with httpx.stream(
        "POST", url + "/v1/completions", json=WAITER, headers={"Prefer": "wait=60"}, timeout=60
    ) as answer:
        statuses.append(answer.status_code)


def _scenario(
    holding_at: str, waiting_at: str, read: Callable[[], list[dict[str, float]]]
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The figures (as ``read`` gives them, one dict per gateway) with one holder through
    ``holding_at``, then with a waiter through ``waiting_at`` as well."""
    with httpx.stream("POST", holding_at + "/v1/completions", json=HOLDER) as holding:
        pieces = holding.iter_bytes()  # kept: a generator closed closes the stream
        next(pieces)  # admitted, and decoding
        held = read()
        statuses: list[int] = []
        waiter = threading.Thread(target=_wait, args=(waiting_at, statuses))
        waiter.start()
        wait_for(lambda: all(m["kv_upstream_shared_queued_requests"] == 1 for m in read()))
        queued = read()
    waiter.join(30)  # the holder gone, the waiter is admitted and goes
    assert statuses == [200]
    return held, queued


def _check(held: dict[str, float], queued: dict[str, float]) -> None:
    reserved = held["kv_upstream_shared_reserved_tokens"]
    assert reserved > HOLDER["max_tokens"]
    assert held["kv_upstream_shared_inflight_requests"] == 1
    assert held["kv_upstream_shared_queued_requests"] == 0
    assert held["kv_upstream_shared_queued_tokens"] == 0
    assert held["kv_upstream_shared_room_tokens"] == 7000 - reserved
    assert held["kv_upstream_preemptions_per_1000"] == 0
    need = queued["kv_upstream_shared_queued_tokens"]
    assert need > WAITER["max_tokens"]
    assert need > held["kv_upstream_shared_room_tokens"]  # why it waits
    assert queued["kv_upstream_shared_reserved_tokens"] == reserved
    # What the queue waits for is not free for a newcomer, who would queue behind it.
    assert queued["kv_upstream_shared_room_tokens"] == max(0, 7000 - reserved - need)


def test_an_in_process_gateway_shows_its_own_backlog() -> None:
    with running_server(**SLOW) as upstream:
        config = GatewayConfig(upstreams=(upstream.base_url,), max_queue_wait=60.0)
        with running_gateway(config) as gateway:

            def read() -> list[dict[str, float]]:
                return [gauges(gateway.base_url, upstream.base_url)]

            (held,), (queued,) = _scenario(gateway.base_url, gateway.base_url, read)
    _check(held, queued)
    assert held["kv_upstream_shared_view_age_seconds"] == 0
    assert queued["kv_upstream_shared_view_age_seconds"] == 0


@pytest.mark.redis
@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_gateways_on_one_redis_show_every_gateways_backlog_alike(
    redis_server: RedisServer, rule: str
) -> None:
    """A holds a request, B queues one: both show both, with the same figures."""
    with running_server(**SLOW) as upstream, ExitStack() as stack:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), ledger=redis_server.url, max_queue_wait=60.0,
            admission_rule=rule,
        )  # fmt: skip
        a, b = (stack.enter_context(running_gateway(config)) for _ in range(2))

        def read() -> list[dict[str, float]]:
            return [gauges(g.base_url, upstream.base_url) for g in (a, b)]

        held, queued = _scenario(a.base_url, b.base_url, read)
    for figures in (held, queued):
        ages = [m.pop("kv_upstream_shared_view_age_seconds") for m in figures]
        assert all(0 <= age < 1 for age in ages)  # read afresh at the scrape
        assert figures[0] == figures[1]
    _check(held[0], queued[0])


@pytest.mark.parametrize("rule", ["caps", "peak"])
def test_the_preemption_rate_is_shown_without_a_forecast(rule: str) -> None:
    """The engine's counter per 1,000 requests admitted, with no forecast (whole caps, or the
    exact peak rule) to keep a rate of its own."""
    scripted = LockstepUpstream()
    with scripted_upstream(scripted.app()) as up:
        config = GatewayConfig(
            upstreams=(up.base_url,), decode_rate=RATE, speed_interval=0.1, admission_rule=rule,
            preemption_budget=(0.0,),
        )  # fmt: skip
        with running_gateway(config) as gateway:
            assert httpx.get(gateway.base_url + "/health").status_code == 200  # discovered
            scrapes = scripted.scrapes
            wait_for(lambda: scripted.scrapes >= scrapes + 2)  # read before any admission
            for _ in range(4):
                answer = httpx.post(
                    gateway.base_url + "/v1/completions",
                    json={"prompt": "p", "max_tokens": 3},
                    timeout=10,
                )
                assert answer.status_code == 200
            scripted.preemptions = 2

            def rate() -> float:
                return gauges(gateway.base_url, up.base_url)["kv_upstream_preemptions_per_1000"]

            wait_for(lambda: rate() == 500)  # 2 per 4


def test_the_preemption_rate_is_over_its_window_and_starts_over_when_a_counter_goes_back() -> None:
    rate = PreemptionRate(window=10.0)
    assert rate.rate() is None
    rate.add(0.0, 5, 100)
    assert rate.rate() is None  # one reading: nothing admitted in the window yet
    rate.add(1.0, 7, 600)
    assert rate.rate() == pytest.approx(4.0)  # 2 per 500
    rate.add(20.0, 7, 1600)
    assert rate.rate() == 0  # from the last reading before the window (1 s)
    rate.add(25.0, 8, 2600)
    assert rate.rate() == pytest.approx(0.5)
    rate.add(31.0, 9, 3600)
    assert rate.rate() == pytest.approx(1.0)  # from 20 s: 2 per 2,000
    rate.add(32.0, 0, 10)  # the engine began again
    assert rate.rate() is None
    rate.add(33.0, 1, 510)
    assert rate.rate() == pytest.approx(2.0)
