"""Pacing a client's sends (pure): the room a server advertises, its cooldown, the send window.

Three rules, one per client (or per replica), each a small object over the times it is given:

- :class:`Pacer`: the latest room a server advertised in its ``RateLimit`` header (the syntax is
  :mod:`kvclient.headers`'), less what this client has sent since: "send now, or hold this
  long";
- :class:`Cooldown`: the "not before" times a 429's Retry-After set, by request size;
- :class:`SendWindow`: how much the client keeps in flight once the server has refused a request.

:class:`kvclient._retry.RetryCall` asks them before each send.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
from collections import deque
from collections.abc import Hashable
from typing import Any

from .headers import RoomHint

__all__ = [
    "DEFAULT_PACE_MAX_AGE",
    "DEFAULT_WINDOW_RESET",
    "PACE_LAG",
    "PACE_LAG_MAX",
    "PACE_POLL",
    "PACE_POLL_FIRST",
    "PACE_POLL_LAST",
    "PACE_TRICKLE",
    "PACE_TRUST_MAX_FACTOR",
    "PACE_WAITER_TTL",
    "Cooldown",
    "Pacer",
    "SendWindow",
]

#: A hint is trusted for at most this long (seconds), and never past its ``t``: the room it
#: describes changes with every admission and release, some of which this client does not see.
#: Not much less: once it ages out a probe goes, and one second without an answer (every
#: holder still running) sent probes that were refused in the retry storm.
DEFAULT_PACE_MAX_AGE = 2.0
#: How far a hint's trust may grow (times ``max_age``): each request sent because the hint
#: had aged out and refused all the same (the room had not come back) doubles how long the next
#: hints are trusted; one admitted that way (room came back unseen) resets it.
PACE_TRUST_MAX_FACTOR = 8
#: A held request asks again this often (seconds): a fresher hint may have arrived meanwhile.
PACE_POLL = 0.02
#: Once a hint has aged out, one held request goes per this many seconds until a fresh hint
#: comes (its answer brings one); after _FORGET_AFTER x max_age without any, all go again.
PACE_TRICKLE = 0.05
_FORGET_AFTER = 10
#: Sends this recent (seconds) when a hint arrives may not have reached the server when it wrote
#: the hint: they stay counted against the new hint instead of being forgotten. On a loaded
#: 2-core machine 50 ms let one request in twenty collect a 429 in the retry storm; 250 ms
#: counted room as taken that was not, for long enough to leave 5-10 % of the budget idle.
PACE_LAG = 0.1
#: Refusals' round trips (send to 429: how long a send takes to reach the server's ledger and an
#: answer to come back) can lengthen the lag: to this many times the median of the last
#: _RTT_SAMPLES, plus PACE_LAG_FLOOR, at most PACE_LAG_MAX. A slow (loaded) server is thus
#: given longer to see a send before its hints are trusted to include it.
PACE_LAG_RTTS = 3.0
PACE_LAG_FLOOR = 0.01
PACE_LAG_MAX = 0.5
_RTT_SAMPLES = 16

#: Held requests in line (with a ``key``) ask again this often (seconds) by their place: the
#: first few every 5 ms (room an answer shows goes to them first, so the pool is not left idle
#: for a whole poll), those far back rarely (a thousand held requests polling every 20 ms kept
#: a client's CPU busy in the soak): (places before, seconds), the last for everyone else.
PACE_POLL_FIRST = 0.005
_POLL_BY_PLACE = ((4, PACE_POLL_FIRST), (16, PACE_POLL), (64, 0.05))
PACE_POLL_LAST = 0.25
#: A held request (with a ``key``) that has not asked again for this long (seconds) is taken
#: to be gone (cancelled, say) and loses its place until it asks again: four of its slowest
#: polls, late even on a loaded machine.
PACE_WAITER_TTL = 1.0

#: Seconds without a refusal after which the send window opens fully again.
DEFAULT_WINDOW_RESET = 10.0


class Pacer:
    """The latest room a server advertised, less what this client has sent since (pure).

    :meth:`observe` records a hint with the time it arrived; :meth:`take` answers whether a
    request of ``need`` KV tokens may go now (and counts it as sent) or how long to hold it
    before asking again. A hint ages out after ``max_age`` seconds, or ``lag`` after its ``t``
    (the next due release: the answer that shows it takes a moment) when that is sooner: then
    one request per ``PACE_TRICKLE`` goes until an answer brings a fresh hint, and after ten
    times ``max_age`` without one, every request goes. Advice that proved right is trusted
    longer: a request sent because its hint had aged out and refused all the same doubles how
    long later hints are trusted (up to ``PACE_TRUST_MAX_FACTOR`` x ``max_age``, never past
    their ``t``), so a client whose holders run long waits for evidence of room (an answer that
    shows it) instead of probing every ``max_age``; one admitted that way resets it. A hint whose
    reserved room is all this client's (``observe(ours=...)``) is trusted that long at once: room
    can only come back as our requests end, and their answers show it (until one ends unseen:
    :meth:`released_unseen`). Before any hint every request goes, as without pacing.
    Sends made less than ``lag`` seconds before a hint arrives still count against it: the
    server may have written it before they reached it. Refusals (``observe`` with
    ``refused=True`` and the refused send) time a send's way to the server and back; when they
    show a slow server (``PACE_LAG_RTTS`` x their median is more than ``lag``), that window
    grows to match, up to ``PACE_LAG_MAX``.
    A request larger than the whole advertised budget goes too: the server refuses it for good,
    which a hold would only delay. Thread- and task-safe: the lock is held for arithmetic only.

    Held requests that give a ``key`` (any orderable value: the call's start time, then a
    sequence number) go in key order, as a FIFO-queued server admits them: while one with a
    smaller key is held (and still asking, within ``PACE_WAITER_TTL``), a larger key waits
    behind it even if it would fit, so a large request is not starved by a stream of small ones
    and a request refused earlier gets in earlier. Requests without a key are not queued.

    >>> pacer = Pacer(max_age=1.0)
    >>> pacer.observe(10.0, RoomHint(quota=1000, remaining=300, reset=5))
    >>> pacer.take(10.1, 200), pacer.take(10.1, 200)   # the second does not fit what is left
    (0.0, 0.02)
    >>> pacer.take(11.0, 200)                          # the hint has aged out
    0.0
    """

    __slots__ = (
        "_expires", "_free", "_lock", "_plain", "_queues", "_quota", "_recent", "_rtts", "_seen",
        "_sent", "_trickle", "_trust", "_waiters", "_waiting", "lag", "max_age",
    )  # fmt: skip

    def __init__(self, *, max_age: float = DEFAULT_PACE_MAX_AGE, lag: float = PACE_LAG) -> None:
        if not (isinstance(max_age, (int, float)) and max_age > 0 and math.isfinite(max_age)):
            raise ValueError(f"max_age must be a positive number of seconds, got {max_age!r}")
        if not (isinstance(lag, (int, float)) and 0 <= lag < math.inf):
            raise ValueError(f"lag must be a finite number of seconds >= 0, got {lag!r}")
        self.max_age = float(max_age)
        #: How long a hint is trusted now (see PACE_TRUST_MAX_FACTOR).
        self._trust = self.max_age
        self.lag = float(lag)
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the latest sends
        self._lock = threading.Lock()
        self._free = 0
        self._quota: int | None = None
        self._queues = False
        self._sent = 0
        self._seen = -math.inf
        self._expires = -math.inf
        # When the latest hint would expire were its reserved room not all ours.
        self._plain = -math.inf
        self._trickle = -math.inf
        # Held requests by key: their keys in order, and each key's latest poll (a key past its
        # TTL is no longer waiting once it reaches the front; it queues again when it asks).
        self._waiters: list[Any] = []  # sorted
        self._waiting: dict[Hashable, float] = {}
        self._rtts: deque[float] = deque(maxlen=_RTT_SAMPLES)

    def __repr__(self) -> str:
        return f"Pacer(free={self._free}, sent={self._sent}, expires={self._expires:.3f})"

    def effective_lag(self) -> float:
        """How long a send stays counted against hints that arrive after it (seconds)."""
        if not self._rtts:
            return self.lag
        ordered = sorted(self._rtts)
        measured = PACE_LAG_RTTS * ordered[len(ordered) // 2] + PACE_LAG_FLOOR
        return max(self.lag, min(PACE_LAG_MAX, measured))

    def observe(
        self,
        now: float,
        hint: RoomHint,
        own: tuple[float, int] | None = None,
        *,
        refused: bool = False,
        ours: int | None = None,
    ) -> None:
        """A response that arrived at monotonic time ``now`` advertised ``hint``.

        ``own`` is the answered request's send, ``(when, need)`` as :meth:`take` let it go: the
        hint already accounts for it (reserved, released or refused), so it is not counted again.
        ``refused``: the answer is a refusal (429), written as soon as the server saw the
        request, so ``now - when`` times a send's way to the ledger and back.
        ``ours``: at most how many KV tokens this client's requests hold at the server besides
        the answered one (None: not known). When the hint's reserved tokens are all ours, room
        comes back only as our own requests end, and each of their answers brings a fresh hint:
        the hint is trusted as long as advice that proved right is (``PACE_TRUST_MAX_FACTOR`` x
        ``max_age``, never past its ``t``) instead of sending a probe that could only be refused.
        """
        with self._lock:
            if refused and own is not None and now >= own[0]:
                self._rtts.append(now - own[0])
            if own is not None and own[0] >= self._expires > -math.inf:
                # It went because the hint had aged out: did the room come back unseen?
                if refused:
                    self._trust = min(2 * self._trust, PACE_TRUST_MAX_FACTOR * self.max_age)
                else:
                    self._trust = self.max_age
            lag = self.effective_lag()
            age = plain = self._trust
            if ours is not None and hint.quota is not None and hint.quota - hint.remaining <= ours:
                age = PACE_TRUST_MAX_FACTOR * self.max_age  # nobody else's room to come back
            if hint.reset:
                age = min(age, float(hint.reset) + lag)
                plain = min(plain, float(hint.reset) + lag)
            if now < self._seen:
                return  # an older answer read late: the newer one stands
            recent = self._recent
            while recent and recent[0][0] < now - lag:
                recent.popleft()
            if own is not None:
                with contextlib.suppress(ValueError):
                    recent.remove(own)
            self._free = hint.remaining
            self._quota = hint.quota
            self._queues = hint.queues
            self._sent = sum(tokens for _, tokens in recent)
            self._seen = now
            self._expires = now + age
            self._plain = now + plain

    def released_unseen(self) -> None:
        """One of this client's requests ended without an answer that shows the room (a
        stream's end, a failure): its room came back unseen, so a hint trusted for holding only
        our room is trusted no longer than any other."""
        with self._lock:
            self._expires = min(self._expires, self._plain)

    def live(self, now: float) -> bool:
        """Whether the latest hint is still trusted at ``now``: answers keep showing the room."""
        return now < self._expires

    def known(self, now: float) -> bool:
        """Whether the server is known to advertise its room: a hint seen and not forgotten
        (it may have aged out; the next answer brings a fresh one)."""
        return not self._forgotten(now)

    def waiting(self, now: float) -> int:
        """Held requests with a key that are still asking (queued in key order)."""
        with self._lock:
            self._head(now)
            return sum(1 for seen in self._waiting.values() if now - seen <= PACE_WAITER_TTL)

    def enqueue(self, now: float, key: Hashable) -> None:
        """Hold a place in line for ``key`` (a refused request, before it waits to retry)."""
        with self._lock:
            self._place(now, key)

    def leave(self, key: Hashable) -> None:
        """A held request gave up (its deadline, say): the next in line need not wait for it."""
        with self._lock:
            self._waiting.pop(key, None)

    def _head(self, now: float) -> Any:
        """The smallest key still waiting (None: nobody), dropping those gone quiet."""
        queue, waiting = self._waiters, self._waiting
        while queue:
            key = queue[0]
            seen = waiting.get(key)
            if seen is not None and now - seen <= PACE_WAITER_TTL:
                return key
            del queue[0]
            waiting.pop(key, None)
        return None

    def _place(self, now: float, key: Any) -> int:
        """How many held requests are ahead of ``key`` (0: none, it may go), queueing it."""
        if key is None:
            return 0
        waiting = self._waiting
        if key not in waiting:
            bisect.insort(self._waiters, key)
        waiting[key] = now
        if self._head(now) == key:
            return 0
        return bisect.bisect_left(self._waiters, key)

    def _went(self, key: Any) -> None:
        if key is not None and self._waiting.pop(key, None) is not None:
            queue = self._waiters
            i = bisect.bisect_left(queue, key)
            if i < len(queue) and queue[i] == key:
                del queue[i]

    def poll_interval(self, now: float, key: Any = None) -> float:
        """How soon a held request should ask again: the first few in line often, since room
        that shows goes to them first; the rest less often (they keep their place)."""
        with self._lock:
            if key is None or key not in self._waiting:
                return PACE_POLL
            return self._interval(self._place(now, key))

    @staticmethod
    def _interval(place: int) -> float:
        for before, seconds in _POLL_BY_PLACE:
            if place < before:
                return seconds
        return PACE_POLL_LAST

    def take(self, now: float, need: int, key: Any = None) -> float:
        """0.0: send now (``need`` is counted against the hint); else seconds to hold first.

        ``key``: the request's place in the queue of held requests (see the class).
        """
        with self._lock:
            wait = self._take(now, need, key)
            if wait == 0.0:
                self._went(key)
            return wait

    def _take(self, now: float, need: int, key: Any) -> float:
        # The head of the queue asks often; a request without a key as before.
        poll = PACE_POLL if key is None else PACE_POLL_FIRST
        if self._quota is not None and need > self._quota:
            self._note(now, need)
            return 0.0
        if self._queues and not self._forgotten(now):
            self._note(now, need)  # the server's own line is fairer than holding here
            return 0.0
        if self._forgotten(now):
            self._note(now, need)  # nothing known: every request goes, as without pacing
            return 0.0
        place = self._place(now, key)
        if place:
            return self._interval(place)
        if now >= self._expires:
            if now >= self._trickle:
                # Stale: one request per PACE_TRICKLE goes, and its answer (a 429 at once,
                # if the room is gone) brings a fresh hint. Letting every held request go
                # the moment a hint ages out sent a herd: nearly all the retry storm's 429s.
                self._trickle = now + PACE_TRICKLE
                self._note(now, need)
                return 0.0
            return min(poll, self._trickle - now)
        if self._sent + need <= self._free:
            self._note(now, need)
            return 0.0
        return min(poll, self._expires - now)

    def _forgotten(self, now: float) -> bool:
        return now >= self._expires + _FORGET_AFTER * self.max_age

    def take_if_fits(self, now: float, need: int, key: Any = None) -> bool:
        """Whether a live hint has room for ``need`` now (then it is counted as sent); with a
        ``key``, only once no smaller key is held (see the class)."""
        with self._lock:
            if self._place(now, key):
                return False
            if now < self._expires and self._sent + need <= self._free:
                self._note(now, need)
                self._went(key)
                return True
            return False

    def send_anyway(self, now: float, need: int, key: Any = None) -> None:
        """Count a request that goes despite the hint (its deadline would not wait)."""
        with self._lock:
            self._note(now, need)
            self._went(key)

    def _note(self, now: float, need: int) -> None:
        self._sent += need
        if self.lag > 0:
            recent = self._recent
            recent.append((now, need))
            if len(recent) > 4096 or recent[0][0] < now - self.lag:  # bounded, whatever happens
                while recent and (len(recent) > 4096 or recent[0][0] < now - self.lag):
                    recent.popleft()


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
