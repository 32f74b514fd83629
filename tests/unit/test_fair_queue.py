"""The fair queue's waiting (asyncio and trio): who is woken with a reservation, what a refused
request is told, and that a waiter that goes away gives back what it was handed."""

from __future__ import annotations

import anyio
import pytest

from reference_server.admission.fair_queue import FairQueue
from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.admission.ledger import Handle, KVAdmissionController
from reference_server.admission.queue import Rejected


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _queue(policy: FairPolicy, max_wait: float = 5.0) -> FairQueue:
    ledger = KVAdmissionController(
        total_kv_tokens=1000, context_window=1000, decode_rate=100.0,
        safety_fraction=1.0, block_size=1,
    )  # fmt: skip
    return FairQueue(ledger, policy=policy, max_wait=max_wait, clock=_Clock())


POLICY = FairPolicy(tenants={"a": Tenant(max_share=0.5, max_queue_wait=0.0), "b": Tenant()})


@pytest.mark.anyio
async def test_a_tenant_at_its_limit_is_refused_with_its_own_room() -> None:
    queue = _queue(POLICY)
    held = [await queue.acquire(150, 100, tenant="a") for _ in range(2)]
    with pytest.raises(Rejected) as refused:
        await queue.acquire(150, 100, tenant="a")
    assert refused.value.room is not None
    assert refused.value.room.usable == 500
    assert refused.value.room.free == 0
    assert refused.value.retry_after >= 1.0  # its own holders' caps: 100 tokens at 100/s
    other = await queue.acquire(150, 100, tenant="b")  # others are admitted meanwhile
    assert queue.headroom(holder=other).usable == 1000
    for handle in [*held, other]:
        await queue.release(handle)
    assert queue.ledger.stats().reserved_tokens == 0


@pytest.mark.anyio
async def test_a_release_wakes_the_tenant_furthest_below_its_share() -> None:
    queue = _queue(POLICY)
    first = [await queue.acquire(150, 100, tenant="b") for _ in range(4)]  # 1000: full
    order: list[str] = []
    handles: list[Handle] = []

    async def wait(tenant: str, priority: int) -> None:
        handle = await queue.acquire(150, 100, tenant=tenant, priority=priority)
        order.append(f"{tenant}{priority}")
        handles.append(handle)

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(wait, "b", 0)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(wait, "x", 0)  # unknown: the default tenant, newly active
        group.start_soon(wait, "b", -1)  # a higher class
        await anyio.wait_all_tasks_blocked()
        assert queue.waiting == 5
        for handle in first:
            await queue.release(handle)
            await anyio.wait_all_tasks_blocked()
        while len(order) < 5 or handles:
            await queue.release(handles.pop())
            await anyio.wait_all_tasks_blocked()
    assert order[:2] == ["b-1", "x0"]
    assert queue.ledger.stats().reserved_tokens == 0


@pytest.mark.anyio
async def test_a_waiter_that_times_out_leaves_nothing_behind() -> None:
    queue = _queue(POLICY, max_wait=0.05)
    held = [await queue.acquire(150, 100, tenant="b") for _ in range(4)]
    with pytest.raises(Rejected) as refused:
        await queue.acquire(150, 100, tenant="x")
    assert refused.value.queued_ahead == 0
    assert queue.waiting == 0
    for handle in held:
        await queue.release(handle)
    assert queue.ledger.stats().reserved_tokens == 0
    assert all(s.held == 0 for s in queue.tenants())
