"""The engine's decode speed from its counters: the parsing per engine and the fit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient._dialects import DecodeCounters, decode_counters
from reference_server.gateway.speed import SpeedEstimator

VLLM = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1200.0
vllm:generation_tokens_total{engine="1",model_name="tiny"} 300.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
"""
LLAMA_CPP = """\
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 400
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 2.5
"""
SGLANG = """\
sglang:generation_tokens_total{model_name="m"} 77.0
sglang:num_running_reqs{model_name="m"} 5.0
"""
OURS = "kv_generated_tokens_total 42.0\nkv_inflight_requests 2.0\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM, DecodeCounters(1500.0, 4.0)),
        (LLAMA_CPP, DecodeCounters(1000.0, 2.0, 400.0)),
        (SGLANG, DecodeCounters(77.0, 5.0)),
        (OURS, DecodeCounters(42.0, 2.0)),
        ("tgi_batch_current_size 3\n", None),
        ("vllm:generation_tokens_total NaN\n", None),
        ("vllm:generation_tokens_total -4\n", None),
        ("", None),
    ],
)
def test_decode_counters_per_engine(text: str, expected: DecodeCounters | None) -> None:
    assert decode_counters(text) == expected


def step_engine(fixed: float, per_sequence: float, runs: list[int]) -> tuple[SpeedEstimator, float]:
    """Scrapes of an engine whose decode step takes ``fixed + per_sequence x n`` seconds, one
    second apart, with ``runs[i]`` sequences running for two seconds each in turn (the gauge
    reads the same at both ends of the second one)."""
    speed = SpeedEstimator()
    tokens = 0.0
    speed.add(0.0, DecodeCounters(tokens, runs[0]))
    second = 0
    for n in runs:
        for _ in range(2):
            second += 1
            tokens += n / (fixed + per_sequence * n)
            speed.add(float(second), DecodeCounters(tokens, n))
    return speed, tokens


def test_a_step_that_lengthens_per_sequence_gives_both_figures() -> None:
    estimate = step_engine(0.009, 0.002, [1, 2, 4, 8])[0].estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1 / 0.011, rel=0.02)
    assert estimate.throughput == pytest.approx(500, rel=0.02)


def test_an_engine_whose_sequences_do_not_slow_each_other_has_no_throughput_limit() -> None:
    estimate = step_engine(0.001, 0.0, [1, 3, 6, 2])[0].estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1000, rel=0.01)
    assert estimate.throughput is None


def test_idle_and_partly_idle_intervals_and_restarts_are_not_points() -> None:
    speed = SpeedEstimator()
    speed.add(0.0, DecodeCounters(0, 0))
    speed.add(1.0, DecodeCounters(50, 2))  # began decoding mid-interval: not a point
    speed.add(2.0, DecodeCounters(150, 3))  # sequences came meanwhile: not a point
    speed.add(3.0, DecodeCounters(150, 0))  # idle
    speed.add(4.0, DecodeCounters(10, 1))  # restarted: counters began again
    assert speed.estimate() is None


@settings(max_examples=50, deadline=None)
@given(
    fixed=st.floats(min_value=1e-4, max_value=0.1),
    per_sequence=st.floats(min_value=0.0, max_value=0.05),
    runs=st.lists(st.integers(min_value=1, max_value=16), min_size=8, max_size=30),
    odd=st.integers(min_value=0, max_value=3),
)
def test_a_few_odd_intervals_move_the_fit_little(
    fixed: float, per_sequence: float, runs: list[int], odd: int
) -> None:
    speed, tokens = step_engine(fixed, per_sequence, runs)
    t = float(2 * len(runs))
    for _ in range(odd):  # a pause: one running sequence, a tenth of its tokens
        t += 1.0
        tokens += 0.1 / (fixed + per_sequence)
        speed.add(t, DecodeCounters(tokens, 1))
    for n in runs:  # and as many good ones again
        for _ in range(2):
            t += 1.0
            tokens += n / (fixed + per_sequence * n)
            speed.add(t, DecodeCounters(tokens, n))
    estimate = speed.estimate()
    assert estimate is not None
    for n in sorted(set(runs)):
        truth = 1 / (fixed + per_sequence * n)
        rate = 1 / (1 / estimate.decode_rate + (n - 1) / (estimate.throughput or float("inf")))
        assert rate == pytest.approx(truth, rel=0.1)
