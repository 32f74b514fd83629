"""The simulated engine's scheduler, step by step on a fake clock: lockstep decode, the cap on
running sequences and its waiting line, shared prefix blocks, and the pool's exact books."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from reference_server.simulated.scheduler import (
    EngineOOMError,
    ScheduledSequence,
    Scheduler,
    prefix_keys,
)

B = 16
STEP = 0.01  # decode_rate 100: one step every 10 ms
_ids = itertools.count(1)


def scheduler(**kw: object) -> Scheduler:
    settings_: dict[str, object] = {
        "capacity_tokens": 1_000_000,
        "block_size": B,
        "decode_rate": 1 / STEP,
    }
    settings_.update(kw)
    return Scheduler(**settings_)  # type: ignore[arg-type]


def seq(prompt: int | list[int], stop: int = 1000) -> ScheduledSequence:
    """A sequence of a prompt of that many tokens, or of these ids (then its prefix is keyed)."""
    if isinstance(prompt, int):
        return ScheduledSequence(id=next(_ids), prompt_tokens=prompt, stop=stop)
    keys = prefix_keys(len(prompt), prompt, B)
    return ScheduledSequence(id=next(_ids), prompt_tokens=len(prompt), stop=stop, keys=keys)


def blocks(tokens: int) -> int:
    return math.ceil(tokens / B) * B


def at_step(n: int) -> float:
    """A moment just after the n-th step from 0 (clear of float rounding at the edge)."""
    return n * STEP + STEP / 10


# --- lockstep ----------------------------------------------------------------------------------


def test_sequences_started_together_advance_in_lockstep() -> None:
    s = scheduler()
    first, second = seq(30), seq(100)
    s.add(first, 0.0)
    s.add(second, 0.0)
    for n in range(1, 40):
        s.advance(at_step(n))
        assert first.generated == second.generated == n
        assert s.steps_total == n
    assert s.generated_tokens_total == 2 * 39


def test_prefill_is_charged_at_once_and_the_first_token_comes_at_the_next_step() -> None:
    s = scheduler()
    late = seq(20)
    s.add(seq(5), 0.0)
    s.advance(at_step(3))
    s.add(late, at_step(3))
    assert late.generated == 0
    assert s.used_tokens == blocks(5 + 3) + blocks(20)
    s.advance(4 * STEP - STEP / 10)
    assert late.generated == 0
    s.advance(at_step(4))
    assert late.generated == 1


def test_a_step_slows_with_the_batch_as_the_ledger_models_it() -> None:
    s = scheduler(decode_rate=100.0, throughput=400.0)
    assert s.step_seconds(1) == pytest.approx(0.01)
    assert s.step_seconds(5) == pytest.approx(0.01 + 4 / 400)
    for _ in range(5):
        s.add(seq(10), 0.0)
    s.advance(0.0199)  # one step of 20 ms, not two of 10
    assert s.steps_total == 0
    s.advance(0.0201)
    assert s.steps_total == 1
    # Without a throughput, every step takes 1 / decode_rate however many run.
    assert scheduler(decode_rate=100.0).step_seconds(50) == pytest.approx(0.01)


def test_a_sequence_ends_at_its_stop_and_frees_its_blocks_at_that_step() -> None:
    s = scheduler()
    short, long = seq(10, stop=3), seq(10, stop=50)
    s.add(short, 0.0)
    s.add(long, 0.0)
    s.advance(at_step(3))
    assert (short.done, long.done) == (True, False)
    assert short.generated == 3
    assert s.used_tokens == blocks(10 + 3)  # only the long one's
    s.advance(10.0)
    assert long.done
    assert long.generated == 50
    assert s.used_tokens == 0
    assert s.next_step_at is None  # idle: no steps are run for nobody


def test_a_sequence_cut_before_its_first_token_is_charged_then_freed() -> None:
    s = scheduler()
    cut = seq(40, stop=0)
    s.add(cut, 0.0)
    assert cut.done
    assert cut.generated == 0
    assert s.used_tokens == 0
    assert s.peak_used_tokens == blocks(40)


# --- the cap on running sequences --------------------------------------------------------------


def test_beyond_max_running_sequences_wait_holding_nothing_until_one_ends() -> None:
    s = scheduler(max_running=2)
    a, b, c, d = seq(10, stop=5), seq(10, stop=50), seq(100), seq(10)
    for x in (a, b, c, d):
        s.add(x, 0.0)
    assert list(s.running.values()) == [a, b]
    assert list(s.waiting) == [c, d]
    assert s.used_tokens == 2 * blocks(10)  # the waiting ones hold no KV
    s.advance(at_step(4))
    assert (c.running, c.generated) == (False, 0)
    s.advance(at_step(5))  # a ends at step 5: c takes its slot there, d still waits
    assert a.done
    assert (c.running, c.generated) == (True, 0)
    assert list(s.waiting) == [d]
    assert s.used_tokens == blocks(10 + 5) + blocks(100)
    s.advance(at_step(6))
    assert c.generated == 1
    assert b.generated == 6


def test_a_cancelled_runner_hands_its_slot_on_and_a_cancelled_waiter_leaves_the_line() -> None:
    s = scheduler(max_running=1)
    a, b, c = seq(10), seq(10), seq(10)
    for x in (a, b, c):
        s.add(x, 0.0)
    s.remove(b, 0.005)
    assert b.done
    assert list(s.waiting) == [c]
    s.advance(at_step(2))
    s.remove(a, at_step(2))
    assert a.done
    assert c.running
    assert s.used_tokens == blocks(10)
    s.advance(at_step(2) + STEP * 1.05)  # c's first step is one step after it started
    assert c.generated == 1
    s.remove(c, 1.0)
    assert s.used_tokens == 0
    assert not s.running
    assert not s.waiting
    s.remove(c, 2.0)  # twice: nothing happens


def test_overflow_fails_every_sequence_in_the_engine_waiting_ones_too() -> None:
    s = scheduler(capacity_tokens=64, max_running=2)
    a, b, c = seq(16), seq(16), seq(16)
    for x in (a, b, c):
        s.add(x, 0.0)
    s.advance(at_step(1))  # 2 x 17 tokens: 4 blocks, 64 tokens: fits
    assert a.failure is None
    s.advance(at_step(17))  # 2 x 33 tokens: 6 blocks
    assert all(isinstance(x.failure, EngineOOMError) for x in (a, b, c))
    assert all(x.done and not x.running for x in (a, b, c))
    assert (s.oom_events_total, s.oom_failed_total) == (1, 3)
    assert s.used_tokens == 0
    assert not s.running
    assert not s.waiting
    assert s.peak_used_tokens == 96
    later = seq(16)
    s.add(later, 2.0)  # the engine goes on serving
    assert later.running
    assert later.failure is None


# --- shared prefix blocks ----------------------------------------------------------------------

PREFIX = list(range(1000, 1512))  # 512 tokens: 32 full blocks


def test_a_prompt_shares_its_prefix_once_the_holders_prefill_is_done() -> None:
    s = scheduler()
    first, second = seq([*PREFIX, 1, 2, 3, 4]), seq([*PREFIX, 5, 6, 7, 8])
    s.add(first, 0.0)
    s.advance(at_step(1))  # the first has its first token: its prefill is done
    s.add(second, at_step(1))
    assert second.shared_blocks == 32
    own = blocks(516) - 512  # the block with its last prompt token
    assert s.used_tokens == blocks(516 + 1) + own
    assert s.shared_blocks_total == 32


def test_prompts_scheduled_in_the_same_step_do_not_share() -> None:
    s = scheduler()
    first, second = seq([*PREFIX, 1, 2, 3, 4]), seq([*PREFIX, 5, 6, 7, 8])
    s.add(first, 0.0)
    s.add(second, 0.001)  # both still in prefill
    assert first.shared_blocks == second.shared_blocks == 0
    assert s.used_tokens == 2 * blocks(516)
    s.advance(at_step(1))
    third = seq([*PREFIX, 9])
    s.add(third, at_step(1))
    assert third.shared_blocks == 32  # one of the two copies, not both
    assert s.used_tokens == 2 * blocks(517) + blocks(513) - 512


def test_a_shared_block_stays_charged_while_any_holder_lives() -> None:
    s = scheduler()
    owner, sharer = seq([*PREFIX, 1], stop=3), seq([*PREFIX, 2], stop=100)
    s.add(owner, 0.0)
    s.advance(at_step(1))
    s.add(sharer, at_step(1))
    s.advance(at_step(3))  # the owner ends
    assert owner.done
    assert s.used_tokens == blocks(513 + 2)  # the sharer's whole prompt, the prefix included
    assert sharer.shared_blocks == 0  # held alone now
    s.advance(100.0)
    assert s.used_tokens == 0


def test_a_prefix_its_last_holder_let_go_is_taken_back_from_the_cache() -> None:
    """As vLLM's prefix cache: a computed block let go stays cached, holding nothing; the next
    prompts that start with it take it back, one copy, even when they start in the same step."""
    s = scheduler()
    owner = seq([*PREFIX, 1], stop=2)
    s.add(owner, 0.0)
    s.advance(at_step(3))
    assert owner.done
    assert s.used_tokens == 0
    first, second = seq([*PREFIX, 5, 6]), seq([*PREFIX, 7, 8])
    s.add(first, at_step(3))
    s.add(second, at_step(3) + 0.001)  # both in their prefill: the cached copy serves both
    assert first.shared_blocks == second.shared_blocks == 32  # one copy, held by both
    assert s.used_tokens == 512 + 2 * (blocks(514) - 512)
    assert s.shared_blocks_total == 64  # neither computed it


def test_cached_blocks_nobody_holds_are_evicted_when_the_pool_needs_their_room() -> None:
    """The pool of 40 blocks: the 32 cached blocks of a prefix let go, then a prompt of 20
    blocks of its own: 12 of the cached ones give their room, the prefix's last first (vLLM
    frees a sequence's blocks from its end). A prompt with the prefix takes back the 20 left."""
    s = scheduler(capacity_tokens=40 * B)
    owner = seq([*PREFIX, 1], stop=2)
    s.add(owner, 0.0)
    s.advance(at_step(3))
    other = seq(20 * B)
    s.add(other, at_step(3))
    assert s.used_tokens == 20 * B
    s.remove(other, at_step(3))
    again = seq([*PREFIX, 2])
    s.add(again, at_step(3))
    assert s.shared_blocks_total == 20  # taken back from the cache, not computed
    assert [block.ready for block in again.prefix] == [True] * 20 + [False] * 12  # the head
    assert s.used_tokens == blocks(514)


