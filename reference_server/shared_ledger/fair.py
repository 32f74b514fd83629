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

Why decide in Python rather than in a Lua script: the rules (weighted token-seconds, lifts,
bounded passes, limits, classes, overload) are written once, in :mod:`..admission.fairness`,
and tested there; the scripts only keep the state and refuse a stale decision. The price is a
read and a write per decision, against requests that last seconds.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import anyio

from ..admission.fair_queue import tenant_room
from ..admission.fairness import (
    DEFAULT_TENANT,
    FairPolicy,
    FairScheduler,
    Holding,
    TenantStats,
    Waiter,
)
from ..admission.ledger import Handle, Headroom, KVAdmissionController
from ..admission.queue import LedgerUnavailable, Rejected, wait_limit
from .ledger import RedisLedger, SharedState, Snapshot
from .queue import SharedQueue, Wake
from .scripts import FAIR_COMMIT, FAIR_SNAPSHOT
from .wakeups import Wakeups

__all__ = ["FairState", "SharedFairQueue"]

#: Decisions taken in a row on a state another gateway changed before the write: past this many
#: the waiters look again at their next wake-up (or poll).
MAX_CONFLICTS = 8


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: list[Any]) -> list[tuple[str, str]]:
    items = [_text(x) for x in flat]
    return list(zip(items[0::2], items[1::2], strict=True))


@dataclass(slots=True)
class _Meta:
    """A waiting ticket as Redis keeps it (``"W priority bypassed lower cap tenant"``)."""

    state: str
    priority: int
    bypassed: int
    lower: int
    cap: int
    tenant: str

    @classmethod
    def parse(cls, text: str) -> _Meta:
        state, priority, bypassed, lower, cap, tenant = text.split(" ", 5)
        return cls(state, int(priority), int(bypassed), int(lower), int(cap), tenant)

    def text(self) -> str:
        return f"{self.state} {self.priority} {self.bypassed} {self.lower} {self.cap} {self.tenant}"


class FairState:
    """One upstream's fair shares as Redis had them at one moment (seconds, Redis clock)."""

    def __init__(self, raw: list[Any]) -> None:
        self.now = int(raw[0]) / 1000
        self.version = _text(raw[1])
        self.reserved = int(raw[2])
        self.raw_holders = raw[3]
        #: ticket -> (tokens, cap, admitted_at, tenant)
        self.holders: dict[str, tuple[int, int, float, str]] = {}
        for ticket, value in _pairs(raw[3]):
            fields = value.split(" ", 4)
            tenant = fields[4] if len(fields) > 4 else DEFAULT_TENANT
            self.holders[ticket] = (int(fields[1]), int(fields[2]), int(fields[3]) / 1000, tenant)
        #: The waiting tickets in order, with their sequence numbers.
        self.queue = [(ticket, int(float(seq))) for ticket, seq in _pairs(raw[4])]
        self.metas = {ticket: _Meta.parse(meta) for ticket, meta in _pairs(raw[5])}
        self.fair = {key: float(value) for key, value in _pairs(raw[6])}

    def snapshot(self) -> Snapshot:
        """The plain shared ledger's view of the same moment (for its Retry-After model)."""
        tickets = [ticket for ticket, _ in self.queue]
        return Snapshot([round(self.now * 1000), self.reserved, self.raw_holders, tickets])

    def seen(self) -> SharedState:
        queued = sum(need_of(ticket) for ticket, _ in self.queue)
        return SharedState(self.reserved, len(self.holders), queued)

    def per_tenant(self, what: str) -> dict[str, float]:
        prefix = what + ":"
        return {k[len(prefix) :]: v for k, v in self.fair.items() if k.startswith(prefix)}

    def known(self, ticket: str) -> bool:
        """Whether ``ticket`` is in Redis at all: waiting, refused or held."""
        return ticket in self.metas or ticket in self.holders


def need_of(ticket: str) -> int:
    """The tokens a ticket (``lease:n:need``) waits for."""
    return int(ticket.rsplit(":", 1)[1])


class _Seat(Waiter):
    """One of this process's waiters: its ticket, what its reservation is made of, its wake-up,
    and its handle once admitted (by this gateway or another)."""

    __slots__ = ("handle", "output_cap", "prompt_tokens", "ticket", "wake")

    def __init__(
        self,
        *,
        ticket: str,
        tenant: str,
        need: int,
        priority: int,
        prompt_tokens: int,
        output_cap: int,
    ) -> None:
        super().__init__(tenant=tenant, need=need, priority=priority)
        self.ticket = ticket
        self.prompt_tokens = prompt_tokens
        self.output_cap = output_cap
        self.wake = Wake()
        self.handle: Handle | None = None


