"""Waiting for admission: a FIFO queue in front of the (pure) ledger.

Requests wait in arrival order: while anyone is queued, a newcomer queues behind them even if it
would fit now, so a large request at the head is not starved by a stream of small ones. Only the
head tries the ledger; a release wakes the head. anyio primitives are created per waiter, inside
the running loop, so the queue works under asyncio and trio.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable

import anyio

from .fairness import FairScheduler, TenantStats
from .ledger import Ask, Handle, Headroom, KVAdmissionController

__all__ = ["AdmissionQueue", "LedgerUnavailable", "Rejected", "wait_limit"]


def wait_limit(own: float, preferred: float | None) -> float:
    """How long a request may wait in a queue whose bound is ``own`` when its client prefers
    ``preferred`` seconds (``Prefer: wait``; None: no preference): never longer than either."""
    return own if preferred is None else min(own, max(0.0, preferred))


class Rejected(Exception):
    """No budget within the allowed wait. ``retry_after`` is the ledger's estimate, in seconds;
    ``room``, when given, the room the refused request's own tenant has (its RateLimit fields),
    else the queue's."""

    def __init__(
        self,
        *,
        need: int,
        retry_after: float,
        queued_ahead: int,
        room: Headroom | None = None,
    ) -> None:
        super().__init__(f"no KV budget for {need} tokens; retry after {retry_after:.3f}s")
        self.need = need
        self.retry_after = retry_after
        self.queued_ahead = queued_ahead
        self.room = room


class LedgerUnavailable(Exception):
    """The ledger cannot be reached (a shared one, when Redis is away): the request is refused
    with 503 and ``retry_after`` seconds, and admitted requests run on."""

    retry_after = 1.0


class _Waiter:
    __slots__ = ("event", "need")

    def __init__(self, need: int) -> None:
        self.need = need
        self.event = anyio.Event()


class AdmissionQueue:
    #: The fair shares' scheduler where the queue has tenants (its policy, limits and figures);
    #: None for a FIFO queue.
    fair: FairScheduler | None = None
    #: Whether its ledger is shared with other processes: then the requests the engine ran
    #: through the budget are every process's (:meth:`occupancy`), not only this ledger's.
    spans_processes = False

    def __init__(
        self,
        ledger: KVAdmissionController,
        *,
        max_wait: float,
        stagger: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.max_wait = max_wait
        self.stagger = stagger
        self._clock = clock
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def tenants(self) -> list[TenantStats]:
        """Each tenant's figures now (for ``/metrics``): none without fair shares."""
        return []

    def now(self) -> float:
        """The queue's clock: the one the ledger's due times are on."""
        return self._clock()

    def load(self) -> tuple[int, int]:
        """(tokens reserved, requests in flight) in the budget this queue admits against."""
        return self.ledger.load()

    def room(self) -> tuple[int, int]:
        """(tokens a newcomer may take now, requests in flight) in the budget this queue admits
        against, by the ledger's rule in force: what routing compares."""
        return self.ledger.room(self._clock())

    async def occupancy(self) -> tuple[float, float, int]:
        """The ledger's :meth:`~.ledger.KVAdmissionController.occupancy` now, of the budget
        this queue admits against."""
        return self.ledger.occupancy(self.now())

    def headroom(
        self, releasing: Handle | None = None, *, holder: Handle | None = None
    ) -> Headroom:
        """The room a newcomer sees now (the RateLimit headers): those queued wait ahead of it.
        ``holder``: the request answered (its tenant's room, where the queue has tenants)."""
        return self.ledger.headroom(self.now(), releasing=releasing, queued=self.waiting_tokens)

    @property
    def waiting_tokens(self) -> int:
        """KV tokens the queued requests wait for: not free for a newcomer, who queues behind."""
        return sum(w.need for w in self._waiters)

    def _reject(self, ask: Ask, ahead: int, extra_need: int, client: Hashable | None) -> Rejected:
        # With staggering, unqueued rejections become promises, so clients turned away together
        # get times that each fit; a queued request's estimate counts those ahead of it instead.
        wait = self.ledger.retry_after(
            ask.need + extra_need,
            self._clock(),
            duration=ask.output_cap / self.ledger.decode_rate,
            promise=self.stagger and ahead == 0,
            client=client,
            ask=ask,
        )
        self.ledger.record_rejection(ask.need, wait)
        return Rejected(need=ask.need, retry_after=wait, queued_ahead=ahead)

    def notify(self) -> None:
        """Something was released: let the head of the queue try again."""
        if self._waiters:
            self._waiters[0].event.set()

    def progress(self, handle: Handle, generated: int) -> None:
        """``handle`` has had ``generated`` tokens relayed: under the peak rule its first token
        shrinks what it counts for, so the head of the queue tries again."""
        if self.ledger.progress(handle, generated, self._clock()):
            self.notify()

    def out_of_step(self, reason: str) -> None:
        """The engine was seen out of lockstep, for ``reason`` (the ledger runs on caps until
        its holders have gone): nothing more to do where this process's holders are all
        there are."""

    async def look_elsewhere(self) -> None:
        """Read what other processes sharing this queue's budget hold, just before and just
        after the engine's books are read (see the shared ledger's queue): nothing to read
        here, this process's holders are all there are."""

    async def release(self, handle: Handle) -> None:
        """Give ``handle``'s reservation back and let the head of the queue try again."""
        self.ledger.release(handle, self._clock())
        self.notify()

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
        """A handle for the request, or :class:`Rejected` after at most ``max_wait`` seconds.

        ``client`` identifies the caller for staggered advice (its connection's address).
        ``max_wait`` shortens the queue's own wait for this request (the client's ``Prefer:
        wait``); it never lengthens it. ``prefix``: the keys of the request's shareable prompt
        blocks and ``sequences`` how many it runs at once (see
        :meth:`KVAdmissionController.try_admit`). ``tenant`` and ``priority`` are
        for a fair queue (:class:`~.fair_queue.FairQueue`); this one serves all in arrival order.
        ``model`` and ``follow``: whose outputs its forecast learns from, and whether its
        progress will be relayed (see :meth:`KVAdmissionController.try_admit`).
        """
        limit = wait_limit(self.max_wait, max_wait)
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        ask = Ask(
            prompt_tokens=prompt_tokens, output_cap=output_cap, need=need, prefix=prefix,
            kind=(model, None), follow=follow, sequences=sequences,
        )  # fmt: skip

        def attempt() -> Handle | None:
            return self.ledger.try_admit(
                prompt_tokens,
                output_cap,
                now=self._clock(),
                count_rejection=False,
                need=need,
                prefix=prefix,
                kind=ask.kind,
                follow=follow,
                sequences=sequences,
            )

        if not self._waiters and (handle := attempt()) is not None:
            return handle
        if limit <= 0:
            raise self._reject(ask, len(self._waiters), sum(w.need for w in self._waiters), client)

        waiter = _Waiter(need)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(limit):
                while True:
                    if self._waiters[0] is waiter and (handle := attempt()) is not None:
                        return handle
                    await waiter.event.wait()
                    waiter.event = anyio.Event()
            ahead = self._waiters.index(waiter)
            extra = sum(self._waiters[i].need for i in range(ahead))
            raise self._reject(ask, ahead, extra, client)
        finally:
            was_head = bool(self._waiters) and self._waiters[0] is waiter
            with contextlib.suppress(ValueError):  # always queued here; belt and braces
                self._waiters.remove(waiter)
            if was_head:
                self.notify()  # the next in line may fit now
