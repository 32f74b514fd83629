"""The peak rule: the pure peak against brute force, and the ledger that admits by it against an
engine stepped in lockstep whose KV pool must never overflow."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.peak import Holder, peak, prefix_blocks
from reference_server.admission.values import Handle
from tests.helpers.lockstep import LockstepEngine, run

# --- the pure peak -------------------------------------------------------------------------------


def _brute_peak(holders: list[Holder], block_size: int) -> int:
    """Every step until all have ended, counted the slow way."""
    horizon = max((h.steps_left or 0 for h in holders), default=0) + 2
    best = 0
    for step in range(horizon):
        total = 0
        copies: dict[object, int] = {}
        present: set[object] = set()
        for h in holders:
            tokens = h.at(step)
            if not tokens:
                continue
            total += math.ceil(tokens / block_size) * block_size - block_size * len(h.prefix)
            for i, key in enumerate(h.prefix):
                present.add(key)
                copies[key] = copies.get(key, 0) + (i >= h.borrowed)
        total += block_size * sum(max(1, copies.get(k, 0)) for k in present)
        best = max(best, total)
    return best


@st.composite
def holders(draw: st.DrawFn) -> tuple[list[Holder], int]:
    block = draw(st.sampled_from([1, 4, 16]))
    out = []
    for _ in range(draw(st.integers(0, 8))):
        prompt = draw(st.integers(1, 200))
        cap = draw(st.integers(1, 300))
        keys = draw(st.integers(0, min(3, (prompt - 1) // block)))
        prefix = tuple(f"k{i}" for i in range(keys))
        borrowed = draw(st.integers(0, keys))
        if draw(st.booleans()):
            out.append(Holder.flat(prompt + cap, prefix, borrowed))
        else:
            made = draw(st.integers(0, cap))
            extra = draw(st.integers(0, cap - made))
            out.append(
                Holder(
                    held=prompt + made + extra,
                    most=prompt + cap,
                    steps_left=max(1, cap - made),
                    prefix=prefix,
                    borrowed=borrowed,
                )
            )
    return out, block


@given(holders())
def test_the_peak_is_the_maximum_over_every_step(case: tuple[list[Holder], int]) -> None:
    found, block = case
    expected = _brute_peak(found, block)
    assert (peak(found, block_size=block) if found else 0) == expected


def test_the_peak_of_the_sum_is_below_the_sum_of_the_peaks() -> None:
    # Three sequences a third of the way apart: their caps sum to 3 x 600, their peak is less.
    running = [Holder(held=100 + g, most=700, steps_left=600 - g) for g in (0, 200, 400)]
    assert peak(running, block_size=1) == 699 + 499 + 299  # the step before the first ends
    assert peak(running, block_size=1) < 3 * 700


def test_shared_prefix_blocks_count_once_while_any_holder_is_alive() -> None:
    prefix = prefix_blocks(list(range(65)), 16)
    assert len(prefix) == 4
    lender = Holder(held=80, most=100, steps_left=20, prefix=prefix)
    borrower = Holder.flat(100, prefix, borrowed=4)
    # The borrower alone holds its 100 tokens (7 blocks), the lender's prefix once.
    assert peak([lender, borrower], block_size=16) == 7 * 16 + 7 * 16 - 4 * 16
    # Two that each computed their own copy (both in prefill at once) hold it twice.
    both = [Holder.flat(100, prefix), Holder.flat(100, prefix)]
    assert peak(both, block_size=16) == 2 * 7 * 16


def test_prefix_keys_follow_the_whole_prefix() -> None:
    a = prefix_blocks([1] * 16 + [2] * 16 + [3], 16)
    b = prefix_blocks([9] * 16 + [2] * 16 + [3], 16)
    assert a[1] != b[1]  # same block, different prefix before it
    assert prefix_blocks([1] * 33, 16, salt="m1") != prefix_blocks([1] * 33, 16, salt="m2")
    assert prefix_blocks([1] * 16, 16) == ()  # the last token's block is never shared


# --- the ledger against a lockstep engine --------------------------------------------------------


_PREFIXES = [list(range(1000, 1064)), list(range(2000, 2040))]


def _engine_places(draw: st.DrawFn) -> dict[str, int | None]:
    """The engine's running cap, and the one the ledger is told: the same, or none (then
    sequences the ledger admits past the engine's cap wait in its line, holding nothing)."""
    running = draw(st.one_of(st.none(), st.integers(1, 8)))
    told = draw(st.sampled_from(["same", "none"])) if running is not None else "none"
    return {"max_running": running, "ledger_running": running if told == "same" else None}


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 24))
    requests = []
    for i in range(n):
        group = draw(st.sampled_from([None, 0, 1]))
        suffix = [5000 + i * 100 + j for j in range(draw(st.integers(1, 60)))]
        prompt = (_PREFIXES[group] if group is not None else []) + suffix
        cap = draw(st.integers(1, 300))
        requests.append(
            {
                "arrival": draw(st.integers(0, 200)),
                "prompt": prompt,
                "cap": cap,
                # Most run to their caps: the peak is reached only by those that do.
                "length": draw(st.one_of(st.just(cap), st.just(cap), st.integers(1, cap))),
                # How late its counts reach the ledger, in steps (at most the workload's delay).
                "late": draw(st.floats(0, 1)),
                # Shared by the engine, unknown to the ledger (counted without token ids).
                "unkeyed": draw(st.integers(0, 5)) == 0,
            }
        )
    return {
        "requests": requests,
        "block": draw(st.sampled_from([1, 4, 16])),
        "kv": draw(st.integers(600, 2500)),
        "delay": draw(st.integers(0, 6)),
        "release_delay": draw(st.integers(0, 3)),
        "share": draw(st.booleans()),
        # Stretches of steps in which no count and no end reaches the ledger (the engine's API
        # process, or the relay, stalled) while it goes on admitting; afterwards each holder's
        # counts come back a few steps apart, the oldest last.
        "stalls": draw(st.lists(st.tuples(st.integers(0, 400), st.integers(1, 80)), max_size=3)),
        **_engine_places(draw),
    }


