"""The FIFO queue in front of a shared ledger: one queue across every gateway process.

The order is kept in Redis (the ledger's queue of tickets): only the head may be admitted, so a
newcomer in any process waits behind those already waiting in any other. A release here wakes
this process's waiters at once; others' releases, through Redis pub/sub (``wakeups``), with a
poll every ``FALLBACK_POLL_SECONDS`` in case a message was lost; without pub/sub (or while its
subscription is down) they are seen by polling, ``POLL_SECONDS`` apart.

The in-process ledger it is given (``ledger``) mirrors this process's own reservations (its
metrics are this process's); admission and the room advertised (:meth:`SharedQueue.headroom`)
are the shared ledger's.

Under the peak rule (the mirror configured for it and in force: the engine qualifies, and the
watch sees it in lockstep), admission is by the peak of every gateway's holders
(:class:`~.view.PeakView`), and this process publishes its own holders' progress, relayed into
the mirror, to Redis (:meth:`SharedQueue.publish`): its first token at once, then every
``PUBLISH_TOKENS`` tokens or ``PUBLISH_SECONDS``, whichever comes first. Otherwise every holder
counts at its whole cap, as the seed's rule has it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable

import anyio

from ..admission.holders import slow_since
from ..admission.ledger import Handle, Headroom, KVAdmissionController
from ..admission.queue import AdmissionQueue, LedgerUnavailable, Rejected, wait_limit
from ..admission.values import Backlog
from .ledger import RedisLedger
from .view import PUBLISH_TOKENS, PeakView, explained_elsewhere
from .wakeups import Wakeups

__all__ = ["FALLBACK_POLL_SECONDS", "POLL_SECONDS", "SharedQueue", "Wake"]

#: How often a waiter looks again at the shared budget when nothing here was released and no
#: pub/sub subscription tells it of others' releases.
POLL_SECONDS = 0.02
#: How often it looks again while subscribed: only a message lost (a subscription that dropped
#: and came back) waits this long.
FALLBACK_POLL_SECONDS = 0.5
#: How old the last view of every gateway's holders may grow, while any holds, before the
#: publisher reads it again (routing's room, and what explains the engine's books).
VIEW_SECONDS = 1.0


class Wake:
    """One waiter's wake-up: a fresh event after each one it used."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


