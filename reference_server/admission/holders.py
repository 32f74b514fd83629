"""The holders as the peak rule sees them: pure functions over live handles, no lock, no clock.

The ledger (:mod:`.ledger`) calls these under its lock; the arithmetic of the peak itself is
:mod:`.peak`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable

from .peak import Holder, peak
from .values import Handle

__all__ = [
    "DEFAULT_RELAY_LAG",
    "START_SLACK_STEPS",
    "RuleInForce",
    "as_holder",
    "borrowable",
    "clock_steps",
    "explained",
    "freshest",
    "holds_unkeyed",
    "lag_tokens",
    "slow_since",
    "slow_write",
    "stalled",
    "start_deadline",
    "tainted_after",
]

#: The most one stream's tokens may lag another's on their way from the engine's decode step
#: to the server's reading of them (the engine's API process writing one stream after another,
#: the sockets, the relay's loop), in seconds: see :func:`lag_tokens`.
DEFAULT_RELAY_LAG = 0.25
#: How much faster than measured a sequence is allowed to decode, for that margin: the speed
#: is measured over seconds, and a batch that thins out decodes faster.
LAG_RATE_FACTOR = 2.0
#: Seconds of a holder's own stream before its own speed counts for that margin: chunks come in
#: bursts (an engine's API process catching up), and a burst's rate is no speed.
OWN_RATE_SPAN = 0.5
#: Decode steps a newcomer admitted on the engine's clock may start late (its prompt's prefill
#: split over steps by the engine's token budget, the engine's API process): a model of the
#: real vLLM's burst shows no loss against a start known exactly with this slack.
START_SLACK_STEPS = 8
#: Seconds a write of an answer may wait on its client, at the least, before its holder is
#: taken for a slow reader (see :func:`slow_write`).
SLOW_WRITE_FLOOR = 0.005


def freshest(live: Iterable[Handle], now: float) -> float:
    """When the freshest count of any holder followed was read (``now`` when none is)."""
    return max((h.seen_at for h in live if h.tracked and h.generated is not None), default=now)


def _lag_rate(handle: Handle, decode_rate: float) -> float:
    """The faster of the engine's measured speed alone and ``handle``'s own observed speed over
    at least ``OWN_RATE_SPAN``."""
    span = handle.seen_at - handle.first_seen_at
    if span >= OWN_RATE_SPAN and handle.generated:
        return max(decode_rate, (handle.generated - 1) / span)
    return decode_rate


def lag_tokens(handle: Handle, fresh: float, *, decode_rate: float, relay_lag: float) -> int:
    """Tokens ``handle`` may have made beyond those relayed, as of the freshest count read
    (``fresh``, see :func:`freshest`): what it can decode in the relay lag plus the time by
    which its own latest count is older, at twice the faster of the engine's measured speed
    alone (``decode_rate``) and its own observed speed over at least ``OWN_RATE_SPAN``.

    Counts that are all equally late need no margin: in lockstep every holder is then the same
    number of steps further on than read, the sum's future is the one computed, only shifted,
    and its peak covers it (a newcomer counts whole until its own first count). A stall of the
    server's own loop, or of the engine's API process, delays every count alike; what differs
    between two holders is what the margin covers."""
    rate = _lag_rate(handle, decode_rate)
    return math.ceil(LAG_RATE_FACTOR * rate * (max(0.0, fresh - handle.seen_at) + relay_lag))


def slow_write(waited: float, relay_lag: float) -> bool:
    """Whether a write that waited ``waited`` seconds on its client makes a slow reader of its
    holder: while the relay waits it reads nothing of the engine's stream, which the engine
    goes on filling (vLLM keeps generating into its own buffers), so the counts read after a
    long wait can lag the engine by more than the relay's margin. A wait within half the
    margin (at least ``SLOW_WRITE_FLOOR``) leaves the count as fresh as the margin allows."""
    return waited > max(SLOW_WRITE_FLOOR, relay_lag / 2)


def as_holder(
    handle: Handle,
    fresh: float,
    *,
    decode_rate: float,
    relay_lag: float,
    now: float | None = None,
) -> Holder:
    """How the peak sees ``handle`` as of the freshest count read (``fresh``), counted to its
    ``counted_output`` (its cap, or its forecast): flat (its whole size) until its first relayed
    token or when its progress is not followed; its trajectory once it has one; and, admitted
    on the engine's clock (``start_by``) with no token yet, as if it had started at admission:
    no more made than the steps since could make, and ended no later than its output after
    every step until its first token is due (see :func:`clock_steps`).

    A slow reader (``slowed_at``: a write of its answer waited on its client) is counted to
    its cap, as advancing at the engine's speed (twice the faster of the engine's measured
    speed and its own, as the relay's margin) from the count read before that wait, up to
    ``now``, whatever it has relayed since: the engine does not wait for its client."""
    if not handle.tracked:
        return Holder.flat(handle.reserved_tokens, handle.prefix, handle.borrowed)
    prompt, total, generated = handle.prompt_tokens, handle.counted_output, handle.generated
    if generated is None:
        if handle.start_by is None:
            return Holder.flat(prompt + total, handle.prefix, handle.borrowed)
        made = clock_steps(max(0.0, fresh - handle.admitted_at), decode_rate)
        return Holder(
            held=prompt + min(total, made),
            most=prompt + total,
            steps_left=total + 1 + clock_steps(max(0.0, handle.start_by - fresh), decode_rate),
            prefix=handle.prefix,
            borrowed=handle.borrowed,
        )
    made = _made(handle, fresh, now, decode_rate=decode_rate, relay_lag=relay_lag)
    if slow_since(handle, now, relay_lag) is not None:
        total = handle.output_cap
    return Holder(
        held=prompt + min(total, made),
        most=prompt + total,
        # Through the step that makes its last token, at its whole size: it frees after.
        steps_left=max(0, total - generated) + 1,
        prefix=handle.prefix,
        borrowed=handle.borrowed,
    )


def explained(
    live: Iterable[Handle],
    fresh: float,
    now: float,
    *,
    decode_rate: float,
    relay_lag: float,
    block_size: int,
    tainted: Collection[Hashable] = (),
) -> int:
    """The most KV the holders may really hold in the engine now, in whole blocks, each
    shareable prefix block once per copy that may exist: what the engine's own books can be
    explained by. Each holder at what it has relayed and may have made beyond (the relay's
    margin; a slow reader's advance at the engine's speed), to its cap; at its prompt and the
    margin before its first count; at its whole reservation when its progress is not followed.
    Not their counted futures."""
    holders = []
    for handle in live:
        if not handle.tracked:
            tokens = handle.reserved_tokens
        elif handle.generated is None:
            made = math.ceil(LAG_RATE_FACTOR * decode_rate * relay_lag)
            tokens = handle.prompt_tokens + min(handle.output_cap, made)
        else:
            made = _made(handle, fresh, now, decode_rate=decode_rate, relay_lag=relay_lag)
            tokens = handle.prompt_tokens + min(handle.output_cap, made)
        holders.append(Holder.flat(tokens, handle.prefix, handle.borrowed))
    return peak(holders, block_size=block_size, tainted=tainted) if holders else 0


def _made(
    handle: Handle, fresh: float, now: float | None, *, decode_rate: float, relay_lag: float
) -> int:
    """The most tokens ``handle`` (with a count) may have made: its count and the relay's
    margin; a slow reader, its count before its wait advanced at the engine's speed since."""
    made = (handle.generated or 0) + lag_tokens(
        handle, fresh, decode_rate=decode_rate, relay_lag=relay_lag
    )
    slowed = slow_since(handle, now, relay_lag)
    if slowed is not None:
        at, count = slowed
        latest = fresh if now is None else max(fresh, now)
        since = max(0.0, latest - at) + relay_lag
        rate = _lag_rate(handle, decode_rate)
        made = max(made, count + math.ceil(LAG_RATE_FACTOR * rate * since))
    return made


