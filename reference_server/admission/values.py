"""The ledger's values: a reservation's handle, the events an observer is told, the ledger's
statistics and the room it advertises. Plain data, no behaviour of their own."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Ask", "Backlog", "Handle", "Headroom", "LedgerEvent", "LedgerStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerEvent:
    """One admission, release or refusal, for an observer (``on_event``) to log.

    ``kind`` is ``"admit"``, ``"release"`` or ``"refuse"``; ``id`` the handle's (0 for a
    refusal); ``tokens`` what was reserved, released or asked for;
    ``retry_after`` the seconds a refusal advised. No time: the ledger has no clock, the
    observer stamps events as it receives them (they arrive in the ledger's own order, under its
    lock).
    """

    kind: Literal["admit", "release", "refuse"]
    id: int
    tokens: int
    retry_after: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """A request as admission counts it: its prompt and output cap, the ``need`` they take,
    the keys of its shareable prompt blocks, whose outputs its forecast learns from, whether
    its progress will be followed, and how many sequences it runs (see
    :meth:`KVAdmissionController.try_admit`)."""

    prompt_tokens: int
    output_cap: int
    need: int
    prefix: tuple[Hashable, ...] = ()
    kind: Hashable = None
    follow: bool = False
    sequences: int = 1


@dataclass(slots=True, kw_only=True)
class _Promise:
    """A rejected client told to come back at ``start``, holding ``tokens`` until ``end``."""

    start: float
    end: float
    tokens: int
    client: Hashable | None = None


class Handle:
    """One admitted request's reservation. Give it back with :meth:`KVAdmissionController.release`.

    ``due_at`` is the worst-case release time as admission saw it: the moment the request reaches
    its output cap when decoding at the engine's rate then. Retry-After estimates follow the
    engine's progress instead: ``progress_at_admit`` is the ledger's decode progress (tokens one
    sequence has generated since the ledger began) when it was admitted.
    ``writing_since`` is when a write of the answer began waiting on the client (the ledger's
    clock), None when none is under way: one waiting longer than the release margin is a client
    that stopped reading, and the holder ends only when the server cuts it. ``slowed_at`` and
    ``slowed_from``: once a write waited long enough that its relayed count may lag the engine
    by more than the relay's margin (a slow reader), the count read before that wait and when;
    from then on it is counted as advancing at the engine's speed from there. Both are set
    through the ledger (:meth:`KVAdmissionController.writing`, ``written``), under its lock.
    ``sequences`` is how many sequences the request runs at once in the engine (``n``), each in
    a place of its own. ``cut_by``: the request was cut before its end (its client gone, or
    not reading) and the engine is taken to have let it go by then (set through
    :meth:`KVAdmissionController.cut`); its reservation is held until it is released.

    For the ``peak`` rule (see :mod:`.peak`): ``tracked`` says the server relays the request's
    progress exactly (one sequence, its tokens counted from the engine's own stream);
    ``generated`` is the tokens relayed so far (None before the first), ``first_seen_at`` and
    ``seen_at`` when the first and the latest count arrived; ``prefix`` the keys of its
    shareable prompt blocks, the first ``borrowed`` of them computed by another holder;
    ``unkeyed``, where the engine shares prefix blocks, says it holds full prompt blocks the
    ledger has no keys of (they may be copies of others'). An untracked holder, or one whose
    first token has not come, counts at its whole reservation.

    Beyond the exact rule (see :mod:`.outputs` and :mod:`.preemption`): ``counted_output`` is
    the output it is counted to (its cap, or the forecast of where it ends), ``level`` how many
    forecasts it has outlived, ``kind`` whose outputs its forecast learns from; ``start_by``,
    when set, says it was admitted on the engine's clock: counted from its admission as if it
    started then, its first token due by that time (else it counts whole); ``ended`` whether
    the engine said it ended by itself (None: not said).
    """

    __slots__ = (
        "admitted_at",
        "borrowed",
        "counted_output",
        "cut_by",
        "due_at",
        "ended",
        "first_seen_at",
        "generated",
        "id",
        "kind",
        "level",
        "output_cap",
        "prefix",
        "progress_at_admit",
        "prompt_tokens",
        "released",
        "reserved_tokens",
        "seen_at",
        "sequences",
        "slowed_at",
        "slowed_from",
        "start_by",
        "tracked",
        "unkeyed",
        "writing_since",
    )

    def __init__(
        self,
        *,
        id: int,
        prompt_tokens: int,
        output_cap: int,
        reserved_tokens: int,
        admitted_at: float,
        due_at: float,
        progress_at_admit: float = 0.0,
        sequences: int = 1,
    ) -> None:
        self.id = id
        self.prompt_tokens = prompt_tokens
        self.output_cap = output_cap
        self.reserved_tokens = reserved_tokens
        self.admitted_at = admitted_at
        self.due_at = due_at
        self.progress_at_admit = progress_at_admit
        self.sequences = sequences
        self.released = False
        self.writing_since: float | None = None
        self.cut_by: float | None = None
        self.slowed_at: float | None = None
        self.slowed_from = 0
        self.tracked = False
        self.generated: int | None = None
        self.first_seen_at = 0.0
        self.seen_at = 0.0
        self.prefix: tuple[Hashable, ...] = ()
        self.borrowed = 0
        self.unkeyed = False
        self.counted_output = output_cap
        self.level = 0
        self.kind: Hashable = None
        self.start_by: float | None = None
        self.ended: bool | None = None

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return (
            f"Handle(id={self.id}, prompt_tokens={self.prompt_tokens}, "
            f"output_cap={self.output_cap}, reserved_tokens={self.reserved_tokens}, {state})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerStats:
    """A consistent snapshot of the ledger (taken under its lock)."""

    strategy: str
    usable_tokens: int
    usable_bytes: int
    reserved_tokens: int
    reserved_bytes: int
    inflight: int
    admitted_total: int
    rejected_total: int
    released_total: int
    peak_reserved_tokens: int
    peak_inflight: int
    max_concurrency: int | None
    #: The admission rule in force: ``"peak"`` (the worst-case peak of the holders' sum) or
    #: ``"caps"`` (the sum of their whole reservations), and why it is ``"caps"`` when the
    #: ledger was configured for ``"peak"`` (None otherwise).
    rule: str = "caps"
    caps_reason: str | None = None
    #: Tokens the holders may hold at once at worst (``peak``; under ``caps`` the reserved sum).
    committed_tokens: int = 0
    #: The forecast of outputs (engines that preempt, with a preemption budget): the quantile
    #: new holders are counted at (None: off, caps), the budget and the measured rate in
    #: preemptions per 1,000 requests, and why it is off when it is.
    forecast_quantile: float | None = None
    preemption_budget: float | None = None
    preemption_rate: float | None = None
    forecast_reason: str | None = None
    #: Newcomers counted from their admission (the engine starts them at once), and the times
    #: one's first token came later than its bound (then counted whole, and newcomers too).
    start_clock: bool = False
    late_starts: int = 0
    #: Holders whose relay waited on a client that reads slowly: counted as advancing at the
    #: engine's speed to their caps, not taken for an engine out of lockstep.
    slow_readers: int = 0
    #: KV the engine uses beyond what the holders explain: someone the gateway does not see,
    #: counted as held (in ``committed_tokens`` too).
    unknown_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Headroom:
    """The room a server advertises (``RateLimit`` headers, ``/metrics``), in KV tokens.

    ``free`` is what a new reservation may take now; ``next_release_in`` the seconds until the
    soonest live reservation is due to end at the latest (0.0 when none is live); ``advertised``
    is False under the ``prompt`` and ``concurrency`` strategies, whose budgets are not what a
    client reserves (prompt + output cap), so their room is not advertised.
    """

    usable: int
    free: int
    next_release_in: float
    advertised: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Backlog:
    """What an autoscaler weighs of one upstream's budget (``/metrics``): tokens reserved and
    requests holding them, requests waiting and the KV tokens they ask for, and the ``room``
    a newcomer may take now (the rule's room less what the queue waits for). Every gateway's
    where the ledger is shared, read from one view of Redis at ``read_at``
    (``time.monotonic()``; None: an in-process ledger, always current)."""

    reserved: int = 0
    inflight: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    room: int = 0
    read_at: float | None = None
