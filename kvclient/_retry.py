"""The retry loop: one call's attempts, driven by tenacity over the pure decisions.

:class:`RetryCall` holds a call's state (attempts, history, time waited), asks the policy
(:mod:`kvclient._policy`), the retry budget, the cooldown, send window and pacer
(:mod:`kvclient._pacing`) what to do, and builds tenacity's ``Retrying`` objects that run the
loop; none of tenacity's types leave this module. Sync and async clients share it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import tenacity

from ._accounting import DEFAULT_BLOCK_SIZE
from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    KVClientError,
    ServerBusyError,
)
from ._models import RetryEvent
from ._pacing import PACE_POLL, PACE_POLL_FIRST, Cooldown, Pacer
from ._policy import RetryPolicy, backoff_wait, is_retryable, server_wait

__all__ = ["RetryCall"]

logger = logging.getLogger("kvclient")

# Guard for injected clocks that do not advance: a hold loop never spins forever.
_MAX_HOLD_ROUNDS = 1000
# Breaks ties between calls started at the same moment: their places in the pacer's queue.
_CALL_SEQUENCE = itertools.count()


@dataclass(frozen=True, slots=True)
class _Decision:
    retry: bool
    wait: float = 0.0
    give_up: KVClientError | None = None


class RetryCall:
    """The state of one call across its attempts, and the tenacity loop that drives them.

    Sync and async clients share it: they iterate it (``for`` or ``async for``, one tenacity
    loop either way) and, inside each attempt, call :meth:`hold_time` before sending. Every
    decision is made here; tenacity only runs the loop and sleeps.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        cooldown: Cooldown,
        *,
        size: int | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.policy = policy
        self.cooldown = cooldown
        # Pacing counts a request's own size; one of unknown size (a probe) is never held.
        self.pacer = pacer if policy.pace and size is not None else None
        self.paced: tuple[float, int] | None = None
        # KV tokens the request reserves (prompt + output cap), what the send window counts;
        # 1 when unknown (GET /v1/models).
        self.size = 1 if size is None else size
        # The server reserves whole KV blocks: count as it will (16 tokens, the usual size).
        self._pace_need = -(-self.size // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
        # The size the cooldown goes by: None (every size) unless the policy sorts by size.
        self._cooldown_size = size if policy.cooldown_by_size else None
        self.on_retry = on_retry
        self.started = policy.clock()
        # Its place among the client's held requests (pace_in_order): the pacer lets them go
        # in this order. None: held requests go as room shows, whichever asks first.
        in_order = policy.pace_in_order and not policy.cooldown_by_size
        self.key = (self.started, next(_CALL_SEQUENCE)) if in_order else None
        # Whether a paced 429 is held on the pacer rather than slept out (see decide). A client
        # of several replicas turns it off: its retry is routed afresh after the advice.
        self.hold_refusals = True

        self.attempts = 0
        self.history: list[RetryEvent] = []
        self.waited = 0.0
        # Immediate re-sends after the server closed a pooled connection (see
        # kvclient._http.stale_connection): bounded per call, so a server that always hangs up
        # costs a couple of sends more, not a multiple of every attempt.
        self.resends = 0
        self._decision = _Decision(retry=False)

    # --- decisions ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        return max(0.0, self.policy.clock() - self.started)

    def time_left(self) -> float:
        return self.policy.deadline - self.elapsed()

    def begin_attempt(self) -> int:
        self.attempts += 1
        return self.attempts

    def _busy(
        self, reason: str, advice: float | None, last: BaseException | None
    ) -> ServerBusyError:
        if self.pacer is not None:
            self.pacer.leave(self.key)  # the next held request need not wait behind it
        error = ServerBusyError(reason, retry_after=advice, attempts=self.attempts, last_error=last)
        return error

    def _paced_hold(self, now: float) -> bool:
        """Whether the call holds on the pacer, not on its cooldown: the server advertises its
        room, so an answer will show when there is room for it."""
        return self.pacer is not None and self.pacer.known(now)

    def hold_time(self) -> float:
        """Seconds to hold before sending because the client is cooling down or the server's
        advertised room would not fit the request (0: send now).

        Raises ServerBusyError when the cooldown outlasts the wait cap or the deadline.
        """
        now = self.policy.clock()
        remaining = self.cooldown.remaining(now, self._cooldown_size)
        if remaining <= 0:
            return self._pace_time(now)
        # The room the server advertised since its 429 is newer than its Retry-After: a request
        # that fits it need not wait the cooldown out.
        if self.pacer is not None and self.pacer.take_if_fits(now, self._pace_need, self.key):
            self.paced = (now, self._pace_need)
            return 0.0
        if (
            remaining <= self.policy.max_wait
            and remaining < self.time_left()
            and self._paced_hold(now)
        ):
            # Retry-After is when room is sure to be back; answers show it sooner. Hold in
            # short polls, in this call's place, until then.
            assert self.pacer is not None
            return min(self.pacer.poll_interval(now, self.key), remaining)
        if remaining > self.policy.max_wait or remaining >= self.time_left():
            raise self._busy(
                f"client is cooling down for {remaining:.3g}s more after the server's "
                f"Retry-After, longer than the wait cap ({self.policy.max_wait:g}s) or the "
                f"{max(self.time_left(), 0.0):.3g}s left before the deadline",
                self.cooldown.advice,
                None,
            )
        # Jitter above the remaining time too, so held requests do not all return at once.
        return server_wait(self.policy, remaining)

    def _pace_time(self, now: float) -> float:
        pacer = self.pacer
        if pacer is None:
            return 0.0
        need = self._pace_need
        wait = pacer.take(now, need, self.key)
        left = self.time_left()
        if wait > 0 and (wait >= left or left <= PACE_POLL):
            pacer.send_anyway(now, need, self.key)  # a hint never fails a call: the server decides
            wait = 0.0
        if wait == 0.0:
            self.paced = (now, need)  # its answer's hint accounts for it: Pacer.observe
        return wait

    def held(self, seconds: float) -> None:
        self.waited += seconds

    def decide(self, error: BaseException | None) -> _Decision:
        """What to do after an attempt: ``error`` None means it succeeded."""
        budget = self.policy.retry_budget
        if error is None:
            if budget is not None:
                budget.record_success()
            return _Decision(retry=False)
        self._annotate(error)
        if not is_retryable(error):
            return _Decision(retry=False)
        advice = error.retry_after if isinstance(error, APIStatusError) else None
        if advice is not None and advice > 0 and isinstance(error, APIStatusError):
            # The server said when it will have room: the client's requests (all, or with
            # cooldown_by_size those at least this large) wait for that moment.
            self.cooldown.extend(self.policy.clock(), advice, self._cooldown_size)
        if budget is not None:
            budget.record_failure()
        if self.attempts >= self.policy.max_attempts:
            return self._give_up(f"gave up after {self.attempts} attempts: {error}", advice, error)
        if budget is not None and not budget.allows_retry():
            return self._give_up(
                f"retry budget exhausted ({budget.tokens:.1f}/{budget.max_tokens:g} tokens): "
                f"the server keeps failing; not retrying: {error}",
                advice,
                error,
            )
        left = self.time_left()
        if (
            advice is not None
            and 0 < advice < min(left, self.policy.max_wait)
            and self.hold_refusals
            and self._paced_hold(self.policy.clock())
        ):
            # Paced: the cooldown just extended holds the retry (see hold_time), until an
            # answer shows room or the advised time comes. From the second retry on the
            # advice (or the hint) was already followed and the server refused again: back
            # off first, so a call cannot spend its attempts in a moment.
            wait = backoff_wait(self.policy, self.attempts) if self.attempts >= 2 else 0.0
            if self.key is not None and self.pacer is not None:
                self.pacer.enqueue(self.policy.clock(), self.key)  # its place, from now on
            if wait >= left:
                return self._give_up(
                    f"deadline of {self.policy.deadline:g}s reached after {self.attempts} "
                    f"attempts (refused again after waiting for room, backing off): {error}",
                    advice,
                    error,
                )
            return _Decision(retry=True, wait=wait)
        if advice is not None and advice > 0:
            if advice > self.policy.max_wait:
                return self._give_up(
                    f"server asked to retry after {advice:.6g}s, more than the wait cap of "
                    f"{self.policy.max_wait:g}s: {error}",
                    advice,
                    error,
                )
            if advice >= left:
                return self._give_up(
                    f"server asked to retry after {advice:.6g}s but only {max(left, 0):.3g}s "
                    f"are left before the {self.policy.deadline:g}s deadline: {error}",
                    advice,
                    error,
                )
            wait = server_wait(self.policy, advice)
            if self.attempts >= 2:
                # The advice was already followed once and the server refused again: it may be
                # too short (a server's estimate can be wrong), so wait at least what backoff
                # would, instead of spending every attempt in a fraction of a second.
                wait = max(wait, backoff_wait(self.policy, self.attempts))
                if wait >= left:
                    return self._give_up(
                        f"deadline of {self.policy.deadline:g}s reached after {self.attempts} "
                        f"attempts (the server's advice of {advice:.6g}s kept being too short, "
                        f"backing off instead): {error}",
                        advice,
                        error,
                    )
        else:
            # No advice (or "now", a past date): back off; a zero-delay retry helps nobody.
            wait = backoff_wait(self.policy, self.attempts)
            if wait >= left:
                return self._give_up(
                    f"deadline of {self.policy.deadline:g}s reached after {self.attempts} "
                    f"attempts: {error}",
                    advice,
                    error,
                )
        wait = min(wait, max(left, 0.0))
        return _Decision(retry=True, wait=wait)

    def _give_up(self, message: str, advice: float | None, error: BaseException) -> _Decision:
        if self.pacer is not None:
            self.pacer.leave(self.key)
        if isinstance(error, APIConnectionError):
            # No capacity signal from the server: the connection error itself is the answer.
            return _Decision(retry=True, give_up=error)
        busy = self._busy(message, advice, error)
        self._annotate(busy)
        return _Decision(retry=True, give_up=busy)

    def _annotate(self, error: BaseException) -> None:
        if isinstance(error, KVClientError):
            error.attempts = self.attempts
            error.history = tuple(self.history)

    def _record(self, error: BaseException | None, wait: float) -> None:
        status = error.status_code if isinstance(error, APIStatusError) else None
        advice = error.retry_after if isinstance(error, APIStatusError) else None
        event = RetryEvent(
            attempt=self.attempts,
            status_code=status,
            error=f"{type(error).__name__}: {error}" if error is not None else "",
            wait=wait,
            retry_after=advice,
        )
        self.history.append(event)
        self.waited += wait
        logger.info(
            "kvclient retry: attempt %d failed (%s), waiting %.3fs",
            event.attempt,
            event.status_code if event.status_code is not None else type(error).__name__,
            wait,
            extra={"kvclient_retry": event},
        )
        if self.on_retry is not None:
            try:
                self.on_retry(event)
            except Exception:  # an observer's bug must not change what the call does
                logger.exception("kvclient on_retry hook raised; retrying anyway")

    # --- tenacity ------------------------------------------------------------------------------

    def _retry(self, state: tenacity.RetryCallState) -> bool:
        """tenacity's question after each attempt, answered by :meth:`decide`: giving up raises
        the call's final error from here."""
        outcome = state.outcome
        error = outcome.exception() if outcome is not None and outcome.failed else None
        self._decision = self.decide(error)
        give_up = self._decision.give_up
        if give_up is None:
            return self._decision.retry
        if give_up is error:
            raise give_up
        raise give_up from error

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        outcome = state.outcome
        error = outcome.exception() if outcome is not None and outcome.failed else None
        self._record(error, self._decision.wait)

    def _retrying(self, kind: type[tenacity.BaseRetrying], sleep: Any) -> Any:
        return kind(
            sleep=sleep,
            retry=self._retry,
            wait=lambda _state: self._decision.wait,
            before_sleep=self._before_sleep,
        )

    def __iter__(self) -> Iterator[Any]:
        """One context manager per attempt: ``for attempt in call: with attempt: ...``."""
        return iter(self._retrying(tenacity.Retrying, self.policy.sleep))

    def __aiter__(self) -> AsyncIterator[Any]:
        """One context manager per attempt: ``async for attempt in call: with attempt: ...``."""
        iterator: AsyncIterator[Any] = self._retrying(
            tenacity.AsyncRetrying, self.policy.async_sleep
        ).__aiter__()
        return iterator

    def hold_rounds(self) -> range:
        if self.pacer is None:
            return range(_MAX_HOLD_ROUNDS)
        # Pacing holds in short polls (the first in line the shortest), up to the deadline.
        return range(_MAX_HOLD_ROUNDS + math.ceil(self.policy.deadline / PACE_POLL_FIRST))
