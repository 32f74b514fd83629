"""The peak rule fails closed: whatever the engine hides or does against its assumptions, the
upstream counts whole caps, and ``/health``, ``/metrics`` and the log say why. In front of
scripted engines (no ``/metrics``, no decode counters, an unknown block size, speculative
decoding, an OOM nobody admitted) and of the reference server's engine with traffic that goes
around the gateway."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.gateway import watch as watch_module
from reference_server.gateway.upstream import Upstream
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import RATE, LockstepUpstream, scripted_upstream


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures unread for half a second are enough here (3 s in service)."""
    monkeypatch.setattr(watch_module, "BLIND_SECONDS", 0.5)


@pytest.fixture
def engine() -> Iterator[tuple[LockstepUpstream, str]]:
    scripted = LockstepUpstream()
    with scripted_upstream(scripted.app()) as up:
        yield scripted, up.base_url


def _config(url: str, **extra: Any) -> GatewayConfig:
    return GatewayConfig(
        upstreams=(url,), safety_fraction=1.0, decode_rate=RATE, speed_interval=0.1, **extra
    )


def _upstream(gateway: Any) -> Upstream:
    state: GatewayState = gateway.app.state.gateway
    return state.upstreams[0]


def _complete(base: str, name: str, cap: int) -> None:
    httpx.post(base + "/v1/completions", json={"prompt": name, "max_tokens": cap}, timeout=30)


def _health(base: str) -> dict[str, Any]:
    upstream: dict[str, Any] = httpx.get(base + "/health").json()["upstreams"][0]
    return upstream


# --- no /metrics, no peak ------------------------------------------------------------------------


def test_an_engine_whose_figures_cannot_be_read_counts_whole_caps_and_says_why(
    engine: tuple[LockstepUpstream, str],
) -> None:
    scripted, url = engine
    with running_gateway(_config(url)) as gw:
        assert _health(gw.base_url)["admission"] == "peak"
        upstream = _upstream(gw)
        scripted.shows_metrics = False  # a proxy in front of it now hides /metrics
        wait_for(lambda: upstream.watch.blind is not None, timeout=10)
        health = _health(gw.base_url)
        shown = httpx.get(gw.base_url + "/metrics").text
        scripted.shows_metrics = True
        wait_for(lambda: upstream.watch.blind is None, timeout=10)
        again = _health(gw.base_url)
    assert health["admission"] == "caps"
    assert "were not read for 0.5 s: its /metrics answered 404" in health["caps_reason"]
    assert health["start_clock"] is False
    assert health["forecast"]["quantile"] is None
    assert "kv_upstream_caps_reason{" in shown
    assert f'kv_upstream_figures_unread{{upstream="{url}"}} 1.0' in shown
    assert upstream.lockstep_breaks == 1
    assert again["admission"] == "peak"  # read again, and nobody admitted meanwhile to drain


def test_the_lockstep_watch_outlives_an_engine_that_exports_no_decode_counters(
    engine: tuple[LockstepUpstream, str],
) -> None:
    """Its speed cannot be measured (three scrapes without counters stopped the one watch
    there was); its waiting line is watched all the same."""
    scripted, url = engine
    scripted.counters = False
    with running_gateway(_config(url)) as gw:
        upstream = _upstream(gw)
        _health(gw.base_url)
        wait_for(lambda: upstream.watch.checks >= 10, timeout=10)  # a second of checks
        assert upstream.speed is None
        holder = threading.Thread(target=_complete, args=(gw.base_url, "A", 400))
        holder.start()
        wait_for(lambda: "A" in scripted.started, timeout=10)
        scripted.waiting = 2
        wait_for(lambda: upstream.lockstep_breaks == 1, timeout=10)
        health = _health(gw.base_url)
        holder.join(30)
    assert health["caps_reason"] == "2 requests wait inside the engine"


def _vllm_like(*, metrics: str | None, window: int = 2048) -> Starlette:
    """An engine that answers discovery as vLLM does; its ``/metrics`` is ``metrics`` (None:
    a 404, as behind a proxy that hides it)."""

    async def page(request: Request) -> Response:
        if metrics is None:
            return Response("not found", status_code=404)
        return Response(metrics)

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "max_model_len": window}]})

    return Starlette(routes=[Route("/metrics", page), Route("/v1/models", models)])


