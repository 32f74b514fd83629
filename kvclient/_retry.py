"""Retry policy: pure decisions, no I/O.

What to retry, how long to wait, when to give up, and the client-wide cooldown all live here as
plain functions and small value objects, so sync and async clients share them and tests drive
them with an injected clock. tenacity runs the loop (:class:`RetryCall` builds its ``Retrying``
objects), but none of its types leave this module.

>>> parse_retry_after({"Retry-After": "2"})
2.0
>>> parse_retry_after({"retry-after-ms": "1500", "Retry-After": "2"})
1.5
>>> parse_retry_after({"Retry-After": "soon"}) is None
True
>>> parse_retry_after({"Retry-After": "1, 2"})  # two headers, as httpx joins them
2.0
"""

from __future__ import annotations

import datetime
import email.utils
import itertools
import logging
import math
import random as _random
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import tenacity

from ._accounting import DEFAULT_BLOCK_SIZE
from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    KVClientError,
    ServerBusyError,
)
from ._models import RetryEvent
from ._pacing import PACE_POLL, PACE_POLL_FIRST, Pacer

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
    "DEFAULT_WINDOW_RESET",
    "Cooldown",
    "RetryBudget",
    "RetryCall",
    "RetryPolicy",
    "SendWindow",
    "backoff_wait",
    "is_retryable",
    "parse_retry_after",
    "server_wait",
]

logger = logging.getLogger("kvclient")

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
#: Seconds without a refusal after which the send window opens fully again.
DEFAULT_WINDOW_RESET = 10.0

# A header longer than this is garbage (or hostile); never feed megabytes to float() or a parser.
# (Room for a few values: repeated headers arrive joined by commas.)
_MAX_HEADER_LENGTH = 256
_MAX_HEADER_VALUES = 8
_DELTA_SECONDS = re.compile(r"\s*(\d{1,20}(?:\.\d{1,9})?)\s*")
# Guard for injected clocks that do not advance: a hold loop never spins forever.
_MAX_HOLD_ROUNDS = 1000
# Breaks ties between calls started at the same moment: their places in the pacer's queue.
_CALL_SEQUENCE = itertools.count()


def _header(headers: Mapping[str, str] | Any, name: str) -> str | None:
    getter = getattr(headers, "get", None)
    if getter is None:
        return None
    value = getter(name)
    if value is None and not hasattr(headers, "multi_items"):  # a plain dict: case-insensitive
        for key, candidate in headers.items():
            if isinstance(key, str) and key.lower() == name:
                value = candidate
                break
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) else None


def _header_values(headers: Mapping[str, str] | Any, name: str) -> list[str]:
    """Every value of header ``name``: httpx keeps repeated headers apart in ``get_list``."""
    get_list = getattr(headers, "get_list", None)
    if callable(get_list):
        values = get_list(name)
        if isinstance(values, list):
            return [value for value in values if isinstance(value, str)]
    value = _header(headers, name)
    return [] if value is None else [value]


def _items(value: str) -> list[str]:
    """The values one header line carries: several joined by commas (``"1, 2"``) or one.

    An IMF-fixdate has a comma of its own (``Sun, 06 Nov 1994 ...``): a part that is not a
    number is joined with the next one before parsing.
    """
    parts = value.split(",")
    items: list[str] = []
    i = 0
    while i < len(parts) and len(items) < _MAX_HEADER_VALUES:
        part = parts[i]
        if _DELTA_SECONDS.fullmatch(part) or i + 1 == len(parts):
            items.append(part)
            i += 1
        else:
            items.append(part + "," + parts[i + 1])
            i += 2
    return items


def _delta(item: str, per_second: float) -> float | None:
    match = _DELTA_SECONDS.fullmatch(item)
    if not match:
        return None
    seconds = float(match.group(1)) / per_second
    return seconds if math.isfinite(seconds) else None


