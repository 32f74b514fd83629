"""The ledger's model of decode speed: sequences share the engine's decode steps.

The advice must follow how a real engine drains: one sequence alone decodes at ``decode_rate``,
many share ``throughput``; when one ends the others speed up. The property test checks the
ledger's forecast against an engine simulated tick by tick (not by the ledger's own formula).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server import KVAdmissionController


def ledger(**kwargs: object) -> KVAdmissionController:
    settings_: dict[str, object] = {
        "total_kv_tokens": 10_000,
        "context_window": 4096,
        "decode_rate": 100.0,
        "safety_fraction": 1.0,
        "block_size": 1,
    }
    settings_.update(kwargs)
    return KVAdmissionController(**settings_)  # type: ignore[arg-type]


def test_one_sequence_decodes_at_decode_rate_and_many_share_the_throughput() -> None:
    shared = ledger(throughput=400.0)
    assert shared.rate_at(1) == 100.0
    assert shared.rate_at(2) == pytest.approx(1 / (0.01 + 1 / 400))
    assert 64 * shared.rate_at(64) == pytest.approx(400.0, rel=0.05)
    alone = ledger()
    assert alone.rate_at(1) == alone.rate_at(64) == 100.0


def test_bad_speeds_are_refused() -> None:
    with pytest.raises(ValueError, match="throughput"):
        ledger(throughput=0.0)
    with pytest.raises(ValueError, match="throughput"):
        ledger().set_speed(100.0, math.inf, now=0.0)
    with pytest.raises(ValueError, match="decode_rate"):
        ledger().set_speed(-1.0, None, now=0.0)


def test_the_others_speed_up_when_one_ends() -> None:
    # decode_rate 100 and throughput 100: two sequences decode at 50 tokens/s each.
    kv = ledger(total_kv_tokens=1000, throughput=100.0)
    kv.try_admit(0, 100, now=0.0)
    kv.try_admit(0, 300, now=0.0)
    # The first ends at 2 s (100 tokens at 50/s); the second has 200 left, alone at 100/s.
    assert kv.retry_after(700, now=0.0) == pytest.approx(2.0)
    assert kv.retry_after(1000, now=0.0) == pytest.approx(4.0)
    # Without the throughput both decode at 100/s: 1 s and 3 s.
    alone = ledger(total_kv_tokens=1000)
    alone.try_admit(0, 100, now=0.0)
    alone.try_admit(0, 300, now=0.0)
    assert alone.retry_after(1000, now=0.0) == pytest.approx(3.0)


def test_progress_made_before_a_speed_change_is_kept() -> None:
    kv = ledger(total_kv_tokens=1000)
    handle = kv.try_admit(0, 400, now=0.0)
    assert handle is not None
    kv.set_speed(50.0, None, now=2.0)  # 200 tokens made at 100/s; 200 left at 50/s
    assert kv.generated(handle, 2.0) == pytest.approx(200.0)
    assert kv.retry_after(1000, now=2.0) == pytest.approx(4.0)
    assert kv.headroom(2.0).next_release_in == pytest.approx(4.0)


def test_a_release_with_its_time_speeds_up_the_rest_from_then() -> None:
    kv = ledger(total_kv_tokens=2000, throughput=100.0)
    first = kv.try_admit(0, 1000, now=0.0)
    second = kv.try_admit(0, 300, now=0.0)
    assert first is not None
    assert second is not None
    kv.release(first, now=1.0)  # both made 50 tokens by then; the second goes on at 100/s
    assert kv.generated(second, 2.0) == pytest.approx(150.0)


def simulate_until_fits(
    caps: list[float], need: int, reserved: list[int], usable: int, rate: object, tick: float
) -> float:
    """Seconds until ``need`` fits, by stepping an engine whose sequences decode at
    ``rate(n)`` tokens/s each while n run: the truth the forecast is judged against."""
    left = list(caps)
    held = list(reserved)
    t = 0.0
    while sum(held) + need > usable:
        running = [i for i, x in enumerate(left) if x > 0]
        step = rate(len(running)) * tick  # type: ignore[operator]
        for i in running:
            left[i] -= step
            if left[i] <= 1e-9:
                held[i] = 0
        t += tick
        if t > 1e4:
            raise AssertionError("never fits")
    return t


@settings(max_examples=60, deadline=None)
@given(
    throughput=st.one_of(st.none(), st.floats(min_value=50, max_value=2000)),
    arrivals=st.lists(
        st.tuples(st.floats(min_value=0, max_value=2), st.integers(min_value=1, max_value=400)),
        min_size=1,
        max_size=8,
    ),
    asked_at=st.floats(min_value=0, max_value=3),
    need=st.integers(min_value=1, max_value=2000),
)
def test_the_forecast_matches_an_engine_stepped_tick_by_tick(
    throughput: float | None, arrivals: list[tuple[float, int]], asked_at: float, need: int
) -> None:
    tick = 0.001
    kv = ledger(total_kv_tokens=2000, throughput=throughput)
    # Replay the arrivals on the ledger and, alongside, on the stepped engine; sequences that
    # end before ``asked_at`` are released at their end.
    live: list[list[float]] = []  # [tokens left, reserved, handle]
    handles = []
    t = 0.0
    events = sorted(arrivals)
    while t < asked_at:
        while events and events[0][0] <= t:
            _, cap = events.pop(0)
            handle = kv.try_admit(0, cap, now=t)
            if handle is not None:
                live.append([float(cap), float(cap)])
                handles.append(handle)
        running = [i for i, x in enumerate(live) if x[0] > 0]
        step = kv.rate_at(len(running)) * tick
        for i in running:
            live[i][0] -= step
            if live[i][0] <= 1e-9:
                kv.release(handles[i], now=t + tick)
        t += tick
    if need > kv.usable_tokens:
        return
    advice = kv.retry_after(need, now=t)
    still = [i for i, x in enumerate(live) if x[0] > 0]
    truth = simulate_until_fits(
        [live[i][0] for i in still],
        need,
        [int(live[i][1]) for i in still],
        kv.usable_tokens,
        kv.rate_at,
        tick,
    )
    # Never sooner than the truth (within a tick or two), and never much later.
    assert advice >= truth - 3 * tick
    assert advice <= truth + 0.02 + 0.01 * truth
