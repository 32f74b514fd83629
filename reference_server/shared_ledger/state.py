"""One upstream's shared state as a gateway reads it from Redis: the totals every script
answers with (:class:`SharedState`), a snapshot of the holders and the waiting tickets
(:class:`Snapshot`), and what gateways sharing an upstream must agree on (:func:`fingerprint`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..admission.fairness import FairPolicy
from ..admission.ledger import KVAdmissionController
from .connection import reply_text
from .lua import ticket_need

__all__ = ["SharedState", "Snapshot", "fingerprint"]


def fingerprint(pricing: KVAdmissionController, fairness: FairPolicy | None = None) -> str:
    """What two gateways must agree on to share an upstream's budget: its pricing, and the fair
    shares' terms when it has them."""
    p = pricing
    text = (
        f"usable={p.usable_tokens} total={p.total_kv_tokens} block={p.block_size} "
        f"strategy={p.strategy} max_concurrency={p.max_concurrency} window={p.context_window}"
    )
    if fairness is not None:
        f = fairness
        terms = [(name, f.tenants[name]) for name in sorted(f.tenants)]
        listed = ",".join(
            f"{name}:{t.weight}:{t.max_share}:{t.max_queue_wait}:{','.join(map(str, t.priorities))}"
            for name, t in [*terms, ("*", f.default)]
        )
        text += f" fair={listed} max_queued={f.max_queued} max_bypass={f.max_bypass}"
    return text


@dataclass(frozen=True, slots=True)
class SharedState:
    """The shared totals of one upstream, across every gateway: tokens reserved, reservations
    held, tokens the queue waits for."""

    reserved: int = 0
    inflight: int = 0
    queued: int = 0

    @classmethod
    def parse(cls, text: Any) -> SharedState:
        """From a script's ``"reserved holders queued"``."""
        reserved, inflight, queued = reply_text(text).split(" ")
        return cls(int(reserved), int(inflight), int(queued))


class Snapshot:
    """The shared state at one moment of the Redis clock (seconds)."""

    __slots__ = ("holders", "now", "reserved", "tickets", "waiting")

    def __init__(self, raw: list[Any]) -> None:
        self.now = int(raw[0]) / 1000
        self.reserved = int(raw[1])
        flat = [reply_text(x) for x in raw[2]]
        #: (tokens, cap, admitted_at) per holder.
        self.holders: list[tuple[int, int, float]] = []
        for value in flat[1::2]:
            tokens, cap, admitted = value.split(" ", 4)[1:4]
            self.holders.append((int(tokens), int(cap), int(admitted) / 1000))
        #: Needs of the waiting tickets, in order.
        self.tickets = [reply_text(t) for t in raw[3]]
        self.waiting = [ticket_need(t) for t in self.tickets]
