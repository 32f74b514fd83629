"""Waiting for admission in fair shares: the :class:`~.queue.AdmissionQueue` with tenants.

The order is the fair scheduler's (:mod:`.fairness`: weighted KV token-seconds, limits, priority
classes, bounded passes); this module only waits. A request joins, and whatever may be admitted
is admitted at once, by whoever gives the occasion: the newcomer itself, a release, a holder's
first token (under the peak rule), a waiter that leaves. The admitted waiter is handed its
reservation and woken; one that went away meanwhile (timed out, its client gone) gives it back.
A holder's relayed progress tells the scheduler what it counts for against its tenant's limit
(the ledger's :meth:`~.ledger.KVAdmissionController.held_now`, by the rule in force) and what it
really holds in the engine (its prompt and the tokens generated so far: what it is charged).
anyio primitives are made per waiter inside the running loop, so it works under asyncio and trio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import anyio

from .fairness import FairPolicy, FairScheduler, TenantStats, Waiter
from .ledger import Handle, Headroom, KVAdmissionController
from .queue import AdmissionQueue, Rejected, wait_limit

__all__ = ["FairQueue", "tenant_room"]


def tenant_room(
    fair: FairScheduler, tenant: str, budget: Headroom, *, released: int = 0
) -> Headroom:
    """The room ``budget`` leaves ``tenant`` within its own limit (its RateLimit fields): what
    it holds counted, less ``released`` tokens of its own being given back."""
    limit = fair.limit(tenant)
    held = fair.held(tenant) - released
    return Headroom(
        usable=limit,
        free=max(0, min(budget.free, limit - held)),
        next_release_in=budget.next_release_in,
        advertised=budget.advertised,
    )


class _Seat(Waiter):
    """A waiter with what its reservation is made of, the event it waits on, and its handle
    once admitted."""

    __slots__ = (
        "event",
        "follow",
        "handle",
        "kind",
        "output_cap",
        "prefix",
        "prompt_tokens",
        "sequences",
    )

    def __init__(
        self,
        *,
        tenant: str,
        need: int,
        priority: int,
        prompt_tokens: int,
        output_cap: int,
        prefix: tuple[Hashable, ...],
        kind: Hashable = None,
        follow: bool = False,
        sequences: int = 1,
    ) -> None:
        super().__init__(tenant=tenant, need=need, priority=priority)
        self.prompt_tokens = prompt_tokens
        self.output_cap = output_cap
        self.prefix = prefix
        self.kind = kind
        self.follow = follow
        self.sequences = sequences
        self.event = anyio.Event()
        self.handle: Handle | None = None


class FairQueue(AdmissionQueue):
    """An :class:`AdmissionQueue` that admits in fair shares between tenants (``policy``)."""

    def __init__(
        self,
        ledger: KVAdmissionController,
        *,
        policy: FairPolicy,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ledger, max_wait=max_wait, clock=clock)
        self.fair: FairScheduler = FairScheduler(policy, usable=ledger.usable_tokens, now=clock())

    @property
    def waiting(self) -> int:
        return self.fair.waiting

    @property
    def waiting_tokens(self) -> int:
        return self.fair.waiting_tokens

    def tenants(self) -> list[TenantStats]:
        """Each tenant's figures now (for ``/metrics``)."""
        return self.fair.stats(self._clock())

    def headroom(
        self, releasing: Handle | None = None, *, holder: Handle | None = None
    ) -> Headroom:
        """The room of the tenant of ``holder`` (or of ``releasing``): its own limit and what
        it holds, within the budget's room less what waits ahead of its next request; without
        either, the budget's room less every waiter's tokens."""
        now = self._clock()
        who = holder or releasing
        tenant = self.fair.tenant_of(who.id) if who is not None else None
        if tenant is None:
            return self.ledger.headroom(now, releasing=releasing, queued=self.waiting_tokens)
        queued = self.fair.tokens_ahead_of_newcomer(tenant, 0, now)
        return self._tenant_room(tenant, now, releasing=releasing, queued=queued)

    def _tenant_room(
        self, tenant: str, now: float, *, releasing: Handle | None = None, queued: int = 0
    ) -> Headroom:
        budget = self.ledger.headroom(now, releasing=releasing, queued=queued)
        own = releasing is not None and self.fair.tenant_of(releasing.id) == tenant
        released = self.fair.holding(releasing.id) if own and releasing is not None else 0
        return tenant_room(self.fair, tenant, budget, released=released)

    def progress(self, handle: Handle, generated: int) -> None:
        """``handle`` has had ``generated`` tokens relayed: its tenant now holds what the rule
        in force counts it at, and is charged its prompt and those tokens; its first token may
        make room (the peak rule), so whoever may go is admitted."""
        now = self._clock()
        first = self.ledger.progress(handle, generated, now)
        if handle.generated is None:
            return  # not followed (released, or its progress untracked)
        held = self.ledger.held_now(handle, now)
        rate = handle.prompt_tokens + handle.generated
        self.fair.resize(handle.id, held=held, rate=rate, now=now)
        if first:
            self.notify()

    def notify(self) -> None:
        """Room may have appeared (a release, a holder's first token): admit who may go."""
        now = self._clock()

        def attempt(waiter: Waiter) -> Handle | None:
            assert isinstance(waiter, _Seat)
            return self.ledger.try_admit(
                waiter.prompt_tokens,
                waiter.output_cap,
                now=now,
                count_rejection=False,
                need=waiter.need,
                prefix=waiter.prefix,
                kind=waiter.kind,
                follow=waiter.follow,
                sequences=waiter.sequences,
            )

        for waiter, handle in self.fair.dispatch(now, attempt):
            assert isinstance(waiter, _Seat)
            waiter.handle = handle
            waiter.event.set()

    def _give_back(self, handle: Handle) -> None:
        now = self._clock()
        self.ledger.release(handle, now)
        self.fair.release(handle.id, now)

    async def release(self, handle: Handle) -> None:
        self._give_back(handle)
        self.notify()

    def _refuse(self, seat: _Seat, client: Hashable | None) -> Rejected:
        """The 429 for ``seat``: Retry-After for its own place (those served before it, and its
        tenant's own holders when it is at its limit), RateLimit for its tenant's room."""
        now = self._clock()
        ahead, tokens = self.fair.ahead(seat, now)
        wait = self.ledger.retry_after(
            seat.need + tokens,
            now,
            duration=seat.output_cap / self.ledger.decode_rate,
            client=client,
        )
        own = self.fair.own_room_in(seat.tenant, seat.need, now)
        if own != float("inf"):
            wait = max(wait, own)
        self.ledger.record_rejection(seat.need, wait)
        self.fair.count_refusal(seat.tenant)
        room = self._tenant_room(seat.tenant, now, queued=tokens)
        return Rejected(need=seat.need, retry_after=wait, queued_ahead=ahead, room=room)

    async def acquire(
        self,
        prompt_tokens: int,
        output_cap: int,
        *,
        client: Hashable | None = None,
        max_wait: float | None = None,
        prefix: tuple[Hashable, ...] = (),
        sequences: int = 1,
        tenant: str | None = None,
        priority: int = 0,
        model: str | None = None,
        follow: bool = False,
    ) -> Handle:
        """A handle for the request, or :class:`Rejected`: after its tenant's longest wait (else
        the queue's), shortened by ``max_wait``; at once when the queue is full and it is the
        one of the lowest class; or when a request of a higher class takes its place."""
        name = self.fair.resolve(tenant)
        own = self.fair.policy.terms(name).max_queue_wait
        limit = wait_limit(self.max_wait if own is None else own, max_wait)
        seat = _Seat(
            tenant=name,
            need=self.ledger.need_tokens(prompt_tokens, output_cap),
            priority=priority,
            prompt_tokens=prompt_tokens,
            output_cap=output_cap,
            prefix=prefix,
            kind=(model, name),
            follow=follow,
            sequences=sequences,
        )
        for refused in self.fair.enqueue(seat, self._clock()):
            assert isinstance(refused, _Seat)
            refused.event.set()
        if seat.refused:
            raise self._refuse(seat, client)
        self.notify()
        taken = False
        try:
            if seat.handle is None and limit > 0:
                with anyio.move_on_after(limit):
                    while seat.handle is None and not seat.refused:
                        await seat.event.wait()
                        seat.event = anyio.Event()
            if seat.handle is not None:
                taken = True
                return seat.handle
            raise self._refuse(seat, client)
        finally:
            left = self.fair.remove(seat)
            if seat.handle is not None and not taken:
                self._give_back(seat.handle)  # admitted as it went away
                left = True
            if left:
                self.notify()  # it may have held the others back