def test_only_full_blocks_before_the_last_prompt_token_are_shared() -> None:
    assert len(prefix_keys(512, PREFIX, B)) == 31  # the last token's block is never shared
    assert len(prefix_keys(513, [*PREFIX, 7], B)) == 32
    assert len(prefix_keys(15, list(range(15)), B)) == 0
    assert len(prefix_keys(600, PREFIX, B)) == 32  # no further than the ids given
    s = scheduler()
    first = seq(PREFIX)
    s.add(first, 0.0)
    s.advance(at_step(1))
    again = seq(PREFIX)
    s.add(again, at_step(1))
    assert again.shared_blocks == 31
    assert s.used_tokens == blocks(513) + B


def test_equal_keys_mean_equal_whole_prefixes() -> None:
    one = prefix_keys(49, [*range(16), *range(100, 116), *range(17)], B)
    other = prefix_keys(49, [*range(200, 216), *range(100, 116), *range(17)], B)
    assert one[1] != other[1]  # the same second block after another first one
    assert one[2] != other[2]
    assert prefix_keys(49, [*range(16), *range(100, 116), *range(17)], B) == one
    s = scheduler()
    s.add(seq([*range(16), *range(100, 116), *range(17)]), 0.0)
    s.advance(at_step(1))
    later = seq([*range(200, 216), *range(100, 116), *range(17)])
    s.add(later, at_step(1))
    assert later.shared_blocks == 0