def slow_since(handle: Handle, now: float | None, relay_lag: float) -> tuple[float, int] | None:
    """For a slow reader, the count it is counted as advancing from and when it was read: the
    one before the write that waited long (``slowed_at``), or before the one that has been
    waiting long by ``now``; None for a holder whose relay keeps up."""
    if handle.slowed_at is not None:
        return handle.slowed_at, handle.slowed_from
    since = handle.writing_since
    if since is None or now is None or handle.generated is None:
        return None
    if not slow_write(now - since, relay_lag):
        return None
    return handle.seen_at, handle.generated


def clock_steps(seconds: float, decode_rate: float) -> int:
    """The most decode steps an engine may run in ``seconds``: at twice the speed of one
    sequence alone (``decode_rate``, as measured), the margin :func:`lag_tokens` takes."""
    return math.ceil(LAG_RATE_FACTOR * decode_rate * seconds)


def start_deadline(now: float, step_seconds: float, relay_lag: float) -> float:
    """When the first token of a newcomer admitted ``now`` on the engine's clock must have been
    relayed: made at the end of the step it starts in, at most ``START_SLACK_STEPS`` steps of
    ``step_seconds`` late, plus the relay's lag."""
    return now + (START_SLACK_STEPS + 1) * step_seconds + relay_lag