class SharedQueue(AdmissionQueue):
    """An :class:`AdmissionQueue` whose admission is ``shared``'s, in Redis."""

    spans_processes = True

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
        shared.on_restore = self._restored
        self._wakeups = wakeups
        if wakeups is not None:
            wakeups.watch(shared, self.notify)
        #: Called when progress should be published before the interval is up (set by the
        #: process's publisher, see :meth:`publish`).
        self.publish_soon: Callable[[], None] | None = None
        #: mirror handle id -> (tracked, generated) as last published
        self._published: dict[int, tuple[bool, int, int]] = {}
        #: A lockstep break seen here, to be told to every gateway (see :meth:`out_of_step`).
        self._break: str | None = None
        #: Every gateway's backlog as last read for ``/metrics`` (:meth:`refresh`); None
        #: before the first read.
        self.backlog: Backlog | None = None
        #: The last two views of every gateway's holders, and when each was read
        #: (``time.monotonic``): see :meth:`look_elsewhere`.
        self._views: deque[tuple[PeakView, float]] = deque(maxlen=2)
        ledger.elsewhere = self._explained_elsewhere

    @property
    def on_peak(self) -> bool:
        """Whether admission is by the peak of every gateway's holders now: the mirror is
        configured for it and it is in force (else whole caps, as the seed's rule)."""
        ledger = self.ledger
        return ledger.rule == "peak" and ledger.strategy == "reserve" and not ledger.caps_reason

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
        """The shared budget's room (by the peak as of the last view under the peak rule, else
        whole caps) and every gateway's requests in flight, as last heard from Redis."""
        reserved, inflight = self.load()
        return self._free(reserved), inflight

    def _free(self, reserved: int) -> int:
        """Room for a newcomer with ``reserved`` held in all: the last view's under the peak
        rule, when it is at least as large."""
        free = self.ledger.usable_tokens - reserved
        if self._views and self.on_peak:
            free = max(free, self._views[-1][0].room())
        return free

    async def refresh(self) -> None:
        """Read the shared totals from Redis (for ``/metrics``), and :attr:`backlog`."""
        snap, _ = await self.shared.refresh()
        await self.measure(len(snap.tickets))

    async def measure(self, waiting: int) -> None:
        """:attr:`backlog` from the totals just read (``waiting``: the tickets in the shared
        queue), the same at every gateway: the room is read from Redis now (by the peak of every
        gateway's holders where it is in force), not from this process's last view."""
        pricing, seen = self.ledger, self.shared.seen
        room = pricing.usable_tokens - seen.reserved
        if self.on_peak:
            room = max(room, (await self.shared.peak_view()).room())
        room -= seen.queued
        if pricing.max_concurrency is not None and seen.inflight >= pricing.max_concurrency:
            room = 0
        self.backlog = Backlog(
            reserved=seen.reserved,
            inflight=seen.inflight,
            waiting=waiting,
            waiting_tokens=seen.queued,
            room=max(0, min(room, pricing.usable_tokens)),
            read_at=time.monotonic(),
        )

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
        free = self._free(reserved) - seen.queued
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

    def _restored(self, back: list[Handle]) -> None:
        # The shared reservations were put back (the lease had lapsed, or Redis lost its data):
        # the mirror's stay as they are, and their progress is published again, from where
        # their records were put back (before their first token).
        restored = {id(h) for h in back}
        for key, (_, shared) in self._links.items():
            if id(shared) in restored:
                self._published.pop(key, None)
        if self.publish_soon is not None:
            self.publish_soon()

    def progress(self, handle: Handle, generated: int) -> None:
        """The mirror's :meth:`~AdmissionQueue.progress`; its first count, tokens enough
        since the last published, or a count past its forecast (it is counted further now:
        every gateway must see it at once) are published soon (see :meth:`publish`)."""
        super().progress(handle, generated)
        if not handle.tracked or self.publish_soon is None or handle.id not in self._links:
            return
        _, published, counted = self._published.get(handle.id, (True, -1, handle.output_cap))
        if (
            published < 0
            or (handle.generated or 0) - published >= PUBLISH_TOKENS
            or handle.counted_output != counted
        ):
            self.publish_soon()

    async def publish(self) -> None:
        """Publish the progress of this process's holders that changed since last published
        (each one's count, whether it is still followed: not once its relay has let it go, or
        waited on a slow client); read every gateway's holders again when the last view is
        old. Raises :class:`LedgerUnavailable` when Redis is away (then all at the next call)."""
        if self._break is not None:
            await self.shared.out_of_step(self._break)
            self._break = None
        mirror, now = self.ledger, self._clock()
        entries = []
        changed: dict[int, tuple[bool, int, int]] = {}
        links = list(self._links.items()) if mirror.tracks_progress else []
        for key, (mine, held) in links:
            field = self.shared.field_of(held)
            if field is None or mine.released:
                continue
            tracked = mine.tracked and slow_since(mine, now, mirror.relay_lag) is None
            generated = -1 if mine.generated is None else mine.generated
            now_counted = (tracked, generated, mine.counted_output)
            if now_counted == self._published.get(key):
                continue
            changed[key] = now_counted
            age = now - mine.seen_at if generated >= 0 else 0.0
            first_age = now - mine.first_seen_at if generated >= 0 else 0.0
            entries.append(
                (field, mine.prompt_tokens, mine.counted_output, tracked, generated, age, first_age)
            )
        if entries:
            await self.shared.publish(entries)
            self._published.update((k, v) for k, v in changed.items() if k in self._links)
        old = not self._views or time.monotonic() - self._views[-1][1] > VIEW_SECONDS
        if old and self.shared.seen.inflight:
            await self.look_elsewhere()

    def out_of_step(self, reason: str) -> None:
        """The watch saw the engine out of lockstep (this process's mirror is on caps until
        its holders have gone): every gateway is told at the next publish, to count whole caps
        until every holder live then has gone (a stalled stream is seen by its own gateway
        alone)."""
        self._break = reason
        if self.publish_soon is not None:
            self.publish_soon()

    async def look_elsewhere(self) -> None:
        """Read every gateway's holders (kept with the one read before: the engine's books are
        read between two such reads, see ``watch.py``); only while the mirror follows progress."""
        if self.ledger.tracks_progress:
            self._views.append((await self.shared.peak_view(let_go=True), time.monotonic()))

    def _explained_elsewhere(self, since: float, now: float) -> int:
        """What other gateways' holders may hold in the engine at ``now`` (this process's
        monotonic clock), from the last two views, and those they let go at ``since`` or later;
        0 without one fresh enough (then the engine's books may take theirs for someone
        unseen's: whole caps while it lasts, the safe way). Called under the mirror's lock: it
        must not call back into the mirror."""
        if not self._views or now - self._views[-1][1] > 3 * VIEW_SECONDS:
            return 0
        view, read = self._views[-1]
        at = view.now + max(0.0, now - read)
        views = [v for v, _ in self._views]
        # ``view.now`` was read before ``read``: ``since`` maps earlier if anything (safe).
        return explained_elsewhere(views, self.shared.lease.id, at, since=view.now + since - read)

    def _cuts(self) -> dict[str, float]:
        """This process's holders whose requests were cut before their end, by reservation:
        the seconds from now by which the engine is taken to let each go (see
        :meth:`RedisLedger.retry_after`)."""
        now, cuts = self._clock(), {}
        for mine, held in list(self._links.values()):
            field = self.shared.field_of(held)
            if mine.cut_by is not None and field is not None:
                cuts[field] = mine.cut_by - now
        return cuts

    async def release(self, handle: Handle) -> None:
        link = self._links.pop(handle.id, None)
        self._published.pop(handle.id, None)
        self.ledger.release(handle, self._clock())  # the mirror's books remember it a moment
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
        # Shared prefix blocks count once across processes (each holder's keys in Redis).
        prefix: tuple[Hashable, ...] = (),
        tenant: str | None = None,  # no fair shares on the shared ledger (the gateway refuses)
        priority: int = 0,
        model: str | None = None,
        follow: bool = False,
        # The shared ledger counts a request once against the running cap; a request of
        # several sequences is never followed, so it counts whole under either rule and
        # sequences waiting in the engine hold no KV it has not reserved.
        sequences: int = 1,
    ) -> Handle:
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        ticket = self.shared.ticket(need)
        wake = Wake()
        self._wakes.append(wake)
        limit = wait_limit(self.max_wait, max_wait)
        try:
            return await self._acquire(
                prompt_tokens, output_cap, need, ticket, wake, limit, follow=follow,
                kind=(model, None), prefix=prefix,
            )  # fmt: skip
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
        *,
        follow: bool = False,
        kind: Hashable = None,
        prefix: tuple[Hashable, ...] = (),
    ) -> Handle:
        shared = self.shared
        enqueue = limit > 0
        deadline = self._clock() + limit
        queued = False
        try:
            while True:
                # Followed while the mirror tracks progress, on the peak or on caps for now:
                # once back on the peak, every gateway counts it by its progress.
                tracks = self.ledger.tracks_progress
                held = await shared.try_admit(
                    prompt_tokens, output_cap, need=need, ticket=ticket, enqueue=enqueue,
                    peak=self.on_peak, follow=follow if tracks else None, kind=kind,
                    prefix=prefix,
                )  # fmt: skip
                if held is not None:
                    queued = False
                    return await self._link(
                        held, prompt_tokens, output_cap, need, follow=follow and tracks,
                        kind=kind, prefix=prefix,
                    )  # fmt: skip
                queued = enqueue
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                with anyio.move_on_after(min(self.poll_seconds, remaining)):
                    await wake.event.wait()
                if wake.event.is_set():
                    wake.event = anyio.Event()
            wait, ahead = await shared.retry_after(
                need, duration=output_cap / self.ledger.decode_rate, ticket=ticket,
                peak=self.on_peak, cuts=self._cuts(),
            )  # fmt: skip
            self.ledger.record_rejection(need, wait)
            raise Rejected(need=need, retry_after=wait, queued_ahead=ahead)
        finally:
            if queued:
                with anyio.CancelScope(shield=True):
                    await shared.leave(ticket)

    async def _link(
        self,
        held: Handle,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        *,
        follow: bool = False,
        kind: Hashable = None,
        prefix: tuple[Hashable, ...] = (),
    ) -> Handle:
        """This process's mirror of the shared reservation ``held`` (``follow``: its progress is
        relayed into it, counted by its forecast where the mirror forecasts, and published;
        ``prefix``: its shareable prompt blocks, counted once as the engine holds them);
        cancelled on the way (its client gone), ``held`` is given back rather than left to a
        lease that lives on."""
        try:
            await self.shared.keep_fresh()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shared.release(held)
            raise
        mine = self.ledger.try_admit(
            prompt_tokens, output_cap, now=self._clock(), count_rejection=False, need=need,
            follow=follow, admitted=True, kind=kind, prefix=prefix,
        )  # fmt: skip
        if mine is None:  # cannot happen: admitted by the shared ledger, it is held here
            with anyio.CancelScope(shield=True):
                await self.shared.release(held)
            raise Rejected(need=need, retry_after=1.0, queued_ahead=0)
        self._links[mine.id] = (mine, held)
        # What its admission wrote (its count: the forecast the view gave it, or its cap; one
        # that differs from the mirror's, the quantile having moved between, is published).
        self._published[mine.id] = (mine.tracked, -1, held.counted_output)
        return mine
