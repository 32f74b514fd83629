"""The fair scheduler (pure): shares by weighted KV token-seconds, limits, classes, no starvation;
driven against a real ledger on a clock of the test's own."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.admission.fairness import (
    DEFAULT_TENANT,
    FairPolicy,
    FairScheduler,
    Tenant,
    Waiter,
)
from reference_server.admission.ledger import Handle, KVAdmissionController

USABLE = 1000


def _ledger() -> KVAdmissionController:
    return KVAdmissionController(
        total_kv_tokens=USABLE, context_window=USABLE, decode_rate=100.0,
        safety_fraction=1.0, block_size=1,
    )  # fmt: skip


def _admit(ledger: KVAdmissionController, now: float) -> Callable[[Waiter], Handle | None]:
    """Reserve for a waiter: half its need is its output cap (due at 100 tokens/s)."""

    def attempt(waiter: Waiter) -> Handle | None:
        cap = waiter.need // 2
        return ledger.try_admit(waiter.need - cap, cap, now=now, need=waiter.need)

    return attempt


class _Sim:
    """Tenants that keep ``depth`` requests waiting each; every request holds for ``hold`` s."""

    def __init__(self, policy: FairPolicy, *, hold: float = 1.0) -> None:
        self.ledger = _ledger()
        self.fair = FairScheduler(policy, usable=USABLE)
        self.hold = hold
        self.now = 0.0
        self.ends: list[tuple[float, int, Handle]] = []
        self.order: list[str] = []

    def send(self, tenant: str, need: int, priority: int = 0) -> Waiter:
        waiter = Waiter(tenant=tenant, need=need, priority=priority)
        self.fair.enqueue(waiter, self.now)
        return waiter

    def dispatch(self) -> list[tuple[Waiter, Handle]]:
        admitted = self.fair.dispatch(self.now, _admit(self.ledger, self.now))
        for waiter, handle in admitted:
            self.order.append(waiter.tenant)
            heapq.heappush(self.ends, (self.now + self.hold, handle.id, handle))
        return admitted

    def release_next(self) -> Handle:
        self.now, _, handle = heapq.heappop(self.ends)
        self.ledger.release(handle, self.now)
        self.fair.release(handle.id, self.now)
        return handle

    def taken(self) -> dict[str, float]:
        return {s.tenant: s.token_seconds for s in self.fair.stats(self.now)}


def test_a_tenant_alone_takes_the_whole_budget() -> None:
    sim = _Sim(FairPolicy(tenants={"a": Tenant(weight=1.0), "b": Tenant(weight=3.0)}))
    for _ in range(12):
        sim.send("a", 100)
    assert len(sim.dispatch()) == 10
    assert sim.ledger.stats().reserved_tokens == USABLE


def test_unknown_tenants_share_the_default() -> None:
    fair = FairScheduler(FairPolicy(tenants={"a": Tenant()}), usable=USABLE)
    waiter = Waiter(tenant="stranger", need=10)
    fair.enqueue(waiter, 0.0)
    assert waiter.tenant == DEFAULT_TENANT
    assert {s.tenant for s in fair.stats(0.0)} == {DEFAULT_TENANT}


@pytest.mark.parametrize(("weights", "sizes"), [((3.0, 1.0), (100, 100)), ((1.0, 1.0), (250, 50))])
def test_saturating_tenants_share_token_seconds_by_weight(
    weights: tuple[float, float], sizes: tuple[int, int]
) -> None:
    """Both keep requests waiting; their token-seconds follow the weights, whatever the sizes."""
    policy = FairPolicy(tenants={"a": Tenant(weight=weights[0]), "b": Tenant(weight=weights[1])})
    sim = _Sim(policy)
    for _ in range(20):
        sim.send("a", sizes[0])
        sim.send("b", sizes[1])
    sim.dispatch()
    for _ in range(2000):
        handle = sim.release_next()
        tenant = "a" if handle.reserved_tokens == sizes[0] and sizes[0] != sizes[1] else None
        if tenant is None:  # same sizes: the scheduler knows whose it was
            tenant = sim.order[handle.id - 1]
        sim.send(tenant, sizes[0] if tenant == "a" else sizes[1])
        sim.dispatch()
    taken = sim.taken()
    assert taken["a"] / taken["b"] == pytest.approx(weights[0] / weights[1], rel=0.05)


def _a_ran_alone_for_100_s() -> _Sim:
    """Tenants A and B of equal weight; A has kept 10 requests in flight alone for 100 s."""
    sim = _Sim(FairPolicy(tenants={"a": Tenant(), "b": Tenant()}))
    for _ in range(10):
        sim.send("a", 100)
    sim.dispatch()
    for _ in range(1000):
        sim.release_next()
        sim.send("a", 100)
        sim.dispatch()
    return sim


def test_a_newly_active_tenant_does_not_bank_its_idle_time() -> None:
    """A ran alone for 100 s; B arrives and both saturate: B is lifted to A's counter, so the
    next admissions alternate instead of all going to B until it has caught up."""
    sim = _a_ran_alone_for_100_s()
    start = len(sim.order)
    for _ in range(10):
        sim.send("b", 100)
    for _ in range(40):
        sim.release_next()
        sim.send(sim.order[-1], 100)
        sim.dispatch()
    recent = sim.order[start:]
    assert 15 <= recent.count("b") <= 25, recent


def test_a_light_tenant_goes_first_when_a_flooding_one_releases() -> None:
    sim = _Sim(FairPolicy(tenants={"a": Tenant(), "b": Tenant()}))
    for _ in range(40):
        sim.send("a", 100)
    sim.dispatch()
    sim.now = 0.5
    sim.send("b", 10)
    sim.dispatch()
    sim.release_next()
    assert next(w.tenant for w, _ in sim.dispatch()) == "b"


def test_a_tenant_at_its_limit_waits_while_others_are_admitted() -> None:
    policy = FairPolicy(tenants={"a": Tenant(max_share=0.3), "b": Tenant()})
    sim = _Sim(policy)
    for _ in range(5):
        sim.send("a", 100)
    sim.send("b", 100)
    admitted = sim.dispatch()
    assert sorted(w.tenant for w, _ in admitted) == ["a", "a", "a", "b"]
    assert sim.fair.held("a") == 300
    assert sim.fair.own_room_in("a", 100, sim.now) == pytest.approx(0.5)  # 50 tokens at 100/s
    assert sim.fair.never_within("a", 301)


def test_a_big_head_is_passed_a_bounded_number_of_times_then_holds_the_rest_back() -> None:
    policy = FairPolicy(tenants={"big": Tenant(), "small": Tenant()}, max_bypass=3)
    sim = _Sim(policy)
    for _ in range(9):  # 900 held
        sim.send("small", 100)
    sim.dispatch()
    big = sim.send("big", 500)
    for _ in range(20):
        sim.send("small", 100)
    passes = 0
    while True:
        sim.release_next()
        admitted = sim.dispatch()
        if any(w is big for w, _ in admitted):
            break
        passes += len(admitted)
    assert big.bypassed == 3
    assert passes == 3


def test_a_higher_class_goes_first_and_a_lower_one_passes_it_once() -> None:
    sim = _Sim(FairPolicy(tenants={"a": Tenant(), "b": Tenant()}))
    for _ in range(10):
        sim.send("a", 100, priority=5)
    sim.dispatch()
    for _ in range(5):
        sim.send("a", 100, priority=5)
    urgent = sim.send("b", 200, priority=0)  # does not fit one release's room
    sim.release_next()
    assert [w.priority for w, _ in sim.dispatch()] == [5]  # the one pass allowed
    assert urgent.lower_passes == 1
    sim.release_next()
    assert sim.dispatch() == []  # the room is kept for it
    sim.release_next()
    assert [w for w, _ in sim.dispatch()] == [urgent]


def test_under_overload_the_lowest_class_is_refused_first() -> None:
    sim = _Sim(FairPolicy(tenants={"a": Tenant(), "b": Tenant()}, max_queued=3))
    for _ in range(10):
        sim.send("a", 100, priority=5)
    sim.dispatch()
    batch = [sim.send("a", 100, priority=5) for _ in range(3)]
    urgent = Waiter(tenant="b", need=100, priority=0)
    refused = sim.fair.enqueue(urgent, sim.now)
    assert refused == [batch[-1]]
    assert batch[-1].refused
    lowest = Waiter(tenant="b", need=100, priority=9)
    assert sim.fair.enqueue(lowest, sim.now) == [lowest]  # the newcomer itself, lowest of all
    assert sim.fair.ahead(urgent, sim.now) == (0, 0)
    assert sim.fair.ahead(batch[0], sim.now) == (1, 100)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from("abcx"), st.integers(1, 600), st.integers(0, 2)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("leave"), st.integers(0, 50)),
        st.tuples(st.just("wait"), st.floats(0.0, 5.0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, max_queued=st.one_of(st.none(), st.integers(1, 6)))
def test_the_ledger_returns_to_zero_and_no_tenant_exceeds_its_limit(
    ops: list[tuple[object, ...]], max_queued: int | None
) -> None:
    policy = FairPolicy(
        tenants={
            "a": Tenant(weight=3.0, max_share=0.5),
            "b": Tenant(weight=1.0, max_share=0.8),
            "c": Tenant(weight=0.5),
        },
        default=Tenant(max_share=0.3),
        max_queued=max_queued,
        max_bypass=2,
    )
    ledger = _ledger()
    fair = FairScheduler(policy, usable=USABLE)
    now = 0.0
    live: list[Handle] = []
    queued: list[Waiter] = []

    def check() -> None:
        stats = fair.stats(now)
        assert sum(s.held for s in stats) == ledger.stats().reserved_tokens
        for s in stats:
            assert s.held <= fair.limit(s.tenant)
        assert fair.waiting == len(queued)

    for op in ops:
        if op[0] == "send":
            _, tenant, need, priority = op
            waiter = Waiter(tenant=str(tenant), need=int(need), priority=int(priority))  # type: ignore[call-overload]
            queued.append(waiter)
            for gone in fair.enqueue(waiter, now):
                queued.remove(gone)
        elif op[0] == "release" and live:
            handle = live.pop(int(op[1]) % len(live))  # type: ignore[call-overload]
            ledger.release(handle, now)
            fair.release(handle.id, now)
        elif op[0] == "leave" and queued:
            waiter = queued.pop(int(op[1]) % len(queued))  # type: ignore[call-overload]
            assert fair.remove(waiter)
        elif op[0] == "wait":
            now += float(op[1])  # type: ignore[arg-type]
        for waiter, handle in fair.dispatch(now, _admit(ledger, now)):
            queued.remove(waiter)
            live.append(handle)
        check()
    for handle in live:
        ledger.release(handle, now)
        fair.release(handle.id, now)
    for waiter in queued:
        fair.remove(waiter)
    assert ledger.stats().reserved_tokens == 0
    assert all(s.held == 0 and s.waiting == 0 for s in fair.stats(now))
    assert fair.waiting == 0
    assert fair.waiting_tokens == 0
    assert all(math.isfinite(s.token_seconds) for s in fair.stats(now))


# --- hostile and after-a-lull cases --------------------------------------------------------------


def test_a_tenant_back_after_a_pause_is_level_with_a_newcomer() -> None:
    """A ran alone for 100 s, then paused (nobody active); B arrives, then A is back: both are
    lifted to the system virtual time (the last start tag served), so they share from there on
    instead of B taking every admission until its counter has caught up with A's 100 s."""
    sim = _a_ran_alone_for_100_s()
    while sim.ends:  # A pauses: every one of its holders ends, nothing waits
        sim.release_next()
    assert all(s.held == 0 and s.waiting == 0 for s in sim.fair.stats(sim.now))
    sim.now += 50.0
    start = len(sim.order)
    for _ in range(10):
        sim.send("b", 100)
    sim.dispatch()
    for _ in range(10):
        sim.send("a", 100)
    for _ in range(60):
        sim.release_next()
        sim.send(sim.order[-1], 100)
        sim.send("a" if sim.order[-1] == "b" else "b", 100)
        sim.dispatch()
    recent = sim.order[start + 10 :]
    assert 0.4 <= recent.count("a") / len(recent) <= 0.6, recent


