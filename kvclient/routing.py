"""Where a reservation goes: pure rules over several endpoints, no I/O.

Shared by the gateway (its upstreams) and any client that spreads load over replicas. Each
endpoint is seen as an :class:`Endpoint`: how much KV budget it has free (advertised, or the
ledger's own), how many requests it has in flight, whether it is in service. A request of
``need`` KV tokens goes where it fits with the most room left; an endpoint that keeps failing is
set aside for a while and then tried again by one request (a half-open probe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Endpoint", "Health", "pick", "ranked"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One endpoint as the router sees it at one instant."""

    #: KV tokens free now (None when unknown: then only in-flight counts).
    free: int | None
    #: Requests in flight there.
    in_flight: int = 0
    #: False while it is set aside after failures.
    in_service: bool = True
    #: KV tokens (prompt + output cap) of the requests in flight there, when known.
    in_flight_tokens: int = 0


def ranked(endpoints: Sequence[Endpoint], need: int) -> list[int]:
    """Indexes of the in-service endpoints where ``need`` tokens fit now, best first: the most
    free budget left after the request, then the fewest KV tokens in flight, then the fewest
    requests in flight, then the lowest index (so equal endpoints are used in a stable order)."""
    fitting = [
        i for i, e in enumerate(endpoints) if e.in_service and (e.free is None or e.free >= need)
    ]
    return sorted(fitting, key=lambda i: _key(endpoints[i], need, i))


def _key(e: Endpoint, need: int, i: int) -> tuple[float, int, int, int]:
    room = float("inf") if e.free is None else e.free - need
    return (-room, e.in_flight_tokens, e.in_flight, i)


def pick(endpoints: Sequence[Endpoint], need: int) -> int | None:
    """The first of :func:`ranked` when ``need`` fits somewhere; else the in-service endpoint
    with the most room (the request waits there, paced, for room to free); None when none is in
    service."""
    order = ranked(endpoints, need)
    if order:
        return order[0]
    serving = [i for i, e in enumerate(endpoints) if e.in_service]
    return min(serving, key=lambda i: _key(endpoints[i], need, i), default=None)


class Health:
    """Consecutive failures of one endpoint; set aside after ``threshold`` of them for
    ``cooldown`` seconds, then one request probes it (success puts it back, failure sets it
    aside again). Time is passed in, so the rule is tested without a clock."""

    __slots__ = ("cooldown", "failures", "out_until", "probing", "threshold")

    def __init__(self, *, threshold: int = 3, cooldown: float = 2.0) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0
        self.out_until: float | None = None
        self.probing = False

    def in_service(self, now: float) -> bool:
        """Whether requests may go there now (one probe at a time once the cooldown passed)."""
        if self.out_until is None:
            return True
        return now >= self.out_until and not self.probing

    def begin(self, now: float) -> None:
        """A request is sent there: when it was set aside, this one is the probe."""
        if self.out_until is not None and now >= self.out_until:
            self.probing = True

    def abandoned(self) -> None:
        """A request there ended without a verdict (cancelled): another may probe."""
        self.probing = False

    def succeeded(self) -> None:
        self.failures = 0
        self.out_until = None
        self.probing = False

    def failed(self, now: float, *, at_once: bool = False) -> None:
        """One more failure; ``at_once`` sets it aside whatever the count (it never answered)."""
        self.failures += 1
        self.probing = False
        if at_once or self.failures >= self.threshold or self.out_until is not None:
            self.out_until = now + self.cooldown

    @property
    def set_aside(self) -> bool:
        return self.out_until is not None
