"""A gateway process's lease on the shared ledger: every reservation it holds carries it, and
Redis sweeps them once it expires unrenewed (see :mod:`.scripts`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from ..admission.queue import LedgerUnavailable
from .scripts import DEFAULT_LEASE_SECONDS

if TYPE_CHECKING:
    from .ledger import RedisLedger

__all__ = ["DEFAULT_LEASE_SECONDS", "Lease"]

logger = logging.getLogger("kvclient.gateway")


class Lease:
    """One process's lease, renewed for every shared ledger it holds reservations in.

    :meth:`run` renews every ``ttl / 3`` seconds until cancelled; releases that failed while Redis
    was away are retried then. ``on_state`` is told True when Redis is reachable again after a
    failure, False when it stops being reachable.
    """

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_LEASE_SECONDS,
        on_state: Callable[[bool], None] | None = None,
    ) -> None:
        if not 0 < ttl < 3600:
            raise ValueError(f"the lease must be > 0 and < 3600 seconds, got {ttl}")
        self.id = uuid.uuid4().hex[:16]
        self.ttl = ttl
        self.ledgers: list[RedisLedger] = []
        self.lapsed_total = 0
        self.reachable = True
        self._on_state = on_state

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))

    def mark(self, reachable: bool) -> None:
        """Record whether Redis answered; log and tell ``on_state`` on a change."""
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if reachable:
            logger.warning("shared ledger: Redis is reachable again; admitting new requests")
        else:
            logger.warning(
                "shared ledger: Redis is unreachable; new requests are refused (503), "
                "admitted ones finish"
            )
        if self._on_state is not None:
            self._on_state(reachable)

    async def renew_once(self) -> None:
        for ledger in list(self.ledgers):
            try:
                await ledger.renew()
            except LedgerUnavailable:
                return

    async def run(self) -> None:
        while True:
            await self.renew_once()
            await anyio.sleep(self.ttl / 3)
