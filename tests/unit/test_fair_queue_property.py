"""The fair queue (async) under any interleaving of tenants' requests: sent in steps, some
refused under overload or at once (no wait allowed), some timing out, some cancelled while they
wait or while they hold. The ledger returns to zero once every task has ended, no tenant ever
holds more than its limit, nothing waits that could go, and every acquire ends.

The steps are the test's own: each one moves the queue's clock (the ledger's due times and the
scheduler's token-seconds), wakes the tasks due then, cancels those due then, and waits until
every task is blocked again before checking. The waits themselves are bounded in the event
loop's time (the queue's ``anyio.move_on_after``), which runs on trio's mock clock: it jumps
to the next deadline once every task is blocked, so a few steps pause (in that time) to let
some of them run out, and the bounds on the whole (``fail_after``) fail only a task that would
wait for ever, however loaded the machine."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import anyio.lowlevel
from hypothesis import event, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from reference_server.admission.fair_queue import FairQueue
from reference_server.admission.fairness import DEFAULT_TENANT, FairPolicy, Tenant
from reference_server.admission.ledger import Handle, KVAdmissionController
from reference_server.admission.queue import Rejected

USABLE = 1000
#: The queue's own bound on a wait, in the loop's (mock) seconds: short, so a request that
#: never fits (more than its tenant's limit) ends in a few steps.
MAX_WAIT = 0.05


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class _Request:
    tenant: str  # "x" is not listed: the default tenant
    priority: int
    prompt: int
    cap: int
    start: int  # the step it is sent at
    max_wait: float | None  # the client's own bound (Prefer: wait), the loop's seconds
    hold: int  # steps it holds once admitted
    cancel_after: int | None  # steps after it is sent, its task is cancelled (waiting or not)


_TENANTS = st.builds(
    Tenant,
    weight=st.sampled_from([0.5, 1.0, 3.0]),
    max_share=st.sampled_from([0.3, 0.5, 0.8, 1.0]),
    max_queue_wait=st.sampled_from([None, None, 0.0, 0.02]),
)


@st.composite
def _policies(draw: st.DrawFn) -> FairPolicy:
    names = draw(st.sampled_from([("a", "b"), ("a", "b", "c")]))
    return FairPolicy(
        tenants={name: draw(_TENANTS) for name in names},
        default=draw(_TENANTS),
        max_queued=draw(st.one_of(st.none(), st.integers(1, 4))),
        max_bypass=draw(st.integers(0, 3)),
    )


_REQUESTS = st.lists(
    st.builds(
        _Request,
        tenant=st.sampled_from("abcx"),
        priority=st.sampled_from([0, 1, 2]),
        prompt=st.integers(1, 400),
        cap=st.integers(1, 300),
        start=st.integers(0, 6),
        max_wait=st.sampled_from([None, None, None, 0.0, 0.01]),
        hold=st.integers(0, 3),
        cancel_after=st.one_of(st.none(), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=14,
)

#: Each step: how far the queue's clock moves (seconds), how long the step pauses in the loop's
#: time, and whether the tasks cancelled then are cancelled before those due then are woken.
_STEPS = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.05, 0.5, 2.0]),
        st.sampled_from([0.0, 0.0, 0.0, 0.01]),
        st.booleans(),
    ),
    min_size=1,
    max_size=14,
)


class _Steps:
    """The step counter the tasks wait on, and how many times they have moved on."""

    def __init__(self) -> None:
        self.now = 0
        self.moves = 0
        self._next = anyio.Event()

    async def until(self, step: int) -> None:
        while self.now < step:
            await self._next.wait()
        self.moves += 1

    async def settle(self) -> None:
        """Until the tasks stop moving (anyio's ``wait_all_tasks_blocked`` polls every 0.1 s on
        asyncio: far longer than the waits here)."""
        still = 0
        while still < 3:
            before = self.moves
            await anyio.lowlevel.checkpoint()
            still = still + 1 if self.moves == before else 0

    def advance(self) -> None:
        self.now += 1
        woken, self._next = self._next, anyio.Event()
        woken.set()


def _check(queue: FairQueue, names: list[str]) -> None:
    """What holds at every moment: no tenant above its limit, the ledger within its budget, and
    the scheduler's holders the ledger's."""
    stats = queue.ledger.stats()
    assert stats.reserved_tokens <= stats.usable_tokens
    for name in names:
        assert 0 <= queue.fair.held(name) <= queue.fair.limit(name), name
    assert sum(queue.fair.held(name) for name in names) == stats.reserved_tokens
    assert queue.waiting >= 0


async def _drive(
    policy: FairPolicy, requests: list[_Request], steps: list[tuple[float, float, bool]]
) -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=USABLE, context_window=USABLE, decode_rate=100.0,
        safety_fraction=1.0, block_size=1,
    )  # fmt: skip
    clock = _Clock()
    queue = FairQueue(ledger, policy=policy, max_wait=MAX_WAIT, clock=clock)
    names = [*policy.tenants, DEFAULT_TENANT]
    counter = _Steps()
    scopes = [anyio.CancelScope() for _ in requests]
    outcomes: list[str | None] = [None] * len(requests)
    handed = 0
    ended = 0

    async def run(i: int, request: _Request) -> None:
        nonlocal ended
        try:
            await attempt(i, request)
        finally:
            counter.moves += 1
            ended += 1

    async def attempt(i: int, request: _Request) -> None:
        nonlocal handed
        with scopes[i]:
            await counter.until(request.start)
            try:
                with anyio.fail_after(2.0):  # a waiter's bound is MAX_WAIT at most
                    handle: Handle = await queue.acquire(
                        request.prompt,
                        request.cap,
                        tenant=request.tenant,
                        priority=request.priority,
                        max_wait=request.max_wait,
                    )
            except Rejected:
                counter.moves += 1
                outcomes[i] = "refused"
                _check(queue, names)
                return
            counter.moves += 1
            handed += 1
            outcomes[i] = "admitted"
            assert handle.reserved_tokens == request.prompt + request.cap
            assert queue.fair.tenant_of(handle.id) == policy.resolve(request.tenant)
            _check(queue, names)
            try:
                await counter.until(counter.now + request.hold)
            finally:
                await queue.release(handle)  # as the server does: in a finally, unshielded
                _check(queue, names)
        if outcomes[i] is None:
            assert scopes[i].cancel_called
            outcomes[i] = "cancelled while waiting"
        elif scopes[i].cancelled_caught:
            outcomes[i] = "cancelled while holding"

    def cancel_due(step: int) -> None:
        for request, scope in zip(requests, scopes, strict=True):
            if request.cancel_after is not None and request.start + request.cancel_after == step:
                scope.cancel()

    async def step(moved: float, pause: float, cancel_first: bool) -> None:
        clock.now += moved
        # Keys move with time (a holder past its due time): the queue admits on events only,
        # so the step itself is one, and the check below is about events at one time.
        queue.notify()
        due = counter.now + 1
        if cancel_first:
            cancel_due(due)
            counter.advance()
        else:  # the step's releases first: a cancelled waiter may be admitted as it goes
            counter.advance()
            cancel_due(due)
        if pause:
            await anyio.sleep(pause)
        await counter.settle()
        _check(queue, names)
        admitted = queue.ledger.stats().admitted_total
        queue.notify()
        assert queue.ledger.stats().admitted_total == admitted, "a waiter that could go waited"

    with anyio.fail_after(5.0):
        async with anyio.create_task_group() as group:
            for i, request in enumerate(requests):
                group.start_soon(run, i, request)
            await counter.settle()
            for moved, pause, cancel_first in steps:
                await step(moved, pause, cancel_first)
            while ended < len(requests):  # the rest: holders end, waiters are admitted or time out
                await step(0.1, 0.002, False)

    stats = queue.ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.released_total == stats.admitted_total
    assert all(queue.fair.held(name) == 0 for name in names)
    assert all(s.held == 0 and s.waiting == 0 for s in queue.tenants())
    assert queue.waiting == 0
    assert queue.waiting_tokens == 0
    for outcome in outcomes:
        event(f"outcome: {outcome}")
    if stats.admitted_total > handed:
        event("admitted as it went away, and given back")


@settings(max_examples=100, deadline=None)  # the give-back race: a few % of examples only
@given(policy=_policies(), requests=_REQUESTS, steps=_STEPS)
def test_every_task_ends_and_the_ledger_returns_to_zero(
    policy: FairPolicy, requests: list[_Request], steps: list[tuple[float, float, bool]]
) -> None:
    anyio.run(
        _drive, policy, requests, steps, backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )  # fmt: skip


def test_a_waiter_cancelled_as_it_is_admitted_gives_its_reservation_back() -> None:
    """The path the property reaches now and then, every time: the waiter's cancellation is on
    its way when a release hands it a reservation."""

    async def main() -> None:
        ledger = KVAdmissionController(
            total_kv_tokens=USABLE, context_window=USABLE, decode_rate=100.0,
            safety_fraction=1.0, block_size=1,
        )  # fmt: skip
        queue = FairQueue(ledger, policy=FairPolicy(), max_wait=5.0, clock=_Clock())
        held = await queue.acquire(600, 300)
        scope = anyio.CancelScope()
        handed: list[Handle] = []

        async def wait() -> None:
            with scope:
                handed.append(await queue.acquire(200, 100))

        async with anyio.create_task_group() as group:
            group.start_soon(wait)
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            assert queue.waiting == 1
            scope.cancel()  # the waiter is to go away...
            await queue.release(held)  # ...and is handed a reservation before it runs
            assert queue.waiting == 0
            assert ledger.stats().reserved_tokens == 300
        assert handed == []
        stats = ledger.stats()
        assert (stats.admitted_total, stats.released_total, stats.reserved_tokens) == (2, 2, 0)
        assert queue.fair.held("default") == 0

    anyio.run(main, backend="asyncio")