@dataclass(frozen=True, slots=True)
class _Slot:
    """A reservation the scheduler decided on, before it is written."""

    id: int
    reserved_tokens: int
    due_at: float


class _Decision:
    """The scheduler restored from a :class:`FairState`, with the waiters it was given by
    ticket (and the metas they had) so that what changed can be written back."""

    def __init__(self, state: FairState, policy: FairPolicy, shared: RedisLedger) -> None:
        self.state = state
        keys = {ticket: n for n, ticket in enumerate(state.holders, start=1)}
        holdings = [
            Holding(
                key=keys[ticket],
                tenant=tenant,
                tokens=tokens,
                due=shared.due(admitted, cap),
                since=admitted,
            )
            for ticket, (tokens, cap, admitted, tenant) in state.holders.items()
        ]
        self.waiters: dict[str, Waiter] = {}
        for ticket, seq in state.queue:
            meta = state.metas.get(ticket)
            if meta is None or meta.state != "W":
                continue
            waiter = Waiter(tenant=meta.tenant, need=need_of(ticket), priority=meta.priority)
            waiter.seq, waiter.bypassed, waiter.lower_passes = seq, meta.bypassed, meta.lower
            self.waiters[ticket] = waiter
        ended = {t: ms / 1000 for t, ms in state.per_tenant("taken").items()}
        admitted, refused = state.per_tenant("admitted"), state.per_tenant("refused")
        counts = {
            t: (int(admitted.get(t, 0)), int(refused.get(t, 0))) for t in {*admitted, *refused}
        }
        self.fair = FairScheduler.restore(
            policy,
            usable=shared.usable_tokens,
            now=state.now,
            holdings=holdings,
            waiters=self.waiters.values(),
            ended=ended,
            offsets=state.per_tenant("offset"),
            counts=counts,
            vtime=state.fair.get("vtime", 0.0),
        )
        self._offsets = self.fair.offsets()
        self._vtime = self.fair.vtime
        self._ids = itertools.count(len(keys) + 1)

    def decide(
        self, joining: list[_Seat], shared: RedisLedger
    ) -> tuple[list[Any] | None, list[tuple[Waiter, _Slot]], list[Waiter]]:
        """Queue ``joining``, dispatch; returns the commit's arguments (None: nothing to write),
        who was admitted and who refused."""
        state, fair, now = self.state, self.fair, self.state.now
        refused: list[Waiter] = []
        for seat in joining:
            refused += fair.enqueue(seat, now)
        reserved, holders = state.reserved, len(state.holders)
        most = shared.pricing.max_concurrency or 0
        caps = {t: m.cap for t, m in state.metas.items()}
        caps.update({s.ticket: s.output_cap for s in joining})
        tickets = {id(w): t for t, w in self.waiters.items()}
        tickets.update({id(s): s.ticket for s in joining})

        def attempt(waiter: Waiter) -> _Slot | None:
            nonlocal reserved, holders
            if reserved + waiter.need > shared.usable_tokens or (most and holders >= most):
                return None
            reserved, holders = reserved + waiter.need, holders + 1
            cap = caps[tickets[id(waiter)]]
            return _Slot(next(self._ids), waiter.need, shared.due(now, cap))

        admitted = fair.dispatch(now, attempt)
        gone = {id(w) for w, _ in admitted} | {id(w) for w in refused}
        joins = [
            (s.ticket, self._meta(s, s.output_cap).text()) for s in joining if id(s) not in gone
        ]
        passes = [
            (t, self._meta(w, caps[t]).text())
            for t, w in self.waiters.items()
            if id(w) not in gone
            and (w.bypassed, w.lower_passes) != (state.metas[t].bypassed, state.metas[t].lower)
        ]
        offsets = [
            (t, repr(v))
            for t, v in fair.offsets().items()
            if not math.isclose(v, self._offsets.get(t, 0.0), rel_tol=1e-9, abs_tol=1e-9)
        ]
        args: list[Any] = [
            state.version,
            shared.lease.id,
            shared.usable_tokens,
            most,
        ]
        for rows in (
            joins,
            [(tickets[id(w)], caps[tickets[id(w)]], w.tenant) for w, _ in admitted],
            [(tickets[id(w)], w.tenant) for w in refused],
            passes,
            offsets,
        ):
            args.append(len(rows))
            args += [x for row in rows for x in row]
        moved = fair.vtime != self._vtime
        args.append(repr(fair.vtime) if moved else "")
        changed = moved or any(rows for rows in (joins, admitted, refused, passes, offsets))
        return (args if changed else None), admitted, refused

    @staticmethod
    def _meta(waiter: Waiter, cap: int) -> _Meta:
        return _Meta("W", waiter.priority, waiter.bypassed, waiter.lower_passes, cap, waiter.tenant)


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
        #: mirror handle id -> its tenant
        self._tenant_of: dict[int, str] = {}

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

    def _read(self, state: FairState) -> _Decision:
        decision = _Decision(state, self.policy, self.shared)
        self._state, self.fair = state, decision.fair
        self.shared.seen = state.seen()
        for ticket, seat in self._seats.items():
            if seat.handle is None and ticket in state.holders:
                self._adopt(seat, state.holders[ticket][2])
            meta = state.metas.get(ticket)
            if meta is not None and meta.state == "R":
                seat.refused = True
                seat.wake.event.set()
        return decision

    def _adopt(self, seat: _Seat, admitted: float) -> None:
        seat.handle = self.shared.adopt(
            seat.ticket, seat.prompt_tokens, seat.output_cap, seat.need, admitted
        )
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
            args, admitted, refused = decision.decide(joining, self.shared)
            if args is None:
                return  # nobody joins, nobody fits: a write would only bump the version
            status, now_ms, seen = await self.shared.run(FAIR_COMMIT, *args)
            if int(status) == -1:  # our lease lapsed: renew, then read again
                await self.shared.renew()
                continue
            if int(status) != 1:
                continue  # another gateway changed the state meanwhile: read it again
            self.shared.seen = SharedState.parse(seen)
            for waiter, _ in admitted:
                if isinstance(waiter, _Seat) and waiter.ticket in self._seats:
                    self._adopt(waiter, int(now_ms) / 1000)
            for waiter in refused:
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
        tenant = self._tenant_of.get(who.id) if who is not None else None
        if tenant is None:
            return budget
        own = releasing is not None and self._tenant_of.get(releasing.id) == tenant
        released = releasing.reserved_tokens if own and releasing is not None else 0
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
        model = self.shared.model(state.snapshot())
        wait = model.retry_after(
            seat.need + tokens, now, duration=seat.output_cap / self.ledger.decode_rate
        )
        own = decision.fair.own_room_in(seat.tenant, seat.need, now)
        if own != float("inf"):
            wait = max(wait, own)
        self.ledger.record_rejection(seat.need, wait)
        budget = Headroom(
            usable=self.ledger.usable_tokens,
            free=max(0, self.ledger.usable_tokens - state.reserved - tokens),
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
        prefix: tuple[Hashable, ...] = (),  # fair shares count whole caps: unused
        tenant: str | None = None,
        priority: int = 0,
        model: str | None = None,  # fair shares count whole caps: no forecast
        follow: bool = False,
        # The shared ledger counts a request once against the running cap: it counts whole
        # caps, so sequences waiting in the engine hold no KV it has not reserved.
        sequences: int = 1,
    ) -> Handle:
        """A handle for the request, or :class:`Rejected`: after its tenant's longest wait (else
        the queue's), shortened by ``max_wait``; at once when the shared queue is full and it is
        the one of the lowest class; or when a request of a higher class takes its place."""
        name = self.policy.resolve(tenant)
        own = self.policy.terms(name).max_queue_wait
        limit = wait_limit(self.max_wait if own is None else own, max_wait)
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        seat = _Seat(
            ticket=self.shared.ticket(need),
            tenant=name,
            need=need,
            priority=priority,
            prompt_tokens=prompt_tokens,
            output_cap=output_cap,
        )
        self._seats[seat.ticket] = seat
        self._wakes.append(seat.wake)
        deadline = self._clock() + limit
        taken = turned_away = False
        try:
            while True:
                await self._dispatch()
                if seat.handle is not None:
                    mine = await self._link(seat.handle, prompt_tokens, output_cap, need)
                    self._tenant_of[mine.id] = name
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
