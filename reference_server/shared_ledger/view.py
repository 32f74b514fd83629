"""The shared ledger's holders as the peak rule sees them: every gateway's, from their records in
Redis, counted by the in-process ledger itself. Pure: no Redis, no clock of its own (times are
the Redis clock's, in seconds).

A holder's record is its reservation (``holders``) and, under the peak rule, its progress
(``progress``, see :mod:`.scripts`): relayed and published in batches by the process that
relays it. :class:`PeakView` rebuilds each holder as a :class:`~..admission.values.Handle` of a
scratch :class:`~..admission.ledger.KVAdmissionController` on the peak rule, so the decision is
the in-process ledger's (``as_holder``, ``peak``, its margins), taken over every process's
holders; nothing of it is copied here or into Lua.

The relay's margin (``relay_lag``) grows by the publish interval: a count is published at the
latest one interval after it was read (its stamp is when it was read, but a holder whose relay
has begun to wait on its client, or let its progress go, says so only at the next publish).

The newcomer's clock (:mod:`..admission.outlook`) is shared the same way: a newcomer the view
counts from its admission (the admitting gateway saw the engine start newcomers at once) is
admitted with the deadline of its first token in its record, and every view counts it by that
deadline: on time, from its admission; late, whole, and no newcomer on the clock until its
first token has come. The deadline is the view's, never later than what the decision counted.

So is the forecast of outputs (:mod:`..admission.outlook`), where the engine preempts: a
newcomer is counted to the admitting gateway's forecast of it, which its record carries (its
``counted`` output, republished by its gateway whenever it outlives it), and every view counts
each holder as its record says.

Shared prefix blocks too, where the engine shares them: a holder's record carries the keys of
its shareable prompt blocks, how many of them it borrowed (decided by the admitting gateway
from the holders past their prefill in its snapshot: it cannot be worked out again once they
have gone) and whether it holds blocks the ledger has no keys of (see
:mod:`.prefixes`); the blocks of which a freed copy may be handed out are kept in Redis
(``tainted``), worked out where a holder goes. So a block is counted once whichever gateway's
holders have it, and a newcomer at one gateway borrows what a holder of another computed. A
record without them counts its whole prompt.

>>> # view = PeakView.parse(raw, pricing)   # raw: PEAK_SNAPSHOT's answer
>>> # view.fits(prompt_tokens, output_cap, need)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..admission.holders import borrowable, explained, freshest, holds_unkeyed
from ..admission.ledger import Handle, KVAdmissionController
from .connection import reply_text
from .prefixes import prefix_record, read_record

__all__ = [
    "PUBLISH_SECONDS",
    "PUBLISH_TOKENS",
    "Fit",
    "PeakView",
    "Record",
    "explained_elsewhere",
    "lending",
    "shared_relay_lag",
]

#: Seconds between two publishes of a process's holders' progress at most: one script per
#: process for all its holders, so ten a second whatever the load; it adds this much to the
#: relay's margin (a few tokens per holder at the speeds of CPU and GPU engines alike).
PUBLISH_SECONDS = 0.1
#: Tokens a holder may make before its progress is published sooner than the interval (its
#: first token is published at once: it ends its whole-cap count).
PUBLISH_TOKENS = 16


def shared_relay_lag(relay_lag: float, publish_seconds: float = PUBLISH_SECONDS) -> float:
    """The relay's margin over the shared view: the relay's own lag and the publish interval."""
    return relay_lag + publish_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One holder as Redis keeps it. ``prompt`` None: no progress record (admitted on whole
    caps, or by a gateway that publishes none): it counts whole. ``generated`` None: no token
    relayed yet."""

    field: str
    lease: str
    tokens: int
    cap: int
    admitted_at: float
    prompt: int | None = None
    counted: int = 0
    tracked: bool = False
    generated: int | None = None
    seen_at: float = 0.0
    first_seen_at: float = 0.0
    #: Admitted on the engine's clock: when its first token is due (else None).
    start_by: float | None = None
    #: The keys of its shareable prompt blocks, the first ``borrowed`` of them lent by others;
    #: ``unkeyed``: it holds full prompt blocks no keys are known of (see :mod:`.prefixes`).
    prefix: tuple[bytes, ...] = ()
    borrowed: int = 0
    unkeyed: bool = False

    @classmethod
    def parse(
        cls, field: str, value: str, progress: str | None, lending: str | None = None
    ) -> Record:
        """From a ``holders`` value (``"lease tokens cap admitted_ms [tenant]"``), its
        ``progress`` value, if any (one that does not read as this version writes it counts as
        none: the holder counts whole), and its ``prefixes`` value, if any (likewise: its whole
        prompt counts)."""
        lease, tokens, cap, admitted = value.split(" ", 4)[:4]
        base = {
            "field": field,
            "lease": lease,
            "tokens": int(tokens),
            "cap": int(cap),
            "admitted_at": int(admitted) / 1000,
        }
        fields = (progress or "").split(" ")
        if len(fields) == 6:  # written before the newcomer's clock was shared: none
            fields.append("0")
        try:
            prompt, counted, tracked, generated, seen, first, start = fields
            numbers = [int(x) for x in (prompt, counted, generated, seen, first, start)]
        except ValueError:
            return cls(**base)  # type: ignore[arg-type]
        prompt_tokens, counted_output, made, seen_ms, first_ms, start_ms = numbers
        prefix, borrowed, unkeyed = read_record(lending)
        return cls(
            **base,  # type: ignore[arg-type]
            prefix=prefix,
            borrowed=borrowed,
            unkeyed=unkeyed,
            prompt=prompt_tokens,
            counted=counted_output,
            tracked=tracked == "1",
            generated=None if made < 0 else made,
            seen_at=seen_ms / 1000,
            first_seen_at=first_ms / 1000,
            start_by=start_ms / 1000 if start_ms > 0 and made < 0 else None,
        )


