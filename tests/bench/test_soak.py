"""The soak (bench/soak.py) in its shortened form: 5 s of mixed load with hang-ups and injected
faults against the reference server in its own process; every criterion must hold. The full soak
(60 s) is ``python bench/soak.py``; its figures are in the README."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_soak() -> ModuleType:
    if "bench_soak" in sys.modules:
        return sys.modules["bench_soak"]
    sys.path.insert(0, str(BENCH))  # soak.py imports bench/_common.py as a sibling
    try:
        spec = importlib.util.spec_from_file_location("bench_soak", BENCH / "soak.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_soak"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_soak_meets_every_criterion(tmp_path: Path) -> None:
    env = {**os.environ, "KVCLIENT_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "soak.py"), "--duration", "5", "--fault-rate", "0.05"],
        cwd=BENCH,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # a 5 s soak; the rest is start-up, on a machine that may be busy
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| server RSS start / after warm-up / end / max" in proc.stdout
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["passed"] is True
    assert all(data["criteria"].values())
    assert data["oom_events"] == 0
    assert data["unexpected_5xx"] == 0
    assert data["server_internal_errors"] == []
    assert data["reserved_tokens_end"] == 0
    assert data["inflight_end"] == 0
    assert data["sent"] == data["requests"] > 100
    assert data["completed"] > 0
    assert data["injected_faults"] >= 1
    assert data["by_kind"]["raw stream, hangs up"] > 0
    assert data["by_kind"]["raw socket, stops reading"] > 0
    assert data["by_kind"]["  of which max_tokens 1"] > 0
    advice = data["retry_after"]
    assert advice["checked"] == advice["refused"] == data["server_rejected_429"] > 0
    assert advice["fits_now_lies"] == 0
    rss = data["rss_mb"]
    if sys.platform.startswith("linux"):
        assert 0 < rss["start"] <= rss["max"]
        assert rss["end"] is not None


def report_of(soak: ModuleType, advice: Any = None, **final: float) -> dict[str, Any]:
    """The soak's verdicts on made-up results."""
    args = argparse.Namespace(
        duration=5.0,
        seed=1,
        load=1.75,
        fault_rate=0.1,
        warm_up=1.0,
        max_rss_growth_mb=20.0,
    )
    record = soak.RequestRecord(index=0, planned=0.0, prompt_tokens=5, max_tokens_requested=9)
    record.sent, record.end, record.error = 0.0, 0.1, final.pop("error", "injected_fault")
    metrics = {
        "kv_oom_events_total": 0.0,
        "kv_reserved_tokens": 0.0,
        "kv_inflight_requests": 0.0,
        "kv_rejected_total": 0.0,
        "kv_admitted_total": 1.0,
        "kv_injected_faults_total": 1.0,
        **final,
    }
    text = 'kv_http_responses_total{route="/v1/completions",status="500"} 1.0\n'
    sampler = soak.Sampler("http://127.0.0.1:1", 1, 1.0)
    sampler.samples = [{"t": 0.0, "rss_mb": 50.0}, {"t": 2.0, "rss_mb": 80.0}]
    sender = soak.SoakSender(client=None, raw=None, hang_up_share=0.1, seed=1)  # type: ignore[arg-type]
    return soak.report(  # type: ignore[no-any-return]
        args,
        [record],
        1.0,
        sender,
        sampler,
        metrics,
        text,
        [],
        50 * 2**20,
        85 * 2**20,
        10.0,
        advice,
    )


def test_the_soak_fails_on_each_criterion() -> None:
    soak = load_soak()
    assert report_of(soak)["passed"] is True
    assert report_of(soak, kv_oom_events_total=1.0)["criteria"]["no OOM"] is False
    assert report_of(soak, kv_reserved_tokens=16.0)["criteria"]["ledger at zero"] is False
    assert report_of(soak, kv_inflight_requests=1.0)["criteria"]["ledger at zero"] is False
    unexpected = report_of(soak, error="http_500:internal_error")
    assert unexpected["unexpected_5xx"] == 1
    assert unexpected["criteria"]["no unexpected 5xx"] is False
    # A 500 no client read, beyond the injected faults no client reported:
    unseen = report_of(soak, error="timeout", kv_injected_faults_total=0.0)
    assert unseen["criteria"]["no unexpected 5xx"] is False
    assert report_of(soak, error="timeout")["criteria"]["no unexpected 5xx"] is True
    # A 429 told 1 ms (t=0.5) while the holder it needed (1000 of 1000 tokens) held until t=3.
    log = [
        {"t": 0.0, "kind": "admit", "id": 1, "tokens": 1000},
        {"t": 0.5, "kind": "refuse", "id": 0, "tokens": 16, "retry_after": 0.001},
        {"t": 3.0, "kind": "release", "id": 1, "tokens": 1000},
    ]
    lied = report_of(soak, advice=soak.check_advice(log, 1000, tolerance=0.02))
    assert lied["retry_after"]["fits_now_lies"] == 1
    assert lied["criteria"]['no 429 told "fits now" while held'] is False
    grown = report_of(soak)
    assert grown["rss_mb"]["growth_after_warm_up"] == 5.0
    assert report_of(soak)["passed"]