# --- the pool's books, under random traffic ----------------------------------------------------

_PREFIXES = [list(range(base, base + 64)) for base in (0, 1000)]


@st.composite
def _prompts(draw: st.DrawFn) -> list[int]:
    prefix = draw(st.sampled_from(_PREFIXES))
    cut = draw(st.one_of(st.just(64), st.integers(0, 64)))
    own = draw(st.lists(st.integers(5000, 5003), max_size=20))
    prompt = [*prefix[:cut], *own]
    return prompt or [7]


_operations = st.lists(
    st.one_of(
        # an arrival, a moment after the previous operation (often after a step or two)
        st.tuples(st.just("add"), _prompts(), st.integers(0, 60), st.floats(0.0, 0.03)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.1)),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
    ),
    min_size=4,
    max_size=60,
)


def _unique_blocks(s: Scheduler) -> int:
    """Blocks held by the live sequences, each physical block once."""
    prefix = {id(block) for x in s.running.values() for block in x.prefix}
    return len(prefix) + sum(x.tail for x in s.running.values())


@settings(max_examples=300, deadline=None)
@given(
    operations=_operations,
    max_running=st.one_of(st.none(), st.integers(1, 4)),
    capacity=st.one_of(st.integers(96, 400), st.just(1_000_000)),
)
def test_the_pool_counts_exactly_the_unique_blocks_of_live_sequences(
    operations: list[tuple[object, ...]], max_running: int | None, capacity: int
) -> None:
    s = scheduler(capacity_tokens=capacity, max_running=max_running)
    now = 0.0
    live: list[ScheduledSequence] = []
    for operation in operations:
        if operation[0] == "add":
            prompt, stop, after = operation[1:]
            assert isinstance(prompt, list)
            assert isinstance(stop, int)
            assert isinstance(after, float)
            now += after
            x = seq(prompt, stop=stop)
            live.append(x)
            s.add(x, now)
        elif operation[0] == "advance":
            assert isinstance(operation[1], float)
            now += operation[1]
            s.advance(now)
        elif live:
            assert isinstance(operation[1], int)
            s.remove(live.pop(operation[1] % len(live)), now)
        live = [x for x in live if not x.done]
        assert s.used_tokens == B * _unique_blocks(s)
        assert s.used_tokens <= capacity
        assert max_running is None or len(s.running) <= max_running
        for x in s.running.values():
            # every running sequence holds its prompt + generated tokens in whole blocks
            assert len(x.prefix) + x.tail == math.ceil((x.prompt_tokens + x.generated) / B)
            assert 0 <= x.generated < x.stop
        assert all(not x.prefix and not x.tail and x.generated == 0 for x in s.waiting)
        assert set(s.running) | {x.id for x in s.waiting} == {x.id for x in live}
    event(f"shared blocks: {s.shared_blocks_total > 0}")
    event(f"overflowed: {s.oom_events_total > 0}")
    s.advance(now + 1000.0)
    assert s.used_tokens == 0
    assert not s.running
    assert not s.waiting