@st.composite
def tight_workloads(draw: st.DrawFn) -> dict[str, object]:
    """Budget-tight: every request's prompt + cap between a third of the pool and all of it,
    arrivals bunched, outputs to their caps or ending just before them, counts late by
    different amounts, and a small running cap with a waiting line behind it."""
    block = draw(st.sampled_from([1, 4, 16]))
    kv = draw(st.integers(150, 900))
    most = math.floor(kv * 0.9) // block * block  # the ledger's usable budget, whole blocks
    share = draw(st.booleans())
    requests = []
    for i in range(draw(st.integers(2, 10))):
        size = draw(st.integers(most // 3, most))
        shared = share and draw(st.booleans())
        head = _PREFIXES[0][: min(64, size // 2)] if shared else []
        prompt_len = max(len(head) + 1, draw(st.integers(1, max(1, size // 3))))
        prompt = head + [7000 + i * 1000 + j for j in range(prompt_len - len(head))]
        cap = max(1, size - len(prompt))
        requests.append(
            {
                "arrival": draw(st.integers(0, 3 * cap)),
                "prompt": prompt,
                "cap": cap,
                "length": draw(st.sampled_from([cap, cap, max(1, cap - 1), max(1, cap // 2)])),
                "late": draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
                "unkeyed": shared and draw(st.integers(0, 3)) == 0,
            }
        )
    return {
        "requests": requests,
        "block": block,
        "kv": kv,
        "delay": draw(st.integers(0, 8)),
        "release_delay": draw(st.integers(0, 2)),
        "share": share,
        "stalls": [],
        **_engine_places(draw),
    }


def _run(work: dict[str, object]) -> tuple[KVAdmissionController, LockstepEngine, int]:
    done = run(work)
    return done.ledger, done.engine, done.most_running


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_a_lockstep_engine_never_overflows_what_the_peak_admits(work: dict[str, object]) -> None:
    ledger, engine, _ = _run(work)
    assert engine.peak_used <= ledger.usable_tokens
    stats = ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.admitted_total == len(work["requests"])  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_workloads())
def test_nor_does_a_budget_tight_one(work: dict[str, object]) -> None:
    ledger, engine, _ = _run(work)
    assert engine.peak_used <= ledger.usable_tokens
    assert ledger.stats().reserved_tokens == 0


def test_the_peak_runs_more_sequences_than_the_caps() -> None:
    work = {
        "requests": [
            {"arrival": i * 40, "prompt": list(range(50)), "cap": 400, "length": 400}
            for i in range(12)
        ],
        "block": 16,
        "kv": 1500,
        "delay": 1,
        "share": False,
    }
    ledger, engine, running = _run(work)
    assert engine.peak_used <= ledger.usable_tokens
    # The caps (450 tokens each) allow 3 at once in 1,350 usable tokens; the peak admits a
    # fourth and fifth while the first are well on.
    assert running >= 4


def test_a_stalled_sequence_is_seen_and_the_ledger_runs_on_caps_until_drained() -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=2000, context_window=4000, decode_rate=100.0, rule="peak"
    )
    a = ledger.try_admit(50, 300, now=0.0)
    b = ledger.try_admit(50, 300, now=0.0)
    assert a is not None
    assert b is not None
    a.tracked = b.tracked = True
    for t in range(1, 40):
        ledger.progress(a, t, t * 0.01)
        if t < 10:
            ledger.progress(b, t, t * 0.01)  # b's count stops at 9 while a's goes on
    assert ledger.stalled(0.40, seconds=0.2) == [b]
    assert ledger.stats().rule == "peak"
    ledger.run_on_caps("a stream stalled while others advanced")
    assert ledger.stats().rule == "caps"
    assert ledger.caps_reason == "a stream stalled while others advanced"
    late = ledger.try_admit(50, 300, now=0.5)
    assert late is not None  # 3 x 352 fits 1,800 on caps too
    ledger.release(a, 0.6)
    assert ledger.stats().rule == "caps"  # b, live when it was seen, has not gone
    ledger.release(b, 0.7)
    assert ledger.stats().rule == "peak"  # drained: the late one was admitted on caps
    ledger.release(late, 0.8)


def test_a_holder_counts_its_whole_cap_until_its_first_token() -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=1000, context_window=4000, decode_rate=100.0, rule="peak",
        block_size=1, safety_fraction=1.0,
    )  # fmt: skip
    a = ledger.try_admit(100, 400, now=0.0)
    b = ledger.try_admit(100, 400, now=0.0)
    assert a is not None
    assert b is not None
    a.tracked = b.tracked = True
    assert ledger.try_admit(100, 100, now=0.0) is None  # 500 + 500 + 200: nothing made yet
    ledger.progress(a, 300, 3.0)
    assert ledger.try_admit(100, 100, now=3.0) is None  # b has not started: still 500
    ledger.progress(b, 1, 3.0)
    # a holds 400 + the relay's margin (2 x 100 tokens/s x 0.25 s = 50) and holds 500 through
    # the step that makes its last token (step 100), b 101 + 50: at worst 500 + 251, then b's
    # 500 alone; the newcomer counts whole (200) until its own first token.
    c = ledger.try_admit(100, 100, now=3.0)
    assert c is not None
    assert ledger.stats().committed_tokens == 951


@pytest.mark.parametrize("rule", ["caps", "peak"])
def test_retry_after_is_when_the_peak_leaves_room(rule: str) -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=2000, context_window=4000, decode_rate=100.0, rule=rule,  # type: ignore[arg-type]
        block_size=1, safety_fraction=1.0,
    )  # fmt: skip
    a = ledger.try_admit(100, 800, now=0.0)
    b = ledger.try_admit(100, 800, now=0.0)
    assert a is not None
    assert b is not None
    a.tracked = b.tracked = True
    ledger.progress(a, 700, 7.0)  # 100 steps left: 1 s at 100 tokens/s
    ledger.progress(b, 100, 7.0)  # 700 steps left
    small, large = ledger.retry_after(400, 7.0), ledger.retry_after(1000, 7.0)
    if rule == "caps":
        assert small == pytest.approx(1.0, abs=0.1)  # 1,800 + 400: once a has gone
    else:
        assert small == 0.0  # at worst 900 + 349 + 400 (a's last step): fits now
    # 1,000 more fits once a has gone under either rule (900 + 1,000).
    assert large == pytest.approx(1.0, abs=0.1)


def _two_holders(
    counts: tuple[int, int], at: float, **settings: float
) -> tuple[KVAdmissionController, Handle, Handle]:
    """A 1,000-token ledger (blocks of 1) holding two requests of 100 + 400, followed, with
    ``counts`` relayed at ``at``."""
    ledger = KVAdmissionController(
        total_kv_tokens=1000, context_window=4000, decode_rate=100.0, rule="peak",
        block_size=1, safety_fraction=1.0, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    a = ledger.try_admit(100, 400, now=0.0)
    b = ledger.try_admit(100, 400, now=0.0)
    assert a is not None
    assert b is not None
    a.tracked = b.tracked = True
    ledger.progress(a, counts[0], at)
    ledger.progress(b, counts[1], at)
    return ledger, a, b


def test_a_holder_whose_count_is_late_is_taken_to_have_gone_on() -> None:
    ledger, a, _ = _two_holders((100, 100), 1.0)
    ledger.progress(a, 300, 3.0)  # b's stream has not been read since: it may be at 300 too
    # Taken at its count, b would hold 200 and peak at 499 when a ends (step 99): 799, room
    # for 200 more. In lockstep it may hold 400 now and 499 then: 999 with a's 500.
    assert ledger.try_admit(100, 100, now=3.0) is None


def test_counts_that_are_all_equally_late_need_no_margin() -> None:
    # Two holders last read together 2 s ago (the engine's API process stalled, say): in
    # lockstep both are as far on as each other, the future computed from their counts is the
    # real one shifted, and its peak covers it. One read since, the other is taken on.
    # a ends in 100 steps at 500, b then holds 300: room for 200 on the step before.
    ledger, _, _ = _two_holders((300, 100), 1.0, relay_lag=0.0)
    assert ledger.try_admit(100, 100, now=3.0) is not None
    ledger, a, _ = _two_holders((300, 100), 1.0, relay_lag=0.0)
    ledger.progress(a, 301, 3.0)  # b not read for 2 s since: up to 400 more steps
    assert ledger.try_admit(100, 100, now=3.0) is None


def _sharing_ledger() -> KVAdmissionController:
    ledger = KVAdmissionController(
        total_kv_tokens=4000, context_window=4000, decode_rate=100.0, rule="peak",
        block_size=16, safety_fraction=1.0,
    )  # fmt: skip
    ledger.shares_prefixes = True
    return ledger


def test_only_a_holder_past_its_prefill_lends_its_prefix_blocks() -> None:
    ledger = _sharing_ledger()
    prefix = prefix_blocks(list(range(200)), 16)
    first = ledger.try_admit(200, 100, now=0.0, prefix=prefix, follow=True)
    assert first is not None
    # Its prefix is still being computed: the newcomer is sent at once, with a copy of its own.
    second = ledger.try_admit(200, 100, now=0.0, prefix=prefix, follow=True)
    assert second is not None
    assert second.borrowed == 0
    ledger.progress(first, 1, 0.1)
    third = ledger.try_admit(200, 100, now=0.1, prefix=prefix)
    assert third is not None
    assert third.borrowed == len(prefix) == 12


def test_a_freed_copy_of_a_duplicated_block_costs_its_borrower_a_copy() -> None:
    """Two holders computed the same prefix at once (the second admitted during the first's
    prefill); one goes (its copy stays cached, freed); a newcomer that borrows from the other
    may be handed the freed copy: two copies again."""
    ledger = _sharing_ledger()
    prefix = prefix_blocks(list(range(65)), 16)  # 4 blocks
    first = ledger.try_admit(65, 10, now=0.0, prefix=prefix, follow=True)
    twin = ledger.try_admit(65, 10, now=0.0, prefix=prefix, follow=True)
    assert first is not None
    assert twin is not None
    assert twin.borrowed == 0
    # 75 tokens each in 5 blocks, the 4 of the prefix counted twice (each computed its own).
    assert ledger.stats().committed_tokens == 10 * 16
    ledger.progress(first, 1, 0.1)
    ledger.progress(twin, 1, 0.1)
    ledger.release(first, 0.2)
    borrower = ledger.try_admit(65, 10, now=0.2, prefix=prefix)
    assert borrower is not None
    assert borrower.borrowed == 4
    # twin: 80 tokens in 5 blocks; the borrower flat at 80 (5 blocks): 10 blocks, its
    # borrowed 4 counted again as the freed copy it may be handed.
    assert ledger.stats().committed_tokens == 10 * 16
    ledger.release(twin, 0.3)
    ledger.release(borrower, 0.3)
    later = ledger.try_admit(65, 10, now=0.4, prefix=prefix)
    assert later is not None
    assert ledger.stats().committed_tokens == 5 * 16  # nobody holds it: forgotten


@pytest.mark.parametrize("overlap", [True, False])
def test_a_holder_without_prefix_keys_may_leave_a_freed_copy_too(overlap: bool) -> None:
    """A holder whose prompt the ledger has no keys of (several sequences, a non-text part,
    no token ids) computes its blocks in the engine all the same: a keyed holder in prefill at
    the same time computes a copy of its own, and once the unkeyed one goes its freed copy may
    be handed to the next borrower. One that started after its first token borrowed from it
    instead (the engine shares it): nothing is freed."""
    ledger = _sharing_ledger()
    prefix = prefix_blocks(list(range(65)), 16)
    unkeyed = ledger.try_admit(65, 10, now=0.0, follow=True)
    assert unkeyed is not None
    assert unkeyed.unkeyed
    if not overlap:
        ledger.progress(unkeyed, 1, 0.05)
    keyed = ledger.try_admit(65, 10, now=0.1, prefix=prefix, follow=True)
    assert keyed is not None
    if overlap:
        ledger.progress(unkeyed, 1, 0.15)
    ledger.progress(keyed, 1, 0.2)
    ledger.release(unkeyed, 0.3)
    borrower = ledger.try_admit(65, 10, now=0.3, prefix=prefix)
    assert borrower is not None
    assert borrower.borrowed == 4
    extra = 4 * 16 if overlap else 0
    assert ledger.stats().committed_tokens == 80 + 16 + extra


def test_a_short_prompt_or_an_engine_that_shares_nothing_is_not_unkeyed() -> None:
    ledger = _sharing_ledger()
    short = ledger.try_admit(16, 10, now=0.0)  # no full block before its last token
    assert short is not None
    assert not short.unkeyed
    ledger.shares_prefixes = False
    alone = ledger.try_admit(65, 10, now=0.0)
    assert alone is not None
    assert not alone.unkeyed


# --- a slow reader -----------------------------------------------------------------------------


def _slow_reader_ledger() -> tuple[KVAdmissionController, Handle, Handle]:
    """Two followed holders of 100 + 400 in 1,000 tokens (blocks of 1), both at 100 tokens at
    1 s; ``b``'s next write waits 2 s on its client."""
    ledger, a, b = _two_holders((100, 100), 1.0, relay_lag=0.05)
    ledger.writing(b, 1.0)
    for t in range(1, 201):  # a's stream goes on, one token a step
        ledger.progress(a, 100 + t, 1.0 + t * 0.01)
    ledger.written(b, 3.0)
    return ledger, a, b


def test_a_slow_reader_is_not_a_stalled_engine() -> None:
    ledger, a, b = _slow_reader_ledger()
    ledger.writing(b, 3.0)  # and waits again
    assert ledger.stalled(3.0, seconds=0.5) == []  # b's count stood still: nobody read it
    assert ledger.stats().slow_readers == 1
    assert a.seen_at == 3.0  # while a's count moved


def test_a_slow_reader_is_counted_as_advancing_at_the_engines_speed() -> None:
    """Its relay read nothing for 2 s: the engine, which does not wait for the client, made up
    to 200 more of b's tokens. The count it relays next (the engine's buffered past) is no
    measure of where it is: counted from its count before the wait at the engine's speed, b
    holds its whole 500 (100 + 200 at twice 100 tokens/s, past its cap), and a newcomer that
    fits beside b's stale count does not."""
    ledger, _, b = _slow_reader_ledger()
    ledger.progress(b, 120, 3.0)  # stale: made long ago, read only now
    # Believed, b would hold 100 + 120 + a margin of 10 and end in 281 steps; a ends in 100.
    assert ledger.try_admit(100, 100, now=3.0) is None
    stats = ledger.stats()
    assert stats.committed_tokens == 500 + 500


def test_a_write_that_waits_within_the_margin_is_no_slow_reader() -> None:
    ledger, _, b = _two_holders((100, 100), 1.0, relay_lag=0.25)
    ledger.writing(b, 1.0)
    ledger.written(b, 1.1)  # under half the relay's lag
    assert ledger.stats().slow_readers == 0
