"""What the ledger is told while its holders run, for the peak rule: their progress as the
relay reads it (and its writes to clients that read slowly), and the engine's figures as the
gateway's watch reads them (its waiting line, preemptions, the KV it uses, whether they can be
read at all). A mixin of :class:`~.ledger.KVAdmissionController` (:class:`Reports`), under its
lock; the arithmetic is in :mod:`.holders` and :mod:`.outlook`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from .holders import RuleInForce, explained, freshest, slow_write, stalled
from .outlook import Outlook
from .values import Handle

__all__ = ["Reports"]


class Reports:
    """The ledger's reports from the relay and the engine: a mixin of
    :class:`~.ledger.KVAdmissionController`, whose state it updates (declared here for the type
    checker)."""

    _lock: threading.Lock
    _live: dict[int, Handle]
    _outlook: Outlook
    _in_force: RuleInForce
    _tainted: set[Hashable]
    _unknown: int
    _let_go: deque[tuple[float, int]]
    relay_lag: float
    block_size: int
    #: The KV that holders this ledger does not hold may explain in the engine's books as of
    #: ``now`` (this ledger's clock; called ``(since, now)``, ``since`` as for
    #: :meth:`engine_used`): where the budget is shared with other processes (the shared
    #: ledger), theirs. None: this ledger's holders are all there is.
    elsewhere: Callable[[float, float], int] | None = None

    if TYPE_CHECKING:

        @property
        def decode_rate(self) -> float: ...

        def _peak_in_force(self) -> bool: ...

    def set_caps_for_good(self, reason: str | None) -> None:
        """Run on caps whatever happens, for ``reason`` (the engine does not qualify for the
        peak rule); None lifts it."""
        with self._lock:
            self._in_force.for_good = reason

    def run_on_caps(self, reason: str) -> None:
        """The engine was seen not to run every holder in lockstep (requests waiting inside it,
        a preemption, a stalled stream): count whole caps until every holder live now has
        gone. Said again while it lasts, it waits for the holders live then."""
        with self._lock:
            self._in_force.until_drained(reason, self._live)

    def engine_unseen(self, reason: str | None) -> None:
        """The engine's waiting, running and preemption figures cannot be read, for ``reason``:
        whole caps, no forecast and no newcomer's clock while it lasts. None: they are read
        again; the holders admitted meanwhile are counted whole until they have gone."""
        with self._lock:
            if reason is not None:
                self._outlook.engine_waiting = None
            self._in_force.last("unread", reason, self._live)

    def progress(self, handle: Handle, generated: int, now: float) -> bool:
        """``handle`` has had ``generated`` tokens relayed by ``now`` (counted from the engine's
        own stream). True when they are its first: the room a queue waits for may have grown."""
        with self._lock:
            if handle.released or not handle.tracked:
                return False
            first = handle.generated is None
            if first:
                handle.first_seen_at = now
                self._outlook.started(handle)
            elif generated <= (handle.generated or 0):
                return False
            handle.generated = min(max(0, generated), handle.output_cap)
            handle.seen_at = now
            if self._peak_in_force():
                self._outlook.outlived(handle, handle.generated)
            return first

    def ended(self, handle: Handle, *, by_itself: bool) -> None:
        """The engine said how ``handle``'s output ended: ``by_itself`` (an end-of-sequence or
        stop token), else at its cap or cut. Its length is learnt when it is released."""
        with self._lock:
            handle.ended = by_itself

    def unfollow(self, handle: Handle) -> None:
        """Its progress will not be relayed after all: it counts whole until released."""
        with self._lock:
            handle.tracked = False
            handle.start_by = None

    @property
    def forecasting(self) -> bool:
        """Whether holders are counted by a forecast of their outputs now (an engine that
        preempts, a preemption budget, the peak rule in force and the budget not spent)."""
        with self._lock:
            return self._peak_in_force() and self._outlook.quantile() is not None

    def engine_seen(
        self, *, waiting: float | None, preemptions: float | None, requests: int | None = None
    ) -> str | None:
        """What the engine's ``/metrics`` said just now: requests waiting inside it (a
        newcomer then may not start at once; None: not known, nor may it) and its preemption
        counter (the forecast's budget; a line for the log when its quantile moved), weighed
        against ``requests`` run through the budget so far where others than this ledger's
        holders run on it too (a shared ledger's every gateway's; None: the holders this
        ledger followed to their ends)."""
        with self._lock:
            self._outlook.engine_waiting = None if waiting is None else int(waiting)
            if preemptions is None:
                return None
            return self._outlook.observe(preemptions, self._live.values(), requests=requests)

    def engine_used(self, used_tokens: int, since: float, now: float) -> int:
        """The KV the engine said it uses (``used_tokens``, as of no earlier than ``since``):
        what the holders cannot explain (:func:`.holders.explained`, and those released since)
        is held by someone the gateway does not see. It is counted as held, flat, until the
        engine says otherwise, and the rule counts whole caps meanwhile (that someone's
        sequences run beside the holders, and grow); returned, in whole blocks."""
        with self._lock:
            live = self._live.values()
            explained_now = explained(
                live, freshest(live, now), now, decode_rate=self.decode_rate,
                relay_lag=self.relay_lag, block_size=self.block_size, tainted=self._tainted,
            )  # fmt: skip
            while self._let_go and self._let_go[0][0] < since:
                self._let_go.popleft()
            explained_now += sum(tokens for _, tokens in self._let_go)
            if self.elsewhere is not None:
                explained_now += self.elsewhere(since, now)
            excess = max(0, used_tokens - explained_now)
            self._unknown = unknown = excess // self.block_size * self.block_size
            reason = (
                f"the engine holds {unknown} KV tokens more than its holders explain (traffic "
                "that does not pass through the gateway)"
            )
            self._in_force.last("unexplained", reason if unknown else None, self._live)
            return unknown

    def stalled(self, now: float, seconds: float) -> list[Handle]:
        """Tracked holders whose count stood still for ``seconds`` while another's moved (see
        :func:`.holders.stalled`)."""
        with self._lock:
            return stalled(self._live.values(), now, seconds)

    def cut(self, handle: Handle, by: float) -> None:
        """``handle``'s request was cut before its end; the engine is taken to let it go by
        ``by`` (what Retry-After counts on: not its cap)."""
        with self._lock:
            handle.cut_by = by

    def writing(self, handle: Handle, now: float) -> None:
        """A write of ``handle``'s answer to its client begins ``now``."""
        with self._lock:
            handle.writing_since = now

    def written(self, handle: Handle, now: float) -> None:
        """The write that began at :meth:`writing` is done ``now``: one that waited long on its
        client makes ``handle`` a slow reader, counted as advancing at the engine's speed from
        its count before the wait (see :func:`.holders.as_holder`)."""
        with self._lock:
            since, handle.writing_since = handle.writing_since, None
            if (
                since is not None
                and handle.slowed_at is None
                and handle.generated is not None
                and slow_write(now - since, self.relay_lag)
            ):
                handle.slowed_at, handle.slowed_from = handle.seen_at, handle.generated
