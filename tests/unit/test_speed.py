"""The engine's decode speed from its counters: the parsing per engine and the fit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient.engines.metrics import DecodeCounters, decode_counters
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
        (VLLM, DecodeCounters(1500.0)),
        (LLAMA_CPP, DecodeCounters(1000.0, 400.0)),
        (SGLANG, DecodeCounters(77.0)),
        (OURS, DecodeCounters(42.0)),
        ("tgi_batch_current_size 3\n", None),
        ("vllm:generation_tokens_total NaN\n", None),
        ("vllm:generation_tokens_total -4\n", None),
        ("", None),
    ],
)
def test_decode_counters_per_engine(text: str, expected: DecodeCounters | None) -> None:
    assert decode_counters(text) == expected


class Engine:
    """An engine whose decode step takes ``fixed + per_sequence x n`` seconds, scraped once a
    second alongside the gateway's occupancy (handle-seconds, busy seconds)."""

    def __init__(self, fixed: float, per_sequence: float) -> None:
        self.fixed, self.per_sequence = fixed, per_sequence
        self.tokens = self.held = self.busy = 0.0
        self.speed = SpeedEstimator()
        self.speed.add(DecodeCounters(0.0), 0.0, 0.0)

    def second(self, running: int, share: float = 1.0) -> None:
        """One second in which ``running`` sequences decode for ``share`` of it (idle after)."""
        self.tokens += share * running / (self.fixed + self.per_sequence * running)
        self.held += share * running
        self.busy += share
        self.speed.add(DecodeCounters(self.tokens), self.held, self.busy)


def step_engine(fixed: float, per_sequence: float, runs: list[int]) -> Engine:
    """``runs[i]`` sequences for long enough each to make two points (a slow engine takes a
    few seconds to generate a point's tokens)."""
    engine = Engine(fixed, per_sequence)
    for n in runs:
        per_second = n / (fixed + per_sequence * n)
        for _ in range(max(2, math.ceil(2 * 64 / per_second) + 1)):
            engine.second(n)
    return engine


def test_a_step_that_lengthens_per_sequence_gives_both_figures() -> None:
    estimate = step_engine(0.009, 0.002, [1, 2, 4, 8]).speed.estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1 / 0.011, rel=0.02)
    assert estimate.throughput == pytest.approx(500, rel=0.02)


def test_an_engine_whose_sequences_do_not_slow_each_other_has_no_throughput_limit() -> None:
    estimate = step_engine(0.001, 0.0, [1, 3, 6, 2]).speed.estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1000, rel=0.01)
    assert estimate.throughput is None


def test_idle_time_is_left_out_and_restarts_are_not_points() -> None:
    engine = Engine(0.009, 0.002)
    for n in (4, 8, 16):
        engine.second(n, share=0.5)  # busy half of each second
    estimate = engine.speed.estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1 / 0.011, rel=0.02)
    engine.second(0, share=0.0)  # idle: no tokens, no point
    engine.speed.add(DecodeCounters(10.0), engine.held + 1, engine.busy + 1)  # restarted
    assert len(engine.speed._points) == 3


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
    engine = step_engine(fixed, per_sequence, runs)
    for _ in range(odd):  # a stall: one running request that made a tenth of its tokens
        engine.tokens += 0.1 / (fixed + per_sequence)
        engine.held += 1
        engine.busy += 1
        engine.speed.add(DecodeCounters(engine.tokens), engine.held, engine.busy)
    for n in runs:  # and as many good ones again
        engine.second(n)
    estimate = engine.speed.estimate()
    assert estimate is not None
    for n in sorted(set(runs)):
        truth = 1 / (fixed + per_sequence * n)
        rate = 1 / (1 / estimate.decode_rate + (n - 1) / (estimate.throughput or float("inf")))
        assert rate == pytest.approx(truth, rel=0.1)


def test_seconds_of_one_token_probes_are_not_points() -> None:
    # Four one-token requests a second (a health probe, say): busy a few ms each, mostly the
    # time around decoding. They must not make a fast engine look slow.
    speed = SpeedEstimator()
    tokens = held = busy = 0.0
    admitted = 0
    speed.add(DecodeCounters(tokens), held, busy, admitted)
    for _ in range(30):
        tokens, held, busy, admitted = tokens + 4, held + 0.02, busy + 0.02, admitted + 4
        speed.add(DecodeCounters(tokens), held, busy, admitted)
    assert speed.estimate() is None
    for _ in range(3):  # then a second of real decoding: 2 sequences at 1,000 tokens/s each
        tokens, held, busy, admitted = tokens + 2000, held + 2, busy + 1, admitted + 2
        speed.add(DecodeCounters(tokens), held, busy, admitted)
    estimate = speed.estimate()
    assert estimate is not None
    assert estimate.decode_rate == pytest.approx(1000, rel=0.01)
