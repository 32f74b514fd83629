"""Back-pressure, for the ledger (:class:`~.ledger.KVAdmissionController` is an
:class:`Advising`): when the holders are due to end, the room a newcomer sees, and how long a
refused request should wait (Retry-After), under the rule in force. The arithmetic is pure, in
:mod:`.forecast` and :mod:`.advice`; these methods read the ledger's state under its lock.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

from .advice import Advice
from .decode import Decoding
from .forecast import Drain, earliest_fit, earliest_peak_fit, expected_ends, quantile_above
from .holders import freshest
from .peak import Holder
from .values import Ask, Handle, Headroom

__all__ = ["Advising"]


class Advising:
    """The ledger's back-pressure: a mixin of :class:`~.ledger.KVAdmissionController`, whose
    state it reads (declared here for the type checker)."""

    _lock: threading.Lock
    _advice: Advice
    _decoding: Decoding
    _live: dict[int, Handle]
    _tainted: set[Hashable]
    _unknown: int
    usable_tokens: int
    block_size: int
    max_concurrency: int | None
    release_margin: float
    overrun: float
    output_quantile: float | None
    strategy: str

    if TYPE_CHECKING:

        @property
        def decode_rate(self) -> float: ...

        def rate_at(self, sequences: int) -> float: ...

        def _advance(self, now: float) -> None: ...

        def _peak_in_force(self) -> bool: ...

        def _holder(self, handle: Handle, fresh: float, now: float | None = None) -> Holder: ...

        def _newcomer(self, ask: Ask, now: float) -> Handle: ...

        def _committed(
            self, now: float, extra: Holder | None = None, without: Handle | None = None
        ) -> int: ...

    def record_output(self, completion_tokens: int) -> None:
        """Remember how long a finished request's output was (for ``output_quantile``)."""
        with self._lock:
            self._advice.record_output(completion_tokens)

    def _expected_ends(self, ordered: list[int] | None, now: float) -> list[tuple[float, Handle]]:
        """When each live handle is taken to free its reservation (lock held): see
        :func:`.forecast.expected_ends`. Its progress is what was relayed where it was,
        else what the engine's speed made of it since its admission."""
        self._advance(now)
        progress = self._decoding.progress
        live = [
            (h, h.generated if h.generated is not None else progress - h.progress_at_admit)
            for h in self._live.values()
        ]
        drain = Drain(self.rate_at, self.decode_rate, self.release_margin, self.overrun)
        return expected_ends(live, now, drain, ordered=ordered, quantile=self.output_quantile)

    def retry_after(
        self,
        need: int,
        now: float,
        *,
        duration: float = 0.0,
        promise: bool = False,
        client: Hashable | None = None,
        ask: Ask | None = None,
    ) -> float:
        """Seconds until ``need`` tokens fit, from when in-flight reservations are due to end.
        ``ask``: the request itself, counted as admission would count it (its prefix, its
        sequences, its forecast and clock); ``need`` beyond its own is what waits ahead of it.

        Each live handle frees its reservation at its worst-case end (its cap, at the engine's
        speed as measured: see :meth:`_expected_ends`). The answer is
        the earliest of those moments at which ``need`` fits, so it is an upper bound for the
        current load: requests that stop early free their share sooner. With
        ``output_quantile`` (say 0.9) and enough finished requests seen, a handle is expected to
        end by the time that quantile of the recent outputs longer than what it has generated
        takes to decode, if that is sooner than its cap: an estimate that holds in most cases
        rather than in all, and is much closer when outputs stop well before their caps.

        With ``promise=True`` the answer is also remembered as a promise that ``client`` (the
        connection's address, say) holds ``need`` tokens for ``duration`` seconds from then, so
        that clients turned away together are told staggered times (see :mod:`.advice`). A live
        handle is never taken as released before it is: while the budget is held, the answer is
        not "fits now". Returns 0.0 when it fits now; callers clamp it for the header.
        """
        with self._lock:
            self._advice.forget(now, client if promise else None)
            ordered = self._advice.recent_outputs(self.output_quantile)
            live = self._expected_ends(ordered, now)
            sequences = 1 if ask is None else ask.sequences
            if self._peak_in_force():
                fresh = freshest(self._live.values(), now)
                counted, later = self._asked(ask, need, now, fresh)
                when = earliest_peak_fit(
                    now, live, lambda h: self._holder(h, fresh, now), counted, later=later,
                    sequences=sequences, usable=self.usable_tokens - self._unknown,
                    block_size=self.block_size, tainted=self._tainted,
                    max_concurrency=self.max_concurrency,
                )  # fmt: skip
                return max(0.0, when - now)
            horizon = None
            if ordered is not None and self.output_quantile is not None:
                horizon = quantile_above(ordered, -1, self.output_quantile)
            if horizon is not None:  # a new request's own likely length
                duration = min(duration, horizon / self.decode_rate)
            fit = functools.partial(
                earliest_fit, usable=self.usable_tokens - self._unknown,
                max_concurrency=self.max_concurrency, sequences=sequences,
            )  # fmt: skip
            margin = self.release_margin
            chosen = self._advice.earliest(need, now, live, fit, duration, margin, promise, client)
            return max(0.0, chosen - now)

    def _asked(
        self, ask: Ask | None, need: int, now: float, fresh: float
    ) -> tuple[list[Holder], list[Holder]]:
        """The holders a newcomer is counted as under the peak rule, admitted now and admitted
        later (flat: its clock would start then), with what waits ahead of it (lock held)."""
        if ask is None:
            return [Holder.flat(need)], [Holder.flat(need)]
        probe = self._newcomer(ask, now)
        counted = self._holder(probe, fresh, now)
        probe.start_by = None
        later = self._holder(probe, fresh, now)
        ahead = [Holder.flat(need - ask.need)] if need > ask.need else []
        return [counted, *ahead], [later, *ahead]

    def outstanding_promises(self) -> int:
        """Clients told to come back whose promised time has not run out."""
        with self._lock:
            return len(self._advice)

    def headroom(self, now: float, *, releasing: Handle | None = None, queued: int = 0) -> Headroom:
        """What is free now and when the next reservation is due to end.

        ``releasing`` is a handle about to be given back (an answer sent just before its
        ``finally``): counted as free already. ``queued`` tokens wait in a queue ahead of any
        newcomer, so they are not free for it.
        """
        with self._lock:
            reserved = self._committed(now, without=releasing)
            inflight = len(self._live)
            soonest = math.inf
            for end, handle in self._expected_ends(None, now):
                if handle is releasing:
                    inflight -= 1
                elif end < soonest:
                    soonest = end
        free = self.usable_tokens - reserved - queued
        if self.max_concurrency is not None and inflight >= self.max_concurrency:
            free = 0
        return Headroom(
            usable=self.usable_tokens,
            free=max(0, free),
            next_release_in=max(0.0, soonest - now) if soonest != math.inf else 0.0,
            advertised=self.strategy == "reserve",
        )