def borrowable(prefix: tuple[Hashable, ...], live: Iterable[Handle]) -> int:
    """How many of ``prefix``'s first blocks a holder past its prefill has: the engine lends
    them to a newcomer instead of computing them again."""
    if not prefix:
        return 0
    computed: set[Hashable] = set()
    for handle in live:
        if handle.generated is not None:
            computed.update(handle.prefix)
    borrowed = 0
    for key in prefix:
        if key not in computed:
            break
        borrowed += 1
    return borrowed


def holds_unkeyed(
    prefix: tuple[Hashable, ...], prompt_tokens: int, *, shares_prefixes: bool, block_size: int
) -> bool:
    """Whether a holder of ``prompt_tokens`` given ``prefix`` holds full prompt blocks the
    ledger has no keys of, where the engine shares them (``shares_prefixes``): they may be
    copies of others' (see :func:`tainted_after`)."""
    return not prefix and shares_prefixes and prompt_tokens - 1 >= block_size


def tainted_after(gone: Handle, live: Collection[Handle], tainted: set[Hashable]) -> set[Hashable]:
    """The tainted blocks once ``gone`` has let its prompt go: a block it computed while another
    holder computed its own copy leaves a freed copy the engine may hand out; blocks no holder
    has any more are forgotten (see :mod:`.peak`).

    A holder the ledger knows no prefix keys of (``unkeyed``: several sequences, a prompt with
    a non-text part, or counted without the engine's token ids) may have computed a copy of
    any block: every block computed by a holder whose prefill overlapped its own is taken to
    have had a copy in it, now freed."""
    out = set(tainted)
    if gone.unkeyed:
        end = _prefill_end(gone)
        for handle in live:
            if handle.admitted_at <= end and gone.admitted_at <= _prefill_end(handle):
                out.update(handle.prefix[handle.borrowed :])
    computed = set(gone.prefix[gone.borrowed :])
    held: set[Hashable] = set()
    for handle in live:
        held.update(handle.prefix)
        out.update(computed.intersection(handle.prefix[handle.borrowed :]))
    return out & held


def _prefill_end(handle: Handle) -> float:
    """When ``handle``'s prefill ended at the latest: its first token relayed (not yet while it
    has none, or its progress is not followed)."""
    return handle.first_seen_at if handle.generated is not None else math.inf


def stalled(live: Iterable[Handle], now: float, seconds: float) -> list[Handle]:
    """Tracked holders with tokens still to make whose count has not moved for ``seconds``
    while another's did: the engine is not running them in lockstep. A holder whose relay
    waits on its client, or has (a slow reader), is not one: its count stands still because
    nobody reads it, and it is counted as advancing at the engine's speed instead."""
    moving = [h for h in live if h.generated is not None]
    if not any(now - h.seen_at < seconds for h in moving):
        return []
    return [
        h
        for h in moving
        if now - h.seen_at >= seconds
        and (h.generated or 0) < h.output_cap
        and h.writing_since is None
        and h.slowed_at is None
    ]


class RuleInForce:
    """Whether a ledger configured for the peak rule runs on it now, and why not: for good (the
    engine does not qualify: ``for_good``); while a condition lasts (its figures cannot be
    read, it holds KV no holder explains: ``lasting``, by kind); or until the holders live when
    the engine was seen out of lockstep, or when a lasting condition ended, have gone
    (``for_now``, ``draining``). Under the ledger's lock."""

    __slots__ = ("draining", "for_good", "for_now", "lasting", "peak_configured")

    def __init__(self, *, peak_configured: bool) -> None:
        self.peak_configured = peak_configured
        self.for_good: str | None = None
        self.lasting: dict[str, str] = {}
        self.for_now: str | None = None
        self.draining: set[int] = set()

    @property
    def tracks_progress(self) -> bool:
        """Holders' progress is worth following (it may be on caps for now, until drained)."""
        return self.peak_configured and self.for_good is None

    @property
    def peak(self) -> bool:
        return self.tracks_progress and not self.lasting and self.for_now is None

    @property
    def reason(self) -> str | None:
        if not self.peak_configured:
            return None
        return self.for_good or next(iter(self.lasting.values()), None) or self.for_now

    def last(self, kind: str, reason: str | None, live: Collection[int]) -> None:
        """Whole caps while ``reason`` (of ``kind``) lasts; None: it has ended, and the holders
        admitted meanwhile are counted whole until they have gone."""
        if reason is not None:
            self.lasting[kind] = reason
        elif (before := self.lasting.pop(kind, None)) is not None:
            self.until_drained(before, live)

    def until_drained(self, reason: str, live: Collection[int]) -> None:
        self.for_now = reason
        self.draining = set(live)
        if not self.draining:
            self.for_now = None

    def gone(self, handle_id: int) -> None:
        self.draining.discard(handle_id)
        if not self.draining:
            self.for_now = None
