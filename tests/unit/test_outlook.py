"""The peak rule past what it has seen: a newcomer's clock and the forecast of outputs, on the
ledger, against an engine stepped in lockstep that starts newcomers late within the bound, or
preempts when its pool overflows."""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.admission.holders import START_SLACK_STEPS
from reference_server.admission.ledger import Handle, KVAdmissionController
from reference_server.admission.preemption import LADDER

DT = 0.01  # seconds a step


def _ledger(
    kv: int, *, block: int = 1, budget: float = 0.0, relay_lag: float = 0.0
) -> KVAdmissionController:
    ledger = KVAdmissionController(
        total_kv_tokens=kv,
        context_window=100_000,
        decode_rate=1 / DT,
        block_size=block,
        safety_fraction=1.0,
        rule="peak",
        relay_lag=relay_lag,
        preemption_budget=budget,
        start_clock=True,
    )
    ledger.set_speed(1 / DT, None, 0.0, steps=True)  # as measured from the engine's counters
    return ledger


# --- the newcomer's clock ----------------------------------------------------------------------


def _one_ending_soon(ledger: KVAdmissionController) -> Handle:
    """A holder of 100 + 600 that has made 580 tokens: it ends in 21 steps."""
    holder = ledger.try_admit(100, 600, now=0.0, follow=True)
    assert holder is not None
    ledger.progress(holder, 580, 0.0)
    return holder


def test_a_newcomer_on_the_clock_is_counted_from_its_admission() -> None:
    # Pool 1,000: the holder holds 680 and may grow to 700. A newcomer of 100 + 400 counted
    # whole (500) does not fit beside it; counted from its admission it holds 100 + the steps
    # it has run, and the holder is gone before it outgrows the room.
    ledger = _ledger(1000)
    _one_ending_soon(ledger)
    newcomer = ledger.try_admit(100, 400, now=0.0, follow=True)
    assert newcomer is not None
    assert newcomer.start_by is not None
    assert ledger.stats().start_clock


def test_without_the_clock_the_same_newcomer_waits() -> None:
    for why in ("no clock", "speed not measured", "waiting", "not followed"):
        ledger = KVAdmissionController(
            total_kv_tokens=1000, context_window=100_000, decode_rate=1 / DT, block_size=1,
            safety_fraction=1.0, rule="peak", relay_lag=0.0, start_clock=why != "no clock",
        )  # fmt: skip
        if why != "speed not measured":
            ledger.set_speed(1 / DT, None, 0.0, steps=True)
        if why == "waiting":
            ledger.engine_seen(waiting=1, preemptions=None)
        _one_ending_soon(ledger)
        assert ledger.try_admit(100, 400, now=0.0, follow=why != "not followed") is None, why


def test_a_late_first_token_counts_it_whole_and_stops_the_clock_until_it_comes() -> None:
    ledger = _ledger(10_000)
    first = ledger.try_admit(100, 400, now=0.0, follow=True)
    assert first is not None
    assert first.start_by is not None
    due = first.start_by
    assert due == (START_SLACK_STEPS + 1) * DT
    second = ledger.try_admit(100, 400, now=due, follow=True)  # just in time: on the clock
    assert second is not None
    assert second.start_by is not None
    third = ledger.try_admit(100, 400, now=due + 0.001, follow=True)
    assert third is not None
    assert third.start_by is None
    stats = ledger.stats()
    assert stats.late_starts == 1
    assert not stats.start_clock
    assert first.start_by is None  # counted whole from now on
    ledger.progress(first, 1, due + 0.002)
    fourth = ledger.try_admit(100, 400, now=due + 0.003, follow=True)
    assert fourth is not None
    assert fourth.start_by is not None


@dataclass
class _Seq:
    id: int
    prompt: int
    cap: int
    length: int
    start_at: int  # the step the engine starts it in
    generated: int = 0
    running: bool = False


class _Engine:
    """One token a step for every running sequence; each newcomer starts on a step of its own
    (late by up to the clock's slack), or, when ``preempt``, when its blocks fit; an overflow
    preempts the newest running sequence (its blocks freed, recomputed when they fit again)
    or, without ``preempt``, is recorded."""

    def __init__(self, pool: int, block: int, *, preempt: bool = False) -> None:
        self.pool, self.block, self.preempt = pool, block, preempt
        self.running: dict[int, _Seq] = {}
        self.waiting: deque[_Seq] = deque()
        self.preemptions = 0
        self.peak_used = 0

    def _blocks(self, seq: _Seq, extra: int = 0) -> int:
        return math.ceil((seq.prompt + seq.generated + extra) / self.block) * self.block

    def used(self, extra: int = 0) -> int:
        return sum(self._blocks(s, extra) for s in self.running.values())

    def step(self, now: int) -> list[_Seq]:
        for seq in list(self.waiting):
            if seq.start_at > now:
                continue
            if self.preempt and self.used(1) + self._blocks(seq, 1) > self.pool:
                break  # in line: the head first
            self.waiting.remove(seq)
            self.running[seq.id] = seq
        while self.preempt and self.running and self.used(1) > self.pool:
            newest = next(reversed(self.running.values()))
            del self.running[newest.id]
            self.waiting.appendleft(newest)
            self.preemptions += 1
        finished = []
        for seq in list(self.running.values()):
            seq.generated += 1
        self.peak_used = max(self.peak_used, self.used())
        for seq in list(self.running.values()):
            if seq.generated >= seq.length:
                finished.append(seq)
                del self.running[seq.id]
        return finished


