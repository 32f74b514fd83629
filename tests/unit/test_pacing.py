"""Pacing from the server's advertised room: the Pacer rule, the hold step, and the server's side
(the ledger's headroom, the RateLimit fields it builds); the header syntax: test_headers.py."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient import APIStatusError, RetryPolicy, ServerBusyError
from kvclient._pacing import (
    PACE_LAG,
    PACE_LAG_MAX,
    PACE_POLL,
    PACE_POLL_FIRST,
    PACE_TRICKLE,
    PACE_WAITER_TTL,
    Cooldown,
    Pacer,
)
from kvclient._retry import RetryCall
from kvclient.headers import RoomHint, format_ratelimit, parse_ratelimit
from kvclient.testing import FakeClock
from reference_server.admission.ledger import Headroom, KVAdmissionController
from reference_server.http.answers import ratelimit_headers

# --- the pacing rule --------------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.floats(0, 0.5), st.integers(0, 5000), st.integers(0, 3)),
        st.tuples(st.just("take"), st.floats(0, 0.5), st.integers(1, 6000), st.just(0)),
    ),
    max_size=60,
)


@given(_ops, st.floats(0.1, 2.0), st.sampled_from([0.0, 0.05, 0.3]))
def test_a_live_hint_is_never_oversubscribed(
    ops: list[tuple[str, float, int, int]], age: float, lag: float
) -> None:
    """While a hint is live, what the pacer lets go since it arrived fits in what it advertised
    (bar requests larger than the whole budget, which go to be refused for good, and may
    leave it oversubscribed); a hold is
    short, positive and never outlasts the hint; with no live hint, everything goes. Sends
    less than ``lag`` before a hint count against it too."""
    pacer = Pacer(max_age=age, lag=lag)
    sends: list[tuple[float, int]] = []
    now = 0.0
    hint: RoomHint | None = None
    seen = expires = 0.0
    trickle = -1.0
    granted = 0
    quota = 4000
    for op, step, amount, reset in ops:
        now += step
        if op == "observe":
            hint = RoomHint(quota=quota, remaining=amount, reset=reset)
            pacer.observe(now, hint)
            seen = now
            granted = sum(a for t, a in sends if lag > 0 and t >= now - lag)
            expires = seen + (min(age, reset + lag) if reset else age)
            continue
        wait = pacer.take(now, amount)
        if wait == 0.0:
            sends.append((now, amount))
        if hint is None or amount > quota:
            assert wait == 0.0
            granted += amount
            continue
        if now >= expires:  # aged out: one request per PACE_TRICKLE, until forgotten
            if now >= trickle or now >= expires + 10 * age:
                assert wait == 0.0
                trickle = now + PACE_TRICKLE
                granted += amount
            else:
                assert 0 < wait <= PACE_POLL
            continue
        assert hint is not None
        if wait == 0.0:
            assert granted + amount <= hint.remaining
            granted += amount
        else:
            assert 0 < wait <= PACE_POLL
            assert now + wait <= expires + 1e-9
            assert granted + amount > hint.remaining


def test_an_answer_settles_its_own_send_but_not_the_others() -> None:
    pacer = Pacer(lag=1.0)
    pacer.observe(0.0, RoomHint(quota=1000, remaining=1000, reset=None))
    assert pacer.take(0.1, 400) == 0.0
    assert pacer.take(0.1, 300) == 0.0
    # The answer to the 400 (a 429, say) says 500 free: the 300 sent just before may not be in
    # it yet, the 400 is.
    pacer.observe(0.15, RoomHint(quota=1000, remaining=500, reset=None), own=(0.1, 400))
    assert pacer.take(0.2, 250) > 0
    assert pacer.take(0.2, 200) == 0.0


def test_an_aged_out_hint_lets_requests_trickle_then_is_forgotten() -> None:
    pacer = Pacer(max_age=1.0)
    pacer.observe(0.0, RoomHint(quota=1000, remaining=0, reset=None))
    assert pacer.take(0.5, 100) > 0  # live, no room
    assert pacer.take(1.0, 100) == 0.0  # aged out: one goes (its answer brings a fresh hint)
    assert pacer.take(1.01, 100) > 0  # not a herd
    assert pacer.take(1.0 + PACE_TRICKLE, 100) == 0.0
    assert [pacer.take(11.0, 100) for _ in range(3)] == [0.0, 0.0, 0.0]  # forgotten


def test_a_server_that_queues_is_sent_to_at_once() -> None:
    """``kvqueue``: what does not fit waits in the server's FIFO line; holding it here would
    only lose its place there."""
    policy, current = format_ratelimit(quota=1000, remaining=0, reset=2.0, queues=True)
    assert policy == '"kv";q=1000;kvtok;kvqueue'
    hint = parse_ratelimit({"RateLimit-Policy": policy, "RateLimit": current})
    assert hint == RoomHint(quota=1000, remaining=0, reset=2.0, queues=True)
    assert parse_ratelimit({"RateLimit-Policy": '"kv";q=9;kvtok', "RateLimit": current}) == (
        RoomHint(quota=9, remaining=0, reset=2.0)
    )
    pacer = Pacer(max_age=1.0)
    pacer.observe(0.0, hint)
    assert [pacer.take(0.1, 400) for _ in range(5)] == [0.0] * 5  # no room: sent all the same
    assert pacer.take(0.2, 400, key=(0.0, 1)) == 0.0  # a call in order too
    pacer.observe(0.3, RoomHint(quota=1000, remaining=0, reset=2.0))  # it stopped queueing
    assert pacer.take(0.4, 400) > 0


def test_a_late_older_answer_does_not_replace_a_newer_one() -> None:
    pacer = Pacer()
    pacer.observe(5.0, RoomHint(quota=100, remaining=10, reset=0))
    pacer.observe(4.0, RoomHint(quota=100, remaining=90, reset=0))
    assert pacer.take(5.1, 50) > 0


def test_max_age_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_age"):
        Pacer(max_age=0)


# --- the hold step (RetryCall) ----------------------------------------------------------------


def _call(pacer: Pacer, clock: FakeClock, *, size: int | None = 600, **policy: object) -> RetryCall:
    retry = RetryPolicy(clock=clock.monotonic, **policy)  # type: ignore[arg-type]
    return RetryCall(retry, Cooldown(), size=size, pacer=pacer)


def test_a_request_that_would_not_fit_is_held_until_room_is_advertised() -> None:
    clock = FakeClock()
    pacer = Pacer()
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=1200, reset=2))
    first, second = _call(pacer, clock), _call(pacer, clock)
    assert first.hold_time() == 0.0
    assert second.hold_time() == PACE_POLL  # 608 + 608 > 1200: counted in whole 16-token blocks
    clock.advance(0.3)  # past the lag: the first send reached the server before the hint
    pacer.observe(
        clock.monotonic(), RoomHint(quota=4000, remaining=700, reset=2)
    )  # an answer came back
    assert second.hold_time() == 0.0


def test_room_advertised_since_a_429_beats_its_cooldown() -> None:
    clock = FakeClock()
    pacer = Pacer()
    cooldown = Cooldown()
    cooldown.extend(clock.monotonic(), 2.0)  # a 429 said: come back in 2 s
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=700, reset=2))
    policy = RetryPolicy(clock=clock.monotonic)
    fits = RetryCall(policy, cooldown, size=600, pacer=pacer)
    assert fits.hold_time() == 0.0  # 608 fit in the 700 free
    too_big = RetryCall(policy, cooldown, size=600, pacer=pacer)
    # 608 more do not: it holds, in short polls (a fresher answer may show room before the
    # cooldown, the server's upper bound, runs out).
    assert too_big.hold_time() == PACE_POLL
    clock.advance(0.3)
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=700, reset=2))
    assert too_big.hold_time() == 0.0  # an answer showed room: it goes before the 2 s
    unpaced = RetryCall(RetryPolicy(clock=clock.monotonic, pace=False), cooldown, size=1)
    assert unpaced.hold_time() >= 1.7  # the rest of its cooldown


def test_pacing_off_probes_and_the_deadline_never_hold() -> None:
    clock = FakeClock()
    pacer = Pacer()
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=0, reset=0))
    assert _call(pacer, clock, pace=False).hold_time() == 0.0
    assert _call(pacer, clock, size=None).hold_time() == 0.0  # GET /v1/models and the like
    near = _call(pacer, clock, deadline=0.5)
    clock.advance(0.49)
    assert near.hold_time() == 0.0  # holding would reach the deadline: the server decides
    assert _call(pacer, clock).hold_time() > 0  # and what went anyway was counted


def test_a_server_without_hints_is_paced_as_before() -> None:
    clock = FakeClock()
    call = _call(Pacer(), clock)
    assert call.hold_time() == 0.0
    assert call.hold_rounds() == range(1000 + round(120.0 / PACE_POLL_FIRST))


# --- the server's side ------------------------------------------------------------------------


def test_headroom_counts_what_is_reserved_releasing_and_queued() -> None:
    ledger = KVAdmissionController(total_kv_tokens=1000, context_window=512, decode_rate=100.0)
    assert ledger.headroom(0.0) == Headroom(usable=900, free=900, next_release_in=0.0)
    a = ledger.try_admit(100, 200, now=0.0)  # 304 tokens, due at 2.0
    b = ledger.try_admit(100, 100, now=0.0)  # 208 tokens, due at 1.0
    assert a is not None
    assert b is not None
    assert ledger.headroom(0.25) == Headroom(usable=900, free=388, next_release_in=0.75)
    assert ledger.headroom(0.25, releasing=b) == Headroom(
        usable=900, free=596, next_release_in=1.75
    )
    assert ledger.headroom(0.25, queued=500).free == 0


def test_headroom_is_zero_at_the_concurrency_cap_and_unadvertised_for_other_strategies() -> None:
    capped = KVAdmissionController(
        total_kv_tokens=1000, context_window=512, decode_rate=100.0, max_concurrency=1
    )
    capped.try_admit(10, 10, now=0.0)
    assert capped.headroom(0.0).free == 0
    for strategy in ("prompt", "concurrency"):
        other = KVAdmissionController(
            total_kv_tokens=1000,
            context_window=512,
            decode_rate=100.0,
            strategy=strategy,  # type: ignore[arg-type]
        )
        assert ratelimit_headers(other.headroom(0.0)) == {}


def test_ratelimit_headers_from_a_snapshot() -> None:
    headers = ratelimit_headers(Headroom(usable=900, free=388, next_release_in=0.75))
    assert headers == {
        "RateLimit-Policy": '"kv";q=900;kvtok',
        "RateLimit": '"kv";r=388;t=1;tms=750',
    }
    queued = ratelimit_headers(Headroom(usable=900, free=0, next_release_in=0.75), queues=True)
    assert queued["RateLimit-Policy"] == '"kv";q=900;kvtok;kvqueue'


# --- the queue of held requests, the measured lag, the paced retry ----------------------------


def test_held_requests_go_in_key_order_whatever_their_size() -> None:
    pacer = Pacer()
    pacer.observe(0.0, RoomHint(quota=4000, remaining=500, reset=None))
    assert pacer.take(0.01, 1000, key=(0.0, 1)) > 0  # does not fit: first in line
    # A later, smaller one would fit, but waits behind it (no starving the large one).
    assert pacer.take(0.02, 100, key=(0.01, 2)) > 0
    assert pacer.take_if_fits(0.02, 100, key=(0.01, 2)) is False
    assert pacer.take(0.02, 100) == 0.0  # a request without a key is not queued
    pacer.observe(0.5, RoomHint(quota=4000, remaining=1200, reset=None))
    assert pacer.take(0.51, 100, key=(0.01, 2)) > 0  # still behind the first
    assert pacer.take(0.51, 1000, key=(0.0, 1)) == 0.0  # the first goes
    assert pacer.take(0.52, 100, key=(0.01, 2)) == 0.0  # then the next
    assert pacer.waiting(0.52) == 0


def test_a_held_request_that_stops_asking_loses_its_place() -> None:
    pacer = Pacer()
    pacer.observe(0.0, RoomHint(quota=4000, remaining=0, reset=None))
    assert pacer.take(0.0, 1000, key=(0.0, 1)) > 0
    assert pacer.take(0.1, 100, key=(0.1, 2)) > 0  # behind it
    pacer.observe(0.2, RoomHint(quota=4000, remaining=300, reset=None))
    # The first was cancelled and never asks again: after PACE_WAITER_TTL the next goes.
    assert pacer.take(0.2 + PACE_WAITER_TTL / 2, 100, key=(0.1, 2)) > 0
    assert pacer.take(0.1 + PACE_WAITER_TTL + 0.05, 100, key=(0.1, 2)) == 0.0
    # One that gives up says so, and the next need not wait for the TTL.
    pacer.enqueue(2.0, (1.0, 3))
    pacer.leave((1.0, 3))
    assert pacer.take(2.0, 100, key=(1.5, 4)) == 0.0


@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(1, 900)), min_size=1, max_size=30),
    st.lists(st.integers(0, 3000), min_size=1, max_size=30),
)
def test_no_request_goes_before_an_earlier_held_one(
    calls: list[tuple[int, int]], rooms: list[int]
) -> None:
    """Whatever the sizes and the room advertised, a keyed request goes only when every request
    with a smaller key that was held (and keeps asking) has gone."""
    pacer = Pacer(lag=0.0)
    keys = [(float(start), i) for i, (start, _) in enumerate(calls)]
    needs = dict(zip(keys, (need for _, need in calls), strict=True))
    held: set[tuple[float, int]] = set()
    gone: list[tuple[float, int]] = []
    now = 0.0
    for room in rooms:
        now += 0.01
        pacer.observe(now, RoomHint(quota=4000, remaining=room, reset=None))
        for key in sorted(set(keys) - set(gone)):
            if pacer.take(now, needs[key], key=key) == 0.0:
                assert all(other in gone for other in held if other < key)
                gone.append(key)
                held.discard(key)
            else:
                held.add(key)


def test_refusals_that_come_back_slowly_lengthen_the_lag() -> None:
    pacer = Pacer(lag=0.1)
    assert pacer.effective_lag() == 0.1
    hint = RoomHint(quota=4000, remaining=0, reset=None)
    for i in range(5):  # 429s answered in 5 ms: a fast server, the default stands
        pacer.observe(i + 0.005, hint, own=(float(i), 16), refused=True)
    assert pacer.effective_lag() == 0.1
    for i in range(10):  # then in 150 ms: 3 x the median + 10 ms, at most PACE_LAG_MAX
        pacer.observe(10 + i + 0.15, hint, own=(10.0 + i, 16), refused=True)
    assert pacer.effective_lag() == pytest.approx(0.46)
    pacer.observe(30.0, hint, own=(29.0, 16), refused=True)  # a 1 s outlier
    assert pacer.effective_lag() <= PACE_LAG_MAX
    pacer.observe(31.0, hint, own=(30.9, 16))  # not a refusal: says nothing of the way in
    assert len(pacer._rtts) == 16  # the last 16 refusals: 5 + 10 + 1


def test_a_paced_429_waits_for_room_not_for_its_retry_after() -> None:
    """Our server's Retry-After is the worst case; while answers show the room, a refused
    request holds in its place and goes as soon as one shows room for it."""
    clock = FakeClock()
    pacer = Pacer()
    cooldown = Cooldown()
    policy = RetryPolicy(clock=clock.monotonic, deadline=10.0, pace_in_order=True)
    call = RetryCall(policy, cooldown, size=600, pacer=pacer)
    assert call.hold_time() == 0.0  # nothing known yet: it goes
    call.begin_attempt()
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=100, reset=8))
    busy = _busy(retry_after=8.0)
    decision = call.decide(busy)
    assert decision.retry
    assert decision.give_up is None
    assert decision.wait == 0.0  # no sleep: the hold decides
    assert call.hold_time() == PACE_POLL_FIRST  # held, polling, first in line
    clock.advance(1.0)
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=700, reset=7))
    assert call.hold_time() == 0.0  # room shown at 1 s, not 8 s
    # Refused again: now it backs off first (at least backoff_min), and still holds its place.
    call.begin_attempt()
    again = call.decide(_busy(retry_after=7.0))
    assert again.retry
    assert again.wait >= RetryPolicy().backoff_min


def test_paced_or_not_advice_past_the_deadline_fails_at_once() -> None:
    clock = FakeClock()
    for pace in (True, False):
        pacer = Pacer()
        policy = RetryPolicy(clock=clock.monotonic, deadline=2.0, pace=pace)
        call = RetryCall(policy, Cooldown(), size=600, pacer=pacer)
        call.begin_attempt()
        pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=0, reset=30))
        decision = call.decide(_busy(retry_after=30.0))  # the worst case is past the deadline
        assert isinstance(decision.give_up, ServerBusyError)


def test_a_paced_hold_stops_at_the_advised_time() -> None:
    clock = FakeClock()
    pacer = Pacer()
    call = RetryCall(RetryPolicy(clock=clock.monotonic), Cooldown(), size=600, pacer=pacer)
    call.begin_attempt()
    # No room; a release due in 0.3 s (the hint ages out 0.4 s from now, as no answer comes).
    pacer.observe(clock.monotonic(), RoomHint(quota=4000, remaining=0, reset=0.3))
    assert call.decide(_busy(retry_after=0.5)).wait == 0.0
    waited = 0.0
    for _ in range(1000):
        wait = call.hold_time()
        if wait == 0.0:
            break
        assert 0 < wait <= PACE_POLL
        clock.advance(wait)
        waited += wait
    assert 0.5 <= waited <= 0.5 + PACE_POLL  # no answer showed room: the advice, not more


def _busy(*, retry_after: float) -> APIStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    response = httpx.Response(429, request=request)
    return APIStatusError(
        "KV cache budget exhausted",
        response=response,
        retry_after=retry_after,
        retryable=True,
    )


def test_a_hint_that_proved_right_is_trusted_longer_and_one_that_proved_stale_less() -> None:
    pacer = Pacer(max_age=1.0)
    full = RoomHint(quota=1000, remaining=0, reset=None)
    pacer.observe(0.0, full)
    assert pacer.take(0.5, 100) > 0  # held: no room
    assert pacer.take(1.0, 100) == 0.0  # aged out: one goes to see
    pacer.observe(1.01, full, (1.0, 100), refused=True)  # and the room had not come back
    assert pacer.take(2.5, 100) > 0  # so the next hint is trusted for 2 s, not 1
    assert pacer.take(3.01, 100) == 0.0
    pacer.observe(3.02, full, (3.01, 100), refused=True)
    assert pacer.take(6.5, 100) > 0  # 4 s
    assert pacer.take(7.02, 100) == 0.0
    pacer.observe(7.03, RoomHint(quota=1000, remaining=900, reset=None), (7.02, 100))
    pacer.observe(7.05, full)  # admitted: room had come back unseen, trust is back to 1 s
    assert pacer.take(8.06, 100) == 0.0
    # However long it has grown (here to 8 s), never past the hint's own next release.
    t = 8.06
    pacer.observe(t + 0.01, full, (t, 100), refused=True)
    for _ in range(4):
        t += 0.01
        while pacer.take(t, 100) > 0:
            t += 0.05
        pacer.observe(t + 0.01, full, (t, 100), refused=True)
    assert pacer.take(t + 7.5, 100) > 0
    pacer.observe(60.0, RoomHint(quota=1000, remaining=0, reset=0.5))
    assert pacer.take(60.4, 100) > 0
    assert pacer.take(60.7, 100) == 0.0  # 0.5 s + the lag


def test_a_hint_whose_reserved_room_is_all_ours_is_trusted_until_our_answers_come() -> None:
    # Room comes back only as our own requests end, and each of their answers brings a fresh
    # hint: a probe could only be refused. With room held by others, it ages out as before.
    full = RoomHint(quota=1000, remaining=100, reset=None)
    ours = Pacer(max_age=1.0)
    ours.observe(0.0, full, ours=900)
    assert ours.take(1.5, 200) > 0
    assert ours.take(7.9, 200) > 0  # PACE_TRUST_MAX_FACTOR x max_age
    assert ours.take(8.0, 200) == 0.0
    shared = Pacer(max_age=1.0)
    shared.observe(0.0, full, ours=800)  # someone else holds 100: it may end unseen
    assert shared.take(0.5, 200) > 0
    assert shared.take(1.0, 200) == 0.0
    unknown = Pacer(max_age=1.0)
    unknown.observe(0.0, full)
    assert unknown.take(1.0, 200) == 0.0
    # Never past the hint's own next release: one of ours ends then, or its answer is late.
    due = Pacer(max_age=1.0)
    due.observe(0.0, RoomHint(quota=1000, remaining=100, reset=3.0), ours=900)
    assert due.take(2.5, 200) > 0
    assert due.take(3.0 + PACE_LAG + 0.01, 200) == 0.0


def test_one_of_ours_ending_unseen_ends_the_longer_trust() -> None:
    # A stream's end (or a failure) gives its room back with no answer to show it.
    pacer = Pacer(max_age=1.0)
    pacer.observe(0.0, RoomHint(quota=1000, remaining=100, reset=None), ours=900)
    assert pacer.take(1.5, 200) > 0
    pacer.released_unseen()
    assert pacer.take(1.5, 200) == 0.0  # aged out as any hint would have: one goes to see
