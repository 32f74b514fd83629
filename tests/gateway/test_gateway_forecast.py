"""The gateway past the exact peak rule: the engine's real pool budgeted, and holders counted by
a forecast of their outputs within a preemption budget, in front of the reference server's
engine that preempts (and one that fails, which never gets a forecast)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reference_server import running_server
from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import scripted_upstream

# --- the pool the engine really has --------------------------------------------------------------


def _vllm_like(blocks: int, block_size: int) -> Starlette:
    """An engine that says what vLLM says of its pool (``num_gpu_blocks`` x ``block_size``)."""
    labels = f'block_size="{block_size}",enable_prefix_caching="False",num_gpu_blocks="{blocks}"'

    async def metrics(request: Request) -> Response:
        return Response(f"vllm:cache_config_info{{{labels}}} 1.0\n")

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "max_model_len": 2048}]})

    return Starlette(routes=[Route("/metrics", metrics), Route("/v1/models", models)])


@pytest.fixture
def vllm_like() -> Iterator[str]:
    with scripted_upstream(_vllm_like(24, 128)) as up:
        yield up.base_url


@pytest.mark.parametrize(
    ("options", "usable", "basis"),
    [
        ({}, 23 * 128, "less the 1 blocks of 128 it keeps for itself"),
        ({"safety_fraction": 0.9}, int(24 * 128 * 0.9), "0.9 of 3072 tokens (--safety-fraction)"),
        ({"kv_tokens": (3072,)}, int(3072 * 0.9), "0.9 of 3072 tokens (--kv-tokens)"),
    ],
)
def test_a_pool_counted_in_blocks_is_budgeted_whole_less_what_the_engine_keeps(
    vllm_like: str, options: dict[str, Any], usable: int, basis: str
) -> None:
    config = GatewayConfig(upstreams=(vllm_like,), max_running=(8,), **options)
    with running_gateway(config) as gw:
        health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
    assert health["usable_tokens"] == usable
    assert basis in health["budget"]


# --- the forecast, in front of an engine that preempts ----------------------------------------

_ENGINE = {
    "decode_rate": 400.0,
    "tick_seconds": 0.005,
    "kv_tokens": 4096,
    "context_window": 2048,
    # The server admits whatever comes: only the gateway stands between its pool and an
    # overflow (which this engine pays for by preempting and recomputing, as vLLM does).
    "admission": "prompt",
    "max_running": 24,
    "on_overflow": "preempt",
    "recompute_seconds": 0.0002,
    # Outputs stop by themselves after 40 tokens on average (exponentially), far before caps
    # of 300-600.
    "mean_output_tokens": 40.0,
}


def _state(gateway: Any) -> GatewayState:
    state: GatewayState = gateway.app.state.gateway
    return state


def _send(base: str, bodies: list[dict[str, Any]], threads: int) -> list[int]:
    """Send ``bodies`` from ``threads`` threads at once; their statuses."""
    statuses: list[int] = []
    lock = threading.Lock()
    pending = list(bodies)

    def worker() -> None:
        with httpx.Client(timeout=120) as client:
            while True:
                with lock:
                    if not pending:
                        return
                    body = pending.pop()
                status = client.post(base + "/v1/completions", json=body).status_code
                with lock:
                    statuses.append(status)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(150)
    return statuses


@pytest.mark.slow
def test_the_forecast_runs_more_at_once_than_the_exact_rule_within_its_budget() -> None:
    rng = __import__("random").Random(3)
    learn = [{"prompt": f"learn {i}", "max_tokens": rng.randint(300, 600)} for i in range(48)]
    burst = [{"prompt": f"burst {i}", "max_tokens": rng.randint(300, 600)} for i in range(40)]
    most: dict[float, int] = {}
    for budget in (0.0, 100.0):
        with running_server(**_ENGINE) as upstream:
            config = GatewayConfig(
                upstreams=(upstream.base_url,), decode_rate=400.0, max_queue_wait=120.0,
                speed_interval=0.2, relay_lag=0.05, preemption_budget=(budget,),
            )  # fmt: skip
            with running_gateway(config) as gw:
                assert set(_send(gw.base_url, learn, threads=4)) == {200}
                ledger = _state(gw).upstreams[0].known.ledger  # type: ignore[union-attr]
                wait_for(lambda: ledger.stats().inflight == 0)  # noqa: B023
                before = ledger.stats().peak_inflight
                assert set(_send(gw.base_url, burst, threads=40)) == {200}
                wait_for(lambda: ledger.stats().reserved_tokens == 0)  # noqa: B023
                stats = ledger.stats()
                health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
                shown = httpx.get(gw.base_url + "/metrics").text
            metrics = upstream.metrics()
        assert f'kv_upstream_preemption_budget{{upstream="{upstream.base_url}"}} {budget}' in shown
        assert metrics["kv_oom_events_total"] == 0
        assert health["admission"] == "peak"
        if budget:
            assert health["forecast"]["preemption_budget"] == budget
            quantile = health["forecast"]["quantile"]
            assert quantile is not None
            assert (
                f'kv_upstream_forecast_quantile{{upstream="{upstream.base_url}"}} {quantile}'
                in shown
            )
        else:
            assert health["forecast"]["quantile"] is None
            assert metrics["kv_engine_preemptions_total"] == 0  # the exact rule never overflows
        most[budget] = max(stats.peak_inflight, before)
    assert most[100.0] > most[0.0]


def test_an_engine_whose_overflow_fails_requests_never_gets_a_forecast() -> None:
    engine = {**_ENGINE, "on_overflow": "fail"}
    with running_server(**engine) as upstream:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), decode_rate=400.0, preemption_budget=(100.0,)
        )
        with running_gateway(config) as gw:
            answer = httpx.post(
                gw.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 50}
            )
            health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
    assert answer.status_code == 200
    assert health["admission"] == "peak"
    assert health["forecast"] == {
        "quantile": None,
        "preemption_budget": None,
        "preemptions_per_1000": None,
        "off_because": None,
    }