@dataclass(frozen=True, slots=True)
class Fit:
    """A newcomer that fits a view: ``start_by``, the deadline of its first token when it is
    counted on the engine's clock (Redis clock, seconds), else None; ``counted``, the output
    it is counted to (its forecast, where the admitting gateway forecasts; else its cap),
    which its record must carry."""

    start_by: float | None = None
    counted: int | None = None

    def start_ms(self) -> str:
        """The deadline of its first token as a record takes it (ms of the Redis clock; '':
        not on the engine's clock)."""
        return "" if self.start_by is None else str(math.floor(self.start_by * 1000))

    def counted_for(self, output_cap: int, *, follow: bool) -> str:
        """The output its record counts it to: its forecast, when it is followed and the
        forecast is short of its cap ('': its cap)."""
        short = follow and self.counted is not None and self.counted < output_cap
        return str(self.counted) if short else ""


def lending(
    pricing: KVAdmissionController,
    keys: tuple[Hashable, ...],
    prompt_tokens: int,
    *,
    follow: bool | None,
    lent: int = 0,
) -> str:
    """A newcomer's prefix record as the admitting scripts take it (:func:`.prefixes.
    prefix_record`): its ``keys``, the first ``lent`` of them borrowed (:meth:`PeakView.lent`);
    without keys, and with a progress record (``follow`` not None), whether it holds full
    prompt blocks of keys unknown where the engine shares them, as the in-process ledger has it
    (``holds_unkeyed``)."""
    if keys:
        return prefix_record(keys, lent, False)
    unkeyed = follow is not None and holds_unkeyed(
        (), prompt_tokens, shares_prefixes=pricing.shares_prefixes, block_size=pricing.block_size
    )
    return prefix_record((), 0, unkeyed)