@st.composite
def clocked(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 20))
    requests = []
    for _ in range(n):
        cap = draw(st.integers(1, 300))
        requests.append(
            {
                "arrival": draw(st.integers(0, 150)),
                "prompt": draw(st.integers(1, 120)),
                "cap": cap,
                "length": draw(st.one_of(st.just(cap), st.integers(1, cap))),
                # Steps the engine starts it late, within the clock's slack.
                "late": draw(st.integers(0, START_SLACK_STEPS)),
            }
        )
    return {
        "requests": requests,
        "block": draw(st.sampled_from([1, 4, 16])),
        "kv": draw(st.integers(440, 2000)),
        "report": draw(st.integers(0, 4)),  # steps every count reaches the ledger late
    }


def _drive(
    work: dict[str, object],
    ledger: KVAdmissionController,
    engine: _Engine,
    *,
    lengths: dict[int, int] | None = None,
    scrape_every: int = 0,
    on_scrape: object = None,
) -> tuple[int, list[Handle]]:
    """Admits by ``ledger`` in FIFO order, steps ``engine``, reports counts ``report`` steps
    late and ends at once; returns the steps run and every handle admitted."""
    report = int(work.get("report", 0))  # type: ignore[call-overload]
    pending = sorted(work["requests"], key=lambda r: r["arrival"])  # type: ignore[arg-type, index]
    queue: list[dict[str, int]] = []
    live: dict[int, tuple[_Seq, Handle, list[int]]] = {}
    admitted: list[Handle] = []
    ids = itertools.count()
    step = 0
    while pending or queue or live:
        now = step * DT
        while pending and pending[0]["arrival"] <= step:
            queue.append(pending.pop(0))
        while queue:
            r = queue[0]
            handle = ledger.try_admit(r["prompt"], r["cap"], now=now, follow=True, kind="m")
            if handle is None:
                break
            queue.pop(0)
            admitted.append(handle)
            seq = _Seq(next(ids), r["prompt"], r["cap"], r["length"], step + r.get("late", 0))
            engine.waiting.append(seq)
            live[seq.id] = (seq, handle, [])
        for seq in engine.step(step):
            _, handle, _ = live.pop(seq.id)
            ledger.ended(handle, by_itself=seq.length < seq.cap)
            ledger.release(handle, (step + 1) * DT)
        step += 1
        now = step * DT
        for seq, handle, history in live.values():
            history.append(seq.generated)
            seen = history[-1 - report] if len(history) > report else 0
            if seen > 0:
                ledger.progress(handle, seen, now)
        if scrape_every and step % scrape_every == 0 and callable(on_scrape):
            on_scrape(step)
        assert step < 200_000
    return step, admitted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clocked())
def test_newcomers_started_within_the_slack_never_overflow_what_the_clock_admits(
    work: dict[str, object],
) -> None:
    block, kv = int(work["block"]), int(work["kv"])  # type: ignore[call-overload]
    ledger = _ledger(kv, block=block, relay_lag=int(work["report"]) * DT)  # type: ignore[call-overload]
    engine = _Engine(kv, block)
    _drive(work, ledger, engine)
    assert engine.peak_used <= kv
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.late_starts == 0  # every first token came within its bound


# --- the forecast ------------------------------------------------------------------------------


def _learnt(ledger: KVAdmissionController, lengths: list[int], cap: int) -> None:
    """Finished outputs of kind "m", as the relay reports them."""
    for n in lengths:
        handle = ledger.try_admit(10, cap, now=0.0, follow=True, kind="m")
        assert handle is not None
        ledger.progress(handle, n, 0.0)
        ledger.ended(handle, by_itself=n < cap)
        ledger.release(handle, 0.0)


def test_a_holder_is_counted_to_its_forecast_and_again_when_it_outlives_it() -> None:
    ledger = _ledger(100_000, budget=5)
    _learnt(ledger, [n % 100 + 1 for n in range(400)], cap=1000)  # lengths 1..100, evenly
    handle = ledger.try_admit(10, 1000, now=0.0, follow=True, kind="m")
    assert handle is not None
    assert handle.counted_output == 75  # the 0.75 quantile of 1..100
    ledger.progress(handle, 74, 0.0)
    assert handle.counted_output == 75
    ledger.progress(handle, 75, 0.0)  # outlived it: the next level, from what it made
    assert handle.level == 1
    assert handle.counted_output == 98  # 0.9 of 76..100
    ledger.progress(handle, 98, 0.0)  # too few seen longer (8 of 400): its cap
    assert handle.counted_output == 1000
    stats = ledger.stats()
    assert stats.forecast_quantile == 0.75
    assert stats.preemption_budget == 5


