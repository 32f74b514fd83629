"""The fair shares' state on the shared ledger as one snapshot read it, and the decision taken on
it. Pure: no Redis, no clock of its own (times are the Redis clock's, in seconds).

:class:`FairState` is ``FAIR_SNAPSHOT``'s answer: every holder with its tenant, every waiting
ticket with its tenant, class, passes and what its request is made of (:class:`PeakAsk`), every
tenant's token-seconds and counter offset, and the peak rule's records of the same moment.
:class:`Decision` restores the fair scheduler from it (:class:`~..admission.fairness.
FairScheduler`, the in-process fair queue's), queues a gateway's newcomers, dispatches, and
says what to write (``FAIR_COMMIT``'s arguments).

**The rule it admits by** is the plain shared queue's. Where the deciding gateway runs on the
peak (its ledger configured for it and in force, and no gateway's lockstep break draining), by
the peak of every gateway's holders: the same :class:`~.view.PeakView` (its scratch ledger, its
margins, the forecast of outputs and the newcomer's clock as this gateway has them, prefix
blocks borrowed from holders past their prefill); each waiter admitted is taken into the view's
model, so the next one is counted beside it, and each is written with the records ADMIT writes
(``hold``, :mod:`.holding`), so every gateway counts it alike. Else by whole caps, as the
seed's rule.

**Progress read late.** The decision reads the holders' progress as last published, up to a
publish interval old, and a count published after it does not stop its commit (PROGRESS bumps
neither ``version`` nor ``grown``). Nor need it: the view counts a holder from its count at the
relay's margin, which includes the publish interval (``shared_relay_lag``), and a count older
than the freshest one read further still (``freshest``, see ``admission/holders.py``), with as
many steps left as from that count: never less than it holds, never fewer steps than it has
left, whatever it made since; and a holder released since holds nothing. What would make the
decision wrong (a holder admitted or put back, a lockstep break) moves ``grown``, which the
commit checks besides ``version``.

**Fair accounting** is the in-process fair queue's: a holder counts against its tenant's limit
by what the rule in force counts (the view's ``held_now`` on the peak, its whole reservation on
caps) and is charged what it holds (its prompt and tokens so far, by its progress record:
:func:`.holding.charged`, the formula the scripts charge it by when it goes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..admission.fairness import DEFAULT_TENANT, FairPolicy, FairScheduler, Holding, Waiter
from ..admission.ledger import KVAdmissionController
from .connection import reply_text
from .holding import charged
from .lua import ticket_need
from .prefixes import KEY_DIGITS, prefix_record
from .state import SharedState, Snapshot
from .view import PeakView, Record, lending

__all__ = ["Decision", "FairState", "Outcome", "PeakAsk", "Seat", "records_of"]


def _pairs(flat: list[Any]) -> list[tuple[str, str]]:
    items = [reply_text(x) for x in flat]
    return list(zip(items[0::2], items[1::2], strict=True))


@dataclass(frozen=True, slots=True)
class PeakAsk:
    """What the peak rule needs of a waiting request besides its need and cap, kept with its
    ticket so that any gateway may admit it (``"prompt follow keys model"``): its prompt, whether
    its progress is followed (None: it gets no progress record, and counts whole), the keys of
    its shareable prompt blocks (16 bytes each) and its model (whose outputs its forecast learns
    from, with its tenant). One that does not read as this version writes it counts whole.

    >>> PeakAsk(7, None, (bytes(16),), None).text()
    '7 - 00000000000000000000000000000000 -'
    >>> PeakAsk.parse(PeakAsk(7, True, (), "m 1").text())
    PeakAsk(prompt=7, follow=True, keys=(), model='m 1')
    """

    prompt: int = 0
    follow: bool | None = None
    keys: tuple[bytes, ...] = ()
    model: str | None = None

    @classmethod
    def of(
        cls, prompt: int, follow: bool | None, prefix: tuple[object, ...], model: str | None
    ) -> PeakAsk:
        """A newcomer's; keys that are not 16 bytes each are not kept (it counts as holding
        blocks of unknown keys, as ADMIT's prefix record has it)."""
        keys = tuple(k for k in prefix if isinstance(k, bytes) and len(k) * 2 == KEY_DIGITS)
        return cls(prompt, follow, keys if len(keys) == len(prefix) else (), model)

    def text(self) -> str:
        follow = "-" if self.follow is None else str(int(self.follow))
        keys = "".join(k.hex() for k in self.keys) or "-"
        model = "-" if self.model is None else "m" + self.model.encode().hex()
        return f"{self.prompt} {follow} {keys} {model}"

    @classmethod
    def parse(cls, text: str) -> PeakAsk:
        try:
            prompt, follow, keys, model = text.split(" ")
            digits = "" if keys == "-" else keys
            if follow not in ("-", "0", "1") or len(digits) % KEY_DIGITS or model[0] not in "-m":
                raise ValueError(text)
            return cls(
                int(prompt),
                None if follow == "-" else follow == "1",
                tuple(
                    bytes.fromhex(digits[i : i + KEY_DIGITS])
                    for i in range(0, len(digits), KEY_DIGITS)
                ),
                None if model == "-" else bytes.fromhex(model[1:]).decode(),
            )
        except (ValueError, IndexError):
            return cls()