def _date_delta(item: str, now: float | None) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(item.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # asctime dates carry no zone; every HTTP-date is GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    current = time.time() if now is None else now
    delta = when.timestamp() - current
    return max(0.0, delta) if math.isfinite(delta) else None


def _largest(values: list[str], parse: Callable[[str], float | None]) -> float | None:
    found = [
        seconds
        for value in values
        if len(value) <= _MAX_HEADER_LENGTH
        for item in _items(value)
        if (seconds := parse(item)) is not None
    ]
    return max(found, default=None)


def parse_retry_after(
    headers: Mapping[str, str] | Any, *, now: float | None = None
) -> float | None:
    """The server's advised wait in seconds, or None when it gave no usable advice.

    ``retry-after-ms`` (milliseconds) wins over ``Retry-After``, which is either delta-seconds
    (integer or decimal) or an HTTP-date, read relative to ``now`` (Unix time, default: the
    current time). A date in the past means "now": ``0.0``. When a header is repeated (httpx
    joins repeats as ``"1, 2"``), the largest valid value counts: the server's floor. Anything
    malformed, negative, non-finite or absurdly long is ignored. Never raises.
    """
    try:
        millis = _largest(_header_values(headers, "retry-after-ms"), lambda v: _delta(v, 1000.0))
        if millis is not None:
            return millis
        return _largest(
            _header_values(headers, "retry-after"),
            lambda v: value if (value := _delta(v, 1.0)) is not None else _date_delta(v, now),
        )
    except Exception:  # a header parser must never take the client down
        return None


class RetryBudget:
    """A token bucket bounding retries to a share of traffic (gRPC retry throttling).

    The bucket starts full with ``max_tokens``. Each retryable failure spends one token, each
    success earns ``token_ratio`` back. Retries are allowed only while more than half the bucket
    is left, so a server that keeps failing sees retries fall to about ``token_ratio`` of
    traffic, while a server that is merely pacing (some successes between 429s) keeps them.
    Thread-safe; share one budget between clients to bound them together.
    """

    __slots__ = ("_lock", "_tokens", "max_tokens", "token_ratio")

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if not (max_tokens > 0 and math.isfinite(max_tokens)):
            raise ValueError(f"max_tokens must be a positive number, got {max_tokens!r}")
        if not (0 < token_ratio <= max_tokens):
            raise ValueError(f"token_ratio must be in (0, max_tokens], got {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self._tokens = float(max_tokens)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RetryBudget(tokens={self.tokens:.2f}/{self.max_tokens}, ratio={self.token_ratio})"

    @property
    def tokens(self) -> float:
        return self._tokens

    def record_success(self) -> None:
        with self._lock:
            self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)

    def record_failure(self) -> None:
        with self._lock:
            self._tokens = max(0.0, self._tokens - 1.0)

    def allows_retry(self) -> bool:
        with self._lock:
            return self._tokens > self.max_tokens / 2


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


class Cooldown:
    """Client-wide "not before" times, by request size, shared by every request of one client.

    A 429 with Retry-After T for a request of ``size`` tokens (prompt + output cap) says that
    the server cannot fit ``size`` tokens before now + T, so no request at least that large is
    sent before then: they hold instead of each discovering the overload with a 429 of their
    own. It says nothing about smaller requests, which may still fit in the room that is left,
    so they are held only by refusals of requests no larger than themselves. A refusal of
    unknown size holds every request, and a request of unknown size is held by every refusal:
    without sizes (the default, ``RetryPolicy.cooldown_by_size=False``) the whole client cools
    down. Value logic over the times it is given; a lock only keeps concurrent updates
    consistent.
    """

    __slots__ = ("_entries", "_lock", "advice")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (size, until), sorted: an entry that a smaller-or-equal size with a later-or-equal
        # time already covers is dropped, so larger sizes have later times.
        self._entries: list[tuple[float, float]] = []
        self.advice: float | None = None

    def extend(self, now: float, advice: float, size: int | None = None) -> None:
        """The server asked for ``advice`` seconds at monotonic time ``now`` for a request of
        ``size`` tokens (None: unknown, holds every size)."""
        bound = 0.0 if size is None else float(size)
        until = now + advice
        with self._lock:
            live = [e for e in self._entries if e[1] > now]
            if any(s <= bound and u >= until for s, u in live):
                self._entries = live
                return  # already held at least that long
            kept = [e for e in live if not (e[0] >= bound and e[1] <= until)]
            kept.append((bound, until))
            kept.sort()
            self._entries = kept
            self.advice = advice

    def remaining(self, now: float, size: int | None = None) -> float:
        """Seconds a request of ``size`` tokens (None: any size) holds before sending."""
        entries = self._entries
        if not entries:
            return 0.0
        bound = math.inf if size is None else float(size)
        until = max((u for s, u in entries if s <= bound), default=-math.inf)
        return max(0.0, until - now)


class SendWindow:
    """How much one client keeps in flight once the server has refused a request (pure).

    The cooldown says *when* the server may have room again; this says *how much*. Without it,
    every request held during a cooldown is sent the moment it ends, and most of them are refused
    again: a herd, once per cooldown. The window counts KV tokens (each request's prompt + output
    cap; 1 when unknown): a refusal (429/503) closes it to the tokens of the other requests still
    in flight, which is what the server is holding for this client now; from then on a new send
    waits until enough of those finish (a request alone in flight always goes). Counting tokens
    rather than requests lets the room a large request leaves be taken by several small ones.
    Each success widens it a little (about one request per window's worth of successes, TCP's
    additive increase), and ``reset`` seconds without a refusal open it fully. Until the first
    refusal the window is open and costs one uncontended lock per send.
    """

    __slots__ = ("_last_refusal", "_lock", "in_flight", "limit", "requests", "reset")

    def __init__(self, *, reset: float = DEFAULT_WINDOW_RESET) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0  # tokens
        self.requests = 0
        self.limit = math.inf
        self.reset = reset
        self._last_refusal = -math.inf

    def try_acquire(self, now: float, size: int = 1) -> bool:
        """Take room for one send of ``size`` tokens if the window allows it."""
        with self._lock:
            if self.limit != math.inf and now - self._last_refusal >= self.reset:
                self.limit = math.inf
            if self.requests == 0 or self.in_flight + size <= self.limit:
                self.in_flight += size
                self.requests += 1
                return True
            return False

    def release(self, outcome: str, now: float, size: int = 1) -> None:
        """Give back a send's room: ``outcome`` is "ok", "refused" (429/503) or "other"."""
        with self._lock:
            if outcome == "refused":
                # The others in flight are what the server holds now: keep to that.
                self.limit = max(float(size), min(self.limit, self.in_flight - float(size)))
                self._last_refusal = now
            elif outcome == "ok" and self.limit != math.inf:
                self.limit += size * size / self.limit
            self.in_flight = max(0, self.in_flight - size)
            self.requests = max(0, self.requests - 1)


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
