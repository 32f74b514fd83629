"""The FIFO queue in front of a shared ledger: one queue across every gateway process.

The order is kept in Redis (the ledger's queue of tickets): only the head may be admitted, so a
newcomer in any process waits behind those already waiting in any other. A release here wakes
this process's waiters at once; others' releases, through Redis pub/sub (``wakeups``), with a
poll every ``FALLBACK_POLL_SECONDS`` in case a message was lost; without pub/sub (or while its
subscription is down) they are seen by polling, ``POLL_SECONDS`` apart.

The in-process ledger it is given (``ledger``) mirrors this process's own reservations (its
metrics are this process's); admission and the room advertised (:meth:`SharedQueue.headroom`)
are the shared ledger's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import anyio

from ..admission.ledger import Handle, Headroom, KVAdmissionController
from ..admission.queue import AdmissionQueue, LedgerUnavailable, Rejected, wait_limit
from .ledger import RedisLedger, Wakeups

__all__ = ["FALLBACK_POLL_SECONDS", "POLL_SECONDS", "SharedQueue", "Wake"]

#: How often a waiter looks again at the shared budget when nothing here was released and no
#: pub/sub subscription tells it of others' releases.
POLL_SECONDS = 0.02
#: How often it looks again while subscribed: only a message lost (a subscription that dropped
#: and came back) waits this long.
FALLBACK_POLL_SECONDS = 0.5


class Wake:
    """One waiter's wake-up: a fresh event after each one it used."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


