"""The load generator and the demo against the real reference server on a loopback port."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvclient import demo
from kvclient.loadgen import cli
from reference_server import running_server


def _bench(url: str, tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "summary.json"
    argv = [url, "--num-requests", "40", "--seed", "3", "--json", str(out), "--records", *extra]
    assert cli.main(argv) == 0
    data: dict[str, object] = json.loads(out.read_text())
    return data


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_bench_counts_add_up_and_match_the_server(tmp_path: Path, stream: bool) -> None:
    with running_server(kv_tokens=12_288, decode_rate=5000, mean_output_tokens=300) as server:
        extra = [
            "--rate",
            "60",
            "--prompt-tokens",
            "50:400",
            "--max-tokens",
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


def test_bench_plot_draws_latency_and_rejections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))  # its font cache, not in $HOME
    png = tmp_path / "run.png"
    with running_server(kv_tokens=4096, decode_rate=5000, mean_output_tokens=200) as server:
        _bench(server.base_url, tmp_path, "--concurrency", "8", "--plot", str(png))
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


def test_bench_needs_one_loop_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["http://127.0.0.1:9", "--num-requests", "1"]) == 2
    assert "exactly one of --rate, --concurrency and --sweep" in capsys.readouterr().err


def test_demo_shows_the_contract(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert demo.main(["--requests", "50", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "naive client" in table
    assert "kvclient" in table
    data = json.loads(out.read_text())
    naive, ours = data["naive client"], data["kvclient"]
    assert naive["server"]["kv_oom_events_total"] == 0
    assert ours["server"]["kv_oom_events_total"] == 0
    assert ours["summary"]["completed"] == 50
    assert ours["summary"]["attempts_per_completed"] < naive["summary"]["attempts_per_completed"]
    assert ours["summary"]["http_429"] < naive["summary"]["http_429"]


def test_demo_prompt_admission_shows_ooms(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert demo.main(["--admission", "prompt", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kvclient"]["server"]["kv_oom_events_total"] >= 1
    assert data["kvclient"]["summary"]["failed_by_cause"]["oom"] >= 1
