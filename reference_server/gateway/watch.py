"""Watching an engine behind the gateway through its ``/metrics``: the peak rule runs only while
the engine is seen to behave as the rule assumes, and the upstream counts whole caps whenever it
is not, or cannot be seen (fail closed).

Two tasks per upstream while the gateway serves:

- :meth:`EngineWatch.scrape` reads the engine's ``/metrics`` once a second at most apart
  (``speed_interval``): its decode counters give its speed (``speed.py``), and its waiting,
  running and preemption figures, the KV it uses and what it lost are weighed by
  :meth:`EngineWatch.seen`.
- :meth:`EngineWatch.lockstep` checks as often that those figures are fresh and that no
  stream stalled while others advanced. A scrape that fails stops the newcomer's clock until
  one succeeds; figures unread for ``BLIND_SECONDS`` (a ``/metrics`` that answers 404 or 401,
  times out twice in a row, or leaves them out) put the upstream on whole caps, with
  no forecast and no newcomer's clock, until they are read again and the holders admitted
  meanwhile have gone. A task of its own: a scrape that hangs, or an engine that exports no
  decode counters, does not stop it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from kvclient.engines.budget import Budget
from kvclient.engines.metrics import (
    METRIC_NAMES,
    KVLosses,
    Lockstep,
    decode_counters,
    kv_losses_from_metrics,
    lockstep_from_metrics,
)

from ..admission.ledger import KVAdmissionController
from ..admission.queue import AdmissionQueue, LedgerUnavailable
from .config import GatewayConfig
from .errors import UPSTREAM_ERRORS
from .speed import Speed, SpeedEstimator

__all__ = [
    "BLIND_SECONDS",
    "PREEMPTION_WINDOW",
    "STALL_SECONDS",
    "EngineWatch",
    "PreemptionRate",
    "Watched",
]

if TYPE_CHECKING:
    from ..shared_ledger.books import EngineBooks

logger = logging.getLogger("kvclient.gateway")

#: Scrapes in a row without decode counters after which an engine is taken to export none.
SPEED_MISSES = 3
#: Seconds a stream's count may stand still while another's moves before the engine is taken
#: not to run them in lockstep: many decode steps even for a large batch on a CPU.
STALL_SECONDS = 3.0
#: The longest a scrape of ``/metrics`` may take before it counts as unread.
SCRAPE_TIMEOUT = 2.0
#: Seconds the engine's waiting, running and preemption figures may go unread before its
#: upstream counts whole caps: two scrapes in a row (at most a second apart) that time out. One
#: slow answer of an engine's busy API server is no blindness (vLLM's took over 2 s under a
#: burst on 2 cores); meanwhile a scrape that failed stops the newcomer's clock at once.
BLIND_SECONDS = 2 * (1.0 + SCRAPE_TIMEOUT)
#: Scrape intervals a gateway on a shared ledger waits for the scraper's next page before it
#: scrapes the engine itself: its own scrape then comes before its figures count as unread
#: (``BLIND_SECONDS``), so a scraper that dies puts no gateway on whole caps.
STALE_INTERVALS = 2
#: Looks for the scraper's next page per scrape interval while waiting for it.
_LOOKS = 5


#: Seconds of the engine's preemption counter the rate shown in ``/metrics`` is taken over.
PREEMPTION_WINDOW = 300.0


class PreemptionRate:
    """The engine's preemptions per 1,000 requests admitted to it over the last ``window``
    seconds, from its counter and the ledger's admissions (every gateway's, where the ledger is
    shared): what an operator scales on, whether or not a forecast runs. Pure: the scrape
    adds the readings."""

    def __init__(self, window: float = PREEMPTION_WINDOW) -> None:
        self.window = window
        self._readings: deque[tuple[float, float, int]] = deque()

    def add(self, now: float, preemptions: float, admitted: int) -> None:
        """A reading at ``now``: a counter that went back (the engine, or the shared ledger's
        keys, began again) starts the window over."""
        last = self._readings[-1] if self._readings else None
        if last is not None and (preemptions < last[1] or admitted < last[2]):
            self._readings.clear()
        self._readings.append((now, preemptions, admitted))
        while len(self._readings) > 2 and self._readings[1][0] <= now - self.window:
            self._readings.popleft()

    def rate(self) -> float | None:
        """Per 1,000 requests admitted in the window; None until some were."""
        if len(self._readings) < 2:
            return None
        _, first_preempted, first_admitted = self._readings[0]
        _, preempted, admitted = self._readings[-1]
        if admitted <= first_admitted:
            return None
        return 1000 * (preempted - first_preempted) / (admitted - first_admitted)


class Known(Protocol):
    """Where a watched upstream's reservations are held (:class:`.upstream.Known`)."""

    @property
    def ledger(self) -> KVAdmissionController: ...

    @property
    def queue(self) -> AdmissionQueue: ...