class SharedQueue(AdmissionQueue):
    """An :class:`AdmissionQueue` whose admission is ``shared``'s, in Redis."""

    def __init__(
        self,
        ledger: KVAdmissionController,
        shared: RedisLedger,
        *,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[], None] | None = None,
        wakeups: Wakeups | None = None,
    ) -> None:
        super().__init__(ledger, max_wait=max_wait, clock=clock)
        self.shared = shared
        self._on_refused = on_refused
        #: mirror handle id -> (mirror handle, shared handle)
        self._links: dict[int, tuple[Handle, Handle]] = {}
        self._wakes: list[Wake] = []
        shared.on_lapse = self._lapsed
        self._wakeups = wakeups
        if wakeups is not None:
            wakeups.watch(shared, self.notify)

    @property
    def poll_seconds(self) -> float:
        """How long a waiter sleeps before it looks again unless woken."""
        if self._wakeups is not None and self._wakeups.subscribed:
            return FALLBACK_POLL_SECONDS
        return POLL_SECONDS

    def notify(self) -> None:
        for wake in self._wakes:
            wake.event.set()

    @property
    def waiting(self) -> int:
        return len(self._wakes)

    def load(self) -> tuple[int, int]:
        """Every gateway's (tokens reserved, requests in flight), as last heard from Redis."""
        return self.shared.seen.reserved, self.shared.seen.inflight

    def room(self) -> tuple[int, int]:
        """The shared budget's room (whole caps: the shared ledger counts them) and every
        gateway's requests in flight, as last heard from Redis."""
        reserved, inflight = self.load()
        return self.ledger.usable_tokens - reserved, inflight

    async def refresh(self) -> None:
        """Read the shared totals from Redis (for ``/metrics``)."""
        await self.shared.refresh()

    async def occupancy(self) -> tuple[float, float, int]:
        """Every gateway's occupancy (:meth:`RedisLedger.occupancy`); raises
        :class:`LedgerUnavailable` when Redis is away."""
        return await self.shared.occupancy()

    def headroom(
        self, releasing: Handle | None = None, *, holder: Handle | None = None
    ) -> Headroom:
        """The room in the shared budget, every gateway's holders and waiters counted, as last
        heard from Redis (this process's last script, or the last change any gateway published).
        The next release: the sooner of this process's holders' soonest end and every gateway's
        soonest at the last snapshot (taken for a 429's estimate and a scrape of ``/metrics``)."""
        pricing, seen, now = self.ledger, self.shared.seen, self._clock()
        reserved, inflight = seen.reserved, seen.inflight
        link = self._links.get(releasing.id) if releasing is not None else None
        if link is not None and link[0] is releasing and not releasing.released:
            reserved -= releasing.reserved_tokens
            inflight -= 1
        free = pricing.usable_tokens - reserved - seen.queued
        if pricing.max_concurrency is not None and inflight >= pricing.max_concurrency:
            free = 0
        ends = []
        if any(h is not releasing for h in self.ledger.live_handles()):
            ends.append(self.ledger.headroom(now, releasing=releasing).next_release_in)
        at = self.shared.next_release_at
        if at is not None and at > time.monotonic():
            ends.append(at - time.monotonic())
        return Headroom(
            usable=pricing.usable_tokens,
            free=max(0, min(free, pricing.usable_tokens)),
            next_release_in=min(ends, default=0.0),
            advertised=pricing.strategy == "reserve",
        )

    def _lapsed(self, lost: list[Handle]) -> None:
        # The shared reservations are gone: the mirror's go too, and their relays stop (they
        # watch ``handle.released``).
        gone = {id(h) for h in lost}
        for key, (mine, shared) in list(self._links.items()):
            if id(shared) in gone:
                del self._links[key]
                self.ledger.release(mine)

    async def release(self, handle: Handle) -> None:
        link = self._links.pop(handle.id, None)
        self.ledger.release(handle)
        if link is not None and link[0] is handle:
            with anyio.CancelScope(shield=True):
                await self.shared.release(link[1])
        self.notify()

    async def acquire(
        self,
        prompt_tokens: int,
        output_cap: int,
        *,
        client: Hashable | None = None,
        max_wait: float | None = None,
        prefix: tuple[Hashable, ...] = (),  # the shared ledger counts whole caps: unused
        tenant: str | None = None,  # no fair shares on the shared ledger (the gateway refuses)
        priority: int = 0,
        model: str | None = None,  # the shared ledger counts whole caps: no forecast
        follow: bool = False,
        # The shared ledger counts a request once against the running cap: it counts whole
        # caps, so sequences waiting in the engine hold no KV it has not reserved.
        sequences: int = 1,
    ) -> Handle:
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        ticket = self.shared.ticket(need)
        wake = Wake()
        self._wakes.append(wake)
        limit = wait_limit(self.max_wait, max_wait)
        try:
            return await self._acquire(prompt_tokens, output_cap, need, ticket, wake, limit)
        except LedgerUnavailable:
            if self._on_refused is not None:
                self._on_refused()
            raise
        finally:
            self._wakes.remove(wake)
            self.notify()

    async def _acquire(
        self,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        ticket: str,
        wake: Wake,
        limit: float,
    ) -> Handle:
        shared = self.shared
        enqueue = limit > 0
        deadline = self._clock() + limit
        queued = False
        try:
            while True:
                held = await shared.try_admit(
                    prompt_tokens, output_cap, need=need, ticket=ticket, enqueue=enqueue
                )
                if held is not None:
                    queued = False
                    return await self._link(held, prompt_tokens, output_cap, need)
                queued = enqueue
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                with anyio.move_on_after(min(self.poll_seconds, remaining)):
                    await wake.event.wait()
                if wake.event.is_set():
                    wake.event = anyio.Event()
            wait, ahead = await shared.retry_after(
                need, duration=output_cap / self.ledger.decode_rate, ticket=ticket
            )
            self.ledger.record_rejection(need, wait)
            raise Rejected(need=need, retry_after=wait, queued_ahead=ahead)
        finally:
            if queued:
                with anyio.CancelScope(shield=True):
                    await shared.leave(ticket)

    async def _link(self, held: Handle, prompt_tokens: int, output_cap: int, need: int) -> Handle:
        """This process's mirror of the shared reservation ``held``; cancelled on the way (its
        client gone), ``held`` is given back rather than left to a lease that lives on."""
        try:
            await self.shared.keep_fresh()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shared.release(held)
            raise
        mine = self.ledger.try_admit(
            prompt_tokens, output_cap, now=self._clock(), count_rejection=False, need=need
        )
        if mine is None:  # cannot happen while this process's share is within the shared one
            with anyio.CancelScope(shield=True):
                await self.shared.release(held)
            raise Rejected(need=need, retry_after=1.0, queued_ahead=0)
        self._links[mine.id] = (mine, held)
        return mine
