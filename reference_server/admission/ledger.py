"""The reservation ledger: which requests hold how much KV cache, and when it will free up.

Pure and thread-safe: no I/O, no clock of its own (every time-dependent call takes ``now``), so the
same object is driven by the ASGI app, by tests and by property tests from many threads.

Three admission strategies share one ledger so their failure modes can be measured side by side:

``reserve``      (prompt + output cap) in whole blocks against the usable budget. The default, and
                 the only one that can never overflow the physical pool.
``prompt``       the prompt's blocks only: blind to the output the request may still generate.
``concurrency``  a request count against ``max_concurrency``: blind to sizes.

Under ``reserve`` the budget is checked by one of two rules (``rule``):

``caps``   the sum of every holder's whole reservation: safe whatever the engine does.
``peak``   the worst-case peak of the holders' sum over the coming decode steps, from each
           holder's relayed progress (:mod:`.peak`): safe while the engine runs every admitted
           sequence in lockstep, which the server watches; when it sees otherwise it runs on
           caps until the holders admitted before have all gone (:meth:`run_on_caps`).

What the ledger is told while its holders run (their progress, the engine's figures) is in
:mod:`.reports`, and its back-pressure (Retry-After, the room it advertises) in :mod:`.advising`:
both mixins of :class:`KVAdmissionController`.

>>> ledger = KVAdmissionController(total_kv_tokens=1000, context_window=512, decode_rate=100.0)
>>> ledger.usable_tokens
900
>>> handle = ledger.try_admit(100, 200, now=0.0)
>>> handle.reserved_tokens, ledger.stats().reserved_tokens
(304, 304)
>>> ledger.release(handle); ledger.release(handle)   # idempotent
>>> ledger.stats().reserved_tokens
0
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Literal, get_args

from kvclient import DEFAULT_BLOCK_SIZE, reservation_tokens, round_up_to_blocks

from .advice import STAGGER_ROUNDS, Advice
from .advising import Advising
from .decode import Decoding, check_speed
from .holders import (
    DEFAULT_RELAY_LAG,
    RuleInForce,
    as_holder,
    borrowable,
    explained,
    freshest,
    holds_unkeyed,
    slow_since,
    tainted_after,
)
from .outlook import Outlook
from .peak import Holder, peak, prefix_blocks
from .preemption import DEFAULT_START_QUANTILE
from .reports import Reports
from .values import Ask, Handle, Headroom, LedgerEvent, LedgerStats

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_SAFETY_FRACTION",
    "RULES",
    "STAGGER_ROUNDS",
    "STRATEGIES",
    "Ask",
    "Handle",
    "Headroom",
    "KVAdmissionController",
    "LedgerEvent",
    "LedgerStats",
    "Rule",
    "Strategy",
]

Strategy = Literal["reserve", "prompt", "concurrency"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
Rule = Literal["peak", "caps"]
RULES: tuple[str, ...] = get_args(Rule)

#: Real runtimes lose memory to fragmentation and activations; admit to 90% of the KV pool.
DEFAULT_SAFETY_FRACTION = 0.9
#: The request cap in ``concurrency`` mode when none is given: a typical hand-tuned value.
DEFAULT_MAX_CONCURRENCY = 16
#: Releases remembered for the engine's books (:meth:`KVAdmissionController.engine_used`).
_LET_GO_KEPT = 4096


class KVAdmissionController(Reports, Advising):
    """Thread-safe reservation ledger over a KV pool of ``total_kv_tokens`` tokens.

    The usable budget is ``floor(total_kv_tokens x safety_fraction)``; bytes are tokens x
    ``kv_bytes_per_token``. ``context_window`` only bounds what a single request may ask for;
    clamping ``max_tokens`` is the caller's job (``kvclient.effective_output_cap``).
    """

    def __init__(
        self,
        *,
        total_kv_tokens: int,
        context_window: int,
        decode_rate: float,
        kv_bytes_per_token: int = 1,
        safety_fraction: float = DEFAULT_SAFETY_FRACTION,
        block_size: int = DEFAULT_BLOCK_SIZE,
        strategy: Strategy = "reserve",
        max_concurrency: int | None = None,
        release_margin: float = 0.0,
        output_quantile: float | None = None,
        overrun: float = 0.0,
        throughput: float | None = None,
        on_event: Callable[[LedgerEvent], None] | None = None,
        rule: Rule = "caps",
        relay_lag: float = DEFAULT_RELAY_LAG,
        preemption_budget: float = 0.0,
        forecast_quantile: float = DEFAULT_START_QUANTILE,
        start_clock: bool = False,
    ) -> None:
        for name, whole in (
            ("total_kv_tokens", total_kv_tokens),
            ("block_size", block_size),
            ("kv_bytes_per_token", kv_bytes_per_token),
            ("max_concurrency", 1 if max_concurrency is None else max_concurrency),
        ):
            if whole < 1:
                raise ValueError(f"{name} must be >= 1, got {whole}")
        for name, share in (
            ("safety_fraction", safety_fraction),
            ("output_quantile", output_quantile),
        ):
            if share is not None and not 0.0 < share <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {share}")
        for name, amount in (
            ("overrun", overrun), ("relay_lag", relay_lag), ("preemption_budget", preemption_budget)
        ):  # fmt: skip
            if not (0.0 <= amount < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {amount}")
        for name, value, allowed in (("strategy", strategy, STRATEGIES), ("rule", rule, RULES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        self._decoding = Decoding(decode_rate, throughput)
        self.total_kv_tokens = total_kv_tokens
        self.context_window = context_window
        self.kv_bytes_per_token = kv_bytes_per_token
        self.safety_fraction = safety_fraction
        self.block_size = block_size
        self.strategy: Strategy = strategy
        if strategy == "concurrency" and max_concurrency is None:
            max_concurrency = DEFAULT_MAX_CONCURRENCY
        self.max_concurrency = max_concurrency
        self.release_margin = release_margin
        self.output_quantile = output_quantile
        self.overrun = float(overrun)
        self._on_event = on_event
        self.usable_tokens = max(1, math.floor(total_kv_tokens * safety_fraction))
        self.rule: Rule = rule
        self.relay_lag = float(relay_lag)
        #: Whether the peak rule is in force, and why not.
        self._in_force = RuleInForce(peak_configured=rule == "peak" and strategy == "reserve")
        #: Whether the engine shares the KV blocks of identical prompt prefixes (set by the
        #: server that knows it): then the peak rule counts them once (:meth:`prefix_keys`).
        self.shares_prefixes = False
        #: Prefix blocks of which a copy was let go while another was held (see ``peak.py``).
        self._tainted: set[Hashable] = set()
        #: KV the engine uses that no holder explains (:meth:`engine_used`), and what the
        #: holders released lately may still hold there: (when, tokens).
        self._unknown = 0
        self._let_go: deque[tuple[float, int]] = deque(maxlen=_LET_GO_KEPT)
        #: The newcomer's clock and the forecast of outputs (see ``outlook.py``).
        self._outlook = Outlook(
            preemption_budget=preemption_budget,
            start_clock=start_clock,
            start_quantile=forecast_quantile,
        )

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, Handle] = {}
        self._reserved = 0
        #: Sequences the live handles run (a request of ``n`` sequences counts ``n``).
        self._running = 0
        self._admitted_total = 0
        self._rejected_total = 0
        self._released_total = 0
        self._peak_reserved = 0
        self._peak_inflight = 0
        self._advice = Advice()

    def like(self, *, forecast: bool = False, **settings: Any) -> KVAdmissionController:
        """An empty ledger priced and timed as this one (its pool, window, blocks, strategy,
        running cap, margins, and its decode speed as measured now), with ``settings`` on
        top: a scratch ledger to model holders kept elsewhere (the shared ledger's).
        ``forecast``: it counts newcomers by this one's forecast of outputs as it stands now
        (:meth:`.outlook.Outlook.twin`)."""
        mine: dict[str, Any] = {
            "total_kv_tokens": self.total_kv_tokens,
            "context_window": self.context_window,
            "decode_rate": self.decode_rate,
            "throughput": self.throughput,
            "safety_fraction": self.safety_fraction,
            "block_size": self.block_size,
            "max_concurrency": self.max_concurrency,
            "release_margin": self.release_margin,
            "overrun": self.overrun,
            "strategy": self.strategy,
        }
        model = KVAdmissionController(**(mine | settings))
        if forecast:  # without the lock: a view may be built under it (what it reads is one
            # quantile and the outputs' reference, each read whole)
            model._outlook = self._outlook.twin(start_clock=model._outlook.start_clock)
        return model

    # --- decode speed ------------------------------------------------------------------------

    @property
    def decode_rate(self) -> float:
        """Tokens per second one sequence decodes at alone (see :meth:`rate_at`)."""
        return self._decoding.decode_rate

    @property
    def throughput(self) -> float | None:
        """Tokens per second a large batch makes in all, when known (see :meth:`rate_at`)."""
        return self._decoding.throughput

    def rate_at(self, sequences: int) -> float:
        """Tokens per second one sequence decodes at while ``sequences`` decode together
        (:meth:`.decode.Decoding.rate_at`)."""
        return self._decoding.rate_at(sequences)

    def set_speed(
        self, decode_rate: float, throughput: float | None, now: float, *, steps: bool = False
    ) -> None:
        """The engine's measured speed (see :meth:`rate_at`), from ``now`` on: the progress of
        the live handles so far is kept at the speed it was made at. ``steps``: measured from
        the engine's own counters, step by step (a newcomer's clock is bounded in its steps),
        rather than guessed from answers' durations."""
        check_speed(decode_rate, throughput)
        with self._lock:
            self._advance(now)
            self._decoding.set(decode_rate, throughput)
            self._outlook.speed_known |= steps

    def _advance(self, now: float) -> None:
        """Move the decode progress to ``now`` (lock held)."""
        self._decoding.advance(now, len(self._live))

    def occupancy(self, now: float) -> tuple[float, float, int]:
        """``(handle-seconds, busy seconds, admitted)`` since the ledger began: the time integral
        of the live handles, the time any was live, and the requests admitted. Between two
        readings, the first over the second is how many requests were running on average while
        any was."""
        with self._lock:
            self._advance(now)
            decoding = self._decoding
            return decoding.held_seconds, decoding.busy_seconds, self._admitted_total

    def generated(self, handle: Handle, now: float) -> float:
        """About how many tokens ``handle`` has generated by ``now`` (decoding since admission
        at the engine's speed; the engine may have stopped it sooner)."""
        with self._lock:
            self._advance(now)
            return max(0.0, self._decoding.progress - handle.progress_at_admit)

    # --- pure pricing ------------------------------------------------------------------------

    def need_tokens(self, prompt_tokens: int, output_cap: int) -> int:
        """Tokens of budget a request takes under this ledger's strategy."""
        if self.strategy == "reserve":
            return reservation_tokens(prompt_tokens, output_cap, block_size=self.block_size)
        if self.strategy == "prompt":
            return round_up_to_blocks(prompt_tokens, self.block_size)
        return 0  # concurrency: sizes are not counted at all

    def never_fits(self, need: int) -> bool:
        """Whether a request needing ``need`` tokens could not be admitted even by an empty ledger.

        Such a request must get a non-retryable error: a 429 would send it round forever.
        """
        return need > self.usable_tokens

    def max_output_that_fits(self, prompt_tokens: int) -> int:
        """The largest output cap a prompt could ever be admitted with (0 when none)."""
        if self.strategy != "reserve":
            return max(0, self.context_window - prompt_tokens)
        whole_blocks = self.usable_tokens // self.block_size * self.block_size
        return max(0, min(whole_blocks - prompt_tokens, self.context_window - prompt_tokens))

    # --- the peak rule -----------------------------------------------------------------------

    def _peak_in_force(self) -> bool:
        return self._in_force.peak

    @property
    def tracks_progress(self) -> bool:
        """Whether holders' progress is worth relaying: the peak rule may count it (it is
        configured and the engine qualifies; it may be on caps for now, until drained)."""
        return self._in_force.tracks_progress

    def clock_runs(self) -> bool:
        """Whether a newcomer admitted now would be counted from its admission: the engine
        starts it at once (see :mod:`.outlook`), as this ledger last saw the engine and its
        own holders' first tokens."""
        with self._lock:
            return self._in_force.tracks_progress and self._outlook.clock_runs()

    def prefix_keys(self, token_ids: Sequence[int] | None, salt: Hashable) -> tuple[Hashable, ...]:
        """The keys of a prompt's shareable blocks where the engine shares them and the peak
        rule may count them once; () otherwise (see :func:`.peak.prefix_blocks`)."""
        if not token_ids or not self.shares_prefixes or not self.tracks_progress:
            return ()
        return prefix_blocks(token_ids, self.block_size, salt)

    @property
    def tainted(self) -> frozenset[Hashable]:
        """Prefix blocks of which a copy was let go while another is held (see ``peak.py``):
        set by a model of holders kept elsewhere (the shared ledger's view) as kept there."""
        with self._lock:
            return frozenset(self._tainted)

    @tainted.setter
    def tainted(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            self._tainted = set(keys)

    @property
    def caps_reason(self) -> str | None:
        """Why a ledger configured for ``peak`` counts whole caps now (None when it does not)."""
        with self._lock:
            if self.rule == "peak" and self.strategy != "reserve":
                return f"the {self.strategy} strategy counts no caps to begin with"
            return self._in_force.reason

    def _holder(self, handle: Handle, fresh: float, now: float | None = None) -> Holder:
        return as_holder(
            handle, fresh, decode_rate=self.decode_rate, relay_lag=self.relay_lag, now=now
        )

    def _committed(
        self, now: float, extra: Holder | None = None, without: Handle | None = None
    ) -> int:
        """The most the holders (but ``without``, and with ``extra``) may hold at once from now
        on (lock held)."""
        if not self._peak_in_force():
            live = without is not None and self._live.get(without.id) is without
            gone = without.reserved_tokens if live and without is not None else 0
            return self._unknown + self._reserved - gone + (extra.most if extra else 0)
        self._outlook.expire(self._live.values(), now)
        fresh = freshest(self._live.values(), now)
        holders = [self._holder(h, fresh, now) for h in self._live.values() if h is not without]
        if extra is not None:
            holders.append(extra)
        if not holders:
            return self._unknown
        return self._unknown + peak(holders, block_size=self.block_size, tainted=self._tainted)

    # --- admission ---------------------------------------------------------------------------

    def _fits(self, newcomer: Handle, now: float) -> bool:
        # Each of a request's sequences runs in a place of its own (vLLM: ``n`` child requests).
        running = self._running + newcomer.sequences
        if self.max_concurrency is not None and running > self.max_concurrency:
            return False
        # A newcomer whose prefix a holder is still computing borrows nothing from it: it is
        # counted with a copy of its own (see ``peak.py``), and once one of the two copies is
        # let go the freed one is charged to the next borrower (``tainted``).
        live = self._live.values()
        if self._unknown + self._reserved + newcomer.reserved_tokens <= self.usable_tokens:
            return True  # the sum of the caps is never below the peak
        if not self._peak_in_force():
            return False
        fresh = freshest(live, now)
        return self._committed(now, self._holder(newcomer, fresh, now)) <= self.usable_tokens

    def _newcomer(self, ask: Ask, now: float) -> Handle:
        """The handle ``ask`` would be admitted with ``now``, as the rule counts it (lock held)."""
        rate = self.rate_at(len(self._live) + 1)
        handle = Handle(
            id=0,
            prompt_tokens=ask.prompt_tokens,
            output_cap=ask.output_cap,
            reserved_tokens=ask.need,
            admitted_at=now,
            due_at=now + ask.output_cap / rate + self.release_margin,
            progress_at_admit=self._decoding.progress,
            sequences=ask.sequences,
        )
        if self._in_force.tracks_progress:
            live = self._live.values()
            self._outlook.expire(live, now)
            self._outlook.admit(
                handle, now, kind=ask.kind, follow=ask.follow, step_seconds=1.0 / rate,
                relay_lag=self.relay_lag,
            )  # fmt: skip
            if ask.prefix and self._peak_in_force():
                handle.prefix = ask.prefix
                handle.borrowed = borrowable(ask.prefix, live)
            handle.unkeyed = holds_unkeyed(
                handle.prefix, ask.prompt_tokens, shares_prefixes=self.shares_prefixes,
                block_size=self.block_size,
            )  # fmt: skip
        return handle

    def try_admit(
        self,
        prompt_tokens: int,
        output_cap: int,
        *,
        now: float,
        count_rejection: bool = True,
        need: int | None = None,
        prefix: tuple[Hashable, ...] = (),
        kind: Hashable = None,
        follow: bool = False,
        sequences: int = 1,
        admitted: bool = False,
    ) -> Handle | None:
        """Reserve for a request, or return ``None`` when the budget is short now.

        ``count_rejection=False`` is for a queued request trying again: only its final answer
        counts in ``rejected_total`` (see :meth:`record_rejection`). ``need``: what
        :meth:`need_tokens` gave for these sizes, when the caller has it already. ``prefix``:
        the keys of its shareable prompt blocks (:func:`.peak.prefix_blocks`), where the engine
        shares them; only the ``peak`` rule counts them once. ``follow``: the caller will relay
        its progress (:meth:`progress`; one sequence, counted from the engine's own stream),
        which the peak rule may count (:attr:`Handle.tracked`); ``kind``: whose outputs its
        forecast learns from (its model, and its tenant). ``sequences``: how many sequences it
        runs at once in the engine, each counted against ``max_concurrency``. ``admitted``: it
        was admitted elsewhere (the shared ledger, by whichever gateway): held whatever this
        ledger's budget says, as a mirror or a model of holders kept in Redis.
        """
        if need is None:
            need = self.need_tokens(prompt_tokens, output_cap)
        ask = Ask(
            prompt_tokens=prompt_tokens, output_cap=output_cap, need=need, prefix=prefix,
            kind=kind, follow=follow, sequences=sequences,
        )  # fmt: skip
        with self._lock:
            self._advance(now)
            handle = self._newcomer(ask, now)
            if not admitted and not self._fits(handle, now):
                if count_rejection:
                    self._rejected_total += 1
                return None
            handle.id = next(self._ids)
            self._running += handle.sequences
            self._live[handle.id] = handle
            self._advice.keep_promise(need, now, self.release_margin)
            self._reserved += need
            self._admitted_total += 1
            self._peak_reserved = max(self._peak_reserved, self._reserved)
            self._peak_inflight = max(self._peak_inflight, len(self._live))
            if self._on_event is not None:
                self._on_event(LedgerEvent(kind="admit", id=handle.id, tokens=need))
            return handle

    def record_rejection(self, need: int = 0, retry_after: float = 0.0) -> None:
        """Count one rejection decided outside :meth:`try_admit` (the admission queue's answer).

        ``need`` and ``retry_after`` (the advice it was given) go to the ``on_event`` observer.
        """
        with self._lock:
            self._rejected_total += 1
            if self._on_event is not None:
                event = LedgerEvent(kind="refuse", id=0, tokens=need, retry_after=retry_after)
                self._on_event(event)

    def release(self, handle: Handle, now: float | None = None) -> None:
        """Give a reservation back. Idempotent: a second release of the same handle is a no-op.

        ``now`` (the ledger's clock) keeps the decode progress exact: the others decode faster
        from then on. Without it the progress is brought up to date at the next call."""
        with self._lock:
            # Identity, not just the id: a handle from another ledger may share the number.
            if handle.released or self._live.get(handle.id) is not handle:
                return
            if now is not None:
                self._advance(now)
                # What the engine's books may still show of it for a moment (see engine_used).
                held = explained(
                    [handle], now, now, decode_rate=self.decode_rate, relay_lag=self.relay_lag,
                    block_size=self.block_size,
                )  # fmt: skip
                self._let_go.append((now, held))
            del self._live[handle.id]
            self._running -= handle.sequences
            if handle.prefix or handle.unkeyed:
                self._tainted = tainted_after(handle, self._live.values(), self._tainted)
            self._in_force.gone(handle.id)
            self._outlook.gone(handle)
            handle.released = True
            self._reserved -= handle.reserved_tokens
            self._released_total += 1
            if self._on_event is not None:
                event = LedgerEvent(kind="release", id=handle.id, tokens=handle.reserved_tokens)
                self._on_event(event)

    # --- observation -------------------------------------------------------------------------

    def load(self) -> tuple[int, int]:
        """(tokens reserved, requests in flight) now: what routing needs, without the whole
        :meth:`stats`."""
        with self._lock:
            return self._reserved, len(self._live)

    def room(self, now: float) -> tuple[int, int]:
        """(tokens a newcomer may take now, requests in flight): the usable budget less what
        the holders may hold at once by the rule in force (routing's view; the queue's own
        check also counts the newcomer's shared prefix)."""
        with self._lock:
            return self.usable_tokens - self._committed(now), len(self._live)

    def live_handles(self) -> list[Handle]:
        """The handles currently holding a reservation, oldest first."""
        with self._lock:
            return list(self._live.values())

    def stats(self, now: float | None = None) -> LedgerStats:
        """A snapshot; ``now`` (the ledger's clock) for what depends on time (the peak, slow
        readers), else the last time the ledger was told."""
        with self._lock:
            at = (self._decoding.at or 0.0) if now is None else now
            return LedgerStats(
                strategy=self.strategy,
                usable_tokens=self.usable_tokens,
                usable_bytes=self.usable_tokens * self.kv_bytes_per_token,
                reserved_tokens=self._reserved,
                reserved_bytes=self._reserved * self.kv_bytes_per_token,
                inflight=len(self._live),
                admitted_total=self._admitted_total,
                rejected_total=self._rejected_total,
                released_total=self._released_total,
                peak_reserved_tokens=self._peak_reserved,
                peak_inflight=self._peak_inflight,
                max_concurrency=self.max_concurrency,
                rule="peak" if self._peak_in_force() else "caps",
                caps_reason=self._in_force.reason,
                committed_tokens=self._committed(at),
                slow_readers=sum(
                    1 for h in self._live.values() if slow_since(h, at, self.relay_lag)
                ),
                unknown_tokens=self._unknown,
                **self._outlook.figures(peak=self._peak_in_force()),
            )

    def held_now(self, handle: Handle, now: float) -> int:
        """Tokens ``handle`` counts for now by the rule in force: under the peak rule what it
        holds from its relayed progress (its whole reservation until its first token; the
        relay's margin counted as of ``now``), under caps its whole reservation; 0 once it is
        released (what a tenant's limit counts, see :mod:`.fairness`)."""
        with self._lock:
            if handle.released or self._live.get(handle.id) is not handle:
                return 0
            if not self._peak_in_force():
                return handle.reserved_tokens
            return min(handle.reserved_tokens, self._holder(handle, now).held)
