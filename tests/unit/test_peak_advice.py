"""Retry-After agrees with admission under the peak rule: a request told "now" is admitted now,
and one admitted now is told "now", whatever its prefix, its sequences, its forecast or its
clock."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reference_server.admission.ledger import Ask, KVAdmissionController
from reference_server.admission.peak import prefix_blocks

_PROMPTS = [list(range(100, 180)), list(range(300, 340))]


@st.composite
def ledgers(draw: st.DrawFn) -> dict[str, Any]:
    requests = []
    for _ in range(draw(st.integers(0, 6))):
        group = draw(st.sampled_from([None, 0, 1]))
        extra = draw(st.integers(1, 40))
        requests.append(
            {
                "group": group,
                "extra": extra,
                "cap": draw(st.integers(1, 200)),
                "sequences": draw(st.sampled_from([1, 1, 1, 2, 3])),
                "count": draw(st.one_of(st.none(), st.integers(1, 200))),
                "seen": draw(st.sampled_from([0.2, 0.5, 0.9])),
            }
        )
    return {
        "kv": draw(st.integers(300, 1500)),
        "block": draw(st.sampled_from([1, 4, 16])),
        "running": draw(st.one_of(st.none(), st.integers(1, 8))),
        "clock": draw(st.booleans()),
        "requests": requests,
        "newcomer": {
            "group": draw(st.sampled_from([None, 0, 1])),
            "extra": draw(st.integers(1, 40)),
            "cap": draw(st.integers(1, 300)),
            "sequences": draw(st.sampled_from([1, 1, 2, 4])),
        },
    }


def _prompt(group: int | None, extra: int, salt: int) -> list[int]:
    head = _PROMPTS[group] if group is not None else []
    return head + [10_000 * salt + i for i in range(extra)]


def _ask(ledger: KVAdmissionController, r: dict[str, Any], salt: int) -> Ask:
    prompt = _prompt(r["group"], r["extra"], salt)
    n = r["sequences"]
    keys = prefix_blocks(prompt, ledger.block_size) if n == 1 else ()
    return Ask(
        prompt_tokens=len(prompt) * n, output_cap=r["cap"] * n,
        need=ledger.need_tokens(len(prompt) * n, r["cap"] * n), prefix=keys,
        kind=("m", None), follow=n == 1, sequences=n,
    )  # fmt: skip


def _admit(ledger: KVAdmissionController, ask: Ask, now: float) -> Any:
    return ledger.try_admit(
        ask.prompt_tokens, ask.output_cap, now=now, need=ask.need, prefix=ask.prefix,
        kind=ask.kind, follow=ask.follow, sequences=ask.sequences,
    )  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(ledgers())
def test_retry_after_says_now_exactly_when_admission_admits(case: dict[str, Any]) -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=case["kv"], context_window=10_000, decode_rate=100.0, rule="peak",
        block_size=case["block"], safety_fraction=1.0, max_concurrency=case["running"],
        start_clock=case["clock"],
    )  # fmt: skip
    ledger.shares_prefixes = True
    if case["clock"]:
        ledger.set_speed(100.0, None, 0.0, steps=True)
        ledger.engine_seen(waiting=0, preemptions=None)
    held = []
    for i, r in enumerate(case["requests"]):
        handle = _admit(ledger, _ask(ledger, r, i + 1), 0.0)
        if handle is not None:
            held.append((handle, r))
    for handle, r in held:
        if r["count"] is not None and handle.tracked:
            ledger.progress(handle, min(r["count"], handle.output_cap), r["seen"])
    ask = _ask(ledger, case["newcomer"], 99)
    # What could never be admitted is refused with a 400 before it comes here.
    assume(not ledger.never_fits(ask.need))
    assume(case["running"] is None or ask.sequences <= case["running"])
    said = ledger.retry_after(ask.need, 1.0, ask=ask)
    admitted = _admit(ledger, ask, 1.0)
    assert (said == 0.0) == (admitted is not None), (said, admitted)


@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_a_request_of_several_sequences_is_told_to_wait_for_its_places(rule: str) -> None:
    """Three places, two taken: a request of two sequences does not fit until one ends."""
    ledger = KVAdmissionController(
        total_kv_tokens=10_000, context_window=10_000, decode_rate=100.0, rule=rule,  # type: ignore[arg-type]
        block_size=1, safety_fraction=1.0, max_concurrency=3,
    )  # fmt: skip
    for _ in range(2):
        assert ledger.try_admit(10, 100, now=0.0) is not None
    ask = Ask(prompt_tokens=20, output_cap=200, need=220, sequences=2)
    assert ledger.try_admit(20, 200, now=0.0, need=220, sequences=2) is None
    assert ledger.retry_after(220, 0.0, ask=ask) > 0.5  # a holder's 100 tokens at 100/s


@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_a_cut_request_is_expected_to_free_its_place_when_the_engine_lets_it_go(rule: str) -> None:
    """A request cut before its end is held until the engine lets it go, not to its cap: the
    advice to a request that needs its room is that moment, not the cap's end."""
    ledger = KVAdmissionController(
        total_kv_tokens=1_000, context_window=1_000, decode_rate=100.0, rule=rule,  # type: ignore[arg-type]
        block_size=1, safety_fraction=1.0,
    )  # fmt: skip
    held = ledger.try_admit(100, 800, now=0.0, follow=True)
    assert held is not None
    if rule == "peak":
        ledger.progress(held, 5, 0.1)
    assert ledger.retry_after(900, 0.1) > 7.0  # 795 tokens left at 100/s
    ledger.cut(held, 0.4)
    assert ledger.retry_after(900, 0.1) == pytest.approx(0.3, abs=0.05)
    ledger.release(held, now=0.4)
    assert ledger.retry_after(900, 0.4) == 0.0
