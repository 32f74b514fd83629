"""The forecast's two pure pieces: outputs' survival (Kaplan-Meier) and the preemption budget."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.admission.outputs import OutputLengths
from reference_server.admission.preemption import LADDER, PreemptionBudget

# --- outputs ---------------------------------------------------------------------------------


def _empirical(lengths: list[int], generated: int, quantile: float) -> int:
    """The quantile of the lengths longer than ``generated``, by counting (nothing censored)."""
    longer = sorted(n for n in lengths if n > generated)
    return longer[max(0, math.ceil(quantile * len(longer)) - 1)]


@settings(max_examples=200)
@given(
    st.lists(st.integers(1, 400), min_size=40, max_size=300),
    st.integers(0, 300),
    st.sampled_from(LADDER),
)
def test_without_censoring_the_forecast_is_the_counted_quantile(
    lengths: list[int], generated: int, quantile: float
) -> None:
    outputs = OutputLengths(min_finished=1, min_at_risk=1)
    for n in lengths:
        outputs.record("m", n, ended=True)
    left = outputs.remaining("m", generated=generated, quantile=quantile)
    if not any(n > generated for n in lengths):
        assert left is None
        return
    assert left is not None
    assert generated + left == _empirical(lengths, generated, quantile)


def test_outputs_cut_at_their_caps_never_make_a_forecast_shorter_than_their_caps() -> None:
    outputs = OutputLengths(min_finished=4, min_at_risk=4)
    for _ in range(100):
        outputs.record("m", 500, ended=False)  # every one ran to its cap of 500
    assert outputs.remaining("m", generated=0, quantile=0.5) is None  # nothing says shorter
    for n in range(10, 110, 10):
        outputs.record("m", n, ended=True)
    # Ten of 110 ended by themselves; the 90 % quantile lies in the unknown beyond 500.
    assert outputs.remaining("m", generated=0, quantile=0.9) is None
    assert outputs.remaining("m", generated=0, quantile=0.05) == 60  # 5.5 of 110: the sixth


def test_censored_outputs_count_as_at_risk_only_as_far_as_they_were_seen() -> None:
    # Half the outputs were cut at 50 tokens (clients gone), half ended at 100 or 200.
    outputs = OutputLengths(min_finished=4, min_at_risk=2)
    for _ in range(10):
        outputs.record("m", 50, ended=False)
        outputs.record("m", 100, ended=True)
        outputs.record("m", 200, ended=True)
    # Past 50, only the 20 that ended are at risk: half end by 100. Counting the cut ones as
    # ending at 50 would have said a third end by 50.
    assert outputs.remaining("m", generated=50, quantile=0.5) == 50
    assert outputs.remaining("m", generated=0, quantile=0.5) == 100


def test_too_little_evidence_gives_the_cap() -> None:
    outputs = OutputLengths(min_finished=32, min_at_risk=16)
    for n in range(31):
        outputs.record("m", n + 1, ended=True)
    assert outputs.remaining("m", generated=0, quantile=0.5) is None  # 31 < 32 finished
    outputs.record("m", 32, ended=True)
    assert outputs.remaining("m", generated=0, quantile=0.5) == 16
    assert outputs.remaining("m", generated=17, quantile=0.5) is None  # 15 longer than 17
    assert outputs.remaining("other", generated=0, quantile=0.5) is None


def test_only_the_most_recent_outputs_are_kept() -> None:
    outputs = OutputLengths(window=50, min_finished=10, min_at_risk=5)
    for _ in range(50):
        outputs.record("m", 1000, ended=True)
    for _ in range(50):
        outputs.record("m", 10, ended=True)  # the mix changed
    assert outputs.finished("m") == 50
    assert outputs.remaining("m", generated=0, quantile=0.99) == 10


# --- the preemption budget -------------------------------------------------------------------


def test_preemptions_over_the_budget_tighten_the_quantile_until_the_forecast_is_off() -> None:
    budget = PreemptionBudget(per_1000=10, start=0.9)
    assert (budget.window, budget.allowed) == (400, 4.0)  # 4 preemptions in any 400 requests
    budget.observe(preemptions=0, finished=0)
    assert budget.observe(preemptions=4, finished=10) is None  # within: 4 allowed
    seen = []
    for i in range(5, 14):
        said = budget.observe(preemptions=i, finished=2 * i)
        assert (said is not None and "over a budget of 10" in said) == (i <= 9)
        seen.append(budget.quantile)
    assert seen == [0.95, 0.98, 0.99, 0.995, None, None, None, None, None]
    assert budget.quantile is None
    assert budget.level_quantile(0) is None
    assert budget.tightened == 5  # nothing past off


def test_one_preemption_more_or_less_does_not_swing_the_quantile() -> None:
    # A budget of 20: a window of 200 requests, 4 preemptions allowed in it. Three preemptions
    # in the first 50 requests are 60 per 1,000 of those, but within the window's allowance.
    budget = PreemptionBudget(per_1000=20)
    budget.observe(preemptions=0, finished=0)
    for finished, preemptions in ((10, 1), (30, 2), (50, 3)):
        assert budget.observe(preemptions=preemptions, finished=finished) is None
    assert budget.quantile == 0.75
    assert budget.rate() == 60.0


def test_the_quantile_loosens_only_after_a_whole_window_well_within_the_budget() -> None:
    budget = PreemptionBudget(per_1000=20, start=0.9)
    budget.observe(preemptions=0, finished=0)
    assert budget.observe(preemptions=5, finished=10) is not None  # 5 > 4: tightened at 10
    assert budget.quantile == 0.95
    for finished in range(20, 210, 10):
        assert budget.observe(preemptions=5, finished=finished) is None  # within 200 of it
    said = budget.observe(preemptions=5, finished=210)  # none in the last 200
    assert said is not None
    assert "within a budget of 20" in said
    assert budget.quantile == 0.9
    # Three in the next 200: within the allowance (4) but not well within it (2): it stays.
    for finished, preemptions in ((300, 6), (350, 7), (400, 8)):
        assert budget.observe(preemptions=preemptions, finished=finished) is None
    assert budget.observe(preemptions=8, finished=420) is None
    assert budget.quantile == 0.9


def test_a_restarted_engine_or_an_old_counter_is_not_a_preemption() -> None:
    budget = PreemptionBudget(per_1000=5)
    assert budget.observe(preemptions=40, finished=0) is None  # counted before the gateway
    assert budget.quantile == 0.75
    assert budget.observe(preemptions=0, finished=20) is None  # the engine restarted
    assert budget.observe(preemptions=0, finished=30) is None
    assert budget.quantile == 0.75


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_a_budget_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match="preemption budget"):
        PreemptionBudget(per_1000=bad)
