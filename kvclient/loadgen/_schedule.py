"""Arrival schedules, fixed in advance (pure).

An open-loop load generator must decide when each request is sent *before* the run starts: if it
waited for answers to pace itself, a slow server would slow the arrivals and hide its own latency
(coordinated omission). Each function returns send offsets in seconds from the start, sorted.
"""

from __future__ import annotations

import math
import random
from typing import Literal

__all__ = ["ArrivalKind", "arrival_offsets"]

ArrivalKind = Literal["poisson", "constant", "gamma"]


def arrival_offsets(
    *,
    rate: float,
    kind: ArrivalKind = "poisson",
    num_requests: int | None = None,
    duration: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Planned send times for an open loop at ``rate`` requests per second.

    ``poisson``: exponential gaps; ``constant``: one every ``1/rate`` s; ``gamma``: gamma gaps
    with shape ``burstiness`` and the same mean (1.0 is Poisson, below 1 burstier, above 1
    smoother; vLLM's ``--burstiness`` convention). At least one of ``num_requests`` and
    ``duration`` bounds the schedule; with both, whichever comes first.

    >>> arrival_offsets(rate=2, kind="constant", num_requests=3)
    [0.0, 0.5, 1.0]
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    if num_requests is None and duration is None:
        raise ValueError("bound the schedule with num_requests, duration, or both")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if duration is not None and not (duration >= 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a finite number of seconds >= 0, got {duration!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    if kind not in ("poisson", "constant", "gamma"):
        raise ValueError(f"unknown arrival kind {kind!r}: poisson, constant or gamma")

    rng = random.Random(seed)
    mean_gap = 1.0 / rate
    offsets: list[float] = []
    t = 0.0
    # The first request goes at t=0 so that short runs are not dominated by an initial gap.
    while num_requests is None or len(offsets) < num_requests:
        if duration is not None and t > duration:
            break
        offsets.append(t)
        if kind == "constant":
            t = len(offsets) * mean_gap  # no drift from summing floats
        elif kind == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, mean_gap / burstiness)
    return offsets