@settings(max_examples=200, deadline=None)
@given(
    operations=_operations,
    max_running=st.one_of(st.none(), st.integers(1, 4)),
    capacity=st.one_of(st.integers(96, 400), st.just(1_000_000)),
    throughput=st.one_of(st.none(), st.just(250.0)),
)
def test_steps_run_in_batches_as_they_would_one_by_one(
    operations: list[tuple[object, ...]],
    max_running: int | None,
    capacity: int,
    throughput: float | None,
) -> None:
    def run(fine: bool) -> list[object]:
        s = scheduler(capacity_tokens=capacity, max_running=max_running, throughput=throughput)
        ids = itertools.count(1)
        now = 0.0
        live: list[ScheduledSequence] = []

        def to(moment: float) -> None:
            # one step at a time (no batch spans two of these), or all at once
            while fine and s.next_step_at is not None and s.next_step_at <= moment:
                s.advance(s.next_step_at)
            s.advance(moment)

        everyone: list[ScheduledSequence] = []
        for operation in operations:
            if operation[0] == "add":
                prompt, stop, after = operation[1:]
                assert isinstance(prompt, list)
                assert isinstance(stop, int)
                assert isinstance(after, float)
                now += after
                to(now)
                keys = prefix_keys(len(prompt), prompt, B)
                x = ScheduledSequence(id=next(ids), prompt_tokens=len(prompt), stop=stop, keys=keys)
                live.append(x)
                everyone.append(x)
                s.add(x, now)
            elif operation[0] == "advance":
                assert isinstance(operation[1], float)
                now += operation[1]
                to(now)
            elif live:
                assert isinstance(operation[1], int)
                s.remove(live.pop(operation[1] % len(live)), now)
            live = [x for x in live if not x.done]
        to(now + 1000.0)
        return [
            s.steps_total,
            s.generated_tokens_total,
            s.peak_used_tokens,
            s.oom_events_total,
            s.shared_blocks_total,
            [
                (x.done, x.failure is not None, x.failure and x.failure.used_tokens)
                for x in everyone
            ],
            [x.generated for x in everyone if x.failure is None],
        ]

    assert run(fine=True) == run(fine=False)


