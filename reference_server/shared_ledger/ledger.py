"""The shared ledger: an upstream's reservations kept in Redis, so that any number of gateway
processes on any number of machines admit against one budget.

Every operation is one Lua script (:mod:`.scripts`) run atomically by Redis, never a read then a
write from here. The pricing (what a request needs, what never fits) is the in-process ledger's,
shared, not copied: a :class:`~.ledger.KVAdmissionController` is the ``pricing`` of each shared
ledger.

Each reservation carries its process's :class:`~.lease.Lease`, renewed in the background while
the process lives; a process that dies (SIGKILL, a cut network) loses its reservations once the
lease expires. One alive whose lease lapsed all the same (Redis away for longer than the lease,
an event loop stalled past the lease's bound) puts back what it still holds when it next
renews, as after Redis lost its data: the engine holds their KV whatever Redis says, and their
requests run on.

Waiters learn of room made by another process through Redis pub/sub
(:class:`~.wakeups.Wakeups`): every script that changes an upstream's shared state publishes the
totals after it on the upstream's ``released`` channel, saying whether the change may let a
waiter in; so each process also knows the shared room (:attr:`RedisLedger.seen`) without asking.

>>> # ledger = RedisLedger(client, name="http://engine:8000", pricing=pricing, lease=lease)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import redis.asyncio as aioredis

from ..admission.fairness import FairPolicy
from ..admission.ledger import Handle, KVAdmissionController
from ..admission.queue import LedgerUnavailable
from .connection import LEDGER_ERRORS, close, reply_text
from .lease import Lease
from .lua import ticket_need
from .scripts import (
    ADMIT,
    BREAK,
    CONFIG,
    DEFAULT_LEASE_SECONDS,
    FAIR_COMMIT,
    FAIR_SNAPSHOT,
    KEY_NAMES,
    LEAVE,
    OCCUPANCY,
    PEAK_SNAPSHOT,
    PROGRESS,
    RELEASE,
    RENEW,
    RESTORE,
    SNAPSHOT,
)
from .state import SharedState, Snapshot, fingerprint
from .view import PeakView, lending

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "Lease",
    "LedgerConflict",
    "LedgerUnavailable",
    "RedisLedger",
    "SharedState",
    "Snapshot",
    "fingerprint",
]

logger = logging.getLogger("kvclient.gateway")

#: Seconds between the snapshots :meth:`RedisLedger.keep_fresh` takes for the room's next release.
_ROOM_SECONDS = 1.0


#: Snapshots read again in a row for one admission by the peak when another gateway admitted
#: meanwhile each time; past this many it is tried on whole caps (and queued when asked).
MAX_CONFLICTS = 4


class LedgerConflict(Exception):
    """Another gateway sharing the ledger has this upstream configured differently."""


def _given(lending: str) -> tuple[str, ...]:
    """ADMIT's last ARGV, the prefix record, when there is one (older ADMITs end before it)."""
    return (lending,) if lending else ()