@dataclass(slots=True)
class _Meta:
    """A waiting ticket as Redis keeps it (``"W priority bypassed lower cap tenant"``, then on a
    second line its :class:`PeakAsk`, when it has one)."""

    state: str
    priority: int
    bypassed: int
    lower: int
    cap: int
    tenant: str
    ask: str = ""

    @classmethod
    def parse(cls, text: str) -> _Meta:
        head, _, ask = text.partition("\n")
        state, priority, bypassed, lower, cap, tenant = head.split(" ", 5)
        return cls(state, int(priority), int(bypassed), int(lower), int(cap), tenant, ask)

    def text(self) -> str:
        head = f"{self.state} {self.priority} {self.bypassed} {self.lower} {self.cap} {self.tenant}"
        return head + ("\n" + self.ask if self.ask else "")


class FairState:
    """One upstream's fair shares as Redis had them at one moment (seconds, Redis clock)."""

    def __init__(self, raw: list[Any]) -> None:
        self.now = int(raw[0]) / 1000
        self.version = reply_text(raw[1])
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
        tickets = [ticket for ticket, _ in self.queue]
        #: ``PEAK_SNAPSHOT``'s answer at the same moment (none of the holders let go).
        self.peak_raw = [raw[0], raw[7], raw[2], raw[3], raw[8], tickets, raw[9], [], *raw[10:12]]

    def view(self, pricing: KVAdmissionController) -> PeakView:
        """Every gateway's holders as the peak rule counts them, priced as ``pricing``."""
        return PeakView.parse(self.peak_raw, pricing)

    def snapshot(self) -> Snapshot:
        """The plain shared ledger's view of the same moment (for its Retry-After model)."""
        tickets = [ticket for ticket, _ in self.queue]
        return Snapshot([round(self.now * 1000), self.reserved, self.raw_holders, tickets])

    def seen(self) -> SharedState:
        queued = sum(ticket_need(ticket) for ticket, _ in self.queue)
        return SharedState(self.reserved, len(self.holders), queued)

    def per_tenant(self, what: str) -> dict[str, float]:
        prefix = what + ":"
        return {k[len(prefix) :]: v for k, v in self.fair.items() if k.startswith(prefix)}

    def known(self, ticket: str) -> bool:
        """Whether ``ticket`` is in Redis at all: waiting, refused or held."""
        return ticket in self.metas or ticket in self.holders


class Seat(Waiter):
    """A gateway's own waiter: its ticket and what its reservation is made of."""

    __slots__ = ("ask", "output_cap", "prompt_tokens", "ticket")

    def __init__(
        self,
        *,
        ticket: str,
        tenant: str,
        need: int,
        priority: int,
        prompt_tokens: int,
        output_cap: int,
        ask: PeakAsk | None = None,
    ) -> None:
        super().__init__(tenant=tenant, need=need, priority=priority)
        self.ticket = ticket
        self.prompt_tokens = prompt_tokens
        self.output_cap = output_cap
        self.ask = ask if ask is not None else PeakAsk(prompt_tokens)


