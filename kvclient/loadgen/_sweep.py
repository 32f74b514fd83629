"""The sweep's decisions (pure): which arrival rates to try, which pass, and where the knee is.

A sweep first measures what the server completes flat out (a closed loop), then runs open loops
at rates around that figure. A rate *passes* when at least ``attainment`` of the requests offered
at it complete within the SLOs; the knee is the highest passing rate below the lowest failing one.
The first rates are a coarse grid; the rest bisect between the last pass and the first failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._metrics import Summary

__all__ = [
    "DEFAULT_ATTAINMENT",
    "GRID",
    "SweepPoint",
    "knee",
    "next_rate",
    "passes",
]

#: Share of offered requests that must complete within the SLOs for a rate to pass.
DEFAULT_ATTAINMENT = 0.9
#: The first rates tried, as multiples of the measured flat-out throughput.
GRID = (0.6, 0.9, 1.2, 1.6)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    rate: float
    summary: Summary
    passed: bool


def passes(summary: Summary, attainment: float = DEFAULT_ATTAINMENT) -> bool:
    """Whether a run's share of offered requests completed within its SLOs is high enough."""
    share = summary.slo_attainment
    return share is not None and summary.offered > 0 and share >= attainment


def _bounds(points: Sequence[SweepPoint]) -> tuple[float | None, float | None]:
    """The lowest failing rate, and the highest passing rate below it."""
    failing = [p.rate for p in points if not p.passed]
    low_fail = min(failing) if failing else None
    passing = [p.rate for p in points if p.passed and (low_fail is None or p.rate < low_fail)]
    return (max(passing) if passing else None), low_fail


def knee(points: Sequence[SweepPoint]) -> float | None:
    """The highest rate that passed with no lower rate failing; None when none passed."""
    return _bounds(points)[0]


def next_rate(points: Sequence[SweepPoint], capacity: float, budget: int) -> float | None:
    """The next rate to try, or None when the sweep is done (``budget`` points in all).

    >>> next_rate([], capacity=10.0, budget=6)
    6.0
    """
    if len(points) >= budget:
        return None
    tried = {round(p.rate, 9) for p in points}
    for factor in GRID:
        rate = factor * capacity
        if round(rate, 9) not in tried:
            high_pass, low_fail = _bounds(points)
            if low_fail is not None and rate > low_fail:
                break  # the grid has already crossed the knee
            return rate
    high_pass, low_fail = _bounds(points)
    if low_fail is None:
        # Everything passed: go further up.
        top = max(p.rate for p in points)
        return top * 1.3
    low = high_pass if high_pass is not None else 0.0
    if high_pass is None:
        # Everything tried failed: go down towards zero.
        return low_fail / 2
    return (low + low_fail) / 2
