"""The engine's ``/metrics`` scraped once per upstream for every gateway on one real Redis: one
scraper, the others reading its page; another takes over when it stops; a gateway whose
scraper writes nothing scrapes itself. ``/health`` says who scrapes and how old the figures
are."""

from __future__ import annotations

import signal
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import redis

from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.gateway.config import public_url
from reference_server.gateway.watch import BLIND_SECONDS
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_shared import FAST, gateway_process
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for

pytestmark = pytest.mark.redis

OWN = "this gateway"


def health(url: str) -> dict[str, Any]:
    upstream: dict[str, Any] = httpx.get(url + "/health").json()["upstreams"][0]
    return upstream


def figures(url: str) -> dict[str, Any]:
    found: dict[str, Any] = health(url)["engine_figures"]
    return found


def fresh(found: dict[str, Any]) -> bool:
    return found["age_seconds"] is not None and found["age_seconds"] < BLIND_SECONDS


def _lockstep_breaks(url: str, upstream: str) -> float:
    prefix = f'kv_upstream_lockstep_breaks_total{{upstream="{public_url(upstream)}"}} '
    text = httpx.get(url + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :])


def _config(upstream: str, redis_url: str, interval: float = 0.2) -> GatewayConfig:
    return GatewayConfig(upstreams=(upstream,), ledger=redis_url, speed_interval=interval)


def test_one_gateway_scrapes_the_engine_for_both(redis_server: RedisServer) -> None:
    with running_server(**FAST, max_running=16) as upstream, ExitStack() as stack:
        config = _config(upstream.base_url, redis_server.url)
        a, b = (stack.enter_context(running_gateway(config)).base_url for _ in range(2))

        def one_scrapes() -> bool:
            seen = [figures(a), figures(b)]
            scrapers = [f["scraper"] for f in seen]
            if not all(fresh(f) for f in seen) or OWN not in scrapers or None in scrapers:
                return False
            reader = next(f for f in seen if f["scraper"] != OWN)
            return scrapers.count(OWN) == 1 and reader["read_by"] == reader["scraper"]

        wait_for(one_scrapes, timeout=20)
        for url in (a, b):  # the reader's figures keep the peak rule in force, as its own did
            answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 20})
            assert answer.status_code == 200
        wait_for(one_scrapes, timeout=20)
        healths = [health(a), health(b)]
    assert [h["admission"] for h in healths] == ["peak", "peak"], healths
    assert [h["caps_reason"] for h in healths] == [None, None], healths
    assert [h["figures_unread"] for h in healths] == [None, None], healths


def test_another_gateway_takes_over_when_the_scraper_stops(redis_server: RedisServer) -> None:
    with running_server(**FAST, max_running=16) as upstream:
        # At the default interval (1 s): the reader's own scrape must come before its figures
        # count as unread.
        config = _config(upstream.base_url, redis_server.url, interval=1.0)
        with running_gateway(config) as b:
            with running_gateway(config) as a:
                wait_for(lambda: figures(a.base_url)["scraper"] == OWN, timeout=20)
                wait_for(lambda: figures(b.base_url)["read_by"] not in (None, OWN), timeout=20)
                # Only a scrapes while both live.
                assert figures(a.base_url)["scraper"] == OWN
                scraper = figures(b.base_url)["scraper"]
                assert scraper not in (None, OWN)
            # a is gone (it gave its claim back), and b scrapes, its figures fresh throughout (never
            # unread long enough to count whole caps: no lockstep break).
            wait_for(lambda: figures(b.base_url)["scraper"] == OWN, timeout=20)
            wait_for(lambda: figures(b.base_url)["read_by"] == OWN, timeout=10)
            assert fresh(figures(b.base_url))
            assert health(b.base_url)["caps_reason"] is None
            assert _lockstep_breaks(b.base_url, upstream.base_url) == 0


def test_another_gateway_takes_over_when_the_scraper_is_killed(redis_server: RedisServer) -> None:
    """A gateway process killed with SIGKILL gives nothing back: its claim lapses (2 scrape
    intervals and the scrape timeout), meanwhile the other scrapes itself."""
    with running_server(**FAST, max_running=16) as upstream, ExitStack() as stack:
        proc, a = stack.enter_context(
            gateway_process(upstream.base_url, "--ledger", redis_server.url)
        )
        wait_for(lambda: figures(a)["scraper"] == OWN, timeout=20)
        config = _config(upstream.base_url, redis_server.url, interval=1.0)
        b = stack.enter_context(running_gateway(config)).base_url
        wait_for(lambda: figures(b)["read_by"] not in (None, OWN), timeout=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: figures(b)["scraper"] == OWN, timeout=20)
        wait_for(lambda: figures(b)["read_by"] == OWN, timeout=10)
        assert fresh(figures(b))
        assert _lockstep_breaks(b, upstream.base_url) == 0


def test_a_scraper_that_writes_nothing_leaves_each_gateway_to_scrape_itself_until_it_dies(
    redis_server: RedisServer,
) -> None:
    with running_server(**FAST, max_running=16) as upstream:
        client = redis.Redis.from_url(redis_server.url)
        key = "{kvclient:" + public_url(upstream.base_url) + "}:scraper"
        client.set(key, "ghost", px=60_000)  # a scraper that never writes a page
        try:
            with running_gateway(_config(upstream.base_url, redis_server.url)) as gateway:
                wait_for(lambda: figures(gateway.base_url)["scraper"] == "ghost", timeout=20)
                wait_for(lambda: figures(gateway.base_url)["read_by"] == OWN, timeout=20)
                # Its own scrapes keep the figures fresh and the rule in force.
                found = health(gateway.base_url)
                assert fresh(found["engine_figures"])
                assert (found["figures_unread"], found["caps_reason"]) == (None, None), found
                client.pexpire(key, 200)  # the ghost died: its claim lapses, the gateway takes it
                wait_for(lambda: figures(gateway.base_url)["scraper"] == OWN, timeout=20)
        finally:
            client.close()