VLLM_PAGE = (
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="256"} 1\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
    'vllm:num_preemptions_total{engine="0",model_name="m"} 0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0\n'
)
SPEC_DECODE = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0\n'


def test_the_peak_is_refused_without_the_engines_block_size() -> None:
    """vLLM behind a proxy that hides ``/metrics``, given ``--kv-tokens`` and
    ``--max-running``: its block size is not known (the gateway used to count in blocks of
    1 then)."""
    with scripted_upstream(_vllm_like(metrics=None)) as up:
        config = GatewayConfig(upstreams=(up.base_url,), kv_tokens=(4096,), max_running=(8,))
        with running_gateway(config) as gw:
            health = _health(gw.base_url)
    assert health["engine"] == "vllm"
    assert health["admission"] == "caps"
    assert "block size is not known" in health["caps_reason"]


@pytest.mark.parametrize("from_the_start", [True, False])
def test_speculative_decoding_counts_whole_caps(from_the_start: bool) -> None:
    """A sequence may advance several tokens a step: no lockstep."""
    pages = [VLLM_PAGE + SPEC_DECODE] if from_the_start else [VLLM_PAGE]

    async def page(request: Request) -> Response:
        return Response(pages[-1])

    app = _vllm_like(metrics="")
    app.router.routes[0] = Route("/metrics", page)
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), max_running=(8,), speed_interval=0.1)
        with running_gateway(config) as gw:
            before = _health(gw.base_url)
            if not from_the_start:
                assert before["admission"] == "peak"
                pages.append(VLLM_PAGE + SPEC_DECODE)  # restarted with a speculative config
                wait_for(lambda: _health(gw.base_url)["admission"] == "caps", timeout=10)
            health = _health(gw.base_url)
    assert health["admission"] == "caps"
    assert "decodes speculatively" in health["caps_reason"]


# --- what the engine lost, and what it holds for others -----------------------------------------


def test_an_oom_the_gateway_did_not_admit_puts_the_upstream_on_caps(
    engine: tuple[LockstepUpstream, str],
) -> None:
    scripted, url = engine
    with running_gateway(_config(url)) as gw:
        upstream = _upstream(gw)
        _health(gw.base_url)
        wait_for(lambda: upstream.watch.checks >= 3, timeout=10)
        holder = threading.Thread(target=_complete, args=(gw.base_url, "A", 400))
        holder.start()
        wait_for(lambda: "A" in scripted.started, timeout=10)
        scripted.oom = 2  # somebody else's requests, or a count of the gateway's gone wrong
        wait_for(lambda: upstream.lockstep_breaks == 1, timeout=10)
        health = _health(gw.base_url)
        holder.join(30)
    assert health["caps_reason"] == (
        "the engine counted 2 requests lost to KV OOM (kv_oom_failed_requests_total)"
    )


_ENGINE = {
    "decode_rate": 400.0,
    "tick_seconds": 0.005,
    "kv_tokens": 4096,
    "context_window": 4096,
    "max_running": 16,
    # The server admits whatever comes: only the gateway stands between its pool and an
    # overflow, and it does not see what is sent to the engine directly.
    "admission": "prompt",
}