class RedisLedger:
    """An upstream's reservations in Redis, under keys named by ``name`` (its public URL).

    The pricing, the budget and the decode rate are ``pricing``'s; admission and release are
    one script each. Methods raise :class:`LedgerUnavailable` when Redis is away.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        name: str,
        pricing: KVAdmissionController,
        lease: Lease,
        fairness: FairPolicy | None = None,
    ) -> None:
        self.client = client
        #: The fair shares' terms (``--tenants``), part of what every gateway must agree on.
        self.fairness = fairness
        self.name = name
        self.lease = lease
        tag = "{kvclient:" + name + "}"
        self._keys = [f"{tag}:{key}" for key in KEY_NAMES]
        #: The pub/sub channel told of every change that may let a waiter in.
        self.channel = self._keys[KEY_NAMES.index("released")]
        self._scripts = {
            script: client.register_script(script)
            for script in (
                ADMIT,
                BREAK,
                CONFIG,
                FAIR_COMMIT,
                FAIR_SNAPSHOT,
                LEAVE,
                OCCUPANCY,
                PEAK_SNAPSHOT,
                PROGRESS,
                RELEASE,
                RENEW,
                RESTORE,
                SNAPSHOT,
            )
        }
        self._ids = itertools.count(1)
        self._fields: dict[int, tuple[Handle, str]] = {}
        #: reservation -> what ADMIT recorded with it besides its holding, to be put back with
        #: it (see :meth:`_restore`): the head of its progress record ("prompt counted
        #: tracked", '' none) and its prefix record ('' none).
        self._records: dict[str, tuple[str, str]] = {}
        #: reservation -> the tenant a fair decision admitted it for (put back with it).
        self._tenants: dict[str, str] = {}
        #: RENEW's answer still to settle by putting back what is held (0: the lease had
        #: lapsed, 2: Redis had lost its data), None when there is none.
        self._restore_due: int | None = None
        self._unreleased: list[str] = []
        self._unleft: list[str] = []
        self._pricing = pricing
        #: Told the handles put back after the lease lapsed or Redis lost its data.
        self.on_restore: Callable[[list[Handle]], None] | None = None
        #: The shared totals as last heard from Redis: an admission's answer, a snapshot, or a
        #: change published by any gateway (:class:`~.wakeups.Wakeups`).
        self.seen = SharedState()
        #: When the soonest holder in the last snapshot is due to end (``time.monotonic()``),
        #: None when it held none.
        self.next_release_at: float | None = None
        self._refreshed_at = -math.inf
        #: The last drain read (see :meth:`peak_view`).
        self._drain: str | None = None

    @property
    def pricing(self) -> KVAdmissionController:
        return self._pricing

    @property
    def usable_tokens(self) -> int:
        return self.pricing.usable_tokens

    @property
    def keys(self) -> list[str]:
        """The upstream's keys in Redis, as every script takes them."""
        return self._keys

    async def run(self, script: str, *args: Any) -> Any:
        try:
            result = await self._scripts[script](keys=self._keys, args=list(args))
        except LEDGER_ERRORS as exc:
            self.lease.mark(False)
            raise LedgerUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc
        self.lease.mark(True)
        return result

    def ticket(self, need: int) -> str:
        """A name for one request's place in the queue, then its reservation."""
        return f"{self.lease.id}:{next(self._ids)}:{need}"

    async def join(self) -> None:
        """Register the lease and this gateway's budget; :class:`LedgerConflict` when another
        gateway's differs."""
        mine = fingerprint(self.pricing, self.fairness)
        theirs = reply_text(await self.run(CONFIG, mine, self.lease.ttl_ms))
        if theirs != mine:
            raise LedgerConflict(
                f"another gateway shares the ledger of {self.name} configured differently "
                f"(theirs: {theirs}; ours: {mine}): give every gateway the same settings"
            )
        await self.run(RENEW, self.lease.id, self.lease.ttl_ms)
        if self not in self.lease.ledgers:
            self.lease.ledgers.append(self)

    async def try_admit(
        self,
        prompt_tokens: int,
        output_cap: int,
        *,
        need: int | None = None,
        ticket: str | None = None,
        enqueue: bool = False,
        peak: bool = False,
        follow: bool | None = None,
        kind: Hashable = None,
        prefix: tuple[Hashable, ...] = (),
    ) -> Handle | None:
        """Reserve in the shared budget, or None: it does not fit, or others wait ahead (then
        ``enqueue`` puts ``ticket`` in the queue behind them).

        ``peak``: by the peak of every gateway's holders (:class:`~.view.PeakView`) where the
        whole caps do not fit; the commit lands only if no holder came since the snapshot, else
        the snapshot is read again (at most ``MAX_CONFLICTS`` times, then whole caps).
        ``follow`` (not None): the holder gets a progress record, its progress published (True)
        or not (False), so that every gateway counts it by the peak; None: it has none, and
        counts whole wherever it is read. Followed, it is counted to this gateway's forecast
        of its output (``kind``: whose outputs it learns from), where it forecasts: its record
        says so, and every gateway counts it so until its progress is published. ``prefix``:
        the keys of its shareable prompt blocks
        (:meth:`~..admission.ledger.KVAdmissionController.prefix_keys`), recorded by the peak
        with the ones it borrows from any gateway's holders; off the peak, or without keys
        where the engine shares prompt blocks, it is recorded as holding blocks of unknown keys,
        as the in-process ledger has it."""
        if need is None:
            need = self.pricing.need_tokens(prompt_tokens, output_cap)
        if ticket is None:
            ticket = self.ticket(need)
        most = self.pricing.max_concurrency or 0
        args: tuple[Any, ...] = (
            self.lease.id, ticket, need, output_cap, self.usable_tokens, most, int(enqueue)
        )  # fmt: skip
        if peak or follow is not None:
            args += (prompt_tokens, int(bool(follow)))
        keys = tuple(prefix) if peak and follow is not None else ()
        record = lending(self.pricing, (), prompt_tokens, follow=follow)
        status, now_ms, seen, counted = 2, 0, None, ""
        for _ in range(MAX_CONFLICTS if peak else 0):
            view = await self.peak_view()
            head = view.tickets[0] if view.tickets else ticket
            grown = start = counted = ""
            fit = None
            if keys:  # what it borrows as this snapshot has it (the record keeps it)
                lent = view.lent(keys)
                record = lending(self.pricing, keys, prompt_tokens, follow=follow, lent=lent)
            if head == ticket and view.drain is None:
                fit = view.fits(
                    prompt_tokens, output_cap, need, follow=bool(follow), kind=kind, prefix=keys
                )
            if fit is not None:  # on the engine's clock, its record says till when; counted
                # to its forecast, it says so
                grown, start = view.grown, fit.start_ms()
                counted = fit.counted_for(output_cap, follow=bool(follow))
            status, now_ms, seen = await self._admit(*args, grown, start, counted, *_given(record))
            if status != 2:
                break
        if status == 2:
            counted = ""
            status, now_ms, seen = await self._admit(*args, "", "", "", *_given(record))
        self.seen = SharedState.parse(seen)
        if status != 1:
            return None
        handle = self.adopt(ticket, prompt_tokens, output_cap, need, int(now_ms) / 1000)
        handle.counted_output = int(counted) if counted else output_cap  # as its record says
        if len(args) > 7:  # ADMIT wrote its progress record, and its prefix record if any
            progress = f"{prompt_tokens} {handle.counted_output} {int(bool(follow))}"
            self._records[ticket] = (progress, record)
        return handle

    async def _admit(self, *args: Any) -> tuple[int, int, Any]:
        status, now_ms, seen = await self.run(ADMIT, *args)
        if status == -1:  # our lease lapsed (or Redis lost it): renew, then try once more
            await self.renew()
            status, now_ms, seen = await self.run(ADMIT, *args)
        return int(status), int(now_ms), seen

    async def peak_view(self, *, let_go: bool = False) -> PeakView:
        """Every gateway's holders and their progress now, as the peak rule counts them, and
        with ``let_go`` those released lately (for the engine's books). A drain not read
        before (a gateway saw the engine out of lockstep: see :meth:`out_of_step`) puts the
        pricing ledger on caps until its own holders of now have gone, unless it is on caps
        already (the gateway that saw it is)."""
        view = PeakView.parse(await self.run(PEAK_SNAPSHOT, int(let_go)), self.pricing)
        queued = sum(ticket_need(t) for t in view.tickets)
        self.seen = SharedState(view.reserved, len(view.records), queued)
        self.heed(view.drain)
        return view

    def heed(self, drain: str | None) -> None:
        """The drain as just read (see :meth:`peak_view`)."""
        if drain is not None and drain != self._drain and self.pricing.caps_reason is None:
            self.pricing.run_on_caps(f"another gateway: {drain.partition(' ')[2]}")
        self._drain = drain

    async def out_of_step(self, reason: str) -> None:
        """The engine was seen out of lockstep, for ``reason``: every gateway counts whole caps
        until the holders live now have gone (``BREAK``)."""
        await self.run(BREAK, reason)

    def field_of(self, handle: Handle) -> str | None:
        """The reservation's name in Redis of ``handle`` (None once released here)."""
        entry = self._fields.get(handle.id)
        return entry[1] if entry is not None and entry[0] is handle else None

    async def publish(self, entries: list[tuple[str, int, int, bool, int, float, float]]) -> int:
        """Publish holders' progress: per holder (reservation, prompt, counted, tracked,
        generated (-1: none), seconds since that count was read, since the first was), in one
        script; returns how many first counts it published."""
        args: list[Any] = [self.lease.id]
        for field, prompt, counted, tracked, generated, age, first_age in entries:
            args += [
                field, prompt, counted, int(tracked), generated,
                max(0, round(age * 1000)), max(0, round(first_age * 1000)),
            ]  # fmt: skip
        return int(await self.run(PROGRESS, *args))

    def adopt(
        self,
        ticket: str,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        admitted: float,
        records: tuple[str, str] | None = None,
        tenant: str | None = None,
    ) -> Handle:
        """The handle of ``ticket``, admitted at ``admitted`` (the Redis clock): released,
        shrunk and renewed by this process from now on; ``records``: the head of the progress
        record and the prefix record it was admitted with, and ``tenant``: whom a fair decision
        admitted it for, put back with it (:meth:`_restore`)."""
        if records is not None:
            self._records[ticket] = records
        if tenant is not None:
            self._tenants[ticket] = tenant
        handle = Handle(
            id=next(self._ids),
            prompt_tokens=prompt_tokens,
            output_cap=output_cap,
            reserved_tokens=need,
            admitted_at=admitted,
            due_at=self.due(admitted, output_cap),
        )
        self._fields[handle.id] = (handle, ticket)
        return handle

    def due(self, admitted: float, output_cap: int) -> float:
        """When a holder admitted at ``admitted`` with ``output_cap`` is due to end, at worst."""
        return admitted + output_cap / self.pricing.decode_rate + self.pricing.release_margin

    async def leave(self, ticket: str, *, refused: bool = False) -> None:
        """A waiter gives up its place in the queue (``refused``: with a 429, counted for its
        tenant under fair shares); when Redis is away, at the next renewal (a ticket left at
        the head would hold up every gateway, one left under fair shares could be admitted
        for nobody). Admitted meanwhile, it is released."""
        try:
            await self.run(LEAVE, ticket, int(refused))
        except LedgerUnavailable:
            self._unleft.append(ticket)

    async def release(self, handle: Handle) -> None:
        """Give a reservation back; idempotent. When Redis is away it is retried at the next
        renewal (and is lost with the lease if this process dies first)."""
        entry = self._fields.pop(handle.id, None)
        if entry is None or entry[0] is not handle:
            return
        handle.released = True
        self._records.pop(entry[1], None)
        self._tenants.pop(entry[1], None)
        try:
            await self.run(RELEASE, entry[1])
        except LedgerUnavailable:
            self._unreleased.append(entry[1])

    async def renew(self) -> None:
        """Extend this process's lease; retry releases that failed; put back what it holds when
        the lease had lapsed or Redis had lost its data (:meth:`found`). A running gateway's
        lease is renewed by its own thread (:mod:`.lease`); this is for joining, and for a
        script that found the lease gone."""
        await self._retry()
        self.found(int(await self.run(RENEW, self.lease.id, self.lease.ttl_ms)))
        if self._restore_due is not None:
            await self._restore()

    async def tend(self) -> None:
        """What the lease's renewal leaves to the event loop: retry the releases and queue
        exits that failed while Redis was away, and put back what is held when a renewal found
        it gone (:meth:`found`)."""
        await self._retry()
        if self._restore_due is not None:
            await self._restore()

    def found(self, kept: int) -> None:
        """Take a renewal's answer: 0, the lease had lapsed and Redis swept this process's
        reservations; 2, Redis had lost its data. Either way what is still held here is put
        back (at the next :meth:`tend` or :meth:`renew`), not ended: the engine holds it
        whatever Redis says. A lapse is counted (``lapsed_total``) when anything was held."""
        if kept == 0 and self._fields:
            self.lease.lapsed_total += 1
        if kept == 2 or (kept == 0 and self._fields):
            self._restore_due = max(kept, self._restore_due or 0)

    async def _retry(self) -> None:
        while self._unreleased:
            await self.run(RELEASE, self._unreleased[-1])
            self._unreleased.pop()
        while self._unleft:
            await self.run(LEAVE, self._unleft[-1], 0)
            self._unleft.pop()

    async def _restore(self) -> None:
        """Put back what is held here (RESTORE): each holding with its progress record as ADMIT
        wrote it (the publisher writes its progress again) and its prefix record, a fair holder
        with its tenant (charged from its return: the sweep charged what it held until then);
        then tell ``on_restore``. Redis away: tried again at the next :meth:`tend`."""
        due, self._restore_due = self._restore_due, None
        if due is None:
            return
        held = list(self._fields.values())
        args: list[str] = []
        for handle, field in held:
            admitted = round(handle.admitted_at * 1000)
            head, lending = self._records.get(field, ("", ""))
            progress = f"{head} -1 {admitted} {admitted} 0" if head else ""
            value = f"{self.lease.id} {handle.reserved_tokens} {handle.output_cap} {admitted}"
            if field in self._tenants:
                value += f" {self._tenants[field]}"
            args += [field, value, progress, lending]
        try:
            if due == 2:
                fingerprinted = fingerprint(self.pricing, self.fairness)
                await self.run(CONFIG, fingerprinted, self.lease.ttl_ms)
            back = int(await self.run(RESTORE, *args)) if args else 0
        except LedgerUnavailable:
            self._restore_due = max(due, self._restore_due or 0)
            raise
        # One released while RESTORE was on its way may have been put back after its release.
        self._unreleased += [f for h, f in held if self.field_of(h) is None]
        if held:
            logger.warning(
                "shared ledger of %s: %s; %d reservations put back (the engine still holds "
                "them; their requests run on)",
                self.name,
                "Redis had lost its data" if due == 2 else "this gateway's lease had lapsed",
                back,
            )
            if self.on_restore is not None:
                self.on_restore([h for h, _ in held if not h.released])
        await self._retry()

    async def snapshot(self) -> Snapshot:
        """The shared state now (and :attr:`seen` from it)."""
        snap = Snapshot(await self.run(SNAPSHOT))
        self.seen = SharedState(snap.reserved, len(snap.holders), sum(snap.waiting))
        return snap

    async def refresh(self) -> tuple[Snapshot, KVAdmissionController]:
        """A snapshot, and its :meth:`model`; :attr:`seen` and :attr:`next_release_at` from
        them."""
        snap = await self.snapshot()
        model = self.model(snap)
        self.next_release_at = None
        self._refreshed_at = time.monotonic()
        if snap.holders:
            self.next_release_at = time.monotonic() + model.headroom(snap.now).next_release_in
        return snap, model

    async def keep_fresh(self) -> None:
        """:meth:`refresh` when reservations are held and the last snapshot is over a second
        old, so the room advertised knows when the next one ends; never raises."""
        if self.seen.inflight == 0 or time.monotonic() - self._refreshed_at < _ROOM_SECONDS:
            return
        with contextlib.suppress(LedgerUnavailable):
            await self.refresh()

    async def retry_after(
        self,
        need: int,
        *,
        duration: float = 0.0,
        ticket: str | None = None,
        peak: bool = False,
        cuts: Mapping[str, float] | None = None,
    ) -> tuple[float, int]:
        """(seconds until ``need`` fits, tickets waiting ahead of ``ticket``), from every
        holder's worst-case end in the shared state, whichever gateway holds it, by the
        in-process ledger's own estimate (``peak``: by the peak rule, every holder counted
        from its published progress). Those waiting ahead count as load. ``cuts``: this
        process's holders cut before their end (their clients gone), by reservation, with the
        seconds from now by which the engine is taken to let each go: their records do not
        say it, and counted to their caps they would put the advice off by whole answers."""
        view = await self.peak_view() if peak else None
        if view is not None and view.drain is None:
            model, now, names = view.model, view.now, view.tickets
            for field, left in (cuts or {}).items():
                handle = view.handles.get(field)
                if handle is not None:
                    handle.cut_by = now + max(0.0, left)
        else:
            snap, model = await self.refresh()
            now, names = snap.now, snap.tickets
        ahead = names.index(ticket) if ticket in names else len(names)
        need += sum(ticket_need(t) for t in names[:ahead])
        return model.retry_after(need, now, duration=duration), ahead

    def model(self, snap: Snapshot) -> KVAdmissionController:
        """An in-process ledger holding every gateway's holders of ``snap`` (on the Redis clock),
        priced and timed as :attr:`pricing` is: its decode rate and throughput, measured by this
        gateway, so the shared estimate drains as fast as the engine does."""
        scratch = self.pricing.like()
        # In order of admission: each holder's progress counts from its own admission, at the
        # rate of the holders running with it.
        for tokens, cap, admitted in sorted(snap.holders, key=lambda h: h[2]):
            scratch.try_admit(0, cap, now=admitted, need=tokens)
        return scratch

    async def give_back(self) -> None:
        """Retry the releases and queue exits that failed while Redis was away (at shutdown)."""
        try:
            while self._unreleased:
                await self.run(RELEASE, self._unreleased.pop())
            while self._unleft:
                await self.run(LEAVE, self._unleft.pop(), 0)
        except LedgerUnavailable:
            logger.warning("shared ledger of %s: unreachable at shutdown", self.name)

    async def aclose(self) -> None:
        """Close the Redis client (the lease's reservations stay until released or expired)."""
        if self in self.lease.ledgers:
            self.lease.ledgers.remove(self)
        await close(self.client)

    async def occupancy(self) -> tuple[float, float, int]:
        """``(reservation-seconds, busy seconds, admitted)`` since the upstream's keys began,
        across every gateway: :meth:`~.ledger.KVAdmissionController.occupancy` of the shared
        budget, so an engine's speed is measured against everything that runs on it, not this
        process's share alone."""
        held, busy, admitted = await self.run(OCCUPANCY)
        return int(held) / 1000, int(busy) / 1000, int(admitted)

    async def load(self) -> tuple[int, int]:
        """(tokens reserved, requests in flight) across every gateway."""
        snap = await self.snapshot()
        return snap.reserved, len(snap.holders)
