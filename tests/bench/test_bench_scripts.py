"""Smoke tests of the bench/ scripts: each runs with the smallest settings, prints its table and
writes its JSON (into a temporary directory, never bench/results/). No timing is asserted: the
figures are the scripts' business, whether they run is ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = pytest.mark.slow


def run_script(tmp_path: Path, script: str, *args: str) -> tuple[str, dict[str, Any]]:
    env = {**os.environ, "KVCLIENT_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = list(tmp_path.glob("*.json"))
    assert len(written) == 1, written
    data = json.loads(written[0].read_text())
    assert data["machine"]["cpus"] >= 1
    return proc.stdout, data


def test_admission_strategies(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path,
        "admission_strategies.py",
        *("--requests", "6", "--rate", "50", "--deadline", "2", "--strategies", "prompt,fifo"),
    )
    assert "| strategy" in out
    assert "reservation + FIFO queue" in out
    assert next(r["strategy"] for r in data["results"]) == "prompt-only admission"
    for r in data["results"]:
        assert r["sent"] == 6
        assert r["metric_samples"] > 0
        assert 0 <= r["mean_physical_kv_utilisation"] <= 1


def test_retry_storm(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path,
        "retry_storm.py",
        *("--capacity", "5", "--burst", "0.6", "--deadline", "2"),
        *("--clients", "naive,kvclient,kvclient cooldown_by_size"),
    )
    assert "| client" in out
    assert "kvclient goals" in out
    by_client = {r["client"]: r for r in data["results"]}
    assert set(by_client) == {"naive", "kvclient", "kvclient cooldown_by_size"}
    for r in by_client.values():
        # The server's count of attempts and the client-side hook's agree.
        assert r["attempts_server"] == r["attempts_client"]
        assert r["requests"] == data["requests"]
    # The ceiling: the same trace through a FIFO-queued server, which says 429 only to a
    # request that would not be admitted within what its client said it would wait (Prefer:
    # wait, a second under its deadline): one the 2 s deadline cuts anyway.
    ceiling = data["ceiling"]
    assert ceiling["requests"] == data["requests"]
    assert ceiling["http_429_server"] <= ceiling["requests"] - ceiling["completed_within_deadline"]
    assert ceiling["completed"] > 0  # the 2 s deadline may cut the last of the queue


def test_client_overhead(tmp_path: Path) -> None:
    out, data = run_script(tmp_path, "client_overhead.py", "--calls", "10")
    assert "| mode" in out
    assert "openai SDK" in out
    for mode in ("sync", "async"):
        for size in ("tiny", "1k"):
            assert set(data[mode][size]) == {"raw httpx", "openai SDK", "kvclient"}
    assert data["count_1k_seconds"] > 0


def test_ledger_server(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path, "ledger_server.py", "--quick", "--requests", "200", "--concurrency", "8"
    )
    assert "| threads" in out
    assert "| connections" in out
    assert [r["threads"] for r in data["ledger"]] == [1, 2, 4, 8]
    (server,) = data["server"]["results"]
    assert server["non_200"] == {"reference": 0, "bare": 0}
    assert server["reference_rps"] > 0
    assert server["bare_rps"] > 0


def test_gateway_overhead(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path,
        "gateway_overhead.py",
        *("--quick", "--requests", "30", "--streams", "2", "--events", "5"),
        *("--upstream-delay", "0.002", "--no-litellm"),
    )
    assert "| path" in out
    assert "gateway (upstream /tokenize) goals" in out
    assert "LiteLLM row skipped: --no-litellm" in out
    assert data["upstream_delay"] == 0.002
    # Every generation waited out the upstream's delay, through every path.
    assert all(r["p50_ms"] >= 2.0 for r in data["results"])
    paths = {r["path"] for r in data["results"]}
    assert {"direct", "gateway (upstream /tokenize)"} <= paths
    for r in data["results"]:
        assert r["requests"] == 30
    for name, s in data["streams"].items():
        assert s["events_received"] == s["events_expected"] == 2 * 7, name
        assert s["non_200"] == 0
    assert data["non_200"] == dict.fromkeys(paths, 0)
    # The correctness probes: one attempt at an upstream 500, the 429's Retry-After relayed.
    assert data["probes"]["500"] == {"status": 500, "upstream_attempts": 1, "ok": True}
    assert data["probes"]["429"] == {
        "status": 429,
        "upstream_attempts": 1,
        "retry_after": "7",
        "headers_with_the_value": ["retry-after", "retry-after-ms"],
        "ok": True,
    }


def test_replicas(tmp_path: Path) -> None:
    out, data = run_script(tmp_path, "replicas.py", "--quick")
    assert "| client" in out
    assert "goals:" in out
    modes = [r["mode"] for r in data["results"]]
    assert modes[:2] == ["kvclient", "round-robin"]
    for r in data["results"]:
        assert r["requests"] == data["settings"]["requests"]
        assert r["lost"] == 0
        assert r["hung"] == 0
        assert r["failed_without_message"] == 0
        assert r["completed"] + sum(r["failed_by_cause"].values()) == r["requests"]
    for r in data["results"][:2]:  # (the killed one's count is read just before it stops)
        assert sum(r["admitted_by_replica"]) >= r["completed"]
    assert data["results"][2]["killed_at"] is not None


def test_gateway_pacing(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path, "gateway_pacing.py", *("--repeat", "1", "--requests", "6", "--rate", "30")
    )
    assert "through the gateway / direct" in out
    for target in ("direct", "gateway"):
        [summary] = data["runs"][target]
        assert summary["completed"] == 6
    assert data["ratio"] > 0


@pytest.mark.redis
def test_shared_wakeup(tmp_path: Path, redis_server_ready: str) -> None:
    out, data = run_script(tmp_path, "shared_wakeup.py", "--rounds", "5")
    assert "| pub/sub" in out
    ways = data["release_to_admission"]
    assert set(ways) == {"poll every 20 ms", "pub/sub"}
    assert all(way["rounds"] == 5 for way in ways.values())


def test_tenant_fairness(tmp_path: Path) -> None:
    out, data = run_script(
        tmp_path,
        "tenant_fairness.py",
        "--quick",
        "--seconds",
        "2",
        "--flood",
        "20",
        "--decode-rate",
        "4000",
    )
    assert "| gateway" in out
    assert "goals:" in out
    for mode in ("fifo", "fair"):
        assert data[mode]["requests"] == 2
        assert data[mode]["p99"] > 0
        assert len(data[mode]["release_waits"]) == 2
        assert data[mode]["rule"] == "peak"
    fair = data["fair"]
    assert fair["bound"] == pytest.approx(max(2 * fair["alone_p99"], fair["alone_p99"] + 1.5))
    shares = data["shares"]
    assert shares["rule"] == "peak"
    assert shares["a_token_seconds"] > 0
    assert shares["b_token_seconds"] > 0
    assert shares["a_tokens"] > 0
    assert shares["b_tokens"] > 0
