"""The load generator and the demo against the real reference server on a loopback port."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvclient import demo
from kvclient.loadgen import cli
from kvclient.loadgen._metrics import RequestRecord, summarize
from reference_server import running_server


def _bench(url: str, tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "summary.json"
    argv = [url, "--requests", "40", "--seed", "3", "--json", str(out), "--records", *extra]
    assert cli.main(argv) == 0
    data: dict[str, object] = json.loads(out.read_text())
    return data


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_bench_counts_add_up_and_match_the_server(tmp_path: Path, stream: bool) -> None:
    with running_server(kv_tokens=12_288, decode_rate=5000, mean_output_tokens=300) as server:
        extra = [
            "--rate",
            "60",
            "--prompt-tokens",
            "50:400",
            "--max-tokens-range",
            "500:3000",
            "--unset-cap-share",
            "0.3",
        ]
        if not stream:
            extra.append("--no-stream")
        data = _bench(server.base_url, tmp_path, *extra)
        metrics = server.metrics()
    summary = data["summary"]
    assert isinstance(summary, dict)
    assert summary["sent"] == 40
    assert summary["completed"] + summary["failed"] == summary["sent"]
    # Every 429 the server sent is one the generator counted, and no more.
    assert summary["http_429"] == metrics["kv_rejected_total"]
    assert data["server"]["kv_rejected_total"] == metrics["kv_rejected_total"]  # type: ignore[index]
    assert summary["attempts"] == metrics["kv_admitted_total"] + metrics["kv_rejected_total"]
    records = data["records"]
    assert isinstance(records, list)
    assert len(records) == 40
    if stream:
        assert summary["ttft"]["count"] == summary["completed"]  # type: ignore[index]
        assert summary["itl"]["count"] > 0  # type: ignore[index]


def test_bench_closed_loop_and_naive_baseline(tmp_path: Path) -> None:
    with running_server(kv_tokens=12_288, decode_rate=5000, mean_output_tokens=200) as server:
        # The naive client gives up on some requests: that is its point, not a failed run.
        data = _bench(
            server.base_url, tmp_path, "--concurrency", "8", "--naive", "--max-failure-rate", "1"
        )
        metrics = server.metrics()
    summary = data["summary"]
    assert isinstance(summary, dict)
    assert summary["completed"] + summary["failed"] == 40
    assert summary["http_429"] == metrics["kv_rejected_total"]


@pytest.mark.slow
def test_bench_plot_draws_latency_and_rejections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))  # its font cache, not in $HOME
    png = tmp_path / "run.png"
    with running_server(kv_tokens=4096, decode_rate=5000, mean_output_tokens=200) as server:
        # Requests of the default mix that can never fit a 4,096-token budget fail, in red.
        argv = ["--concurrency", "8", "--plot", str(png), "--max-failure-rate", "1"]
        _bench(server.base_url, tmp_path, *argv)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # two panels with points, not an empty canvas


def test_bench_plot_without_matplotlib_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "run.png"
    with running_server(kv_tokens=4096, decode_rate=5000, mean_output_tokens=50) as server:
        argv = [server.base_url, "--concurrency", "2", "--plot", str(png)]
        assert cli.main(argv) == 2
        assert server.metrics()["kv_admitted_total"] == 0  # nothing was run
    assert "pip install 'kvclient[plot]'" in capsys.readouterr().err
    assert not png.exists()


def test_bench_takes_at_most_one_loop_kind(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["http://127.0.0.1:9", "--requests", "1", "--rate", "1", "--concurrency", "1"]
    assert cli.main(argv) == 2
    assert "at most one of --rate, --concurrency and --sweep" in capsys.readouterr().err


def test_demo_shows_the_contract(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert demo.main(["--requests", "50", "--repeat", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "naive client" in table
    assert "kvclient" in table
    # Its own reading of the figures, and what one run cannot tell.
    assert "- The server kept its half: no OOM event" in table
    assert "- kvclient kept the client's half:" in table
    assert "- Variance: this is one run." in table
    data = json.loads(out.read_text())
    naive, ours = data["naive client"], data["kvclient"]
    assert naive["server"]["kv_oom_events_total"] == 0
    assert ours["server"]["kv_oom_events_total"] == 0
    assert ours["summary"]["completed"] == 50
    assert ours["summary"]["attempts_per_completed"] < naive["summary"]["attempts_per_completed"]
    assert ours["summary"]["http_429"] < naive["summary"]["http_429"]


def test_demo_prompt_admission_shows_ooms(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert demo.main(["--admission", "prompt", "--repeat", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # Admitted by prompt alone, the burst outgrows the pool: OOMs, counted by the server and
    # seen by the client as such. Which client meets them depends on timing (kvclient paces,
    # and on a loaded machine its requests spread out), so the two clients' runs are summed.
    runs = [data["naive client"], data["kvclient"]]
    assert sum(run["server"]["kv_oom_events_total"] for run in runs) >= 1
    assert sum(run["summary"]["failed_by_cause"].get("oom", 0) for run in runs) >= 1


def _run(name: str, completed: int, http_429: int, oom: float = 0.0) -> demo.DemoRun:
    records = []
    for i in range(10):
        r = RequestRecord(index=i, planned=0.0, prompt_tokens=1, max_tokens_requested=None)
        r.sent, r.end, r.attempts, r.ok = 0.0, 0.1 * (i + 1), 1 + http_429 // 10, i < completed
        r.http_429 = http_429 // 10
        r.error = None if r.ok else "gave_up:http_429"
        records.append(r)
    summary = summarize(records, duration=2.0, deadline=45.0)
    server = {
        "kv_oom_events_total": oom,
        "kv_peak_reserved_tokens": 90.0,
        "kv_usable_tokens": 100.0,
    }
    return demo.DemoRun(name, summary, server)


def test_demo_table_shows_median_and_range_over_repeats() -> None:
    rounds = [
        [_run("naive client", 9, 300), _run("kvclient", 10, 10)],
        [_run("naive client", 8, 900), _run("kvclient", 10, 20)],
        [_run("naive client", 10, 500), _run("kvclient", 10, 10)],
    ]
    rows = {row[0]: row[1:] for row in demo.comparison_rows(rounds)}
    assert rows["429s received"] == ["500 (300–900)", "10 (10–20)"]
    assert rows["completed"] == ["9 (8–10)", "10"]
    assert rows["peak reserved KV (% of usable)"] == ["90%", "90%"]
    assert rows["  why (all runs)"] == ["gave_up:http_429 3", "-"]
    lines = demo.interpret(rounds)
    assert any("500 429s" not in line and "10 429s against 500" in line for line in lines)
    assert lines[-1].startswith("Variance: each cell is the median of 3 runs")
    oom = demo.interpret([[_run("naive client", 5, 0, oom=1), _run("kvclient", 5, 0, oom=2)]])
    assert oom[0].startswith("The server admitted more than its KV cache holds: 3 OOM events")


def _latency_run(name: str, http_429: int, attempts: int, p50: float) -> demo.DemoRun:
    records = []
    for i in range(10):
        r = RequestRecord(index=i, planned=0.0, prompt_tokens=1, max_tokens_requested=None)
        r.sent, r.end, r.attempts, r.ok = 0.0, p50, attempts, True
        r.http_429 = http_429 // 10
        records.append(r)
    summary = summarize(records, duration=2.0, deadline=45.0)
    return demo.DemoRun(name, summary, {"kv_oom_events_total": 0.0})


def test_demo_closing_text_follows_the_figures() -> None:
    """Hammering is named only when the naive client did hammer (more 429s, more attempts)."""
    quiet = demo.interpret(
        [[_latency_run("naive client", 0, 1, 0.5), _latency_run("kvclient", 0, 1, 0.9)]]
    )
    text = " ".join(quiet)
    assert "hammering" not in text
    assert "Neither client got a 429" in text
    assert "not because the naive client hammered" in text
    assert "kvclient kept the client's half" not in text

    stormy = demo.interpret(
        [[_latency_run("naive client", 300, 31, 0.5), _latency_run("kvclient", 10, 2, 0.9)]]
    )
    text = " ".join(stormy)
    assert "grabs freed capacity by hammering" in text
    assert "10 429s against 300" in text

    lucky = demo.interpret(
        [[_latency_run("naive client", 0, 1, 0.5), _latency_run("kvclient", 0, 1, 0.5)]],
        admission="prompt",
    )
    assert lucky[0].startswith("No OOM event this time, but not by design")
    assert "because it reserves" not in " ".join(lucky)

    faster = demo.interpret(
        [[_latency_run("naive client", 300, 31, 0.9), _latency_run("kvclient", 10, 2, 0.5)]]
    )
    assert "hammering" not in " ".join(faster)
