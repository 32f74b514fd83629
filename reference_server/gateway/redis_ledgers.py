"""The gateway's side of the shared ledger (``--ledger redis://...``): one Redis client, one
lease and one pub/sub subscription (waiters wake when another process releases) per process, a
shared ledger and queue per upstream, the lease renewed in the background (from a thread of its
own: see :mod:`..shared_ledger.lease`), and what the gateway does while Redis is away.

Under the peak rule each process publishes its holders' progress to Redis (one publisher per
process, for every upstream: see :meth:`SharedLedgers.publish`), so that every process admits
by the peak of every process's holders.

The policy while Redis is away: new requests are refused with 503 and Retry-After (nothing can
be admitted without the shared budget), admitted ones run to their end; their releases are
retried once Redis answers again, and admission resumes by itself, with no restart.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

import anyio

from ..admission.fairness import FairPolicy
from ..admission.ledger import KVAdmissionController
from ..admission.queue import AdmissionQueue, LedgerUnavailable
from .errors import UpstreamUnavailable

if TYPE_CHECKING:
    from ..shared_ledger.books import EngineBooks
    from ..shared_ledger.lease import Lease
    from ..shared_ledger.ledger import RedisLedger
    from ..shared_ledger.queue import SharedQueue
    from ..shared_ledger.wakeups import Wakeups

__all__ = ["SharedLedgers"]

logger = logging.getLogger("kvclient.gateway")


class SharedLedgers:
    """Everything one gateway process keeps in the shared ledger at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        lease_seconds: float,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        # Imported here: redis is needed only when a ledger is shared.
        from ..shared_ledger.connection import connect, connect_sync
        from ..shared_ledger.lease import Lease
        from ..shared_ledger.wakeups import Wakeups

        self.url = url
        self.client = connect(url, ca_file=ca_file, client_cert=client_cert, client_key=client_key)
        #: The lease's thread's own client, synchronous, from the same settings.
        self._sync_client = functools.partial(
            connect_sync, url, ca_file=ca_file, client_cert=client_cert, client_key=client_key
        )
        self.lease: Lease = Lease(ttl=lease_seconds, on_state=self._state)
        self.wakeups: Wakeups = Wakeups(self.client)
        self.ledgers: list[RedisLedger] = []
        self.queues: list[SharedQueue] = []
        self.books: list[EngineBooks] = []
        #: Times Redis was found unreachable (a change from reachable).
        self.outages = 0
        #: Requests refused because Redis was away.
        self.refused = 0
        self._publish_soon = anyio.Event()

    @property
    def reachable(self) -> bool:
        return self.lease.reachable

    def _state(self, reachable: bool) -> None:
        if not reachable:
            self.outages += 1

    async def queue_for(
        self,
        name: str,
        ledger: KVAdmissionController,
        max_wait: float,
        fairness: FairPolicy | None = None,
    ) -> AdmissionQueue:
        """The shared queue of upstream ``name``, priced by ``ledger``, in fair shares by
        ``fairness`` when given; raises ``UpstreamUnavailable`` when another gateway has it
        configured differently or Redis cannot be reached (discovery is tried again later)."""
        from ..shared_ledger.fair import SharedFairQueue
        from ..shared_ledger.ledger import LedgerConflict, RedisLedger
        from ..shared_ledger.queue import SharedQueue

        shared = RedisLedger(
            self.client, name=name, pricing=ledger, lease=self.lease, fairness=fairness
        )
        try:
            await shared.join()
        except LedgerConflict as exc:
            raise UpstreamUnavailable(str(exc)) from None
        except LedgerUnavailable as exc:
            raise UpstreamUnavailable(f"the shared ledger is unreachable ({exc})") from None
        self.ledgers.append(shared)
        queue: SharedQueue
        if fairness is not None:
            queue = SharedFairQueue(
                ledger,
                shared,
                policy=fairness,
                max_wait=max_wait,
                on_refused=self._refused,
                wakeups=self.wakeups,
            )
        else:
            queue = SharedQueue(
                ledger, shared, max_wait=max_wait, on_refused=self._refused, wakeups=self.wakeups
            )
        queue.publish_soon = self._wake_publisher
        self.queues.append(queue)
        return queue

    def books_for(self, name: str, *, ttl: float) -> EngineBooks:
        """The engine's books of upstream ``name`` in Redis: one process scrapes them for
        every gateway, its claim lapsing ``ttl`` seconds after it last renewed it."""
        from ..shared_ledger.books import EngineBooks

        books = EngineBooks(self.client, name=name, lease_id=self.lease.id, ttl=ttl)
        self.books.append(books)
        return books

    async def refresh(self) -> None:
        """Read every upstream's shared totals from Redis (for ``/metrics``); when Redis is
        away the last ones heard stay, and ``kv_ledger_unreachable`` says so."""
        for queue in self.queues:
            try:
                await queue.refresh()
            except LedgerUnavailable:
                return

    def _refused(self) -> None:
        self.refused += 1

    async def run(self) -> None:
        """Renew the lease (from a thread of its own, over a synchronous client of its own) and
        listen for others' releases until cancelled (the app's lifespan); the thread has
        stopped when this returns."""
        from ..shared_ledger.connection import close_sync

        renewing = self._sync_client()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.wakeups.run)
                group.start_soon(self.publish)
                await self.lease.run(renewing)
        finally:
            close_sync(renewing)

    def _wake_publisher(self) -> None:
        self._publish_soon.set()

    async def publish(self) -> None:
        """Publish every upstream's holders' progress until cancelled: every
        ``PUBLISH_SECONDS``, sooner when a holder's first token (or tokens enough) came. While
        Redis is away nothing is lost: the next publish carries the latest counts."""
        from ..shared_ledger.view import PUBLISH_SECONDS

        while True:
            with anyio.move_on_after(PUBLISH_SECONDS):
                await self._publish_soon.wait()
            self._publish_soon = anyio.Event()
            for queue in self.queues:
                with contextlib.suppress(LedgerUnavailable):
                    await queue.publish()

    async def aclose(self) -> None:
        from ..shared_ledger.connection import close

        with anyio.CancelScope(shield=True):
            for shared in self.ledgers:
                await shared.give_back()
            for books in self.books:  # the next gateway to look scrapes at once
                with contextlib.suppress(LedgerUnavailable):
                    await books.give_back()
            await close(self.client)
