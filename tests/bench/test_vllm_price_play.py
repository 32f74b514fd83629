"""The engine model the bench plays each rule in on the realistic mix: what its figures rest on
(the best schedule never preempts and is never beaten by a rule that does not either; direct
preempts where the pool is short; the forecast is a bet held by its budget), and the
``--play`` path of ``bench/vllm_price.py``.
"""

from __future__ import annotations

import doctest
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _vllm_price_play  # noqa: E402
from _vllm_price_play import PLAYED_RULES, play  # noqa: E402

STEP = (0.01, 0.001, 0.00002)


Mix = tuple[list[float], list[int], list[int], list[int]]


def mix(n: int, seed: int, rate: float = 3.0) -> Mix:
    rng = random.Random(seed)
    arrivals, prompts, caps, lengths, at = [], [], [], [], 0.0
    for _ in range(n):
        arrivals.append(at)
        prompts.append(rng.randint(100, 300))
        cap = rng.randint(400, 800)
        caps.append(cap)
        lengths.append(min(cap, int(rng.expovariate(1 / 250)) + 1))
        at += rng.expovariate(rate)
    return arrivals, prompts, caps, lengths


def test_the_doctest_holds() -> None:
    assert doctest.testmod(_vllm_price_play).failed == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40))
def test_every_rule_serves_every_token_and_only_direct_and_the_forecast_preempt(
    seed: int, n: int
) -> None:
    arrivals, prompts, caps, lengths = mix(n, seed)
    for rule in PLAYED_RULES:
        played = play(
            arrivals, prompts, caps, lengths, pool=2944, block_size=128, max_running=8,
            rule=rule, step=STEP,
        )  # fmt: skip
        assert played.tokens == sum(lengths)
        assert played.running_mean <= 8
        if rule in ("best", "exact"):
            assert played.preemptions == 0


def test_on_a_short_pool_direct_preempts_and_the_best_schedule_runs_more_than_caps() -> None:
    arrivals, prompts, caps, lengths = mix(120, seed=3)
    kw = {"pool": 2944, "block_size": 128, "max_running": 8, "step": STEP}
    direct = play(arrivals, prompts, caps, lengths, rule="direct", **kw)  # type: ignore[arg-type]
    best = play(arrivals, prompts, caps, lengths, rule="best", **kw)  # type: ignore[arg-type]
    exact = play(arrivals, prompts, caps, lengths, rule="exact", **kw)  # type: ignore[arg-type]
    assert direct.preemptions > 0
    assert best.running_mean > exact.running_mean
    assert best.tokens_per_second > exact.tokens_per_second


def test_the_forecast_counts_caps_until_it_has_learnt_and_gains_once_it_has() -> None:
    arrivals, prompts, caps, lengths = mix(120, seed=5)
    kw = {"pool": 2944, "block_size": 128, "max_running": 8, "step": STEP}
    exact = play(arrivals, prompts, caps, lengths, rule="exact", **kw)  # type: ignore[arg-type]
    learnt = list(zip(mix(60, seed=6)[3], mix(60, seed=6)[2], strict=True))
    forecast = play(
        arrivals,
        prompts,
        caps,
        lengths,
        rule="forecast",
        learnt=learnt,
        **kw,  # type: ignore[arg-type]
    )
    assert forecast.running_mean > exact.running_mean


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="no rule"):
        play([0.0], [10], [10], [5], pool=256, block_size=128, max_running=1, rule="no", step=STEP)


@pytest.mark.slow
def test_the_bench_plays_the_realistic_mix_without_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "vllm_price.py"), "--mix", "realistic", "--rate", "3",
         "--requests", "40", "--warmup", "16", "--play"],
        cwd=BENCH, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for what in PLAYED_RULES.values():
        assert what in proc.stdout
    assert "the best" in proc.stdout
