"""``kvclient bench`` fails fast and says why, counts refusals apart, and sweeps to the knee."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvclient import AsyncClient, RetryPolicy, TiktokenCounter
from kvclient.engines.budget import Budget
from kvclient.loadgen import SLO, Shape, SyntheticWorkload, cli, run_load, summarize
from kvclient.loadgen._bench import (
    DEFAULT_CONCURRENCY,
    MAX_DEFAULT_CONCURRENCY,
    default_concurrency,
)
from kvclient.loadgen._kvsender import KVClientSender
from reference_server import RunningServer, running_server
from reference_server.testing import serve_in_thread

# A failed preflight ends promptly rather than hanging: the checks take well under a second on
# an idle machine; the bound leaves room for a machine busy with a real engine beside the tests.
PREFLIGHT_BOUND = 15.0
REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # closed again: nothing listens there


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(
        kv_tokens=2048, context_window=2048, decode_rate=5000, mean_output_tokens=50, api_key="k"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def no_window() -> Iterator[str]:
    """A server whose /v1/models names a model but no context window (as many engines do)."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    with serve_in_thread(Starlette(routes=[Route("/v1/models", models)])) as s:
        yield s.base_url


def _preflight_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    start = time.monotonic()
    code = cli.main([*argv, "--concurrency", "1", "--requests", "1"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert elapsed < PREFLIGHT_BOUND
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one clear line
    return lines[0]


def test_preflight_server_not_running(capsys: pytest.CaptureFixture[str]) -> None:
    line = _preflight_fails([f"http://127.0.0.1:{_closed_port()}"], capsys)
    assert "cannot reach" in line
    assert "is the server running" in line


def test_preflight_wrong_path(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    line = _preflight_fails([server.base_url + "/api", "--api-key", "k"], capsys)
    assert "answered 404" in line
    assert "base URL" in line


def test_preflight_missing_api_key(
    server: RunningServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCLIENT_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    line = _preflight_fails([server.base_url], capsys)
    assert "refused the credentials (401)" in line
    assert "--api-key" in line


def test_preflight_api_key_from_the_environment(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.setenv("KVCLIENT_BASE_URL", server.base_url)
    argv = ["--concurrency", "2", "--requests", "4", "--prompt-tokens", "20"]
    assert cli.main([*argv, "--max-tokens-range", "20", "--no-progress"]) == 0


@pytest.mark.parametrize("window", [None, "2048"], ids=["discovered", "given"])
def test_preflight_unknown_model(
    server: RunningServer, capsys: pytest.CaptureFixture[str], window: str | None
) -> None:
    extra = [] if window is None else ["--context-window", window]
    line = _preflight_fails([server.base_url, "--api-key", "k", "--model", "gtp-4", *extra], capsys)
    assert "'gtp-4' is not served" in line
    assert "kvclient-sim" in line  # the names it does serve


def test_preflight_context_window_unknown(
    no_window: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _preflight_fails([no_window], capsys)
    assert "max_model_len" in line
    assert "context_window" in line or "--context-window" in line


def test_no_url_anywhere(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCLIENT_BASE_URL", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["--rate", "1"]) == 2
    assert "OPENAI_BASE_URL" in capsys.readouterr().err


def test_outputs_checked_before_the_run(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = server.metrics()["kv_admitted_total"]
    missing = tmp_path / "no" / "such" / "dir" / "report.html"
    argv = [server.base_url, "--api-key", "k", "--rate", "5", "--html", str(missing)]
    assert cli.main(argv) == 2
    assert "--html" in capsys.readouterr().err
    assert cli.main([server.base_url, "--api-key", "k", "--sweep"]) == 2
    assert "--sweep needs a target" in capsys.readouterr().err
    assert server.metrics()["kv_admitted_total"] == before


def _run(server: RunningServer, tmp_path: Path, *extra: str) -> tuple[int, dict[str, object]]:
    out = tmp_path / "s.json"
    argv = [server.base_url, "--api-key", "k", "--concurrency", "4", "--seed", "5"]
    code = cli.main([*argv, "--no-progress", "--json", str(out), "--records", *extra])
    return code, json.loads(out.read_text())


def test_max_failure_rate_sets_the_exit_status(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 of 10 requests have prompts that cannot fit the 2,048-token context: refused locally.
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": " the" * 30, "max_tokens": 20}] * 8 + [{"prompt": " the" * 3000}] * 2
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, data = _run(server, tmp_path, "--dataset", str(path), "--requests", "10")
    err = capsys.readouterr().err
    assert code == 1
    assert "2 of 10 requests (20.0%) did not complete" in err
    assert "prompt_too_long" in err
    summary = data["summary"]
    assert isinstance(summary, dict)
    assert (summary["offered"], summary["refused_locally"], summary["sent"]) == (10, 2, 8)
    assert summary["completed"] == 8
    (group,) = summary["failures"]
    assert group["cause"] == "prompt_too_long"
    assert "leaves no room for output" in group["messages"][0][0]  # the message, in full
    code, _ = _run(
        server, tmp_path, "--dataset", str(path), "--requests", "10", "--max-failure-rate", ".2"
    )
    assert code == 0


def test_failures_keep_their_message_in_the_table(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A request that can never fit the usable budget is refused by the server with its reason.
    code, data = _run(
        server,
        tmp_path,
        "--requests",
        "2",
        "--prompt-tokens",
        "1000",
        "--max-tokens-range",
        "1000",
        "--context-window",
        "4096",
        "--max-failure-rate",
        "1",
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "http_400:kv_budget_exceeded ×2" in out  # the cause, its count and (beside) its message
    summary = data["summary"]
    assert isinstance(summary, dict)
    assert summary["admitted"] == 0
    assert summary["failed_by_cause"] == {"http_400:kv_budget_exceeded": 2}
    ((message, count),) = summary["failures"][0]["messages"]
    assert count == 2
    assert "This request can never be admitted: it needs 2000 KV tokens" in message


# --- the sweep finds the knee ----------------------------------------------------------------

KNEE_SERVER = {
    "kv_tokens": 1024,
    "context_window": 2048,
    # Slow enough that the engine, not the CPU, sets the capacity (0.6 s a request, three at a
    # time: 5 requests/s). Every time below is in units of that service time, long beside the
    # stalls of a busy 2-core machine (client and server share a process here): at 0.3 s a
    # request with a 1 s SLO, a stall of a few hundred ms failed rates below the capacity.
    "decode_rate": 250.0,
    "mean_output_tokens": 100_000.0,  # every request runs to its cap: a steady service time
    "seed": 1,
}
KNEE_PROMPT, KNEE_CAP = 100, 150


async def _capacity(url: str, n: int) -> float:
    """As bench/retry_storm.py measures it: a closed loop of 32 through kvclient."""
    shape = Shape((KNEE_PROMPT, KNEE_PROMPT), (KNEE_CAP, KNEE_CAP))
    items = SyntheticWorkload(shapes=[shape], seed=1).items(n, TiktokenCounter())
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as http:
        client = AsyncClient(base_url=url, http_client=http, retry=RetryPolicy(deadline=60))
        records, wall = await run_load(items, KVClientSender(client, stream=False), concurrency=32)
    return summarize(records, duration=wall).request_throughput


@pytest.mark.slow
def test_sweep_finds_the_knee_near_the_measured_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The capacity as bench/retry_storm.py measures it: a FIFO-queued server that never says 429.
    with running_server(max_queue_wait=600, **KNEE_SERVER) as queued:  # type: ignore[arg-type]
        capacity = anyio.run(_capacity, queued.base_url, 24)
    out = tmp_path / "sweep.json"
    with running_server(**KNEE_SERVER) as server:  # type: ignore[arg-type]
        code = cli.main(
            [
                server.base_url,
                "--sweep",
                "--sweep-points", "4",
                "--duration", "6",  # ten service times: a 60 % overload misses the SLO
                "--probe-requests", "24",
                "--arrival", "constant",
                "--prompt-tokens", str(KNEE_PROMPT),
                "--max-tokens-range", str(KNEE_CAP),
                "--no-stream",
                "--slo-latency", "2.0",  # about 3.3x the service time of one request
                "--sweep-attainment", "0.85",  # room for a stall of a loaded machine
                "--json", str(out),
            ]
        )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "knee" in table
    sweep = json.loads(out.read_text())["sweep"]
    knee = sweep["knee_rate"]
    assert knee is not None
    print(f"\nknee {knee:.2f} req/s, capacity {capacity:.2f} req/s")
    assert abs(knee - capacity) / capacity <= 0.25, (knee, capacity, table)
    rates = [p["rate"] for p in sweep["points"]]
    assert rates == sorted(rates)
    # A failing rate, when the grid reached one, lies above the knee. (On an idle machine the
    # grid's top, 1.6x the probe, may still pass; the knee is then that top, checked above.)
    failing = [p["rate"] for p in sweep["points"] if not p["passed"]]
    assert all(rate > knee for rate in failing)


def test_sweep_table_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    from kvclient.loadgen._metrics import RequestRecord
    from kvclient.loadgen._plots import plot_sweep
    from kvclient.loadgen._report import sweep_rows
    from kvclient.loadgen._results import BenchResult, SweepResult
    from kvclient.loadgen._sweep import SweepPoint

    def run(rate: float, within: int) -> BenchResult:
        records = []
        for i in range(10):
            r = RequestRecord(index=i, planned=0.0, prompt_tokens=1, max_tokens_requested=1)
            r.sent, r.ok, r.end = 0.0, True, 0.1 if i < within else 5.0
            records.append(r)
        summary = summarize(records, duration=10 / rate, slo=SLO(latency=1.0), deadline=9.0)
        return BenchResult(summary, records, {})

    probe = run(10.0, 10)
    runs = [run(6.0, 10), run(9.0, 10), run(12.0, 5)]
    verdicts = zip((6.0, 9.0, 12.0), runs, (True, True, False), strict=True)
    points = [SweepPoint(rate, b.summary, ok) for rate, b, ok in verdicts]
    sweep = SweepResult(probe, points, runs, knee=9.0)
    rows = sweep_rows(sweep)
    assert [row[-1] for row in rows] == ["pass", "knee", "fail"]
    assert rows[2][3] == "50%"  # within the SLOs
    png = tmp_path / "sweep.png"
    plot_sweep(sweep, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sweep.to_json()["sweep"]["knee_rate"] == 9.0


# --- no arrival mode: a closed loop the server's KV pool holds ------------------------------------


@pytest.mark.parametrize(
    ("budget", "window", "expected"),
    [
        (Budget(8192), 2048, 4),
        (Budget(1000), 2048, 1),  # less than one window: still one request at a time
        (Budget(10**9), 2048, MAX_DEFAULT_CONCURRENCY),
        (Budget(2048, max_concurrency=3, engine="llama.cpp"), 2048, 3),  # its slots
        (Budget(None), 2048, DEFAULT_CONCURRENCY),
    ],
)
def test_default_concurrency(budget: Budget, window: int, expected: int) -> None:
    n, why = default_concurrency(budget, window)
    assert n == expected
    assert why


def _bench(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvclient", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **env},
    )


def test_bench_without_an_arrival_mode_runs_a_closed_loop_the_pool_holds() -> None:
    """``kvclient bench`` with only a URL (here from $KVCLIENT_BASE_URL): a closed loop at the
    concurrency the KV pool holds, said in one line; httpx's request lines are not shown."""
    with running_server(
        kv_tokens=4096, context_window=1024, decode_rate=5000, mean_output_tokens=20
    ) as server:
        env = {"KVCLIENT_BASE_URL": server.base_url, "OPENAI_BASE_URL": ""}
        small = ("--requests", "5", "--prompt-tokens", "20", "--max-tokens-range", "20")
        out = _bench(*small, "--no-progress", env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        chosen = [line for line in out.stderr.splitlines() if "no arrival mode" in line]
        assert len(chosen) == 1, out.stderr
        assert "closed loop at --concurrency 4" in chosen[0]
        assert "4,096 tokens holds 4 whole 1,024-token context windows" in chosen[0]
        assert "HTTP Request:" not in out.stderr
        assert server.metrics()["kv_admitted_total"] >= 5
        # Asked for, they are there.
        loud = _bench(*small, "--concurrency", "1", "--log-level", "debug", env=env)
        assert loud.returncode == 0, loud.stderr[-2000:]
        assert "HTTP Request:" in loud.stderr


# --- the server's KV losses beside the client's failures ------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("admission", "oom"), [("prompt", True), ("reserve", False)])
def test_bench_reports_the_servers_ooms_streamed_or_not(
    admission: str, oom: bool, stream: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16 requests at once of 50 prompt + 800 output tokens that all run to their caps (for 0.8 s
    # each, so that they overlap however the machine staggers them): 13,600 tokens against a
    # 4,096-token pool. Admitted by prompt alone, the pool overflows mid-decode.
    out = tmp_path / "bench.json"
    argv = ["--concurrency", "16", "--requests", "16", "--prompt-tokens", "50"]
    argv += ["--max-tokens-range", "800", "--no-progress", "--json", str(out)]
    argv += [] if stream else ["--no-stream"]
    with running_server(
        admission=admission,
        kv_tokens=4096,
        context_window=1024,
        decode_rate=1000.0,
        mean_output_tokens=1e6,
    ) as server:
        cli.main([server.base_url, *argv])
        lost = server.engine.stats().oom_failed_sequences_total
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    losses = data["server_kv_losses"]
    assert losses["metric"] == "kv_oom_failed_requests_total"
    assert losses["count"] == lost
    assert "requests lost to KV OOM" in table
    ooms = data["summary"]["failed_by_cause"].get("oom", 0)
    if oom:
        assert lost > 0
        assert ooms > 0  # a stream cut by an error event is an OOM too, not a bad answer
        assert "bad_response" not in data["summary"]["failed_by_cause"]
    else:
        assert (lost, ooms) == (0, 0)