def test_a_newcomer_alone_starts_at_the_system_virtual_time() -> None:
    fair = FairScheduler(FairPolicy(tenants={"a": Tenant(), "b": Tenant()}), usable=USABLE)
    ledger = _ledger()
    fair.enqueue(Waiter(tenant="a", need=100), 0.0)
    [(_, handle)] = fair.dispatch(0.0, _admit(ledger, 0.0))
    fair.release(handle.id, 100.0)  # A held 100 tokens for 100 s: 10,000 token-seconds
    ledger.release(handle, 100.0)
    fair.enqueue(Waiter(tenant="a", need=100), 200.0)
    fair.dispatch(200.0, _admit(ledger, 200.0))
    assert fair.vtime == pytest.approx(10_000)
    newcomer = Waiter(tenant="b", need=100)
    fair.enqueue(newcomer, 300.0)  # nobody waits: B is lifted all the same
    assert fair.offsets()["b"] == pytest.approx(10_000)


def test_a_waiter_within_its_limit_is_never_refused_for_one_over_its_limit() -> None:
    """max_queued 2: chat's two waiters are within its limit; batch, at its limit and granted
    the most urgent class there is, sends two more: they are refused, not chat's."""
    policy = FairPolicy(
        tenants={"chat": Tenant(), "batch": Tenant(max_share=0.5, priorities=(-1000, 0))},
        max_queued=2,
    )
    sim = _Sim(policy)
    for tenant in ("batch",) * 5 + ("chat",) * 5:
        sim.send(tenant, 100)
        sim.dispatch()  # the budget fills: batch holds its 500, chat 500
    chat = [sim.send("chat", 100) for _ in range(2)]
    flood = [Waiter(tenant="batch", need=100, priority=-1000) for _ in range(2)]
    for waiter in flood:
        assert sim.fair.enqueue(waiter, sim.now) == [waiter]
    assert not any(w.refused for w in chat)
    assert sim.fair.waiting == 2