@pytest.mark.slow
def test_traffic_around_the_gateway_is_counted_as_held_and_nothing_overflows() -> None:
    """A client sends a 2,000-token prompt straight to the engine, beside the gateway. The
    gateway sees the engine hold KV its holders do not explain: it counts it as held by
    someone unseen (the room shrinks at once) and runs on caps. Eight requests of 500 tokens
    sent then through the gateway fill the engine's pool beside it unless they wait: counted
    from the gateway's own holders alone, they overflowed the engine (every request in it
    failed)."""
    from reference_server import running_server

    words = " ".join(["river"] * 1999)
    outside: dict[str, httpx.Response] = {}
    with running_server(**_ENGINE) as engine:

        def around() -> None:
            outside["answer"] = httpx.post(
                engine.base_url + "/v1/completions",
                json={"prompt": words, "max_tokens": 400, "ignore_eos": True},
                timeout=60,
            )

        config = GatewayConfig(
            upstreams=(engine.base_url,), decode_rate=400.0, speed_interval=0.1,
            relay_lag=0.05, max_queue_wait=60.0,
        )  # fmt: skip
        with running_gateway(config) as gw:
            _health(gw.base_url)
            ledger = _upstream(gw).known
            assert ledger is not None
            sender = threading.Thread(target=around)
            sender.start()
            wait_for(lambda: ledger.ledger.stats().unknown_tokens > 1000, timeout=10)
            health = _health(gw.base_url)
            answers: list[httpx.Response] = []

            def one(i: int) -> None:
                body = {"prompt": f"request {i}", "max_tokens": 500, "ignore_eos": True}
                answers.append(httpx.post(gw.base_url + "/v1/completions", json=body, timeout=90))

            burst = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for thread in burst:
                thread.start()
            for thread in [sender, *burst]:
                thread.join(120)
        metrics = engine.metrics()
    assert metrics["kv_oom_events_total"] == 0
    assert outside["answer"].status_code == 200
    assert [a.status_code for a in answers] == [200] * 8
    assert health["admission"] == "caps"
    assert "traffic that does not pass through the gateway" in health["caps_reason"]
    assert health["unknown_tokens"] >= 2000


# --- released when the engine has let go --------------------------------------------------------


def test_a_cut_request_holds_its_reservation_until_the_engine_lets_go(
    engine: tuple[LockstepUpstream, str],
) -> None:
    """A's client goes away mid-stream; the engine takes 0.15 s to let A go after its
    connection is reset. B, whose 303 tokens fit only once A's 1,003 are released (1,200 in
    all), waits for that: released at the cut, B was sent while the engine still held A."""
    scripted, url = engine
    scripted.let_go_seconds = 0.15
    with running_gateway(_config(url, relay_lag=0.3)) as gw:
        upstream = _upstream(gw)
        body = {"prompt": "A", "max_tokens": 1000, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", gw.base_url + "/v1/completions", json=body) as answer,
        ):
            lines = answer.iter_lines()
            while next(lines) == "":
                pass
            waiter = threading.Thread(target=_complete, args=(gw.base_url, "B", 300))
            waiter.start()
            known = upstream.known
            assert known is not None
            wait_for(lambda: known.queue.waiting == 1, timeout=10)
        # The client has gone: A is cut.
        waiter.join(30)
        wait_for(lambda: known.ledger.stats().reserved_tokens == 0)
    assert "A" not in scripted.ended
    assert scripted.started["B"] >= scripted.gone["A"]


# --- one slow reader ---------------------------------------------------------------------------


def test_a_client_that_stops_reading_is_no_stalled_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client opens a stream with a 4 KiB receive buffer and reads nothing: its relay waits
    on it, its count stands still while another stream's moves. That is a slow reader, counted
    as advancing at the engine's speed, not an engine out of lockstep: the upstream stays on
    the peak for everyone else (it used to fall back to caps for all)."""
    monkeypatch.setattr(watch_module, "STALL_SECONDS", 0.5)
    # 2 MB a second to a client that reads none: past the kernel's buffers (4 MB) in seconds.
    scripted = LockstepUpstream(text="x" * 20_000, rate=100.0)
    with (
        scripted_upstream(scripted.app()) as up,
        running_gateway(_config(up.base_url, send_timeout=30.0)) as gw,
    ):
        upstream = _upstream(gw)
        _health(gw.base_url)
        known = upstream.known
        assert known is not None
        reader = threading.Thread(target=_complete, args=(gw.base_url, "A", 500))
        reader.start()
        body = json.dumps({"prompt": "S", "max_tokens": 500, "stream": True}).encode()
        host, port = gw.base_url.removeprefix("http://").split(":")
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect((host, int(port)))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def waiting_long() -> bool:
            now = time.monotonic()
            return any(
                h.writing_since is not None and now - h.writing_since > 1.0
                for h in known.ledger.live_handles()
            )

        wait_for(lambda: "A" in scripted.started, timeout=10)
        wait_for(waiting_long, timeout=10)
        checks = upstream.watch.checks
        wait_for(lambda: upstream.watch.checks >= checks + 5, timeout=10)
        health = _health(gw.base_url)
        slow.close()
        reader.join(30)
    assert upstream.lockstep_breaks == 0
    assert health["admission"] == "peak"
    assert health["slow_readers"] == 1
