"""An engine's decode speed, measured from its own counters (pure).

Two scrapes of an engine's ``/metrics`` (see ``kvclient._dialects.decode_counters``) say how many
tokens it generated in between and how many sequences were running: one point, ``n`` sequences
and the seconds a decode step took. A step makes one token for every running sequence and takes
longer the more there are, ``s(n) = a + b n``; the line is fitted over the last minute of points
by Theil-Sen (the median of the slopes between points, then the median intercept), so a few odd
intervals (a burst ending mid-interval, a pause) do not move it. The ledger then decodes one
sequence at ``1 / (a + b)`` tokens/s and a large batch at ``1 / b`` tokens/s in all (see
``KVAdmissionController.rate_at``).

Points come only from intervals in which the engine decoded throughout (sequences running at
both scrapes): a partly idle interval would make its steps look slow. Where the engine counts
its steps (llama.cpp), the sequences that ran are its tokens over its steps; where it only
gauges them, an interval counts when the gauge reads the same at both ends.

>>> from kvclient._dialects import DecodeCounters
>>> speed = SpeedEstimator()
>>> scrapes = [(0, 1), (91, 1), (177, 2), (331, 2), (566, 4), (801, 4), (1087, 6), (1373, 6)]
>>> for second, (tokens, running) in enumerate(scrapes):
...     speed.add(float(second), DecodeCounters(tokens, running))
>>> estimate = speed.estimate()   # the engine: a step takes 9 ms + 2 ms per sequence
>>> round(estimate.decode_rate), round(estimate.throughput or 0)
(91, 500)
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kvclient._dialects import DecodeCounters

__all__ = ["Speed", "SpeedEstimator"]

#: Points kept (one per scrape interval): about a minute at the gateway's one scrape a second.
_WINDOW = 60
#: Points needed before there is an estimate.
_MIN_POINTS = 3
#: Two points whose running sequences differ by less than this say nothing about the slope.
_MIN_SPREAD = 0.5
#: Bounds on what is believed (tokens per second): beyond them a counter is broken.
_SLOWEST, _FASTEST = 0.01, 1e7


@dataclass(frozen=True, slots=True)
class Speed:
    """One sequence's decode rate alone, and the engine's tokens/s with a large batch (None when
    its steps do not measurably lengthen with more sequences)."""

    decode_rate: float
    throughput: float | None


class SpeedEstimator:
    """Feeds on successive scrapes of one engine (:meth:`add`); :meth:`estimate` fits them."""

    def __init__(self, window: int = _WINDOW) -> None:
        self._last: tuple[float, DecodeCounters] | None = None
        #: (sequences running, seconds per decode step)
        self._points: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, now: float, counters: DecodeCounters) -> None:
        """One scrape at ``now`` (seconds, any monotonic clock)."""
        last, self._last = self._last, (now, counters)
        if last is None:
            return
        then, before = last
        seconds = now - then
        tokens = counters.generated - before.generated
        if seconds <= 0 or tokens <= 0:
            return  # idle, a restarted engine (its counters began again), or a clock glitch
        if not (before.running and counters.running):
            return  # not decoding throughout (or no gauge): its steps would look slow
        if counters.steps is not None and before.steps is not None:
            steps = counters.steps - before.steps
            if steps <= 0:
                return
            running = tokens / steps
        elif before.running == counters.running:
            running = counters.running
            steps = tokens / running
        else:
            return  # sequences came or went meanwhile: how many ran, and how long, is unknown
        rate = tokens / seconds
        if not _SLOWEST <= rate <= _FASTEST:
            return
        self._points.append((max(1.0, running), seconds / steps))

    def estimate(self) -> Speed | None:
        """The fitted speed, None until there are enough points."""
        points = list(self._points)
        if len(points) < _MIN_POINTS:
            return None
        slopes = [
            (s2 - s1) / (n2 - n1)
            for i, (n1, s1) in enumerate(points)
            for n2, s2 in points[i + 1 :]
            if abs(n2 - n1) >= _MIN_SPREAD
        ]
        per_sequence = max(0.0, statistics.median(slopes)) if len(slopes) >= _MIN_POINTS else 0.0
        fixed = max(0.0, statistics.median(s - per_sequence * n for n, s in points))
        one = fixed + per_sequence
        if one <= 0:
            return None
        decode_rate = min(_FASTEST, max(_SLOWEST, 1.0 / one))
        throughput = None
        if per_sequence > 0:
            throughput = min(_FASTEST, max(_SLOWEST, 1.0 / per_sequence))
        return Speed(decode_rate=decode_rate, throughput=throughput)