def test_no_forecast_without_a_budget_or_without_evidence() -> None:
    for budget in (0.0, 5.0):
        ledger = _ledger(100_000, budget=budget)
        if budget:
            _learnt(ledger, [50] * 10, cap=1000)  # too few outputs
        else:
            _learnt(ledger, [50] * 400, cap=1000)
        handle = ledger.try_admit(10, 1000, now=0.0, follow=True, kind="m")
        assert handle is not None
        assert handle.counted_output == 1000
        assert ledger.stats().forecast_quantile is None if not budget else True


def test_preemptions_over_the_budget_raise_every_live_holder_at_once() -> None:
    ledger = _ledger(100_000, budget=5)
    _learnt(ledger, [n % 100 + 1 for n in range(400)], cap=1000)
    handle = ledger.try_admit(10, 1000, now=0.0, follow=True, kind="m")
    assert handle is not None
    assert handle.counted_output == 75
    assert ledger.engine_seen(waiting=0, preemptions=0) is None
    said = ledger.engine_seen(waiting=1, preemptions=5)  # 4 allowed in 800 requests
    assert said is not None
    assert "0.75 -> 0.9" in said
    assert handle.counted_output == 90
    assert ledger.forecasting


@st.composite
def bets(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(20, 70))
    shape = draw(st.sampled_from(["geometric", "to caps", "bimodal"]))
    mean = draw(st.integers(5, 120))
    requests = []
    for i in range(n):
        cap = draw(st.integers(40, 250))
        if shape == "to caps":
            length = cap
        elif shape == "bimodal":
            length = cap if draw(st.integers(0, 4)) == 0 else draw(st.integers(1, 20))
        else:  # a long tail, drawn by hypothesis so that it shrinks
            length = min(cap, 1 + int(-mean * math.log(1 - draw(st.floats(0, 0.999)))))
        requests.append(
            {"arrival": i * draw(st.integers(0, 6)), "prompt": draw(st.integers(1, 60)),
             "cap": cap, "length": length}
        )  # fmt: skip
    return {
        "requests": requests,
        "kv": draw(st.integers(600, 1500)),
        "budget": draw(st.sampled_from([0.0, 5.0, 50.0])),
        "learnt": draw(st.integers(0, 80)),
        "preempt": draw(st.booleans()),
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bets())
def test_the_forecast_bets_within_its_budget_and_the_ledger_returns_to_zero(
    work: dict[str, object],
) -> None:
    kv, budget = int(work["kv"]), float(work["budget"])  # type: ignore[call-overload]
    preempt = bool(work["preempt"])
    # An engine whose overflow fails requests is never given a budget (the gateway's rule).
    ledger = _ledger(kv, budget=budget if preempt else 0.0)
    requests = work["requests"]
    # What the gateway has learnt before: outputs of the same kind as the ones to come.
    earlier = [r["length"] for r in requests][: int(work["learnt"])]  # type: ignore[index, call-overload]
    _learnt(ledger, earlier * 2, cap=max(r["cap"] for r in requests))  # type: ignore[index, union-attr]
    engine = _Engine(kv, 1, preempt=preempt)
    quantiles: list[float | None] = []

    def scrape(step: int) -> None:
        before = ledger.stats()
        over = (before.preemption_rate or 0.0) > budget
        said = ledger.engine_seen(waiting=len(engine.waiting), preemptions=engine.preemptions)
        after = ledger.stats()
        if said is not None and "over" in said:
            # The mechanism: a preemption over the budget moves the quantile up, or off.
            assert before.forecast_quantile is not None
            assert after.forecast_quantile is None or (
                after.forecast_quantile > before.forecast_quantile
            )
        del over
        quantiles.append(after.forecast_quantile)

    _, admitted = _drive(work, ledger, engine, scrape_every=5, on_scrape=scrape)
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    if not preempt or not budget:
        # The exact rule: nothing counted short of its cap, and the pool never overflows.
        assert all(h.counted_output == h.output_cap for h in admitted)
        assert engine.preemptions == 0
        assert engine.peak_used <= kv
    assert all(q is None or q in LADDER for q in quantiles)


def test_the_forecast_runs_more_at_once_than_the_exact_rule_on_outputs_that_stop_early() -> None:
    # Caps of 400, outputs of 20-60 tokens: the exact rule fits 2 holders of 10 + 400 in 1,000
    # tokens at first; the forecast counts each to about 60.
    work = {
        "requests": [
            {"arrival": 0, "prompt": 10, "cap": 400, "length": 20 + (i * 7) % 41} for i in range(60)
        ],
    }
    steps = {}
    for budget in (0.0, 5.0):
        ledger = _ledger(1000, budget=budget)
        _learnt(ledger, [20 + (i * 7) % 41 for i in range(200)], cap=400)
        engine = _Engine(1000, 1, preempt=True)
        steps[budget], _ = _drive(work, ledger, engine)
        assert engine.preemptions == 0
    assert steps[5.0] < steps[0.0] / 2
