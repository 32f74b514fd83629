"""The retry policy: its settings, and the pure decisions it implies (no I/O).

What to retry (:func:`is_retryable`), how long to wait with the server's advice
(:func:`server_wait`) and without it (:func:`backoff_wait`): plain functions over a frozen
:class:`RetryPolicy`, so sync and async clients share them and tests drive them with injected
clocks and draws. :class:`kvclient._retry.RetryCall` applies them to one call.
"""

from __future__ import annotations

import math
import random as _random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from ._budget import RetryBudget
from ._exceptions import APIConnectionError, APIStatusError
from ._pacing import DEFAULT_WINDOW_RESET

__all__ = [
    "DEFAULT_BACKOFF_INITIAL",
    "DEFAULT_BACKOFF_MAX",
    "DEFAULT_BACKOFF_MIN",
    "DEFAULT_BACKOFF_MULTIPLIER",
    "DEFAULT_DEADLINE",
    "DEFAULT_JITTER_ABSOLUTE",
    "DEFAULT_JITTER_RATIO",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_WAIT",
    "RetryPolicy",
    "backoff_wait",
    "is_retryable",
    "server_wait",
]

#: Attempts per call, the first one included.
DEFAULT_MAX_ATTEMPTS = 6
#: Seconds a call may take across all its attempts and waits.
DEFAULT_DEADLINE = 120.0
#: Longest single wait kvclient accepts; a server asking for more gets ServerBusyError at once.
DEFAULT_MAX_WAIT = 60.0
#: Full-jitter exponential backoff when the server gives no advice.
DEFAULT_BACKOFF_INITIAL = 0.5
DEFAULT_BACKOFF_MULTIPLIER = 2.0
DEFAULT_BACKOFF_MAX = 10.0
#: Floor of a backoff wait: full jitter alone can draw ~0, which would be a zero-delay retry.
DEFAULT_BACKOFF_MIN = 0.05
#: Jitter added *above* the server's advice: up to 10% of it plus up to 0.1 s.
DEFAULT_JITTER_RATIO = 0.1
DEFAULT_JITTER_ABSOLUTE = 0.1


def _default_sleep(seconds: float) -> None:
    time.sleep(seconds)


async def _default_async_sleep(seconds: float) -> None:
    await anyio.sleep(seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When to retry, how long to wait, when to give up.

    ``max_attempts`` counts every request of one call; ``deadline`` bounds the whole call in
    seconds; ``max_wait`` caps one wait: a server asking for more, or for more than the time left
    before the deadline, gets :class:`ServerBusyError` at once instead of a hopeless sleep.

    The server's advice (Retry-After) is a floor: the wait is the advice plus a random jitter of
    up to ``jitter_ratio`` x advice + ``jitter_absolute``, never less. Without advice the wait is
    full-jitter exponential backoff: uniform in [``backoff_min``, min(``backoff_max``,
    ``backoff_initial`` x ``backoff_multiplier`` ** (attempt - 1))]. From a call's second retry
    on, the wait is at least that backoff even with advice: a server whose advice keeps being
    too short (``Retry-After: 1`` while it stays full) cannot make a call spend all its attempts
    in a moment.

    A 429 with advice cools the whole client down: its other requests hold new sends until the
    advised time. With ``cooldown_by_size`` only those at least as large (prompt + output cap)
    as the refused request hold, since smaller ones may fit in what is left: see
    :class:`Cooldown`. ``window`` (on by default) paces the client after a refusal: see
    :class:`SendWindow`; ``window_reset`` is how long without a refusal before it opens fully.

    ``pace`` (on by default) holds a request locally while it would not fit the room the server
    last advertised in its ``RateLimit`` header (less what the client sent since): it goes when
    a fresher answer shows room, when the hint ages out, or when holding longer would reach the
    deadline (then the server decides). With ``pace_in_order`` (off by default) held requests
    go in the order their calls started, as a FIFO-queued server admits them: a later one
    waits behind an earlier one even when it would fit, so large requests are not starved
    (the retry storm's p99 is lower with it, its median far higher); but one large request that
    other clients keep beating to the room holds all of its client's requests back (in the
    soak it halved the completions), so it is not the default. A server that sends no hints is
    not affected: see :class:`kvclient._pacing.Pacer`. While the
    server advertises its room, a refused request also waits for room rather than for its
    Retry-After (an upper bound: our server's is the worst case, every holder to its cap): it
    is held, in its place, until an answer shows room for it or the advised time comes (advice
    past the deadline still fails at once); from its second retry on, it first backs off as
    without pacing.

    ``clock`` (monotonic seconds), ``wall_clock`` (Unix time, for HTTP-dates), ``sleep``,
    ``async_sleep`` and ``random`` are injectable, so tests never sleep for real; see
    :mod:`kvclient.testing`.
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    deadline: float = DEFAULT_DEADLINE
    max_wait: float = DEFAULT_MAX_WAIT
    backoff_initial: float = DEFAULT_BACKOFF_INITIAL
    backoff_multiplier: float = DEFAULT_BACKOFF_MULTIPLIER
    backoff_max: float = DEFAULT_BACKOFF_MAX
    backoff_min: float = DEFAULT_BACKOFF_MIN
    jitter_ratio: float = DEFAULT_JITTER_RATIO
    jitter_absolute: float = DEFAULT_JITTER_ABSOLUTE
    retry_budget: RetryBudget | None = None
    cooldown_by_size: bool = False
    window: bool = True
    window_reset: float = DEFAULT_WINDOW_RESET
    pace: bool = True
    pace_in_order: bool = False
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    wall_clock: Callable[[], float] = field(default=time.time, repr=False)
    sleep: Callable[[float], None] = field(default=_default_sleep, repr=False)
    async_sleep: Callable[[float], Awaitable[None]] = field(
        default=_default_async_sleep, repr=False
    )
    random: Callable[[], float] = field(default=_random.random, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ValueError(f"max_attempts must be an integer, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("deadline", "max_wait", "backoff_initial", "backoff_max", "window_reset"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("backoff_min", "jitter_ratio", "jitter_absolute"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (self.backoff_multiplier >= 1 and math.isfinite(self.backoff_multiplier)):
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier!r}")


def backoff_wait(policy: RetryPolicy, attempt: int) -> float:
    """Full-jitter exponential backoff after failed attempt number ``attempt`` (1-based)."""
    exponent = min(max(attempt - 1, 0), 64)  # 2**64 x anything is past any cap already
    ceiling = min(policy.backoff_max, policy.backoff_initial * policy.backoff_multiplier**exponent)
    floor = min(policy.backoff_min, ceiling)
    return floor + (ceiling - floor) * policy.random()


def server_wait(policy: RetryPolicy, advice: float) -> float:
    """The wait for a server's advice: the advice plus jitter above it, capped at max_wait.

    Never below ``advice``; callers check ``advice <= max_wait`` first.
    """
    jitter = (policy.jitter_ratio * advice + policy.jitter_absolute) * policy.random()
    return max(advice, min(advice + jitter, policy.max_wait))


def is_retryable(error: BaseException) -> bool:
    """Whether a retry may fix ``error``: the classification made when the error was built."""
    if isinstance(error, (APIStatusError, APIConnectionError)):
        return error.retryable
    return False
