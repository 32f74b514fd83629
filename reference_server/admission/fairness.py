"""Fair shares of one KV budget between tenants: weights, limits and priority classes. Pure: no
I/O and no clock of its own (whatever depends on time takes ``now``), so it is driven the same
way by the admission queue, by tests and by property tests.

**What is shared** is KV token-seconds: the tokens a tenant's requests really hold in the
engine, integrated over the time they hold them. A holder is charged its prompt and what it has
generated so far, as its relayed progress says (:meth:`FairScheduler.resize`); until its first
relayed token, or where its progress is not followed, what the budget counts it at (its whole
reservation). A long request takes more from the others than a short one, for as long as it
runs, and one that stops early stops being charged when it stops.

**What a tenant holds** (against its limit) is what the admission rule counts its holders at:
under the peak rule what each holds now from its progress (its whole reservation until its first
token), under the caps rule their whole reservations. So a limit never undoes the peak rule's
gain: a tenant allowed the whole budget is held back by nothing the budget itself does not.

**Which waiter goes next.** Each tenant has a virtual counter, start-time fair queuing as the
Virtual Token Counter does it (Sheng et al., OSDI'24), over token-seconds: its key is the
token-seconds it has been charged, plus what its live holders are due to take at their present
size until their due ends, over its weight. When room appears, the backlogged tenant with the
lowest key is served. Why a counter, not deficit round robin: a round robin spends a quantum on
each request's cost when it is dequeued, and a request's token-seconds are known only when it
ends (most outputs stop before their caps). The projected part makes an admission count at once
(else one tenant would take every place a release opens before its counter moved) and falls
away when a holder ends early. The **system virtual time** is the start tag of the last waiter
served: its tenant's counter then (what it had been charged, not what its holders were due to
take, which falls away when they end early or hold less than their caps). A tenant that becomes
backlogged (it had nothing waiting) is lifted to it, whether or not anyone else is active: idle
time is never banked for a later burst, and a newcomer after a lull starts level with the one
that ran alone. Among equal keys, the tenant holding least per weight goes first, then arrival
order.

**Work-conserving.** Nothing is held back for a tenant that is not waiting: a tenant alone may
take the whole budget (up to its own ``max_share``).

**No starvation.** Within a tenant and a class, requests are served in arrival order: only the
head of each such queue is a candidate. Across them, the first candidate in order that does not
fit now may be passed by later ones that fit (the budget is not left idle behind a big request),
but at most ``max_bypass`` times by its own class and :data:`LOWER_CLASS_PASSES` time by a lower
class; after that nothing behind it is admitted until it fits, so the room releases make is kept
for it. Its tenant's key does not grow while it waits with nothing held, so it comes first in
its class in time.

**Limits.** A tenant never holds more than ``max_share`` of the budget: a waiter that would take
it past is not a candidate (it holds nobody back) until its own tenant's holders release. A
tenant allowed the whole budget has no limit of its own: the budget's rule holds it. (Under the
peak rule what a tenant holds now may come near the budget while its holders are about to end;
counted against a limit of the whole budget, it would hold that tenant back while the budget
admits another's newcomers beside those ends, and the other would take every such room.)

**Priorities.** An integer class per request, lower served first (default 0), within the classes
the operator granted its tenant (:meth:`Tenant.grant`): classes come before keys in the order,
so a waiting request of a higher class is delayed by a lower one by at most one admission (a
pass while it does not fit).

**Overload.** With ``max_queued``, a tenant may keep at most ``max_share`` of those places
(at least one): its next request is refused at once. Past ``max_queued`` waiting in all, a
waiter is refused: first one whose tenant is over its limit (what it holds and what it has
queued up to that waiter exceed it: it could not be admitted before its own holders end), so a
waiter within its limit is never refused for one over its limit; among those alike, the lowest
class, then the newest of the tenant furthest above its share.

>>> policy = FairPolicy(tenants={"a": Tenant(weight=3.0), "b": Tenant(weight=1.0)})
>>> fair = FairScheduler(policy, usable=1000)
>>> fair.resolve("someone"), fair.resolve("a")
('default', 'a')
>>> Tenant(priorities=(-1, 0)).grant(-1000), Tenant().grant(5)
(-1, 0)
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from .terms import (
    DEFAULT_MAX_BYPASS,
    DEFAULT_TENANT,
    LOWER_CLASS_PASSES,
    PRIORITY_RANGE,
    FairPolicy,
    Tenant,
)

__all__ = [
    "DEFAULT_MAX_BYPASS",
    "DEFAULT_TENANT",
    "LOWER_CLASS_PASSES",
    "PRIORITY_RANGE",
    "FairPolicy",
    "FairScheduler",
    "Held",
    "Holding",
    "Tenant",
    "TenantStats",
    "Waiter",
]


class Waiter:
    """One request waiting for room: its tenant (as resolved), class and need in tokens.
    ``bypassed`` and ``lower_passes``: admissions that passed it while it did not fit;
    ``refused``: turned away under overload."""

    __slots__ = ("bypassed", "lower_passes", "need", "priority", "refused", "seq", "tenant")

    def __init__(self, *, tenant: str, need: int, priority: int = 0) -> None:
        self.tenant = tenant
        self.need = need
        self.priority = priority
        self.seq = 0
        self.bypassed = 0
        self.lower_passes = 0
        self.refused = False


class Held(Protocol):
    """What the scheduler reads of an admitted reservation (a ledger's ``Handle``)."""

    @property
    def id(self) -> int: ...

    @property
    def reserved_tokens(self) -> int: ...

    @property
    def due_at(self) -> float: ...


H = TypeVar("H", bound=Held)


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """A live reservation as a shared store keeps it (:meth:`FairScheduler.restore`): its key,
    tenant, tokens, due end, and since when it has been held; what it counts for against its
    tenant's limit now (``held``: as the admission rule counts it), the KV it holds now
    (``rate``: what it is charged per second) and the token-seconds it has been charged so far
    (``taken``), each, when not given, by its whole reservation (``tokens``) since ``since``."""

    key: int
    tenant: str
    tokens: int
    due: float
    since: float
    held: int | None = None
    rate: int | None = None
    taken: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantStats:
    """One tenant's figures: tokens it holds now (as the admission rule counts them), KV
    token-seconds it has been charged since it was first seen, requests waiting, admitted and
    refused (429)."""

    tenant: str
    weight: float
    held: int
    token_seconds: float
    waiting: int
    admitted: int
    refused: int


@dataclass(slots=True)
class _Hold:
    tenant: str
    held: int  # what it counts for against its tenant's limit now
    rate: int  # the KV it is charged for now, per second
    due: float


@dataclass(slots=True)
class _Account:
    weight: float
    limit: int
    counter: float = 0.0  # token-seconds charged, over the weight, plus lifts (virtual time)
    taken: float = 0.0  # token-seconds charged
    held: int = 0
    rate: int = 0
    holds: dict[int, _Hold] = field(default_factory=dict)
    queues: dict[int, deque[Waiter]] = field(default_factory=dict)
    admitted: int = 0
    refused: int = 0

    def key(self, now: float) -> float:
        due = sum(h.rate * max(0.0, h.due - now) for h in self.holds.values())
        return self.counter + due / self.weight

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())