class Watched(Protocol):
    """What the watch reads and sets of its upstream (:class:`.upstream.Upstream`)."""

    speed: Speed | None
    lockstep_breaks: int

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> GatewayConfig: ...

    @property
    def budget(self) -> Budget | None: ...

    @property
    def known(self) -> Known | None: ...

    async def fetch(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        limit: int = ...,
    ) -> tuple[int, str | None, bytes | None]: ...


class EngineWatch:
    """What the gateway sees of one upstream's engine, and what it does about it."""

    def __init__(self, upstream: Watched) -> None:
        self.upstream = upstream
        #: When the engine's figures were last read whole, and why they were not since.
        self.read_at: float | None = None
        self.unread: str | None = None
        #: Why its figures cannot be read now (the upstream counts whole caps), or None.
        self.blind: str | None = None
        #: Sequences it said it runs, in a scrape begun no earlier than ``running_from``.
        self.running: float | None = None
        self.running_from = 0.0
        self.scraped = anyio.Event()
        #: Lockstep checks run so far (what a test waits on).
        self.checks = 0
        self._preemptions: float | None = None
        self._losses: KVLosses | None = None
        self._unknown = 0
        #: The engine's preemption counter as last read (None: it gives none), and its rate.
        self.preemptions_read: float | None = None
        self.preemptions = PreemptionRate()
        #: The engine's books in Redis, read once for every gateway (set at discovery when the
        #: ledger is shared), and whose scrape the figures last weighed came from (the lease's
        #: id; None: this process's own).
        self.books: EngineBooks | None = None
        self.read_by: str | None = None

    def discovered(self, now: float) -> None:
        """Its figures were read with its budget, just now."""
        self.read_at = now

    @property
    def interval(self) -> float:
        """Seconds between two scrapes, and two checks: ``speed_interval``, at most one."""
        wanted = self.upstream.config.speed_interval
        return min(wanted, 1.0) if wanted > 0 else 1.0

    @property
    def claim_seconds(self) -> float:
        """How long the scraper's claim lasts unrenewed: the bound the others wait for its
        next page, and a scrape that times out."""
        return STALE_INTERVALS * self.interval + SCRAPE_TIMEOUT

    def figures(self, now: float) -> dict[str, Any]:
        """``/health``'s ``engine_figures``: who scrapes the engine (``this gateway``, another's
        lease, or None where none does yet), whose scrape the figures weighed last came from,
        and how old they are (seconds; None: never read)."""
        books = self.books
        own = "this gateway"
        if books is None:
            scraper: str | None = own
        else:
            scraper = own if books.mine else books.scraper
        by = self.read_by
        return {
            "scraper": scraper,
            "read_by": own if by is None or (books is not None and by == books.lease_id) else by,
            "age_seconds": None if self.read_at is None else round(now - self.read_at, 3),
        }

    # --- the tasks ---------------------------------------------------------------------------

    async def scrape(self) -> None:
        """Read the engine's ``/metrics`` while the gateway serves (see the module). Stops only
        for an engine whose figures the peak rule does not need (it counts whole caps for good)
        and that exports no decode counters either."""
        upstream = self.upstream
        estimator = SpeedEstimator()
        misses = 0
        page: tuple[str | None, float, float] | None = None
        while True:
            # Quicker until there is a speed: the first answers' advice is built on it.
            measures = upstream.config.speed_interval > 0
            quick = measures and upstream.speed is None and misses < SPEED_MISSES
            if page is None:  # a reader of the scraper's pages goes at its pace
                await anyio.sleep(min(self.interval, 0.25) if quick else self.interval)
            known = upstream.known
            if known is None:
                page = None
                continue
            page = await self._page_of_scraper(known, self.books) if self.books else None
            text, started, now = page if page is not None else await self._scrape(known)
            if text is not None:
                self.seen(text, now, started=started, admitted=await self._admitted(known))
            else:  # nothing known of what waits in the engine: no newcomer starts on its clock
                known.ledger.engine_seen(waiting=None, preemptions=None)
            self.scraped.set()
            self.scraped = anyio.Event()
            if not measures:
                continue  # the answers' own rates stand for its speed
            counters = decode_counters(text or "")
            if counters is None:
                misses += 1
                # Nothing more to learn from an engine on caps for good without counters.
                watched = known.ledger.tracks_progress
                if misses >= SPEED_MISSES and upstream.speed is None and not watched:
                    return
                continue
            misses = 0
            try:  # everything that runs on the engine through the ledger (a shared one's too)
                occupancy = await known.queue.occupancy()
            except LedgerUnavailable:
                continue
            estimator.add(counters, *occupancy)
            speed = estimator.estimate()
            if speed is not None:
                upstream.speed = speed
                known.ledger.set_speed(speed.decode_rate, speed.throughput, now, steps=True)

    async def _scrape(self, known: Known) -> tuple[str | None, float, float]:
        """(the page or None, when the scrape began, when it ended): this process's own, handed
        to every gateway when this process is the scraper."""
        # Other processes' holders, read on both sides of the engine's figures: each one
        # admitted before them is in the second read, each let go since in the first.
        with contextlib.suppress(LedgerUnavailable):
            await known.queue.look_elsewhere()
        started = time.monotonic()
        text = await self._read()
        now = time.monotonic()
        with contextlib.suppress(LedgerUnavailable):
            await known.queue.look_elsewhere()
        self.read_by = None
        books = self.books
        if books is not None and books.mine and text is not None:
            ages = {"started_age": time.monotonic() - started, "read_age": time.monotonic() - now}
            with contextlib.suppress(LedgerUnavailable):
                await books.write(text, **ages)
        return text, started, now

    async def _page_of_scraper(
        self, known: Known, books: EngineBooks
    ) -> tuple[str | None, float, float] | None:
        """The scraper's next page, as (page, began, read) on this process's clock, between
        two reads of every gateway's holders as an own scrape is; None when this process is
        the scraper, Redis is away, or no page came within ``STALE_INTERVALS`` (then it
        scrapes itself)."""
        try:
            if await books.claim():
                return None
            # The page must be of a scrape begun after the first read of the holders.
            with contextlib.suppress(LedgerUnavailable):
                await known.queue.look_elsewhere()
            after, page = await books.read()
            for _ in range(STALE_INTERVALS * _LOOKS):
                await anyio.sleep(self.interval / _LOOKS)
                at, page = await books.read(after)
                here = time.monotonic()  # with ``at``: the two clocks at one moment
                if page is not None:
                    break
            if page is None:
                if self.read_by is not None:  # said once, when the pages stop
                    logger.info(
                        "upstream %s: no page from the engine's scraper (%s) for %d scrape "
                        "intervals: this gateway scrapes", self.upstream.name, books.scraper,
                        STALE_INTERVALS,
                    )  # fmt: skip
                return None
            with contextlib.suppress(LedgerUnavailable):
                await known.queue.look_elsewhere()
        except LedgerUnavailable:
            return None
        self.read_by = page.by
        return page.text, here - (at - page.started), here - (at - page.read)

    async def lockstep(self) -> None:
        """Check, while the gateway serves, that the engine's figures are fresh and no stream
        stalled (:meth:`check`)."""
        while True:
            await anyio.sleep(self.interval)
            self.check(time.monotonic())

    async def _read(self) -> str | None:
        """The ``/metrics`` text, or None (with why in :attr:`unread`)."""
        try:
            with anyio.fail_after(SCRAPE_TIMEOUT):
                status, _, data = await self.upstream.fetch("GET", "/metrics")
        except TimeoutError:
            self.unread = f"its /metrics took longer than {SCRAPE_TIMEOUT:g} s"
            return None
        except UPSTREAM_ERRORS as exc:
            self.unread = f"its /metrics could not be reached ({type(exc).__name__})"
            return None
        if status != 200 or not data:
            self.unread = f"its /metrics answered {status}"
            return None
        return data.decode("utf-8", "replace")

    async def _admitted(self, known: Known) -> int | None:
        """Requests admitted through the budget so far (every gateway's, where the ledger is
        shared); None when the shared ledger is away."""
        try:
            _, _, admitted = await known.queue.occupancy()
        except LedgerUnavailable:
            return None
        return admitted

    # --- what it saw -------------------------------------------------------------------------

    def seen(self, text: str, now: float, *, started: float, admitted: int | None = None) -> None:
        """A scrape's text (asked for at ``started``): whether the engine runs its holders in
        lockstep, how much KV it uses that the holders do not explain, what it lost.
        ``admitted``: the requests admitted through the budget so far (None: not known), the
        preemption rate's denominator, and the forecast's where the ledger is shared."""
        upstream, known = self.upstream, self.upstream.known
        if known is None:
            return
        ledger = known.ledger
        signals = lockstep_from_metrics(text)
        self.preemptions_read = signals.preemptions
        if signals.preemptions is not None and admitted is not None:
            self.preemptions.add(now, signals.preemptions, admitted)
        if signals.speculative and ledger.tracks_progress:
            reason = speculative_reason()
            ledger.set_caps_for_good(reason)
            logger.warning("upstream %s: admission counts whole caps: %s", upstream.name, reason)
        budget = upstream.budget
        missing = signals.missing(preempts=budget is not None and budget.preempts)
        if missing:
            self.unread = f"its /metrics does not give {', '.join(missing)}"
            ledger.engine_seen(waiting=None, preemptions=None)
            return
        self.read_at, self.unread = now, None
        self.running, self.running_from = signals.running, started
        if not ledger.tracks_progress:
            return
        # Where the ledger is shared, the engine's preemptions are weighed against every
        # gateway's requests (each gateway follows only its own to their ends).
        said = ledger.engine_seen(
            waiting=signals.waiting, preemptions=signals.preemptions,
            requests=admitted if known.queue.spans_processes else None,
        )  # fmt: skip
        if said is not None:
            logger.warning("upstream %s: %s", upstream.name, said)
        for why in (self._lockstep_break(signals, known), self._lost(text)):
            if why is not None:
                self.out_of_step(why)
        # Its figures are a step old at most, and a holder released since may be in them.
        self._unexplained(signals, known, started - ledger.relay_lag, now)

    def _lockstep_break(self, signals: Lockstep, known: Known) -> str | None:
        """Requests waiting inside the engine, or a preemption since the last scrape; not while
        holders are counted by a forecast: preemptions are then the price of the bet, which
        its budget holds (and a preempted sequence waits in the engine until recomputed)."""
        previous, self._preemptions = self._preemptions, signals.preemptions
        if known.ledger.forecasting:
            return None
        now_preempted = signals.preemptions
        if previous is not None and now_preempted is not None and now_preempted > previous:
            return f"the engine preempted {now_preempted - previous:.0f} requests"
        if signals.waiting:
            return f"{signals.waiting:.0f} requests wait inside the engine"
        return None

    def _lost(self, text: str) -> str | None:
        """Requests the engine failed for lack of KV since the last scrape (ours' OOM; vLLM's
        losses are its preemptions, weighed above): the gateway's count of it was wrong, or
        someone it does not see filled it."""
        losses = kv_losses_from_metrics(text)
        previous, self._losses = self._losses, losses
        if losses is None or losses.metric == (_preemption_metric(losses.engine) or ""):
            return None
        new = losses.since(previous)
        if new is None or new.total <= 0:
            return None
        return f"the engine counted {new.total:.0f} {losses.kind} ({losses.metric})"

    def _unexplained(self, signals: Lockstep, known: Known, since: float, now: float) -> None:
        """KV the engine uses that its holders cannot explain: counted as held by someone the
        gateway does not see (it shrinks the room at once), and the rule on caps while it lasts
        (:meth:`~reference_server.admission.ledger.KVAdmissionController.engine_used`)."""
        used = signals.kv_used_tokens
        budget = self.upstream.budget
        if used is None and signals.kv_used_share is not None and budget is not None:
            pool = budget.exact_pool
            if pool is not None and budget.block_size > 0:
                used = round(signals.kv_used_share * pool / budget.block_size) * budget.block_size
        if used is None:
            return
        first = known.ledger.caps_reason is None
        unknown = known.ledger.engine_used(int(used), since, now)
        if unknown and not self._unknown:
            if first:
                self.upstream.lockstep_breaks += 1
            logger.warning(
                "upstream %s: the engine holds %d KV tokens more than the gateway's holders "
                "explain: counted as held, and whole caps while it lasts",
                self.upstream.name, unknown,
            )  # fmt: skip
        self._unknown = unknown

    def check(self, now: float) -> None:
        """Figures unread for ``BLIND_SECONDS``, or a stream that stalled while others advanced,
        put the upstream on whole caps."""
        self.checks += 1
        known = self.upstream.known
        if known is None or not known.ledger.tracks_progress:
            return
        if self.read_at is None or now - self.read_at > BLIND_SECONDS:
            reason = (
                f"the engine's waiting, running and preemption figures were not read for "
                f"{BLIND_SECONDS:g} s: {self.unread or 'no scrape'}"
            )
            if self.blind is None:
                logger.warning(
                    "upstream %s: %s: whole caps until they are read again",
                    self.upstream.name, reason,
                )  # fmt: skip
            if self.blind is None and known.ledger.caps_reason is None:
                self.upstream.lockstep_breaks += 1
            self.blind = reason
            known.ledger.engine_unseen(reason)
            return
        if self.blind is not None:
            logger.info("upstream %s: the engine's figures are read again", self.upstream.name)
            self.blind = None
            known.ledger.engine_unseen(None)
        stalled = known.ledger.stalled(now, STALL_SECONDS)
        if stalled:
            self.out_of_step(f"{len(stalled)} streams stalled while others advanced")

    def out_of_step(self, reason: str) -> None:
        """Whole caps until the holders live now have gone, for ``reason``."""
        known = self.upstream.known
        if known is None:
            return
        if known.ledger.caps_reason is None:
            self.upstream.lockstep_breaks += 1
            logger.warning(
                "upstream %s: %s: whole caps until its holders have gone",
                self.upstream.name, reason,
            )  # fmt: skip
        known.ledger.run_on_caps(reason)
        known.queue.out_of_step(reason)


def speculative_reason() -> str:
    return (
        "the engine decodes speculatively (its spec_decode metrics): a sequence may advance "
        "several tokens a step and hold slots for its drafts"
    )


def _preemption_metric(engine: str) -> str | None:
    names = METRIC_NAMES.get(engine)
    return names.preemptions if names is not None else None
