"""Fair shares on the shared ledger: the fair scheduler's order across every gateway process.

The state is Redis's (see the fair shares' part of :mod:`.scripts`): every holder's tenant,
every waiting ticket's tenant, class and passes, every tenant's token-seconds and counter
offset. The decision is the pure :class:`~..admission.fairness.FairScheduler`'s, the one the
in-process fair queue uses, taken in whichever gateway has an occasion (a waiter of its own that
joins, or wakes on a change any gateway published): it reads the state (``FAIR_SNAPSHOT``),
restores the scheduler from it, queues its own newcomers, dispatches, and writes the outcome
(``FAIR_COMMIT``) only if nothing changed since it read: otherwise it reads again. So the
order is one order, whoever takes the decision; a gateway may admit another's waiter, whose own
gateway finds it among the holders when it next looks (woken by the commit's message).

The decision admits by the rule the plain shared queue admits by: the peak of every gateway's
holders where the deciding gateway runs on it, else whole caps; a tenant's holders count
against its limit as that rule counts them, and it is charged what they hold (see
:mod:`.fair_state`, the state and the decision, pure). Each waiter carries what the peak
needs of its request (its prompt, whether its progress is followed, its prefix's keys, its
model), so any gateway may admit it; its own gateway relays and publishes its progress.

Why decide in Python rather than in a Lua script: the rules (weighted token-seconds, lifts,
bounded passes, limits, classes, overload) are written once, in :mod:`..admission.fairness`,
and tested there; the scripts only keep the state and refuse a stale decision. The price is a
read and a write per decision, against requests that last seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import anyio

from ..admission.fair_queue import tenant_room
from ..admission.fairness import FairPolicy, FairScheduler, TenantStats
from ..admission.ledger import Handle, Headroom, KVAdmissionController
from ..admission.queue import LedgerUnavailable, Rejected, wait_limit
from .fair_state import Decision, FairState, PeakAsk, Seat, records_of
from .ledger import RedisLedger
from .queue import SharedQueue, Wake
from .scripts import FAIR_COMMIT, FAIR_SNAPSHOT
from .state import SharedState
from .wakeups import Wakeups

__all__ = ["FairState", "SharedFairQueue"]

#: Decisions taken in a row on a state another gateway changed before the write: past this many
#: the waiters look again at their next wake-up (or poll).
MAX_CONFLICTS = 8


class _Seat(Seat):
    """One of this process's waiters: its ticket, what its reservation is made of, its wake-up,
    and its handle once admitted (by this gateway or another)."""

    __slots__ = ("handle", "wake")

    def __init__(self, **seat: Any) -> None:
        super().__init__(**seat)  # a Seat's terms
        self.wake = Wake()
        self.handle: Handle | None = None


class SharedFairQueue(SharedQueue):
    """A :class:`SharedQueue` that admits in fair shares between tenants (``policy``), one
    order across every gateway sharing the ledger."""

    def __init__(
        self,
        ledger: KVAdmissionController,
        shared: RedisLedger,
        *,
        policy: FairPolicy,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[], None] | None = None,
        wakeups: Wakeups | None = None,
    ) -> None:
        super().__init__(
            ledger, shared, max_wait=max_wait, clock=clock, on_refused=on_refused, wakeups=wakeups
        )
        self.policy = policy
        #: The scheduler as of the last state read (its figures, limits and holders' tenants).
        self.fair: FairScheduler = FairScheduler(policy, usable=ledger.usable_tokens)
        self._state: FairState | None = None
        self._seats: dict[str, _Seat] = {}
        self._lock = anyio.Lock()
        self._asked = 0
        self._done = 0
        #: mirror handle id -> (its tenant, its reservation's name)
        self._tenant_of: dict[int, tuple[str, str]] = {}
        #: reservation -> its key in :attr:`fair` (as of the last state read)
        self._keys: dict[str, int] = {}

    def tenants(self) -> list[TenantStats]:
        """Every gateway's tenants, as of the last state read (``/metrics`` reads it afresh)."""
        now = self._state.now if self._state is not None else 0.0
        return self.fair.stats(now)

    async def refresh(self) -> None:
        """Read the shared state (its totals and the tenants' figures)."""
        await self.shared.refresh()
        state = FairState(await self.shared.run(FAIR_SNAPSHOT))
        self._read(state)
        await self.measure(len(state.queue))

    def _read(self, state: FairState) -> Decision:
        """The decision on ``state``: by the peak where this gateway runs on it (a drain read
        here first puts it on caps, see :meth:`RedisLedger.heed`); this process's waiters
        admitted by another gateway adopted, those refused told."""
        view = state.view(self.ledger)
        self.shared.heed(view.drain)
        decision = Decision(
            state, view, self.policy, self.ledger, peak=self.on_peak, due=self.shared.due
        )
        self._state, self.fair, self._keys = state, decision.fair, decision.keys
        self.shared.seen = state.seen()
        records = {r.field: r for r in view.records}
        for ticket, seat in self._seats.items():
            if seat.handle is None and ticket in state.holders:
                written = records_of(records[ticket]) if ticket in records else None
                self._adopt(seat, state.holders[ticket][2], written)
            meta = state.metas.get(ticket)
            if meta is not None and meta.state == "R":
                seat.refused = True
                seat.wake.event.set()
        return decision

    def _adopt(
        self, seat: _Seat, admitted: float, written: tuple[int, tuple[str, str] | None] | None
    ) -> None:
        """``seat``'s handle, admitted at ``admitted`` with the records ``written`` (the output
        they count it to, and what is put back with it: see :func:`.fair_state.records_of`)."""
        counted, records = written if written is not None else (seat.output_cap, None)
        seat.handle = self.shared.adopt(
            seat.ticket, seat.prompt_tokens, seat.output_cap, seat.need, admitted, records,
            tenant=seat.tenant,
        )  # fmt: skip
        seat.handle.counted_output = counted
        seat.wake.event.set()

    async def _dispatch(self) -> None:
        """One decision covering every request for one made before it began."""
        self._asked += 1
        mine = self._asked
        async with self._lock:
            if self._done >= mine:
                return
            upto = self._asked
            await self._decide()
            self._done = upto

    async def _decide(self) -> None:
        for _ in range(MAX_CONFLICTS):
            state = FairState(await self.shared.run(FAIR_SNAPSHOT))
            decision = self._read(state)
            joining = [
                s
                for s in self._seats.values()
                if s.handle is None and not s.refused and not state.known(s.ticket)
            ]
            outcome = decision.decide(joining, self.shared.lease.id)
            if outcome.args is None:
                return  # nobody joins, nobody fits: a write would only bump the version
            status, now_ms, seen = await self.shared.run(FAIR_COMMIT, *outcome.args)
            if int(status) == -1:  # our lease lapsed: renew, then read again
                await self.shared.renew()
                continue
            if int(status) != 1:
                continue  # another gateway changed the state meanwhile: read it again
            self.shared.seen = SharedState.parse(seen)
            for waiter, _ in outcome.admitted:
                if isinstance(waiter, _Seat) and waiter.ticket in self._seats:
                    written = outcome.written[waiter.ticket]
                    self._adopt(waiter, int(now_ms) / 1000, written)
            for waiter in outcome.refused:
                if isinstance(waiter, _Seat):
                    waiter.wake.event.set()
            return

    def headroom(
        self, releasing: Handle | None = None, *, holder: Handle | None = None
    ) -> Headroom:
        """The shared budget's room, within the tenant's own limit of ``holder`` (or of
        ``releasing``) as of the last state read."""
        budget = super().headroom(releasing, holder=holder)
        who = holder or releasing
        mine = self._tenant_of.get(who.id) if who is not None else None
        if mine is None:
            return budget
        tenant = mine[0]
        gone = self._tenant_of.get(releasing.id) if releasing is not None else None
        released = 0
        if gone is not None and gone[0] == tenant:  # what it counts for, as last read
            released = self.fair.holding(self._keys.get(gone[1], 0))
        return tenant_room(self.fair, tenant, budget, released=released)

    async def release(self, handle: Handle) -> None:
        self._tenant_of.pop(handle.id, None)
        await super().release(handle)

    async def _refuse(self, seat: _Seat) -> Rejected:
        """The 429 for ``seat``: Retry-After for its own place in the shared order (those
        served before it, and its tenant's own holders when it is at its limit)."""
        state = FairState(await self.shared.run(FAIR_SNAPSHOT))
        decision = self._read(state)
        now = state.now
        waiter = decision.waiters.get(seat.ticket)
        if waiter is not None:
            ahead, tokens = decision.fair.ahead(waiter, now)
        else:
            ahead = decision.fair.waiting
            tokens = decision.fair.tokens_ahead_of_newcomer(seat.tenant, seat.priority, now)
        # By the rule it is admitted by: on the peak, every holder by its progress, and this
        # gateway's holders cut before their end as ending soon (as the plain shared queue).
        model = decision.view.model if decision.peak else self.shared.model(state.snapshot())
        for field, left in self._cuts().items() if decision.peak else ():
            if (cut := decision.view.handles.get(field)) is not None:
                cut.cut_by = now + max(0.0, left)
        wait = model.retry_after(
            seat.need + tokens, now, duration=seat.output_cap / self.ledger.decode_rate
        )
        own = decision.fair.own_room_in(seat.tenant, seat.need, now)
        if own != float("inf"):
            wait = max(wait, own)
        self.ledger.record_rejection(seat.need, wait)
        free = self.ledger.usable_tokens - state.reserved
        if decision.peak:
            free = max(free, decision.view.room())
        budget = Headroom(
            usable=self.ledger.usable_tokens,
            free=max(0, free - tokens),
            next_release_in=model.headroom(now).next_release_in,
            advertised=self.ledger.strategy == "reserve",
        )
        room = tenant_room(decision.fair, seat.tenant, budget)
        return Rejected(need=seat.need, retry_after=wait, queued_ahead=ahead, room=room)

    async def acquire(
        self,
        prompt_tokens: int,
        output_cap: int,
        *,
        client: Hashable | None = None,
        max_wait: float | None = None,
        # Shared prefix blocks count once across processes (each holder's keys in Redis).
        prefix: tuple[Hashable, ...] = (),
        tenant: str | None = None,
        priority: int = 0,
        model: str | None = None,
        follow: bool = False,
        # The shared ledger counts a request once against the running cap; a request of
        # several sequences is never followed, so it counts whole under either rule and
        # sequences waiting in the engine hold no KV it has not reserved.
        sequences: int = 1,
    ) -> Handle:
        """A handle for the request, or :class:`Rejected`: after its tenant's longest wait (else
        the queue's), shortened by ``max_wait``; at once when the shared queue is full and it is
        the one of the lowest class; or when a request of a higher class takes its place."""
        name = self.policy.resolve(tenant)
        own = self.policy.terms(name).max_queue_wait
        limit = wait_limit(self.max_wait if own is None else own, max_wait)
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        # Followed while the mirror tracks progress, on the peak or on caps for now: once back
        # on the peak, every gateway counts it by its progress (as the plain shared queue).
        tracks = self.ledger.tracks_progress
        seat = _Seat(
            ticket=self.shared.ticket(need),
            tenant=name,
            need=need,
            priority=priority,
            prompt_tokens=prompt_tokens,
            output_cap=output_cap,
            ask=PeakAsk.of(prompt_tokens, follow if tracks else None, prefix, model),
        )
        self._seats[seat.ticket] = seat
        self._wakes.append(seat.wake)
        deadline = self._clock() + limit
        taken = turned_away = False
        try:
            while True:
                await self._dispatch()
                if seat.handle is not None:
                    mine = await self._link(
                        seat.handle, prompt_tokens, output_cap, need,
                        follow=follow and tracks, kind=(model, name), prefix=prefix,
                    )  # fmt: skip
                    self._tenant_of[mine.id] = (name, seat.ticket)
                    taken = True
                    return mine
                remaining = deadline - self._clock()
                if seat.refused or remaining <= 0:
                    break
                with anyio.move_on_after(min(self.poll_seconds, remaining)):
                    await seat.wake.event.wait()
                if seat.wake.event.is_set():
                    seat.wake.event = anyio.Event()
            turned_away = True
            raise await self._refuse(seat)
        except LedgerUnavailable:
            if self._on_refused is not None:
                self._on_refused()
            raise
        finally:
            del self._seats[seat.ticket]
            self._wakes.remove(seat.wake)
            if not taken:
                with anyio.CancelScope(shield=True):
                    if seat.handle is not None:  # admitted as it went away
                        await self.shared.release(seat.handle)
                    else:
                        await self.shared.leave(seat.ticket, refused=turned_away)
            self.notify()