class FairScheduler:
    """Who of the waiters goes next, and what each tenant holds and has taken, for a budget of
    ``usable`` tokens (see the module's docstring for the rules). Not locked: one event loop
    drives it (the queue's), as it drives the waiters."""

    def __init__(self, policy: FairPolicy, *, usable: int, now: float = 0.0) -> None:
        if usable < 1:
            raise ValueError(f"usable must be at least 1, got {usable}")
        self.policy = policy
        self.usable = usable
        self._accounts: dict[str, _Account] = {}
        self._holds: dict[int, _Hold] = {}
        self._seq = itertools.count(1)
        self._at = now
        self.waiting = 0
        #: The system virtual time: the counter (start tag) of the tenant of the last waiter served.
        self.vtime = 0.0

    # --- tenants -------------------------------------------------------------------------------

    def resolve(self, name: str | None) -> str:
        return self.policy.resolve(name)

    def limit(self, tenant: str) -> int:
        """The most ``tenant`` may hold at once, in tokens."""
        return self._account(tenant).limit

    def held(self, tenant: str) -> int:
        return self._account(tenant).held

    def holding(self, key: int) -> int:
        """What the live reservation ``key`` counts for against its tenant's limit (0: none)."""
        hold = self._holds.get(key)
        return hold.held if hold is not None else 0

    def tenant_of(self, key: int) -> str | None:
        """The tenant of the live reservation ``key``, None when it is not held here."""
        hold = self._holds.get(key)
        return hold.tenant if hold is not None else None

    def never_within(self, tenant: str | None, need: int) -> bool:
        """Whether ``need`` tokens exceed what ``tenant`` may ever hold: it would wait for ever
        (it counts whole until its first token, under either rule)."""
        return need > self.limit(self.resolve(tenant))

    def _account(self, tenant: str) -> _Account:
        account = self._accounts.get(tenant)
        if account is None:
            terms = self.policy.terms(tenant)
            limit = math.floor(terms.max_share * self.usable)
            account = self._accounts[tenant] = _Account(weight=terms.weight, limit=limit)
        return account

    @classmethod
    def restore(
        cls,
        policy: FairPolicy,
        *,
        usable: int,
        now: float,
        holdings: Iterable[Holding] = (),
        waiters: Iterable[Waiter] = (),
        ended: Mapping[str, float] | None = None,
        offsets: Mapping[str, float] | None = None,
        counts: Mapping[str, tuple[int, int]] | None = None,
        vtime: float = 0.0,
    ) -> FairScheduler:
        """A scheduler in the state a shared store keeps (a ledger other processes change too):
        the live ``holdings`` (each counted, held and charged as its :class:`Holding` says);
        the ``waiters`` in arrival order, their ``seq``,
        ``bypassed`` and ``lower_passes`` as kept; the token-seconds each tenant's ``ended``
        holdings took; each tenant's counter ``offsets`` (:meth:`offsets`: what lifts added);
        its (admitted, refused) ``counts``; the system virtual time ``vtime``. A tenant's
        token-seconds are its ended ones plus what its live holdings have held since they
        began, so the counters need no clock of the store's."""
        fair = cls(policy, usable=usable, now=now)
        fair.vtime = vtime
        for tenant in {*(ended or {}), *(offsets or {}), *(counts or {})}:
            fair._account(tenant)
        for holding in holdings:
            account = fair._account(holding.tenant)
            tokens = holding.tokens
            held = tokens if holding.held is None else holding.held
            rate = tokens if holding.rate is None else holding.rate
            hold = _Hold(tenant=holding.tenant, held=held, rate=rate, due=holding.due)
            fair._holds[holding.key] = account.holds[holding.key] = hold
            account.held += held
            account.rate += rate
            taken = holding.taken
            account.taken += tokens * max(0.0, now - holding.since) if taken is None else taken
        last = 0
        for waiter in waiters:
            account = fair._account(waiter.tenant)
            account.queues.setdefault(waiter.priority, deque()).append(waiter)
            fair.waiting += 1
            last = max(last, waiter.seq)
        fair._seq = itertools.count(last + 1)
        for name, account in fair._accounts.items():
            account.taken += (ended or {}).get(name, 0.0)
            account.counter = account.taken / account.weight + (offsets or {}).get(name, 0.0)
            account.admitted, account.refused = (counts or {}).get(name, (0, 0))
        return fair

    def offsets(self) -> dict[str, float]:
        """Each tenant's counter less its token-seconds over its weight: what lifts added (what
        a shared store keeps for :meth:`restore`)."""
        return {name: a.counter - a.taken / a.weight for name, a in self._accounts.items()}

    # --- time ----------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Charge every tenant what its holders held since the last call."""
        elapsed = now - self._at
        if elapsed <= 0:
            return
        self._at = now
        for account in self._accounts.values():
            if account.rate:
                spent = account.rate * elapsed
                account.taken += spent
                account.counter += spent / account.weight

    def _lift(self, account: _Account) -> float:
        """What lifting ``account`` to the system virtual time would add to its counter: it is
        becoming backlogged (nothing of its own waits), and its counter must not be below the
        start tag of the last waiter served, whoever else is active."""
        if account.queues:
            return 0.0
        return max(0.0, self.vtime - account.counter)

    # --- holders -------------------------------------------------------------------------------

    def hold(self, key: int, tenant: str, tokens: int, due: float, now: float) -> None:
        """A reservation of ``tokens`` for ``tenant`` was admitted, due to end by ``due``: it
        counts and is charged at ``tokens`` until :meth:`resize` says otherwise."""
        self.advance(now)
        name = self.resolve(tenant)
        account = self._account(name)
        hold = _Hold(tenant=name, held=tokens, rate=tokens, due=due)
        self._holds[key] = account.holds[key] = hold
        account.held += tokens
        account.rate += tokens
        account.admitted += 1

    def resize(self, key: int, *, held: int, rate: int, now: float) -> None:
        """The live reservation ``key`` counts for ``held`` tokens against its tenant's limit
        from ``now`` on (as the admission rule counts it), and holds ``rate`` tokens of KV in
        the engine (what it is charged per second): its progress was relayed. No-op when it is
        not held here."""
        hold = self._holds.get(key)
        if hold is None:
            return
        self.advance(now)
        account = self._accounts[hold.tenant]
        account.held += held - hold.held
        account.rate += rate - hold.rate
        hold.held, hold.rate = held, rate

    def release(self, key: int, now: float) -> None:
        """The reservation ``key`` was given back. Idempotent."""
        hold = self._holds.pop(key, None)
        if hold is None:
            return
        self.advance(now)
        account = self._accounts[hold.tenant]
        del account.holds[key]
        account.held -= hold.held
        account.rate -= hold.rate

    # --- waiters -------------------------------------------------------------------------------

    def enqueue(self, waiter: Waiter, now: float) -> list[Waiter]:
        """Queue ``waiter`` (its tenant resolved, lifted to the system virtual time when it had
        nothing waiting); returns those refused to keep the queue within ``max_queued``
        (``waiter`` itself, when it is the one to go, or its tenant keeps all its places)."""
        self.advance(now)
        waiter.tenant = self.resolve(waiter.tenant)
        account = self._account(waiter.tenant)
        places = self.policy.places(waiter.tenant)
        if places is not None and account.waiting >= places:
            waiter.refused = True
            return [waiter]
        account.counter += self._lift(account)
        waiter.seq = next(self._seq)
        account.queues.setdefault(waiter.priority, deque()).append(waiter)
        self.waiting += 1
        bound = self.policy.max_queued
        refused: list[Waiter] = []
        while bound is not None and self.waiting > bound:
            over = self._over_limit()
            victim = max(self._all(), key=lambda w: self._victim_key(w, over, now))
            self.remove(victim)
            victim.refused = True
            refused.append(victim)
        return refused

    def _over_limit(self) -> set[int]:
        """The waiters (by ``id``) whose tenant's holding and its waiters queued up to them, in
        arrival order, exceed its limit: none of them can go before its own holders end."""
        over: set[int] = set()
        for account in self._accounts.values():
            total = account.held
            for waiter in sorted(itertools.chain(*account.queues.values()), key=lambda w: w.seq):
                total += waiter.need
                if total > account.limit:
                    over.add(id(waiter))
        return over

    def count_refusal(self, tenant: str) -> None:
        """One of ``tenant``'s requests was refused (a 429), for its figures."""
        self._account(self.resolve(tenant)).refused += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out of the queue; False when it was not in it."""
        account = self._accounts.get(waiter.tenant)
        queue = account.queues.get(waiter.priority) if account is not None else None
        if account is None or queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del account.queues[waiter.priority]
        self.waiting -= 1
        return True

    def _all(self) -> Iterator[Waiter]:
        for account in self._accounts.values():
            for queue in account.queues.values():
                yield from queue

    @property
    def waiting_tokens(self) -> int:
        return sum(w.need for w in self._all())

    def _rank(self, waiter: Waiter, now: float) -> tuple[int, float, float, int]:
        account = self._account(waiter.tenant)
        return (waiter.priority, account.key(now), account.held / account.weight, waiter.seq)

    def _victim_key(
        self, waiter: Waiter, over: set[int], now: float
    ) -> tuple[bool, int, float, int]:
        key = self._account(waiter.tenant).key(now)
        return (id(waiter) in over, waiter.priority, key, waiter.seq)

    def order(self, now: float) -> list[Waiter]:
        """The candidates (the head of each tenant's queue of each class), first served first."""
        heads = [q[0] for a in self._accounts.values() for q in a.queues.values()]
        return sorted(heads, key=lambda w: self._rank(w, now))

    def ahead(self, waiter: Waiter, now: float) -> tuple[int, int]:
        """(requests, tokens) waiting ahead of ``waiter``, queued or not, in the order they
        would be served (within a tenant and class, by arrival)."""
        rank = self._rank(waiter, now)
        before = [w for w in self._all() if w is not waiter and self._rank(w, now) < rank]
        return len(before), sum(w.need for w in before)

    def tokens_ahead_of_newcomer(self, tenant: str, priority: int, now: float) -> int:
        """Tokens waiting ahead of a request ``tenant`` would send now (for its room)."""
        account = self._account(self.resolve(tenant))
        key = account.key(now) + self._lift(account)
        rank = (priority, key, account.held / account.weight, math.inf)
        return sum(w.need for w in self._all() if self._rank(w, now) < rank)

    def _within_limit(self, waiter: Waiter) -> bool:
        account = self._account(waiter.tenant)
        return account.limit >= self.usable or account.held + waiter.need <= account.limit

    def own_room_in(self, tenant: str, need: int, now: float) -> float:
        """Seconds until ``tenant``'s own holders, ending by their due times, leave it room for
        ``need`` more within its limit (0.0: now; infinity: never)."""
        account = self._account(self.resolve(tenant))
        held = account.held
        if held + need <= account.limit:
            return 0.0
        for hold in sorted(account.holds.values(), key=lambda h: h.due):
            held -= hold.held
            if held + need <= account.limit:
                return max(0.0, hold.due - now)
        return math.inf

    @staticmethod
    def _may_pass(skipped: Waiter, passer: Waiter, max_bypass: int) -> bool:
        if skipped.priority < passer.priority:
            return skipped.lower_passes < LOWER_CLASS_PASSES
        return skipped.bypassed < max_bypass

    def dispatch(
        self, now: float, try_admit: Callable[[Waiter], H | None]
    ) -> list[tuple[Waiter, H]]:
        """Admit what may be admitted now, in fair order: ``try_admit`` reserves for a waiter in
        the ledger (None: it does not fit). Returns the waiters admitted and their reservations,
        which are held here from then on."""
        self.advance(now)
        admitted: list[tuple[Waiter, H]] = []
        while True:
            chosen: tuple[Waiter, H] | None = None
            skipped: list[Waiter] = []
            for waiter in self.order(now):
                if not self._within_limit(waiter):
                    continue
                if not all(self._may_pass(s, waiter, self.policy.max_bypass) for s in skipped):
                    break
                handle = try_admit(waiter)
                if handle is not None:
                    chosen = (waiter, handle)
                    break
                skipped.append(waiter)
            if chosen is None:
                return admitted
            waiter, handle = chosen
            for passed in skipped:
                if passed.priority < waiter.priority:
                    passed.lower_passes += 1
                else:
                    passed.bypassed += 1
            # Its start tag: the system virtual time a tenant becoming backlogged is lifted to.
            self.vtime = max(self.vtime, self._account(waiter.tenant).counter)
            self.hold(handle.id, waiter.tenant, handle.reserved_tokens, handle.due_at, now)
            self.remove(waiter)
            admitted.append(chosen)

    # --- figures -------------------------------------------------------------------------------

    def stats(self, now: float) -> list[TenantStats]:
        """Every tenant seen so far, as of ``now``."""
        self.advance(now)
        return [
            TenantStats(
                tenant=name,
                weight=a.weight,
                held=a.held,
                token_seconds=a.taken,
                waiting=a.waiting,
                admitted=a.admitted,
                refused=a.refused,
            )
            for name, a in self._accounts.items()
        ]
