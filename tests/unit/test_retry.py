"""The pure retry logic: waits, the policy, budget, cooldown, give-up decisions (Retry-After
parsing: test_headers.py)."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient import RetryBudget, RetryPolicy, ServerBusyError
from kvclient._exceptions import APIConnectionError, RateLimitError
from kvclient._pacing import Cooldown
from kvclient._policy import backoff_wait, server_wait
from kvclient._retry import RetryCall
from kvclient.testing import FakeClock

# --- waits -----------------------------------------------------------------------------------


@settings(deadline=None)
@given(
    advice=st.floats(0, 1e6, allow_nan=False),
    draw=st.floats(0, 1, exclude_max=True),
    max_wait=st.floats(0.001, 1e6),
    ratio=st.floats(0, 2),
    absolute=st.floats(0, 10),
)
def test_server_wait_is_never_below_advice_nor_above_cap(
    advice: float, draw: float, max_wait: float, ratio: float, absolute: float
) -> None:
    policy = RetryPolicy(
        max_wait=max_wait, jitter_ratio=ratio, jitter_absolute=absolute, random=lambda: draw
    )
    if advice > max_wait:
        return  # the client gives up instead of waiting; see test_advice_over_cap_gives_up
    wait = server_wait(policy, advice)
    assert advice <= wait <= max_wait


def test_jitter_is_only_above_the_server_number() -> None:
    low = server_wait(RetryPolicy(random=lambda: 0.0), 2.0)
    high = server_wait(RetryPolicy(random=lambda: 0.999999), 2.0)
    assert low == 2.0
    assert 2.0 < high <= 2.0 + 0.1 * 2.0 + 0.1
    # Different draws spread clients told the same number.
    assert len({server_wait(RetryPolicy(), 2.0) for _ in range(20)}) > 1


@settings(deadline=None)
@given(attempt=st.integers(1, 10_000), draw=st.floats(0, 1, exclude_max=True))
def test_backoff_is_full_jitter_within_bounds(attempt: int, draw: float) -> None:
    policy = RetryPolicy(random=lambda: draw)
    wait = backoff_wait(policy, attempt)
    ceiling = min(policy.backoff_max, policy.backoff_initial * 2 ** min(attempt - 1, 64))
    assert policy.backoff_min <= wait <= ceiling


def test_backoff_grows_exponentially_up_to_max() -> None:
    policy = RetryPolicy(
        random=lambda: 1.0, backoff_initial=0.5, backoff_multiplier=2, backoff_max=10
    )
    assert [backoff_wait(policy, n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts": 0},
        {"max_attempts": True},
        {"deadline": 0},
        {"max_wait": -1},
        {"max_wait": float("nan")},
        {"backoff_multiplier": 0.5},
        {"jitter_ratio": -0.1},
        {"jitter_absolute": float("inf")},
    ],
)
def test_policy_rejects_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_policy_defaults_are_named_constants() -> None:
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.deadline, policy.max_wait) == (6, 120.0, 60.0)
    assert (policy.backoff_initial, policy.backoff_multiplier, policy.backoff_max) == (0.5, 2, 10)
    with pytest.raises(AttributeError):
        policy.max_attempts = 3  # type: ignore[misc]


# --- retry budget and cooldown ---------------------------------------------------------------


def test_retry_budget_spends_on_failures_and_earns_on_successes() -> None:
    budget = RetryBudget(max_tokens=4, token_ratio=0.5)
    assert budget.allows_retry()
    budget.record_failure()  # 3 > 2
    assert budget.allows_retry()
    budget.record_failure()  # 2, not > 2
    assert not budget.allows_retry()
    budget.record_success()  # 2.5
    assert budget.allows_retry()
    for _ in range(100):
        budget.record_success()
    assert budget.tokens == 4
    for _ in range(100):
        budget.record_failure()
    assert budget.tokens == 0


def test_retry_budget_is_thread_safe() -> None:
    budget = RetryBudget(max_tokens=100_000, token_ratio=1)

    def spend() -> None:
        for _ in range(1000):
            budget.record_failure()

    threads = [threading.Thread(target=spend) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert budget.tokens == 100_000 - 8000


def test_retry_budget_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        RetryBudget(max_tokens=0)
    with pytest.raises(ValueError, match="token_ratio"):
        RetryBudget(token_ratio=0)


def test_cooldown_keeps_the_latest_not_before() -> None:
    cooldown = Cooldown()
    assert cooldown.remaining(0) == 0
    cooldown.extend(10.0, 5.0)
    cooldown.extend(11.0, 1.0)  # ends earlier: ignored
    assert cooldown.remaining(12.0) == pytest.approx(3.0)
    assert cooldown.advice == 5.0
    assert cooldown.remaining(20.0) == 0


def test_cooldown_holds_requests_at_least_as_large_as_the_refused_one() -> None:
    cooldown = Cooldown()
    cooldown.extend(0.0, 5.0, size=4000)  # 4,000 tokens do not fit before t=5
    assert cooldown.remaining(1.0, 4000) == pytest.approx(4.0)
    assert cooldown.remaining(1.0, 8000) == pytest.approx(4.0)
    assert cooldown.remaining(1.0, 300) == 0  # a smaller request may fit in what is left
    assert cooldown.remaining(1.0) == pytest.approx(4.0)  # unknown size: held
    cooldown.extend(1.0, 2.0, size=300)  # then 300 did not fit either, until t=3
    assert cooldown.remaining(2.0, 300) == pytest.approx(1.0)
    assert cooldown.remaining(2.0, 5000) == pytest.approx(3.0)  # the later time still holds
    assert cooldown.remaining(2.0, 100) == 0
    cooldown.extend(2.0, 10.0)  # a refusal of unknown size (GET /v1/models) holds every size
    assert cooldown.remaining(3.0, 1) == pytest.approx(9.0)
    assert cooldown.remaining(3.0) == pytest.approx(9.0)


@given(
    st.lists(
        st.tuples(
            st.floats(0, 2),  # time step
            st.floats(0.01, 10),  # advice
            st.one_of(st.none(), st.integers(1, 10_000)),  # size
        ),
        max_size=40,
    ),
    st.lists(st.one_of(st.none(), st.integers(1, 10_000)), min_size=1, max_size=5),
)
def test_cooldown_matches_the_rule_it_states(
    refusals: list[tuple[float, float, int | None]], probes: list[int | None]
) -> None:
    """Whatever refusals came, a request waits for the latest of those no larger than itself
    (a refusal of unknown size counts as the smallest, a request of unknown size as the
    largest), and a larger request never waits less."""
    cooldown = Cooldown()
    now = 0.0
    seen: list[tuple[float, float]] = []
    for step, advice, size in refusals:
        now += step
        cooldown.extend(now, advice, size)
        seen.append((0 if size is None else size, now + advice))
        assert len(cooldown._entries) <= len(seen)
    for probe in probes:
        bound = math.inf if probe is None else probe
        expected = max((u for s, u in seen if s <= bound), default=-math.inf)
        assert cooldown.remaining(now, probe) == pytest.approx(max(0.0, expected - now))
    sizes = sorted(p for p in probes if p is not None)
    waits = [cooldown.remaining(now, p) for p in sizes]
    assert waits == sorted(waits)


# --- decisions -------------------------------------------------------------------------------


def rate_limited(advice: float | None) -> RateLimitError:
    response = httpx.Response(429, request=httpx.Request("POST", "http://x/v1/completions"))
    return RateLimitError("busy", response=response, retry_after=advice, retryable=True)


def test_advice_over_cap_gives_up_at_once() -> None:
    clock = FakeClock()
    call = RetryCall(clock.policy(max_wait=5), Cooldown())
    call.begin_attempt()
    decision = call.decide(rate_limited(30))
    assert isinstance(decision.give_up, ServerBusyError)
    assert decision.give_up.retry_after == 30
    assert decision.give_up.attempts == 1
    assert "wait cap" in str(decision.give_up)


def test_advice_past_deadline_gives_up_at_once() -> None:
    clock = FakeClock()
    call = RetryCall(clock.policy(deadline=10, max_wait=60), Cooldown())
    call.begin_attempt()
    clock.advance(8)
    decision = call.decide(rate_limited(5))
    assert isinstance(decision.give_up, ServerBusyError)
    assert "deadline" in str(decision.give_up)


def test_no_advice_or_zero_advice_backs_off() -> None:
    clock = FakeClock()
    call = RetryCall(clock.policy(random=lambda: 0.0), Cooldown())
    call.begin_attempt()
    for advice in (None, 0.0):
        decision = call.decide(rate_limited(advice))
        assert decision.retry
        assert decision.give_up is None
        assert decision.wait == RetryPolicy().backoff_min


def test_connection_errors_give_up_with_themselves() -> None:
    clock = FakeClock()
    call = RetryCall(clock.policy(max_attempts=1), Cooldown())
    call.begin_attempt()
    error = APIConnectionError("refused")
    decision = call.decide(error)
    assert decision.give_up is error
    assert error.attempts == 1


def test_advice_shorter_than_backoff_is_floored_from_the_second_retry_on() -> None:
    # A server that keeps saying "1 ms" while it stays full.
    clock = FakeClock()
    policy = clock.policy(random=lambda: 0.5)
    call = RetryCall(policy, Cooldown())
    waits = []
    for _ in range(5):
        call.begin_attempt()
        decision = call.decide(rate_limited(0.001))
        assert decision.give_up is None
        waits.append(decision.wait)
    assert waits[0] == server_wait(policy, 0.001)  # the first retry trusts the advice
    assert waits[1:] == [backoff_wait(policy, attempt) for attempt in range(2, 6)]


def test_advice_longer_than_backoff_is_kept() -> None:
    clock = FakeClock()
    policy = clock.policy(random=lambda: 0.5)
    call = RetryCall(policy, Cooldown())
    for _ in range(3):
        call.begin_attempt()
        assert call.decide(rate_limited(20.0)).wait == server_wait(policy, 20.0)