class PeakView:
    """Every gateway's holders at one moment (``now``, Redis clock), with ``grown`` (the
    admissions counter the commit compares) and the waiting ``tickets``, modelled by a scratch
    ledger on the peak rule priced as ``pricing`` (built when first asked: a waiter that is not
    at the head of the queue needs only the tickets)."""

    def __init__(
        self,
        *,
        now: float,
        grown: str,
        records: Iterable[Record],
        tickets: Sequence[str] = (),
        pricing: KVAdmissionController,
        publish_seconds: float = PUBLISH_SECONDS,
        drain: str | None = None,
        clock: bool = False,
        let_go: Iterable[tuple[float, Record]] = (),
        tainted: Iterable[bytes] = (),
    ) -> None:
        self.now = now
        #: The holders released lately, each with when (Redis clock), oldest first: read only
        #: for the engine's books (see :func:`explained_elsewhere`).
        self.let_go = list(let_go)
        #: Prefix blocks of which a freed copy may be handed to a borrower (see ``peak.py``).
        self.tainted = frozenset(tainted)
        #: Whether a newcomer admitted now starts at once in the engine (as the admitting
        #: gateway saw the engine: see :meth:`.admission.ledger.KVAdmissionController.clock_runs`):
        #: then it is counted from its admission, its first token due by a deadline every
        #: gateway reads from its record, unless another newcomer's first token is late.
        self.clock = clock
        #: Why every gateway counts whole caps until the holders live then have gone
        #: (``"grown reason"``: see ``BREAK``), or None.
        self.drain = drain
        self.grown = grown
        self.tickets = list(tickets)
        self._handles: dict[str, Handle] = {}
        self.records = sorted(records, key=lambda r: r.admitted_at)
        self._pricing = pricing
        self._publish_seconds = publish_seconds

    @functools.cached_property
    def model(self) -> KVAdmissionController:
        """The scratch ledger holding every record's handle (see :attr:`handles`)."""
        p = self._pricing
        model = p.like(
            rule="peak",
            relay_lag=shared_relay_lag(p.relay_lag, self._publish_seconds),
            start_clock=self.clock,
            forecast=True,  # a newcomer counted as the admitting gateway forecasts it now
        )
        model.shares_prefixes = p.shares_prefixes
        if self.clock:  # the engine's speed as measured from its counters: the clock's steps
            first = self.records[0].admitted_at if self.records else self.now
            model.set_speed(p.decode_rate, p.throughput, min(first, self.now), steps=True)
        # In order of admission, each at its own admission (the model's Retry-After drains so).
        for record in self.records:
            handle = model.try_admit(
                record.prompt or 0, record.cap, now=min(record.admitted_at, self.now),
                need=record.tokens, follow=record.prompt is not None and record.tracked,
                admitted=True,
            )  # fmt: skip
            assert handle is not None  # admitted=True holds whatever the budget says
            # On the clock only as its record says (the model's own clock is for newcomers).
            handle.start_by = None
            if handle.tracked:
                handle.counted_output = min(max(0, record.counted), record.cap)
                handle.generated = record.generated
                handle.seen_at = record.seen_at
                handle.first_seen_at = record.first_seen_at
                handle.start_by = record.start_by
            if record.prompt is not None:  # else it counts whole
                handle.prefix, handle.borrowed = record.prefix, record.borrowed
                handle.unkeyed = record.unkeyed
            self._handles[record.field] = handle
        model.tainted = self.tainted
        return model

    @property
    def handles(self) -> dict[str, Handle]:
        """reservation -> its handle in the :attr:`model`."""
        _ = self.model
        return self._handles

    @functools.cached_property
    def let_go_handles(self) -> dict[str, tuple[float, Handle]]:
        """reservation -> (when it was released, its handle as it was): :attr:`let_go` built
        as the live holders are, in a scratch ledger of their own."""
        if not self.let_go:
            return {}
        gone = PeakView(
            now=self.now, grown=self.grown, records=(r for _, r in self.let_go),
            pricing=self._pricing, publish_seconds=self._publish_seconds,
        )  # fmt: skip
        return {r.field: (at, gone.handles[r.field]) for at, r in self.let_go}

    @classmethod
    def parse(
        cls,
        raw: list[Any],
        pricing: KVAdmissionController,
        publish_seconds: float = PUBLISH_SECONDS,
    ) -> PeakView:
        """From ``PEAK_SNAPSHOT``'s answer."""
        holders = [reply_text(x) for x in raw[3]]
        progress = [reply_text(x) for x in raw[4]]
        kept = dict(zip(progress[0::2], progress[1::2], strict=True))
        lendings = [reply_text(x) for x in raw[8]] if len(raw) > 8 else []
        lent = dict(zip(lendings[0::2], lendings[1::2], strict=True))
        records = [
            Record.parse(field, value, kept.get(field), lent.get(field))
            for field, value in zip(holders[0::2], holders[1::2], strict=True)
        ]
        tainted = []
        for key in raw[9] if len(raw) > 9 else ():
            try:
                tainted.append(bytes.fromhex(reply_text(key)))
            except ValueError:
                continue  # not a key this version writes: no holder has it
        return cls(
            now=int(raw[0]) / 1000,
            grown=reply_text(raw[1]),
            records=records,
            tickets=[reply_text(t) for t in raw[5]],
            pricing=pricing,
            publish_seconds=publish_seconds,
            drain=(reply_text(raw[6]) or None) if len(raw) > 6 else None,
            clock=pricing.clock_runs(),
            let_go=_let_go(raw[7]) if len(raw) > 7 else (),
            tainted=tainted,
        )

    @property
    def reserved(self) -> int:
        """Every holder's whole reservation, summed."""
        return sum(r.tokens for r in self.records)

    def fits(
        self,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        *,
        follow: bool = False,
        kind: Hashable = None,
        prefix: tuple[Hashable, ...] = (),
    ) -> Fit | None:
        """Whether a newcomer fits now by the peak of every holder's trajectory, and the
        running cap (None: it does not). ``follow``: its progress will be published; then,
        where :attr:`clock` runs, it is counted from its admission and its first token is due
        by :attr:`Fit.start_by`, which its record must carry; else it counts whole until its
        first token is published. Followed, it is counted to the admitting gateway's forecast
        of its output (``kind``: whose outputs it learns from), where that gateway forecasts:
        :attr:`Fit.counted`, which its record must carry too. ``prefix``: the keys of its
        shareable prompt blocks, of which it borrows the :meth:`lent` ones (its record must say
        so)."""
        handle = self._admit(prompt_tokens, output_cap, need, follow, kind, prefix)
        if handle is None:
            return None
        self.model.release(handle)  # the model is a view: the commit is Redis's
        self.model.tainted = self.tainted  # and so is what its going would leave
        return Fit(start_by=handle.start_by, counted=handle.counted_output)

    def take(
        self,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        *,
        follow: bool = False,
        kind: Hashable = None,
        prefix: tuple[Hashable, ...] = (),
    ) -> Fit | None:
        """As :meth:`fits`, but a newcomer that fits stays in the :attr:`model`: a decision
        that admits several at once (the fair shares') counts each beside those taken before
        it, and commits them together."""
        handle = self._admit(prompt_tokens, output_cap, need, follow, kind, prefix)
        if handle is None:
            return None
        return Fit(start_by=handle.start_by, counted=handle.counted_output)

    def _admit(
        self,
        prompt_tokens: int,
        output_cap: int,
        need: int,
        follow: bool,
        kind: Hashable,
        prefix: tuple[Hashable, ...],
    ) -> Handle | None:
        return self.model.try_admit(
            prompt_tokens, output_cap, now=self.now, need=need, count_rejection=False,
            follow=follow, kind=kind, prefix=prefix,
        )  # fmt: skip

    def lent(self, prefix: tuple[Hashable, ...]) -> int:
        """How many of ``prefix``'s first blocks a holder past its prefill has, whichever
        gateway holds it: a newcomer borrows them (see :func:`.holders.borrowable`)."""
        return borrowable(prefix, self.model.live_handles())

    @functools.cached_property
    def _room(self) -> int:
        return self.model.room(self.now)[0]

    def room(self) -> int:
        """Tokens a newcomer may take now by the peak (routing's figure, and the room shown),
        worked out once per view."""
        return self._room


