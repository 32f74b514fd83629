"""The real server (uvicorn on a loopback port) driven over real HTTP: httpx and the openai SDK."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kvclient import TiktokenCounter
from reference_server import RunningServer, running_server
from tests.helpers.servers import at_zero, wait_for

COUNTER = TiktokenCounter()
FAST: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 2048,
    "decode_rate": 20_000.0,
    "mean_output_tokens": 50.0,
    "tick_seconds": 0.005,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(**FAST) as running:
        yield running


@pytest.fixture
def sdk(server: RunningServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    yield client
    client.close()


#: One pooled client for every holder: building a client (its TLS context) costs more than the
#: short requests the holders send, and under load the test would measure that instead.
_HOLDERS = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=64))


def hold(server: RunningServer, max_tokens: int, **body: Any) -> threading.Thread:
    """Send a request in a thread (it occupies the ledger until it finishes)."""

    def run() -> None:
        body_ = {"prompt": "x", "max_tokens": max_tokens, **body}
        _HOLDERS.post(server.base_url + "/v1/completions", json=body_)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --- start-up ------------------------------------------------------------------------------------


def test_running_server_listens_on_loopback_and_stops_cleanly() -> None:
    with running_server(**FAST) as running:
        assert running.base_url.startswith("http://127.0.0.1:")
        assert running.port > 0
        assert httpx.get(running.base_url + "/health").json()["status"] == "ok"
        url = running.base_url
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_cli_help_explains_the_single_process_design(capsys: pytest.CaptureFixture[str]) -> None:
    from reference_server.simulated.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "Single process by design" in out
    for option in (
        "--port",
        "--context-window",
        "--kv-tokens",
        "--kv-bytes",
        "--model-preset",
        "--safety-fraction",
        "--block-size",
        "--decode-rate",
        "--mean-output-tokens",
        "--admission",
        "--max-concurrency",
        "--max-queue-wait",
        "--api-key",
        "--seed",
    ):
        assert option in out


def test_cli_builds_the_config_from_bytes_and_a_preset() -> None:
    from reference_server.simulated.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--kv-bytes", str(2 * 1024**3), "--model-preset", "llama-3.1-8b", "--admission", "prompt"]
    )
    config = config_from_args(args)
    assert config.total_kv_tokens == 2 * 1024**3 // 131072 == 16384
    assert config.admission == "prompt"


def test_cli_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    from reference_server.simulated.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--safety-fraction", "1.5"])
    assert exc.value.code == 2
    assert "safety_fraction" in capsys.readouterr().err


# --- the openai SDK, unchanged -------------------------------------------------------------------


def test_openai_sdk_models_completions_chat(sdk: openai.OpenAI, server: RunningServer) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["kvclient-sim"]
    assert models.data[0].model_extra is not None
    assert models.data[0].model_extra["max_model_len"] == 2048

    completion = sdk.completions.create(model="kvclient-sim", prompt="Hello there", max_tokens=20)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == COUNTER.count("Hello there")
    assert completion.usage.completion_tokens == COUNTER.count(completion.choices[0].text)

    messages: Any = [{"role": "user", "content": "Hi!"}]
    chat = sdk.chat.completions.create(model="kvclient-sim", messages=messages, max_tokens=10)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == COUNTER.count_messages(messages)
    assert chat.choices[0].finish_reason in ("stop", "length")
    wait_for(lambda: at_zero(server))


def test_openai_sdk_streaming(sdk: openai.OpenAI, server: RunningServer) -> None:
    messages: Any = [{"role": "user", "content": "Stream!"}]
    stream = sdk.chat.completions.create(
        model="kvclient-sim",
        messages=messages,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    assert usage.completion_tokens == COUNTER.count("".join(pieces))

    text_stream = sdk.completions.create(
        model="kvclient-sim", prompt="go", max_tokens=15, stream=True
    )
    reasons = [c.choices[0].finish_reason for c in text_stream if c.choices]
    assert reasons[-1] in ("stop", "length")
    wait_for(lambda: at_zero(server))


def test_openai_sdk_gets_our_429_with_retry_after() -> None:
    with running_server(**{**FAST, "decode_rate": 2000.0, "mean_output_tokens": 1e6}) as srv:
        holder = hold(srv, 2000)
        wait_for(lambda: srv.metrics()["kv_inflight_requests"] == 1)
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model="kvclient-sim", prompt="y", max_tokens=2000)
        client.close()
        headers = exc.value.response.headers
        assert int(headers["retry-after"]) >= 1
        assert 500 <= int(headers["retry-after-ms"]) <= 1200  # ~1 s of decoding left
        assert exc.value.code == "rate_limit_exceeded"
        holder.join(10)
        wait_for(lambda: at_zero(srv))


def test_openai_sdk_retries_honour_retry_after_and_succeed() -> None:
    with running_server(**{**FAST, "decode_rate": 4000.0, "mean_output_tokens": 1e6}) as srv:
        holder = hold(srv, 2000)
        wait_for(lambda: srv.metrics()["kv_inflight_requests"] == 1)
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=3)
        start = time.monotonic()
        completion = client.completions.create(model="kvclient-sim", prompt="y", max_tokens=2000)
        elapsed = time.monotonic() - start
        client.close()
        assert completion.choices[0].finish_reason == "length"
        assert srv.metrics()["kv_rejected_total"] >= 1
        assert elapsed >= 0.4  # it waited for the holder (0.5 s of decoding) instead of hammering
        holder.join(10)
        wait_for(lambda: at_zero(srv))


def test_openai_sdk_sees_413_for_an_oversized_prompt(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        sdk.completions.create(model="kvclient-sim", prompt="word " * 3000, max_tokens=5)
    assert exc.value.status_code == 413
    assert exc.value.code == "context_length_exceeded"


# --- release on disconnect over a real socket ----------------------------------------------------


def test_client_disconnect_mid_stream_releases_the_reservation() -> None:
    with running_server(**{**FAST, "decode_rate": 1000.0, "mean_output_tokens": 1e6}) as srv:
        body = {"prompt": "x", "max_tokens": 1500, "stream": True}
        with (
            httpx.Client(base_url=srv.base_url, timeout=10) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            chunks = response.iter_bytes()  # keep it: a dropped iterator closes the connection
            first = next(chunks)
            assert first.startswith(b"data: ")
            assert srv.metrics()["kv_inflight_requests"] == 1
        # The connection is closed here, long before the 1.5 s of decoding would end.
        wait_for(lambda: at_zero(srv), timeout=3)
        assert srv.engine.stats().finished_total == 0


def test_client_timeout_on_a_plain_request_releases_the_reservation() -> None:
    with running_server(**{**FAST, "decode_rate": 1000.0, "mean_output_tokens": 1e6}) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                srv.base_url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 1500},
                timeout=httpx.Timeout(0.2),
            )
        wait_for(lambda: at_zero(srv), timeout=3)
        assert srv.metrics()["kv_admitted_total"] == 1


# --- the seed's comparison, measured -------------------------------------------------------------

BURST = {"kv_tokens": 2048, "context_window": 1024, "decode_rate": 4000.0, "tick_seconds": 0.005}


def run_burst(
    admission: str, *, stagger: bool = False, requests: int = 16, retries: int = 40
) -> dict[str, Any]:
    """Short prompts, large caps, all at once; rejected requests retry after the server's advice
    (exactly, no jitter: the server's staggering alone must keep them from colliding)."""
    config = {
        **BURST,
        "admission": admission,
        "stagger_retry_after": stagger,
        "mean_output_tokens": 100_000.0,
        "seed": 7,
    }
    with running_server(**config) as srv:
        statuses: list[int] = []
        retried_then: list[int] = []  # status of each request sent after waiting as advised
        lock = threading.Lock()

        def one(i: int) -> None:
            with httpx.Client(base_url=srv.base_url, timeout=30) as client:
                deadline = time.monotonic() + 20
                for attempt in range(retries):
                    response = client.post(
                        "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 800}
                    )
                    with lock:
                        statuses.append(response.status_code)
                        if attempt:
                            retried_then.append(response.status_code)
                    if response.status_code != 429 or time.monotonic() > deadline:
                        return
                    time.sleep(int(response.headers["retry-after-ms"]) / 1000)

        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(one, range(requests)))
        wait_for(lambda: at_zero(srv))
        metrics = srv.metrics()
        return {
            "ok": statuses.count(200),
            "oom_500": statuses.count(500),
            "rejected_429": statuses.count(429),
            "admitted_on_return": f"{retried_then.count(200)}/{len(retried_then)}",
            "oom_events": metrics["kv_oom_events_total"],
            "peak_reserved": metrics["kv_peak_reserved_tokens"],
            "peak_used": metrics["kv_peak_used_tokens"],
            "capacity": metrics["kv_physical_capacity_tokens"],
        }