def test_a_tenant_keeps_at_most_its_share_of_the_places() -> None:
    policy = FairPolicy(tenants={"chat": Tenant(), "flood": Tenant(max_share=0.3)}, max_queued=10)
    sim = _Sim(policy)
    for _ in range(10):
        sim.send("chat", 100)
    sim.dispatch()  # the budget is full
    flood = [Waiter(tenant="flood", need=10) for _ in range(5)]
    refused = [w for waiter in flood for w in sim.fair.enqueue(waiter, sim.now)]
    assert refused == flood[3:]  # 3 places: 30 % of 10
    assert [w for w in (sim.send("chat", 100) for _ in range(7)) if w.refused] == []


def test_a_holder_is_charged_what_it_holds_and_counted_as_the_rule_counts_it() -> None:
    """Admitted, it counts and is charged whole; its progress then says what it counts for
    (``held``) and what it holds in the engine (``rate``); an early end stops its charge."""
    fair = FairScheduler(FairPolicy(tenants={"a": Tenant(max_share=0.5)}), usable=USABLE)
    fair.hold(1, "a", 400, due=10.0, now=0.0)
    assert fair.held("a") == 400
    fair.resize(1, held=120, rate=110, now=1.0)  # 1 s at 400, then prompt 100 + 10 made
    assert fair.held("a") == fair.holding(1) == 120
    assert not fair.never_within("a", 380)
    assert fair.own_room_in("a", 380, 1.0) == 0.0
    fair.resize(1, held=140, rate=130, now=3.0)  # 2 s at 110
    fair.release(1, 4.0)  # stopped early: 1 s at 130, and nothing after
    [stats] = fair.stats(100.0)
    assert stats.token_seconds == pytest.approx(400 + 220 + 130)
    assert stats.held == 0
    fair.resize(1, held=1, rate=1, now=200.0)  # a late count of a holder gone: nothing
    assert fair.stats(300.0)[0].token_seconds == pytest.approx(750)


