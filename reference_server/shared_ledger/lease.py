"""A gateway process's lease on the shared ledger: every reservation it holds carries it, and
Redis sweeps them once it expires unrenewed (see :mod:`.scripts`).

The lease is renewed every ``ttl / 3`` seconds from a thread of its own, over a synchronous Redis
client, so an event loop that falls seconds behind (a busy gateway on a loaded machine) does not
let it lapse while its requests stream. The thread renews only while the loop shows it runs: the
loop stamps a heartbeat every ``ttl / 3`` seconds, and a heartbeat older than ``stall_limit``
(``STALL_LEASES`` leases unless given) stops the renewals. So a process whose loop is wedged for
good loses its reservations as a dead one does, within ``stall_limit + ttl`` of its last
heartbeat, where a process that dies loses them within ``ttl``.

What needs the loop stays on it (:meth:`~.ledger.RedisLedger.tend`): releases and queue exits
that failed while Redis was away are retried there, and what a renewal found is settled there: a
lease that had lapsed (Redis swept its reservations) or that Redis no longer knows (it lost its
data), after which what the process still holds is put back. The thread hands those answers to
the loop (``call_soon_threadsafe``) and never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import redis

from ..admission.queue import LedgerUnavailable
from .connection import LEDGER_ERRORS
from .scripts import DEFAULT_LEASE_SECONDS, RENEW

if TYPE_CHECKING:
    from .ledger import RedisLedger

__all__ = ["DEFAULT_LEASE_SECONDS", "STALL_LEASES", "Lease"]

logger = logging.getLogger("kvclient.gateway")

#: Leases the event loop may go without a heartbeat before the lease is no longer renewed: many
#: times a step of a busy loop (2-4 s measured, a whole process's stall 11.5 s), so that load
#: never costs a live process its lease; few enough that a wedged process pins the shared budget
#: for a few leases more than a dead one.
STALL_LEASES = 2.0


class Lease:
    """One process's lease, renewed for every shared ledger it holds reservations in.

    :meth:`run` renews it from a thread of its own while the event loop's heartbeat is under
    ``stall_limit`` seconds old (``STALL_LEASES`` leases by default), and tends every ledger on
    the loop, until cancelled. ``on_state`` is told True when Redis is reachable again after a
    failure, False when it stops being reachable.
    """

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_LEASE_SECONDS,
        on_state: Callable[[bool], None] | None = None,
        stall_limit: float | None = None,
    ) -> None:
        if not 0 < ttl < 3600:
            raise ValueError(f"the lease must be > 0 and < 3600 seconds, got {ttl}")
        if stall_limit is not None and stall_limit <= 0:
            raise ValueError(f"the stall limit must be > 0 seconds, got {stall_limit}")
        self.id = uuid.uuid4().hex[:16]
        self.ttl = ttl
        self.stall_limit = STALL_LEASES * ttl if stall_limit is None else stall_limit
        self.ledgers: list[RedisLedger] = []
        #: Times a renewal found the lease lapsed while this process held reservations (they
        #: were put back).
        self.lapsed_total = 0
        self.reachable = True
        #: When the event loop last stepped (``time.monotonic()``), as :meth:`run` stamps it.
        self.beat = time.monotonic()
        self._on_state = on_state
        self._wake: anyio.Event | None = None

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

    def handed(self, ledger: RedisLedger, kept: int) -> None:
        """On the loop: a renewal off it found ``kept`` (RENEW's answer, not 1) for ``ledger``."""
        ledger.found(kept)
        if self._wake is not None:
            self._wake.set()

    async def tend(self) -> None:
        """What the renewal leaves to the loop, for every ledger (see :meth:`RedisLedger.tend`);
        stops at the first that finds Redis away."""
        for ledger in list(self.ledgers):
            try:
                await ledger.tend()
            except LedgerUnavailable:
                return

    async def run(self, client: redis.Redis) -> None:
        """Renew the lease from a thread of its own over ``client`` (synchronous: see
        :func:`~.connection.connect_sync`; the caller closes it) and tend the ledgers on the
        loop, every ``ttl / 3`` seconds (sooner when the thread found something) until
        cancelled; the thread is stopped and joined on the way out."""
        self._wake = anyio.Event()
        self.beat = time.monotonic()
        keeper = _Keeper(self, client, asyncio.get_running_loop())
        keeper.start()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._heartbeat)
                while True:
                    with anyio.move_on_after(self.ttl / 3):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    await self.tend()
        finally:
            with anyio.CancelScope(shield=True):
                await keeper.stop()

    async def _heartbeat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await anyio.sleep(min(self.ttl, self.stall_limit) / 3)


class _Keeper:
    """The thread that renews a lease (see the module)."""

    def __init__(self, lease: Lease, client: redis.Redis, loop: asyncio.AbstractEventLoop) -> None:
        self._lease = lease
        self._loop = loop
        self._renew = client.register_script(RENEW)
        self._stop = threading.Event()
        self._stalled = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvclient-lease-{lease.id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and wait for it (a renewal under way ends first)."""
        self._stop.set()
        await anyio.to_thread.run_sync(self._thread.join)

    def _run(self) -> None:
        while True:
            try:
                self.renew()
            except Exception:  # a thread that died would leave the lease to lapse unseen
                logger.exception("shared ledger: renewing the lease failed")
            if self._stop.wait(self._lease.ttl / 3):
                return

    def renew(self) -> None:
        """Renew the lease in every ledger, if the loop stepped lately; hand the loop what it
        must settle."""
        lease = self._lease
        quiet = time.monotonic() - lease.beat
        if quiet > lease.stall_limit:
            if not self._stalled:
                logger.warning(
                    "shared ledger: the event loop has not stepped for %.1f s (the bound is "
                    "%.1f s); the lease is no longer renewed and lapses as a dead process's",
                    quiet,
                    lease.stall_limit,
                )
            self._stalled = True
            return
        if self._stalled:
            logger.warning("shared ledger: the event loop steps again; renewing the lease")
        self._stalled = False
        reachable: bool | None = None  # None: nothing asked of Redis
        for ledger in list(lease.ledgers):
            if self._stop.is_set():
                return
            try:
                kept = int(self._renew(keys=ledger.keys, args=[lease.id, lease.ttl_ms]))
            except LEDGER_ERRORS:
                reachable = False
                break
            reachable = True
            if kept != 1:
                self._tell(lease.handed, ledger, kept)
        if reachable is not None:
            self._tell(lease.mark, reachable)

    def _tell(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody left to tell
            self._loop.call_soon_threadsafe(callback, *args)