def test_same_burst_never_ooms_in_reserve_mode_and_does_in_prompt_mode() -> None:
    reserve = run_burst("reserve")
    staggered = run_burst("reserve", stagger=True)
    prompt = run_burst("prompt")
    print(f"\nburst reserve: {reserve}\nstaggered:     {staggered}\nburst prompt:  {prompt}")
    assert reserve["oom_events"] == 0
    assert reserve["oom_500"] == 0
    assert reserve["ok"] == 16  # everyone got through, paced by Retry-After
    assert reserve["rejected_429"] >= 1
    assert reserve["peak_used"] <= reserve["capacity"]
    assert staggered["oom_events"] == 0
    assert staggered["ok"] == 16
    # Clients turned away together were told staggered times: most fit when they came back.
    admitted, returned = map(int, staggered["admitted_on_return"].split("/"))
    assert admitted >= 0.8 * returned
    assert prompt["oom_events"] >= 1
    assert prompt["oom_500"] >= 1
    assert prompt["peak_used"] > prompt["capacity"]


# --- Retry-After is honest -----------------------------------------------------------------------


def test_waiting_as_advised_gets_admitted() -> None:
    """Fill the server, get a 429, wait exactly as advised, try again: admitted in most cases."""
    rng = random.Random(3)
    config = {
        **FAST,
        "kv_tokens": 4096,
        "context_window": 2048,
        "decode_rate": 10_000.0,
        "mean_output_tokens": 600.0,
    }
    admitted = 0
    trials = 0
    ratios: list[float] = []
    with running_server(**config) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        for _ in range(12):
            wait_for(lambda: at_zero(srv))
            holders = []
            while (reserved := srv.metrics()["kv_reserved_tokens"]) < 2600:
                admitted_before = srv.metrics()["kv_admitted_total"]
                free = 3686 - int(reserved)
                holders.append(hold(srv, min(rng.randrange(300, 1500), free - 32)))
                wait_for(lambda: srv.metrics()["kv_admitted_total"] > admitted_before)  # noqa: B023
            cap = rng.randrange(1200, 2000)
            rejected = c.post("/v1/completions", json={"prompt": "probe", "max_tokens": cap})
            if rejected.status_code != 429:
                continue
            trials += 1
            advised = int(rejected.headers["retry-after-ms"]) / 1000
            asked = time.monotonic()
            need = srv.ledger.need_tokens(COUNTER.count("probe"), cap)
            fits_at = None
            while time.monotonic() - asked < advised:
                if fits_at is None and srv.ledger.stats().reserved_tokens + need <= 3686:
                    fits_at = time.monotonic() - asked
                time.sleep(0.002)
            retried = c.post("/v1/completions", json={"prompt": "probe", "max_tokens": cap})
            admitted += retried.status_code == 200
            if fits_at is not None:
                ratios.append(advised / max(fits_at, 0.001))
            for thread in holders:
                thread.join(10)
    rate = admitted / trials
    print(
        f"\nRetry-After honesty: {admitted}/{trials} admitted after waiting as advised; "
        f"advice / actual time to fit: median {statistics.median(ratios):.2f}"
    )
    assert trials >= 8
    assert rate >= 0.8


# --- concurrent traffic leaves nothing behind ----------------------------------------------------


def test_mixed_traffic_leaves_the_ledger_at_zero(server: RunningServer) -> None:
    def one(i: int) -> int:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            kind = i % 4
            if kind == 0:
                r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1500})
            elif kind == 1:
                r = client.post("/v1/completions", content=b"{broken")
            elif kind == 2:
                with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "stream": True},
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            json.loads(line[6:])
            else:
                r = client.post("/v1/completions", json={"prompt": "w " * 3000})
            return r.status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(32)))
    assert set(statuses) <= {200, 400, 413, 429}
    assert 500 not in statuses
    wait_for(lambda: at_zero(server))


def test_serve_on_a_port_in_use_says_so_in_one_line() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "kvclient.cli", "serve", "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"kvclient serve: http://127.0.0.1:{port} is already in use"
    assert "Traceback" not in done.stderr