def _let_go(raw: list[Any]) -> list[tuple[float, Record]]:
    """From ``PEAK_SNAPSHOT``'s holders let go (flat: reservation, released_ms, holders value,
    progress value)."""
    flat = [reply_text(x) for x in raw]
    return [
        (int(released) / 1000, Record.parse(field, value, progress or None))
        for field, released, value, progress in zip(
            flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True
        )
    ]


def explained_elsewhere(views: Sequence[PeakView], lease: str, at: float, *, since: float) -> int:
    """The most KV the holders of other leases than ``lease`` in any of ``views`` (oldest
    first; each holder as the latest one has it) may hold in the engine at ``at`` (Redis
    clock): each at its count and what it may have made since it was read (see
    :func:`~..admission.holders.explained`). A holder let go since an older view is still
    counted: the engine's figures may show it a moment longer; so is one let go at ``since``
    or later that no view has live (the engine's page began then, less the relay's margin),
    as it was when let go."""
    if not views:
        return 0
    held: dict[str, Handle] = {}
    tainted: set[Hashable] = set()
    for view in views:
        held.update((f, h) for f, h in view.handles.items() if not f.startswith(lease + ":"))
        tainted |= view.tainted
    let_go = _explained_let_go(views, lease, since, held)
    if not held:
        return let_go
    model = views[-1].model
    fresh = max(at, freshest(held.values(), at))
    return let_go + explained(
        list(held.values()), fresh, fresh, decode_rate=model.decode_rate,
        relay_lag=model.relay_lag, block_size=model.block_size, tainted=tainted,
    )  # fmt: skip


def _explained_let_go(
    views: Sequence[PeakView], lease: str, since: float, live: Collection[str]
) -> int:
    """The most KV the holders of other leases than ``lease`` that ``views`` have let go at
    ``since`` or later (the engine's page began then, less the relay's margin), and not
    ``live``, may still hold in the page: admitted and let go between two reads of the
    holders, they are in no view's holders. Each as it was when let go, on its own, as the
    in-process ledger counts its own (``engine_used``)."""
    gone: dict[str, tuple[float, Handle]] = {}
    for view in views:
        gone.update(
            (f, g)
            for f, g in view.let_go_handles.items()
            if not f.startswith(lease + ":") and f not in live
        )
    model = views[-1].model
    total = 0
    for released, handle in gone.values():
        if released >= since:
            total += explained(
                [handle], released, released, decode_rate=model.decode_rate,
                relay_lag=model.relay_lag, block_size=model.block_size,
            )  # fmt: skip
    return total
