"""The admission log (--admission-log) and the Retry-After check that replays it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_server import KVAdmissionController, ServerConfig, create_app
from reference_server.admission.journal import AdmissionLog, check_advice, read_log


def test_the_log_has_every_admission_release_and_refusal_in_order(tmp_path: Path) -> None:
    log = AdmissionLog(str(tmp_path / "admission.jsonl"))
    ledger = KVAdmissionController(
        total_kv_tokens=1000,
        safety_fraction=1.0,
        context_window=1000,
        decode_rate=100.0,
        on_event=log,
    )
    handle = ledger.try_admit(100, 800, now=0.0)
    assert handle is not None
    ledger.record_rejection(208, 9.0)
    ledger.release(handle)
    ledger.release(handle)  # idempotent: logged once
    log.close()
    events = read_log(log.path)
    assert [(e["kind"], e["id"], e["tokens"]) for e in events] == [
        ("admit", handle.id, 912),
        ("refuse", 0, 208),
        ("release", handle.id, 912),
    ]
    assert events[1]["retry_after"] == 9.0
    assert events[0]["t"] <= events[1]["t"] <= events[2]["t"]


def test_the_server_writes_it_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    state = create_app(ServerConfig(admission_log=str(path))).state.server
    handle = state.ledger.try_admit(1, 1, now=0.0)
    assert handle is not None
    state.ledger.release(handle)
    state.admission_log.close()
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == [
        "admit",
        "release",
    ]


def event(t: float, kind: str, id: int = 0, tokens: int = 0, advice: float = 0.0) -> dict:
    return {"t": t, "kind": kind, "id": id, "tokens": tokens, "retry_after": advice}


def test_check_advice_compares_each_429_with_when_its_room_really_came_back() -> None:
    # usable 1000; holders 1 (600) and 2 (300); a refusal for 300 needs one of them gone.
    log = [
        event(0.0, "admit", 1, 600),
        event(0.0, "admit", 2, 300),
        event(1.0, "refuse", tokens=300, advice=2.0),  # room back at 2.5 (holder 2): 1.5 s
        event(1.0, "refuse", tokens=300, advice=1.0),  # told 1.0 s: 0.5 s short
        event(1.0, "refuse", tokens=700, advice=0.001),  # needs holder 1 too (4.0): a lie
        event(2.0, "admit", 3, 100),  # later admissions do not count against the advice
        event(2.5, "release", 2, 300),
        event(4.0, "release", 1, 600),
        event(5.0, "release", 3, 100),
        event(5.5, "admit", 4, 1000),
        event(6.0, "refuse", tokens=10, advice=1.0),  # holder 4 never released: not checked
    ]
    check = check_advice(log, 1000, tolerance=0.02)
    assert (check.refused, check.checked) == (4, 3)
    assert check.told_less == 2
    assert check.fits_now_lies == 1
    assert check.worst_shortfall == pytest.approx(3.0 - 0.001)
    assert check.ratios == pytest.approx(sorted([2.0 / 1.5, 1.0 / 1.5, 0.001 / 3.0]))
    assert check.told_less_share == pytest.approx(2 / 3)