def test_a_step_ends_at_the_same_moment_whether_steps_run_one_by_one_or_in_a_batch() -> None:
    # A sequence's ninth and last step ends at 0.03125 + 9 steps: summing the steps one by one
    # and multiplying them out in a batch once disagreed in the last bit, so the batch ran only
    # eight steps by then, the sequence still ran, and the next prompt shared its prefix:
    # a peak of 96 tokens in a batch, 80 one step at a time.
    def run(fine: bool) -> list[object]:
        s = scheduler(capacity_tokens=96)
        prompt = list(range(64))
        first = seq(prompt, stop=9)
        s.add(first, 0.03125)
        now = 0.03125 + 0.09
        while fine and s.next_step_at is not None and s.next_step_at <= now:
            s.advance(s.next_step_at)
        s.advance(now)
        second = seq(prompt, stop=0)
        s.add(second, now)
        s.advance(now + 1.0)
        return [
            s.steps_total,
            s.generated_tokens_total,
            s.peak_used_tokens,
            s.shared_blocks_total,
            s.oom_events_total,
            first.generated,
            first.done,
        ]

    assert run(fine=True) == run(fine=False)


# --- an engine that preempts ------------------------------------------------------------------


def test_an_overflow_preempts_the_newest_sequence_and_recomputes_it_when_it_fits() -> None:
    # Pool of 8 blocks (128 tokens): two sequences of 48-token prompts grow to 64 each after 16
    # steps; the 17th step would need a fifth block for one of them.
    s = scheduler(capacity_tokens=128, on_overflow="preempt", recompute_seconds=0.001)
    old, new = seq(48, stop=40), seq(48, stop=40)
    s.add(old, 0.0)
    s.add(new, 0.0)
    s.advance(at_step(16))
    assert (old.generated, new.generated, s.used_tokens) == (16, 16, 128)
    s.advance(at_step(17))
    assert s.preemptions_total == 1
    assert not new.running
    assert list(s.waiting) == [new]
    assert new.generated == 16
    assert old.generated == 17
    assert s.used_tokens == blocks(48 + 17)
    assert s.oom_events_total == 0
    # The old one ends at step 40; the new one rejoins once its blocks fit (with a block to
    # spare for the running), recomputing its 64 tokens (64 ms added to that step), and ends.
    s.advance(at_step(300))
    assert old.done
    assert new.done
    assert new.generated == 40
    assert s.used_tokens == 0
    assert s.oom_events_total == 0
    assert s.peak_used_tokens <= 128


def test_a_preempting_engine_starts_a_newcomer_only_when_its_blocks_fit() -> None:
    s = scheduler(capacity_tokens=64, on_overflow="preempt")
    first, second = seq(40, stop=5), seq(40, stop=5)
    s.add(first, 0.0)
    s.add(second, 0.0)  # 3 blocks + 3 blocks would overflow 4
    assert first.running
    assert not second.running
    assert list(s.waiting) == [second]
    s.advance(at_step(20))
    assert first.done
    assert second.done
    assert s.oom_events_total == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 80), st.integers(1, 120), st.integers(0, 50)), max_size=12),
    st.integers(8, 30),
)
def test_a_preempting_engine_never_overflows_and_finishes_everything(
    requests: list[tuple[int, int, int]], pool_blocks: int
) -> None:
    s = scheduler(capacity_tokens=pool_blocks * B, on_overflow="preempt", recompute_seconds=0.0005)
    sequences = []
    for prompt, stop, arrival in sorted(requests, key=lambda r: r[2]):
        if blocks(prompt + stop + 1) + B > pool_blocks * B:
            continue  # could never fit alone
        sequence = seq(prompt, stop=stop)
        s.add(sequence, at_step(arrival))
        sequences.append(sequence)
    s.advance(1000.0)
    event(f"preempted: {s.preemptions_total > 0}")
    assert all(x.done and x.failure is None for x in sequences)
    assert s.oom_events_total == 0
    assert s.peak_used_tokens <= pool_blocks * B
    assert s.used_tokens == 0
