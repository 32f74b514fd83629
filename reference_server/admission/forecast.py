"""When the holders are due to end, and when a request fits: the ledger's advice (Retry-After,
``RateLimit``'s reset), pure. No lock, no clock: the ledger gives each function what it knows
now, under its lock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

from .peak import Holder, peak
from .values import Handle, _Promise

__all__ = ["Drain", "earliest_fit", "earliest_peak_fit", "expected_ends", "quantile_above"]

#: Recent outputs longer than what a running holder has generated that are needed to estimate
#: its end from them (fewer: its cap).
MIN_TAIL = 10


def quantile_above(ordered: Sequence[int], generated: float, quantile: float) -> int | None:
    """The ``quantile`` of the recent outputs (``ordered``) longer than ``generated`` tokens.

    None when fewer than ``MIN_TAIL`` were: nothing seen vouches for an end before the cap.
    """
    first = bisect.bisect_right(ordered, generated)
    tail = len(ordered) - first
    if tail < MIN_TAIL:
        return None
    return ordered[first + max(0, math.ceil(quantile * tail) - 1)]


@dataclass(frozen=True, slots=True)
class Drain:
    """How the engine drains its holders: one sequence's speed while ``n`` decode together
    (``rate_at``), the speed alone, the seconds an end takes to land (``margin``), and the
    longest a finished answer may wait on its client (``overrun``)."""

    rate_at: Callable[[int], float]
    decode_rate: float
    margin: float
    overrun: float


def expected_ends(
    live: Sequence[tuple[Handle, float]],
    now: float,
    drain: Drain,
    *,
    ordered: Sequence[int] | None = None,
    quantile: float | None = None,
) -> list[tuple[float, Handle]]:
    """When each live handle (with the tokens it has generated) is taken to free its
    reservation, always later than ``now``.

    A handle ends when it has generated its length: the ``quantile`` of the recent outputs
    (``ordered``) longer than what it has generated so far (it is still running: shorter ones
    say nothing about it), if at least ``MIN_TAIL`` were and that is before its cap; otherwise
    its cap (once a holder has outlived what the recent outputs can vouch for, its remaining
    cap is all that is known). The running handles share the engine's decode steps: the one
    with the fewest tokens left ends first, and the others decode faster once it has gone. Each
    end is ``margin`` after its last token. A handle already at its length ends within another
    ``margin``; later than that, ``overrun`` after it reached it; and a holder whose answer
    waits on a client that does not read, ``overrun`` (the send timeout) after the write began,
    when the server cuts it; a request already cut, when the engine is taken to let it go
    (``cut_by``). Never sooner than ``margin`` (or one token) from now: it is still
    held, and a sequence takes that long to wind down.
    """
    margin = drain.margin
    soonest = now + max(margin, 1.0 / drain.decode_rate)
    rate_now = drain.rate_at(len(live))
    ends: list[tuple[float, Handle]] = []
    running: list[tuple[float, Handle]] = []
    for handle, generated in live:
        if handle.cut_by is not None:  # cut: held until the engine lets it go
            ends.append((max(handle.cut_by, soonest), handle))
            continue
        writing = handle.writing_since
        if writing is not None and now - writing > margin:
            ends.append((max(writing + drain.overrun, soonest), handle))  # cut then
            continue
        length: float = handle.output_cap
        if ordered is not None and quantile is not None:
            likely = quantile_above(ordered, generated, quantile)
            if likely is not None and likely < length:
                length = likely
        left = length - generated
        if left > 0:
            running.append((left, handle))
            continue
        reached = now + left / rate_now  # when it generated its length
        end = reached + margin
        if end <= now:
            end += margin
        if end <= now:
            end = reached + margin + drain.overrun
        ends.append((max(end, soonest), handle))
    running.sort(key=lambda item: item[0])
    t, done, decoding = now, 0.0, len(running)
    for left, handle in running:
        t += (left - done) / drain.rate_at(decoding)
        done, decoding = left, decoding - 1
        ends.append((max(t + margin, soonest), handle))
    return ends


def _fits_at(
    need: int,
    t: float,
    live: Sequence[tuple[float, Handle]],
    promises: Sequence[_Promise],
    usable: int,
    max_concurrency: int | None,
    sequences: int = 1,
) -> bool:
    """Whether ``need`` (of ``sequences`` sequences) fits at ``t`` among the live handles not
    yet ended and the promised returns under way."""
    tokens = places = 0
    for end, handle in live:
        if end > t:
            tokens += handle.reserved_tokens
            places += handle.sequences
    for promise in promises:
        if promise.start <= t < promise.end:
            tokens += promise.tokens
            places += 1
    if max_concurrency is not None and places + sequences > max_concurrency:
        return False
    return tokens + need <= usable


def earliest_fit(
    need: int,
    now: float,
    live: Sequence[tuple[float, Handle]],
    promises: Sequence[_Promise],
    duration: float,
    *,
    usable: int,
    max_concurrency: int | None,
    sequences: int = 1,
) -> float:
    """The first moment from ``now`` at which ``need`` (of ``sequences`` sequences, each taking
    a place) fits among ``live`` (ends and handles) and ``promises``, whole reservations
    counted."""
    candidates = sorted({now} | {end for end, _ in live} | {p.end for p in promises})
    for t in candidates:
        # It must fit when it starts and whenever a promised return starts after that.
        checkpoints = [t] + [p.start for p in promises if t < p.start < t + duration]
        if all(
            _fits_at(need, c, live, promises, usable, max_concurrency, sequences)
            for c in checkpoints
        ):
            return t
    return candidates[-1]  # by then everything in sight is released


def earliest_peak_fit(
    now: float,
    live: Sequence[tuple[float, Handle]],
    holder_of: Callable[[Handle], Holder],
    newcomer: Sequence[Holder],
    *,
    later: Sequence[Holder] | None = None,
    sequences: int = 1,
    usable: int,
    block_size: int,
    tainted: Collection[Hashable] = (),
    max_concurrency: int | None = None,
) -> float:
    """The first moment from ``now`` at which the ``newcomer`` (its holders as admission counts
    them now, of ``sequences`` sequences) fits under the peak rule. ``later``: flat holders it
    is counted as if admitted after now (a trajectory counted from now no longer applies).

    At a holder's expected end every holder still running has advanced as many steps as it
    had left (they decode in lockstep): the peak from then on is the peak over the steps after
    those. Flat holders count until their own expected end, and its places must be free among
    ``max_concurrency``. Promised returns are not counted (the gateway does not stagger).
    """
    holders = {id(h): holder_of(h) for _, h in live}
    advanced: list[tuple[float, int]] = [(now, 0)]
    for end, handle in live:
        steps_left = holders[id(handle)].steps_left
        if steps_left is not None:
            advanced.append((end, steps_left))
    for t in sorted({now} | {end for end, _ in live}):
        steps = max(s for at, s in advanced if at <= t)
        running = [(holders[id(h)], h.sequences) for end, h in live if end > t]
        places = sum(n for _, n in running) + sequences
        if max_concurrency is not None and places > max_concurrency:
            continue  # no place in the engine's batch yet
        coming = newcomer if t == now or later is None else later
        alive = [holder for holder, _ in running] + list(coming)
        if peak(alive, block_size=block_size, after=steps, tainted=tainted) <= usable:
            return t
    return max((end for end, _ in live), default=now)
