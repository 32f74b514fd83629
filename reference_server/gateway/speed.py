"""An engine's decode speed, measured from its own counters (pure).

Two scrapes of an engine's ``/metrics`` (see ``kvclient.engines.metrics.decode_counters``) say how
many tokens it generated in between; the gateway's ledger says how many of its requests were running
meanwhile, on average over the time any was (``KVAdmissionController.occupancy``). Together:
one point, ``n`` sequences and the seconds a decode step took. A step makes one token for every
running sequence and takes longer the more there are, ``s(n) = a + b n``; the line is fitted
over the last minute of points by Theil-Sen (the median of the slopes between points, then the
median intercept), so a few odd intervals do not move it. The ledger then decodes one sequence
at ``1 / (a + b)`` tokens/s and a large batch at ``1 / b`` tokens/s in all (see
``KVAdmissionController.rate_at``).

Where the engine counts its steps (llama.cpp), the sequences that ran are its tokens over its
steps. Elsewhere the count of running requests is the ledger's: with a shared ledger
(``--ledger``), every gateway's holders, read from Redis, so gateways that share an engine each
measure it whole. It is exact when the gateways are the engine's only clients; other traffic
adds tokens no holder of theirs made, and the engine looks faster per sequence than it is.

>>> from kvclient.engines.metrics import DecodeCounters
>>> speed = SpeedEstimator()
>>> tokens = held = busy = 0.0
>>> speed.add(DecodeCounters(tokens), held, busy)
>>> for running in [1, 2, 4, 6]:   # an engine whose step takes 9 ms + 2 ms per sequence
...     tokens += running / (0.009 + 0.002 * running)   # one second of decoding
...     held, busy = held + running, busy + 1.0
...     speed.add(DecodeCounters(tokens), held, busy)
>>> estimate = speed.estimate()
>>> round(estimate.decode_rate), round(estimate.throughput or 0)
(91, 500)
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kvclient.engines.metrics import DecodeCounters

__all__ = ["Speed", "SpeedEstimator"]

#: Points kept (one per scrape interval): about a minute at the gateway's one scrape a second.
_WINDOW = 60
#: Points needed before there is an estimate.
_MIN_POINTS = 2
#: Two points whose running sequences differ by less than this say nothing about the slope.
_MIN_SPREAD = 0.5
#: Tokens an interval must have generated to be a point: a few short requests (a probe of one
#: token, say) are mostly the time around their decoding, and would make the steps look slow.
_MIN_TOKENS = 64
#: Tokens per request admitted in an interval below which the interval is left out.
_MIN_TOKENS_PER_REQUEST = 8
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
        #: The scrape the next point is measured from: (counters, handle-seconds, busy seconds,
        #: requests admitted).
        self._anchor: tuple[DecodeCounters, float, float, int] | None = None
        #: (sequences running, seconds per decode step)
        self._points: deque[tuple[float, float]] = deque(maxlen=window)

    def add(
        self,
        counters: DecodeCounters,
        held_seconds: float,
        busy_seconds: float,
        admitted: int = 0,
    ) -> None:
        """One scrape, with the ledger's :meth:`~KVAdmissionController.occupancy` read with it
        (handle-seconds, busy seconds and requests admitted so far).

        An interval that generated fewer than ``_MIN_TOKENS`` is joined to the next (a slow
        engine makes a point every few scrapes); one whose requests made fewer than
        ``_MIN_TOKENS_PER_REQUEST`` tokens each is left out: such requests are mostly the time
        around their decoding (a one-token probe, a long prompt's prefill)."""
        current = (counters, held_seconds, busy_seconds, admitted)
        anchor = self._anchor
        if anchor is None:
            self._anchor = current
            return
        before, held_before, busy_before, admitted_before = anchor
        tokens = counters.generated - before.generated
        busy = busy_seconds - busy_before
        held = held_seconds - held_before
        if tokens < 0 or busy < 0 or held < 0:
            self._anchor = current  # a restarted engine: its counters began again
            return
        requests = admitted - admitted_before
        if requests > 0 and tokens < _MIN_TOKENS_PER_REQUEST * requests:
            self._anchor = current  # short requests, mostly not decoding: left out
            return
        if tokens < _MIN_TOKENS:
            return  # too few tokens yet: joined to the next interval
        self._anchor = current
        if busy <= 0 or held <= 0:
            return
        if counters.steps is not None and before.steps is not None:
            steps = counters.steps - before.steps
            if steps <= 0:
                return
            running = tokens / steps
        else:
            running = held / busy
            steps = tokens / running
        if not _SLOWEST <= tokens / busy <= _FASTEST:
            return
        self._points.append((max(1.0, running), busy / steps))

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