@dataclass(frozen=True, slots=True)
class _Slot:
    """A reservation the scheduler decided on, before it is written."""

    id: int
    reserved_tokens: int
    due_at: float


def records_of(record: Record) -> tuple[int, tuple[str, str] | None]:
    """(the output it is counted to, the head of its progress record and its prefix record as
    it was admitted: None without a progress record) of a holder as a view read it."""
    if record.prompt is None:
        return record.cap, None
    head = f"{record.prompt} {record.counted} {int(record.tracked)}"
    return record.counted, (head, prefix_record(record.prefix, record.borrowed, record.unkeyed))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a decision decided: ``FAIR_COMMIT``'s arguments (None: nothing to write), who was
    admitted and who refused, and per ticket admitted the output its record counts it to and
    its records as written (see :func:`records_of`)."""

    args: list[Any] | None
    admitted: list[tuple[Waiter, _Slot]]
    refused: list[Waiter]
    written: dict[str, tuple[int, tuple[str, str] | None]]


class Decision:
    """The scheduler restored from a :class:`FairState` and its ``view`` (priced as
    ``pricing``), with the waiters it was given by ticket (and the metas they had) so that what
    changed can be written back. ``peak``: the deciding gateway runs on the peak (it decides
    by it unless a drain is read); ``due``: when a holder admitted at a time with a cap is due
    to end, at worst."""

    def __init__(
        self,
        state: FairState,
        view: PeakView,
        policy: FairPolicy,
        pricing: KVAdmissionController,
        *,
        peak: bool,
        due: Callable[[float, int], float],
    ) -> None:
        self.state, self.view, self._pricing, self._due = state, view, pricing, due
        #: Whether it admits by the peak of every gateway's holders (else whole caps).
        self.peak = peak and view.drain is None
        records = {r.field: r for r in view.records}
        #: reservation -> its key in :attr:`fair`
        self.keys = keys = {ticket: n for n, ticket in enumerate(state.holders, start=1)}
        holdings = [
            self._holding(keys[ticket], ticket, held, records.get(ticket))
            for ticket, held in state.holders.items()
        ]
        self.waiters: dict[str, Waiter] = {}
        for ticket, seq in state.queue:
            meta = state.metas.get(ticket)
            if meta is None or meta.state != "W":
                continue
            waiter = Waiter(tenant=meta.tenant, need=ticket_need(ticket), priority=meta.priority)
            waiter.seq, waiter.bypassed, waiter.lower_passes = seq, meta.bypassed, meta.lower
            self.waiters[ticket] = waiter
        ended = {t: ms / 1000 for t, ms in state.per_tenant("taken").items()}
        admitted, refused = state.per_tenant("admitted"), state.per_tenant("refused")
        counts = {
            t: (int(admitted.get(t, 0)), int(refused.get(t, 0))) for t in {*admitted, *refused}
        }
        self.fair = FairScheduler.restore(
            policy,
            usable=pricing.usable_tokens,
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

    def _holding(
        self, key: int, ticket: str, held: tuple[int, int, float, str], record: Record | None
    ) -> Holding:
        """A holder as the scheduler restores it: counted by the rule in force, charged what
        it holds (see the module)."""
        tokens, cap, admitted, tenant = held
        now, counted = self.state.now, tokens
        if self.peak and ticket in self.view.handles:  # as of its latest count, as in process
            # (where a holder is counted again at each relayed count): its margin is the
            # relay's, not the time its count has waited for this decision
            handle = self.view.handles[ticket]
            seen = handle.seen_at if handle.generated is not None else now
            counted = min(tokens, self.view.model.held_now(handle, min(seen, now)))
        rate, taken = tokens, tokens * max(0.0, now - admitted)
        if record is not None and record.prompt is not None and record.generated is not None:
            rate = record.prompt + record.generated
            taken = charged(
                tokens, admitted, now, prompt=record.prompt, generated=record.generated,
                seen=record.seen_at, first=record.first_seen_at,
            )  # fmt: skip
        return Holding(
            key=key, tenant=tenant, tokens=tokens, due=self._due(admitted, cap), since=admitted,
            held=counted, rate=rate, taken=taken,
        )  # fmt: skip

    def decide(self, joining: Sequence[Seat], lease: str) -> Outcome:
        """Queue ``joining`` (this gateway's newcomers, of lease ``lease``), dispatch."""
        state, fair, view, now = self.state, self.fair, self.view, self.state.now
        pricing = self._pricing
        refused: list[Waiter] = []
        for seat in joining:
            refused += fair.enqueue(seat, now)
        reserved, holders = state.reserved, len(state.holders)
        most = pricing.max_concurrency or 0
        caps = {t: m.cap for t, m in state.metas.items()}
        caps.update({s.ticket: s.output_cap for s in joining})
        asks = {t: m.ask for t, m in state.metas.items()}
        asks.update({s.ticket: s.ask.text() for s in joining})
        tickets = {id(w): t for t, w in self.waiters.items()}
        tickets.update({id(s): s.ticket for s in joining})
        rows: list[tuple[Any, ...]] = []
        written: dict[str, tuple[int, tuple[str, str] | None]] = {}

        def attempt(waiter: Waiter) -> _Slot | None:
            nonlocal reserved, holders
            ticket = tickets[id(waiter)]
            cap, ask = caps[ticket], PeakAsk.parse(asks[ticket])
            follow, lent, start, counted = ask.follow, 0, "", ""
            keys = ask.keys if self.peak and follow is not None else ()
            if self.peak:
                lent = view.lent(keys) if keys else 0
                fit = view.take(
                    ask.prompt, cap, waiter.need, follow=bool(follow),
                    kind=(ask.model, waiter.tenant), prefix=keys,
                )  # fmt: skip
                if fit is None:
                    return None
                start, counted = fit.start_ms(), fit.counted_for(cap, follow=bool(follow))
            elif reserved + waiter.need > pricing.usable_tokens or (most and holders >= most):
                return None
            reserved, holders = reserved + waiter.need, holders + 1
            record = lending(pricing, keys, ask.prompt, follow=follow, lent=lent)
            prompt = "" if follow is None else str(ask.prompt)
            tracked = "" if follow is None else str(int(follow))
            rows.append((ticket, cap, waiter.tenant, prompt, tracked, start, counted, record))
            output = int(counted) if counted else cap
            head = f"{prompt} {output} {tracked}"
            written[ticket] = (output, (head, record) if prompt else None)
            return _Slot(next(self._ids), waiter.need, self._due(now, cap))

        admitted = fair.dispatch(now, attempt)
        gone = {id(w) for w, _ in admitted} | {id(w) for w in refused}
        joins = [
            (s.ticket, self._meta(s, s.output_cap, asks[s.ticket]).text())
            for s in joining
            if id(s) not in gone
        ]
        passes = [
            (t, self._meta(w, caps[t], asks[t]).text())
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
            lease,
            pricing.usable_tokens,
            most,
            view.grown if self.peak else "",
        ]
        lists: tuple[list[tuple[Any, ...]], ...] = (
            joins, rows, [(tickets[id(w)], w.tenant) for w in refused], passes, offsets
        )  # fmt: skip
        for items in lists:
            args.append(len(items))
            args += [x for row in items for x in row]
        moved = fair.vtime != self._vtime
        args.append(repr(fair.vtime) if moved else "")
        changed = moved or any(items for items in (joins, admitted, refused, passes, offsets))
        return Outcome(args if changed else None, admitted, refused, written)

    @staticmethod
    def _meta(waiter: Waiter, cap: int, ask: str) -> _Meta:
        return _Meta(
            "W", waiter.priority, waiter.bypassed, waiter.lower_passes, cap, waiter.tenant, ask
        )
