"""A tenant's terms and the fair shares' policy: what the operator sets (``--tenants``) and every
gateway sharing a ledger must agree on. Pure values, checked when made; the scheduler that
applies them is :mod:`.fairness`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_MAX_BYPASS",
    "DEFAULT_TENANT",
    "LOWER_CLASS_PASSES",
    "PRIORITY_RANGE",
    "FairPolicy",
    "Tenant",
]

#: The tenant every request without a listed identity is counted as: they share its terms.
DEFAULT_TENANT = "default"
#: Admissions of its own class a waiter that does not fit may be passed by before it holds back
#: those behind it: enough to keep the budget busy while it waits for room, few enough that a
#: stream of small requests cannot put it off for long.
DEFAULT_MAX_BYPASS = 4
#: Admissions of a lower class a waiter of a higher class may be passed by (it does not fit now).
LOWER_CLASS_PASSES = 1
#: Priority classes that may be asked for or granted: a bound that keeps them small integers.
PRIORITY_RANGE = range(-1000, 1001)


def _finite(name: str, value: float, *, low: float, strict: bool) -> None:
    ok = value > low if strict else value >= low
    if isinstance(value, bool) or not (ok and math.isfinite(value)):
        sign = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {sign} {low}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    """One tenant's terms: its ``weight`` (its share against the others'), the most of the
    budget it may hold at once and of the queue's places it may keep (``max_share``, a
    fraction), the longest its requests may wait for room (``max_queue_wait`` seconds; None:
    the queue's own bound), and the priority classes it may ask for (``priorities``)."""

    weight: float = 1.0
    max_share: float = 1.0
    max_queue_wait: float | None = None
    priorities: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        _finite("weight", self.weight, low=0.0, strict=True)
        _finite("max_share", self.max_share, low=0.0, strict=True)
        if self.max_share > 1.0:
            raise ValueError(f"max_share must be at most 1, got {self.max_share!r}")
        if self.max_queue_wait is not None:
            _finite("max_queue_wait", self.max_queue_wait, low=0.0, strict=False)
        if not self.priorities:
            raise ValueError("priorities must list at least one class")
        for p in self.priorities:
            if isinstance(p, bool) or not isinstance(p, int) or p not in PRIORITY_RANGE:
                raise ValueError(
                    f"priorities must be integers from {PRIORITY_RANGE.start} to "
                    f"{PRIORITY_RANGE.stop - 1}, got {p!r}"
                )

    def grant(self, asked: int) -> int:
        """The class a request asking for ``asked`` is served in: ``asked`` when granted, else
        the most urgent granted class that is no more urgent than ``asked`` (a class above the
        grant gets the tenant's best; one below its worst, its worst)."""
        if asked in self.priorities:
            return asked
        later = [p for p in self.priorities if p >= asked]
        return min(later) if later else max(self.priorities)


@dataclass(frozen=True, slots=True, kw_only=True)
class FairPolicy:
    """The tenants by name, the terms of every other (``default``), and the most requests that
    may wait at once (``max_queued``; None: no bound but their waits)."""

    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    default: Tenant = field(default_factory=Tenant)
    max_queued: int | None = None
    max_bypass: int = DEFAULT_MAX_BYPASS

    def __post_init__(self) -> None:
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {self.max_queued}")
        if self.max_bypass < 0:
            raise ValueError(f"max_bypass must be >= 0, got {self.max_bypass}")

    def resolve(self, name: str | None) -> str:
        """The tenant ``name`` is counted as: itself when listed, else :data:`DEFAULT_TENANT`."""
        return name if name is not None and name in self.tenants else DEFAULT_TENANT

    def terms(self, name: str) -> Tenant:
        return self.tenants.get(name, self.default)

    def places(self, name: str) -> int | None:
        """The most of ``max_queued`` places tenant ``name`` may keep (None: no bound)."""
        if self.max_queued is None:
            return None
        return max(1, math.floor(self.terms(name).max_share * self.max_queued))
