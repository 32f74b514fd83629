"""The gateway measures how fast its engine really decodes, from the engine's own counters, and
its advice follows: not from one answer's rate, not from streamed events (an engine may send
several tokens an event)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvclient.headers import parse_ratelimit
from reference_server import RunningServer, running_server
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for

DECODE_RATE = 400.0


@pytest.fixture
def engine() -> Iterator[RunningServer]:
    # Long outputs: a few sequences keep decoding through several scrapes.
    with running_server(
        kv_tokens=65_536, context_window=8192, decode_rate=DECODE_RATE, mean_output_tokens=4000
    ) as server:
        yield server


def stream_some(url: str, requests: int, max_tokens: int) -> list[httpx.Response]:
    """Start ``requests`` streams and read them to their ends, together."""
    with httpx.Client(base_url=url, timeout=60) as http:
        bodies = {
            "model": "kvclient-sim",
            "prompt": "Tell me a long story.",
            "max_tokens": max_tokens,
            "stream": True,
        }
        streams = [http.stream("POST", "/v1/completions", json=bodies) for _ in range(requests)]
        answers = [s.__enter__() for s in streams]
        for answer in answers:
            answer.read()
        for s in streams:
            s.__exit__(None, None, None)
        return answers


def test_the_gateway_measures_the_engines_decode_rate_from_its_counters(
    engine: RunningServer,
) -> None:
    config = GatewayConfig(upstreams=(engine.base_url,), speed_interval=0.2)
    with running_gateway(config) as gateway:
        upstream = gateway.gateway.upstreams[0]
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            http.get("/v1/models").raise_for_status()  # discovered
        started = time.monotonic()
        answers = stream_some(gateway.base_url, 3, 2400)  # ~6 s each at 400 tokens/s
        assert all(a.status_code == 200 for a in answers)
        wait_for(lambda: upstream.speed is not None, timeout=5)
        speed = upstream.speed
        assert speed is not None
        # Our engine sends ten tokens an event: counting events would say ~40 tokens/s.
        assert speed.decode_rate == pytest.approx(DECODE_RATE, rel=0.3)
        # Its sequences do not slow each other down: no throughput limit, or one far above.
        assert speed.throughput is None or speed.throughput > 3 * DECODE_RATE
        assert time.monotonic() - started < 30
        # The ledger decodes at that speed: a holder's worst case is its cap at ~400 tokens/s.
        ledger = upstream.known.ledger if upstream.known else None
        assert ledger is not None
        assert ledger.rate_at(1) == pytest.approx(DECODE_RATE, rel=0.3)


def test_the_room_advertised_follows_the_measured_speed(engine: RunningServer) -> None:
    config = GatewayConfig(upstreams=(engine.base_url,), speed_interval=0.2)
    with running_gateway(config) as gateway:
        upstream = gateway.gateway.upstreams[0]
        stream_some(gateway.base_url, 2, 2400)
        wait_for(lambda: upstream.speed is not None, timeout=5)
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            body = {"model": "kvclient-sim", "prompt": "Hi", "max_tokens": 2000, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as answer:
                hint = parse_ratelimit(answer.headers)
                answer.read()
        assert hint is not None
        # Its own reservation ends within about 2000 / 400 = 5 s, not 50 s (events/s).
        assert hint.reset is not None
        assert hint.reset < 12