def test_a_tenant_allowed_the_whole_budget_is_held_back_by_the_budget_alone() -> None:
    """Under the peak rule a tenant's holders may count for nearly the whole budget now while
    they are about to end, and the budget admit newcomers beside those ends: a tenant allowed
    the whole budget takes its turn all the same (counted against a limit of the whole budget,
    it would leave every such room to the others). A tenant allowed a share is held to it."""
    policy = FairPolicy(
        tenants={"a": Tenant(weight=3.0), "b": Tenant(), "c": Tenant(max_share=0.5)}
    )
    fair = FairScheduler(policy, usable=USABLE)
    fair.hold(1, "a", 900, due=1.0, now=0.0)  # held now; the budget's rule knows it ends soon
    fair.hold(2, "c", 450, due=1.0, now=0.0)
    waiters = [Waiter(tenant=t, need=200) for t in ("a", "b", "c")]
    for waiter in waiters:
        fair.enqueue(waiter, 0.0)
    ids = iter(range(10, 20))

    def fits(waiter: Waiter) -> Handle | None:  # the budget's rule lets every one in
        return Handle(
            id=next(ids), prompt_tokens=0, output_cap=waiter.need,
            reserved_tokens=waiter.need, admitted_at=0.0, due_at=2.0,
        )  # fmt: skip

    admitted = [w.tenant for w, _ in fair.dispatch(0.0, fits)]
    assert sorted(admitted) == ["a", "b"]  # c, at its half, waits for its own holder
    assert fair.held("a") == 1100 > USABLE
