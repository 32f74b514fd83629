"""The reservation ledger: pure arithmetic, thread safety, Retry-After estimates, invariants."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvclient import effective_output_cap, reservation_tokens
from reference_server import Handle, KVAdmissionController


def make(**kw: object) -> KVAdmissionController:
    defaults: dict[str, object] = {
        "total_kv_tokens": 10_000,
        "context_window": 4096,
        "decode_rate": 100.0,
    }
    defaults.update(kw)
    return KVAdmissionController(**defaults)  # type: ignore[arg-type]


def test_usable_budget_is_total_times_safety_fraction() -> None:
    assert make().usable_tokens == 9000
    assert make(safety_fraction=0.5).usable_tokens == 5000
    ledger = make(kv_bytes_per_token=131072)
    assert ledger.stats().usable_bytes == 9000 * 131072


def test_reserve_mode_prices_prompt_plus_cap_in_whole_blocks() -> None:
    ledger = make(block_size=16)
    assert ledger.need_tokens(200, 4000) == reservation_tokens(200, 4000, block_size=16) == 4208
    handle = ledger.try_admit(200, 4000, now=0.0)
    assert handle is not None
    assert handle.reserved_tokens == 4208
    stats = ledger.stats()
    assert stats.reserved_tokens == 4208
    assert stats.inflight == 1
    assert stats.admitted_total == 1


def test_unset_cap_is_clamped_to_the_context_as_the_seed_says() -> None:
    # The app clamps with kvclient's effective_output_cap before asking the ledger.
    cap = effective_output_cap(None, prompt_tokens=200, context_window=4096)
    assert cap == 3896
    assert make().need_tokens(200, cap) == 4096


def test_rejects_when_short_and_admits_after_release() -> None:
    ledger = make()
    first = ledger.try_admit(100, 4000, now=0.0)
    second = ledger.try_admit(100, 4000, now=0.0)
    assert first is not None
    assert second is not None
    assert ledger.try_admit(100, 4000, now=0.0) is None
    assert ledger.stats().rejected_total == 1
    ledger.release(first)
    assert ledger.try_admit(100, 4000, now=0.0) is not None


def test_release_is_idempotent() -> None:
    ledger = make()
    handle = ledger.try_admit(10, 10, now=0.0)
    assert handle is not None
    ledger.release(handle)
    ledger.release(handle)
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.released_total == 1
    assert handle.released


def test_releasing_a_foreign_handle_changes_nothing() -> None:
    ledger = make()
    mine = ledger.try_admit(10, 10, now=0.0)
    assert mine is not None
    other = make().try_admit(100, 100, now=0.0)
    assert other is not None
    ledger.release(other)  # not this ledger's: harmless
    assert ledger.stats().reserved_tokens == mine.reserved_tokens


def test_prompt_mode_reserves_only_prompt_blocks() -> None:
    ledger = make(strategy="prompt")
    assert ledger.need_tokens(20, 4000) == 32
    handles = [ledger.try_admit(20, 4000, now=0.0) for _ in range(100)]
    assert all(h is not None for h in handles)
    assert ledger.stats().reserved_tokens == 3200  # blind to the 400k output tokens promised


def test_concurrency_mode_counts_requests_only() -> None:
    ledger = make(strategy="concurrency", max_concurrency=3)
    assert ledger.need_tokens(4000, 4000) == 0
    handles = [ledger.try_admit(4000, 4000, now=0.0) for _ in range(3)]
    assert all(h is not None for h in handles)
    assert ledger.try_admit(1, 1, now=0.0) is None
    assert ledger.stats().reserved_tokens == 0


def test_concurrency_mode_has_a_default_cap() -> None:
    assert make(strategy="concurrency").max_concurrency == 16


def test_max_concurrency_also_caps_reserve_mode() -> None:
    ledger = make(max_concurrency=1)
    assert ledger.try_admit(1, 1, now=0.0) is not None
    assert ledger.try_admit(1, 1, now=0.0) is None


def test_each_sequence_of_a_request_counts_against_the_running_cap() -> None:
    ledger = make(max_concurrency=8)
    four = ledger.try_admit(1, 1, now=0.0, sequences=4)
    assert four is not None
    assert four.sequences == 4
    assert ledger.try_admit(1, 1, now=0.0, sequences=5) is None  # 4 + 5 > 8
    assert ledger.try_admit(1, 1, now=0.0, sequences=4) is not None
    assert ledger.try_admit(1, 1, now=0.0) is None  # 8 running
    ledger.release(four)
    assert ledger.try_admit(1, 1, now=0.0, sequences=4) is not None


def test_never_fits() -> None:
    ledger = make()
    assert not ledger.never_fits(9000)
    assert ledger.never_fits(9001)
    assert ledger.max_output_that_fits(1000) == 3096  # the context binds first
    small = make(total_kv_tokens=1000, context_window=4096)
    assert small.max_output_that_fits(100) == 896 - 100
    assert not small.never_fits(small.need_tokens(100, small.max_output_that_fits(100)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_kv_tokens": 0}, "total_kv_tokens"),
        ({"safety_fraction": 0.0}, "safety_fraction"),
        ({"safety_fraction": 1.5}, "safety_fraction"),
        ({"block_size": 0}, "block_size"),
        ({"decode_rate": 0.0}, "decode_rate"),
        ({"strategy": "lottery"}, "strategy"),
        ({"max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


# --- Retry-After ---------------------------------------------------------------------------


def test_retry_after_is_zero_when_it_fits_now() -> None:
    assert make().retry_after(100, now=0.0) == 0.0


def test_retry_after_accumulates_due_releases_in_order() -> None:
    # usable 9000; decode 100 tok/s: a cap of 1000 is due 10 s after admission.
    ledger = make(block_size=1)
    a = ledger.try_admit(0, 3000, now=0.0)  # due at 30
    b = ledger.try_admit(0, 1000, now=5.0)  # due at 15
    c = ledger.try_admit(0, 4000, now=0.0)  # due at 40 -> reserved 8000
    assert a is not None
    assert b is not None
    assert c is not None
    assert ledger.retry_after(1000, now=10.0) == 0.0  # 1000 free
    # 2000 needed: b (due 15) frees 1000 -> 2000 free: 5 s from now.
    assert ledger.retry_after(2000, now=10.0) == pytest.approx(5.0)
    # 5000 needed: b then a (due 30) -> 5000 free: 20 s from now.
    assert ledger.retry_after(5000, now=10.0) == pytest.approx(20.0)
    # Past-due handles still hold their budget: not "fits now" but within a token's time (the
    # decode loop ends them on its next tick), or within the overrun the server allows past it.
    assert ledger.retry_after(2000, now=100.0) == pytest.approx(0.01)
    late = make(block_size=1, overrun=5.0)
    assert late.try_admit(0, 8000, now=0.0) is not None  # due at 80
    assert late.retry_after(2000, now=82.0) == pytest.approx(3.0)


def test_retry_after_counts_concurrency_slots() -> None:
    ledger = make(strategy="concurrency", max_concurrency=2)
    assert ledger.try_admit(0, 500, now=0.0)  # due 5
    assert ledger.try_admit(0, 200, now=0.0)  # due 2
    assert ledger.retry_after(0, now=1.0) == pytest.approx(1.0)


def test_retry_after_includes_the_release_margin() -> None:
    ledger = make(release_margin=0.25)
    assert ledger.try_admit(0, 8992, now=0.0)
    assert ledger.retry_after(16, now=0.0) == pytest.approx(89.92 + 0.25)


def test_clients_turned_away_together_are_told_staggered_times() -> None:
    # usable 9000 with blocks of 1; one holder of 8000 due at 80 s (100 tok/s).
    ledger = make(block_size=1)
    assert ledger.try_admit(0, 8000, now=0.0) is not None
    first = ledger.retry_after(5000, 0.0, duration=50.0, promise=True)
    second = ledger.retry_after(5000, 0.0, duration=50.0, promise=True)
    third = ledger.retry_after(3000, 0.0, duration=10.0, promise=True)
    assert first == pytest.approx(80.0)  # when the holder is due
    assert second == pytest.approx(130.0)  # when the first one back is due to be done
    assert third == pytest.approx(80.0)  # fits beside the first one back
    assert ledger.outstanding_promises() == 3
    # Without promise=True nothing is remembered.
    assert ledger.retry_after(5000, 0.0, duration=50.0) == pytest.approx(180.0)
    assert ledger.outstanding_promises() == 3


def test_a_returning_client_keeps_its_promise_and_promises_expire() -> None:
    ledger = make(block_size=1)
    holder = ledger.try_admit(0, 8000, now=0.0)
    assert holder is not None
    assert ledger.retry_after(5000, 0.0, duration=50.0, promise=True) == pytest.approx(80.0)
    ledger.release(holder)
    assert ledger.try_admit(0, 5000, now=80.0) is not None  # the client came back
    assert ledger.outstanding_promises() == 0
    assert ledger.retry_after(5000, 80.0, duration=1.0, promise=True) == pytest.approx(50.0)
    assert ledger.outstanding_promises() == 1
    ledger.retry_after(1, 1000.0)  # long after: the unused promise has run out
    assert ledger.outstanding_promises() == 0


def test_promises_do_not_block_admission() -> None:
    ledger = make(block_size=1)
    assert ledger.try_admit(0, 8000, now=0.0) is not None
    ledger.retry_after(5000, 0.0, duration=50.0, promise=True)
    assert ledger.try_admit(0, 1000, now=1.0) is not None  # fits now: admitted


# --- concurrency and invariants -----------------------------------------------------------------


def test_many_threads_admit_and_release_back_to_zero() -> None:
    ledger = make(total_kv_tokens=5000)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[Handle] = []
        for _ in range(500):
            if held and rng.random() < 0.5:
                handle = held.pop(rng.randrange(len(held)))
                ledger.release(handle)
                if rng.random() < 0.2:
                    ledger.release(handle)  # double release: harmless
            else:
                handle_or_none = ledger.try_admit(rng.randrange(200), rng.randrange(1, 600), now=0)
                if handle_or_none is not None:
                    held.append(handle_or_none)
            stats = ledger.stats()
            if not 0 <= stats.reserved_tokens <= stats.usable_tokens:
                errors.append(f"reserved out of range: {stats}")
        for handle in held:
            ledger.release(handle)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.admitted_total == stats.released_total


_op = st.tuples(
    st.sampled_from(["admit", "finish", "fail", "cancel", "double_release"]),
    st.integers(0, 3000),
    st.integers(1, 3000),
    st.integers(0, 10_000),
)


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(["reserve", "prompt", "concurrency"]),
    scripts=st.lists(st.lists(_op, max_size=40), min_size=1, max_size=4),
)
def test_random_interleavings_from_many_threads_keep_the_invariants(
    strategy: str, scripts: list[list[tuple[str, int, int, int]]]
) -> None:
    """Each thread runs its own random script; interleavings are up to the scheduler."""
    ledger = make(total_kv_tokens=8000, strategy=strategy, max_concurrency=6)
    barrier = threading.Barrier(len(scripts))
    violations: list[str] = []

    def run(script: list[tuple[str, int, int, int]]) -> None:
        held: list[Handle] = []
        barrier.wait(10)
        for op, prompt, cap, pick in script:
            if op == "admit" or not held:
                handle = ledger.try_admit(prompt, cap, now=0.0)
                if handle is not None:
                    held.append(handle)
            else:
                # finish, fail and cancel all end in the same finally: release.
                handle = held.pop(pick % len(held))
                ledger.release(handle)
                if op == "double_release":
                    ledger.release(handle)
            stats = ledger.stats()
            if stats.reserved_tokens < 0 or stats.reserved_tokens > stats.usable_tokens:
                violations.append(f"reserved {stats.reserved_tokens}")
        for handle in held:
            ledger.release(handle)

    threads = [threading.Thread(target=run, args=(s,)) for s in scripts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not violations
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.admitted_total == stats.released_total


class LedgerMachine(RuleBasedStateMachine):
    """Single-threaded model check: reserved is always the sum of the live handles."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = make(total_kv_tokens=6000, max_concurrency=5)
        self.live: list[Handle] = []
        self.dead: list[Handle] = []
        self.now = 0.0

    @rule(prompt=st.integers(0, 4000), cap=st.integers(1, 4000))
    def admit(self, prompt: int, cap: int) -> None:
        need = self.ledger.need_tokens(prompt, cap)
        before = self.ledger.stats()
        handle = self.ledger.try_admit(prompt, cap, now=self.now)
        fits = before.reserved_tokens + need <= before.usable_tokens and before.inflight < 5
        assert (handle is not None) == fits
        if handle is not None:
            assert handle.reserved_tokens == need
            self.live.append(handle)

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 100), how=st.sampled_from(["finish", "fail", "cancel"]))
    def end(self, pick: int, how: str) -> None:
        handle = self.live.pop(pick % len(self.live))
        self.ledger.release(handle)
        self.dead.append(handle)

    @precondition(lambda self: bool(self.dead))
    @rule(pick=st.integers(0, 100))
    def release_again(self, pick: int) -> None:
        self.ledger.release(self.dead[pick % len(self.dead)])

    @rule(dt=st.floats(0, 5))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(need=st.integers(0, 6000))
    def estimate(self, need: int) -> None:
        wait = self.ledger.retry_after(need, self.now)
        assert wait >= 0.0
        if not self.ledger.never_fits(need):
            # "Fits now" exactly when it does: a past-due handle still holds its budget.
            stats = self.ledger.stats()
            fits = stats.reserved_tokens + need <= stats.usable_tokens and stats.inflight < 5
            assert (wait == 0.0) == fits

    @rule(need=st.integers(1, 6000), duration=st.floats(0, 50))
    def turn_away_with_a_promise(self, need: int, duration: float) -> None:
        if self.ledger.never_fits(need):
            return
        before = self.ledger.stats()
        plain = self.ledger.retry_after(need, self.now, duration=duration)
        promised = self.ledger.retry_after(need, self.now, duration=duration, promise=True)
        # Remembering the promise does not change this client's answer, nor the reservations.
        assert promised == plain >= 0.0
        assert self.ledger.stats().reserved_tokens == before.reserved_tokens

    @invariant()
    def reserved_is_the_sum_of_live_handles(self) -> None:
        stats = self.ledger.stats()
        assert stats.reserved_tokens == sum(h.reserved_tokens for h in self.live)
        assert stats.inflight == len(self.live)
        assert 0 <= stats.reserved_tokens <= stats.usable_tokens

    def teardown(self) -> None:
        for handle in self.live:
            self.ledger.release(handle)
        assert self.ledger.stats().reserved_tokens == 0


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_output_quantile_tightens_the_estimate_once_enough_outputs_were_seen() -> None:
    # usable 9000, blocks of 1, 100 tok/s: a holder capped at 8000 is due at 80 s.
    ledger = make(block_size=1, output_quantile=0.9)
    assert ledger.try_admit(0, 8000, now=0.0) is not None
    assert ledger.retry_after(2000, 0.0) == pytest.approx(80.0)  # no history yet: worst case
    for length in range(1, 101):  # outputs of 1..100 tokens: the 90th percentile is 90
        ledger.record_output(length)
    assert ledger.retry_after(2000, 0.0) == pytest.approx(0.9)  # 90 tokens at 100 tok/s
    # A handle whose cap is below the quantile keeps its own (earlier) worst case.
    small = make(block_size=1, output_quantile=0.9)
    for length in range(1, 101):
        small.record_output(length)
    assert small.try_admit(0, 8950, now=0.0) is not None
    assert small.try_admit(0, 40, now=0.0) is not None
    assert small.retry_after(40, 0.0) == pytest.approx(0.4)


def test_output_quantile_is_off_by_default_and_validated() -> None:
    ledger = make(block_size=1)
    assert ledger.try_admit(0, 8000, now=0.0) is not None
    for _ in range(100):
        ledger.record_output(1)
    assert ledger.retry_after(2000, 0.0) == pytest.approx(80.0)
    with pytest.raises(ValueError, match="output_quantile"):
        make(output_quantile=1.5)
