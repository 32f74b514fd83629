"""Fair shares on the shared ledger, on a real Redis: one fair order across gateway processes
(each its own lease, client and queue), tenants' limits and classes across them, token-seconds
charged whoever releases, overload refusals told to the waiter's own process, a dead gateway's
waiters swept, and the ledger back to zero whatever the interleaving."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import anyio
import pytest

from reference_server import Handle
from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.admission.queue import Rejected
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.fair import FairState, SharedFairQueue
from reference_server.shared_ledger.lease import Lease
from reference_server.shared_ledger.ledger import LedgerConflict, RedisLedger
from reference_server.shared_ledger.scripts import FAIR_SNAPSHOT
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import OPENED, anyio_backend, closing
from tests.unit.test_server_ledger import make

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name

POLICY = FairPolicy(
    tenants={"a": Tenant(weight=1.0), "b": Tenant(weight=1.0), "small": Tenant(max_share=0.25)}
)


async def gateway(
    server: RedisServer,
    policy: FairPolicy = POLICY,
    *,
    max_wait: float = 5.0,
    ttl: float = 5.0,
) -> SharedFairQueue:
    """One gateway process's fair queue on upstream ``u``: its own Redis client and lease."""
    pricing = make()  # 9,000 usable tokens, 100 tokens/s
    ledger = RedisLedger(
        connect(server.url), name="u", pricing=pricing, lease=Lease(ttl=ttl), fairness=policy
    )
    OPENED.append(ledger)
    await ledger.join()
    return SharedFairQueue(pricing, ledger, policy=policy, max_wait=max_wait)


async def state(queue: SharedFairQueue) -> FairState:
    return FairState(await queue.shared.run(FAIR_SNAPSHOT))


async def until(predicate: Callable[[], Awaitable[bool]], seconds: float = 5.0) -> None:
    """Wait, looking every 10 ms, until ``predicate`` holds (Redis tells no event to wait on)."""
    for _ in range(round(seconds / 0.01)):
        if await predicate():
            return
        await anyio.sleep(0.01)
    raise AssertionError(f"not within {seconds} s")


async def at_zero(queue: SharedFairQueue) -> None:
    now = await state(queue)
    assert (now.reserved, now.holders, now.queue, now.metas) == (0, {}, [], {})


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_release_in_one_gateway_admits_the_tenant_below_its_share_in_another(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    held = [await one.acquire(0, 2000, tenant="a") for _ in range(4)]  # 8,000 of 9,000
    order: list[str] = []
    handles: list[tuple[SharedFairQueue, Handle]] = []

    async def wait(queue: SharedFairQueue, tenant: str) -> None:
        handle = await queue.acquire(0, 2000, tenant=tenant)
        order.append(tenant)
        handles.append((queue, handle))

    async with anyio.create_task_group() as group:
        for _ in range(3):  # a's waiters first, in the gateway that holds its flood
            group.start_soon(wait, one, "a")
            await anyio.sleep(0.05)
        group.start_soon(wait, two, "b")  # b last, in another gateway
        await until(lambda: _waiting(one, 4))
        await one.release(held.pop())  # room for one: b, below its share, goes first
        await until(lambda: _sync(len(order) == 1))
        assert order == ["b"]
        for handle in held:
            await one.release(handle)
    assert order[0] == "b"
    for queue, handle in handles:
        await queue.release(handle)
    await at_zero(one)


async def _waiting(queue: SharedFairQueue, n: int) -> bool:
    return len((await state(queue)).queue) == n


async def _sync(value: bool) -> bool:
    return value


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_tenant_at_its_limit_across_gateways_waits_while_others_are_admitted(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    first = await one.acquire(0, 2000, tenant="small")  # 2,000 of its 2,250
    with pytest.raises(Rejected) as refused:
        await two.acquire(0, 1000, tenant="small", max_wait=0.2)  # over its share, elsewhere
    assert refused.value.room is not None
    assert refused.value.room.usable == 2250
    assert refused.value.retry_after >= 15.0  # its own holder's cap: 2,000 tokens at 100/s
    other = await two.acquire(0, 4000, tenant="b")  # room for others meanwhile
    assert two.headroom(holder=other).usable == 9000
    stats = {s.tenant: s for s in two.tenants()}
    assert stats["small"].held == 2000
    assert stats["small"].refused == 1
    await one.release(first)
    await two.release(other)
    await at_zero(one)


@pytest.mark.redis
@pytest.mark.anyio
async def test_an_interactive_request_goes_ahead_of_every_queued_batch_one_across_gateways(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    held = await one.acquire(0, 8500, tenant="a", priority=10)
    order: list[int] = []

    async def wait(queue: SharedFairQueue, priority: int) -> None:
        handle = await queue.acquire(0, 5000, tenant="a", priority=priority)  # one at a time
        order.append(priority)
        await anyio.sleep(0.05)
        await queue.release(handle)

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(wait, one, 10)  # batch
            await anyio.sleep(0.05)
        group.start_soon(wait, two, -10)  # interactive, last and elsewhere
        await until(lambda: _waiting(one, 4))
        await one.release(held)
    assert order[0] == -10
    await at_zero(one)


@pytest.mark.redis
@pytest.mark.anyio
async def test_under_overload_the_lowest_class_is_refused_in_its_own_gateway(
    redis_server: RedisServer, closing: None
) -> None:
    policy = FairPolicy(tenants=POLICY.tenants, max_queued=1)
    one, two = await gateway(redis_server, policy), await gateway(redis_server, policy)
    held = await one.acquire(0, 8500, tenant="a")
    outcome: list[str] = []

    async def batch() -> None:
        try:
            await one.acquire(0, 2000, tenant="a", priority=5)
        except Rejected:
            outcome.append("batch refused")

    async with anyio.create_task_group() as group:
        group.start_soon(batch)
        await until(lambda: _waiting(one, 1))
        group.start_soon(lambda: two.acquire(0, 2000, tenant="b", priority=0, max_wait=0.5))
        await until(lambda: _sync(outcome == ["batch refused"]))
        group.cancel_scope.cancel()
    await one.release(held)
    stats = {s.tenant: s for s in (await _fresh(one)).tenants()}
    assert stats["a"].refused == 1
    await at_zero(one)


async def _fresh(queue: SharedFairQueue) -> SharedFairQueue:
    await queue.refresh()
    return queue


@pytest.mark.redis
@pytest.mark.anyio
async def test_token_seconds_are_charged_whoever_releases(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    handle = await one.acquire(0, 1000, tenant="a")
    await anyio.sleep(0.5)
    await one.release(handle)
    stats = {s.tenant: s for s in (await _fresh(two)).tenants()}
    assert 400 <= stats["a"].token_seconds <= 1000 * 2.0  # 1,008 tokens for about 0.5 s
    assert stats["a"].held == 0
    assert stats["a"].admitted == 1


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_dead_gateways_holders_and_waiters_are_swept_and_charged(
    redis_server: RedisServer, closing: None
) -> None:
    dead = await gateway(redis_server, ttl=0.3)
    alive = await gateway(redis_server)
    await dead.acquire(0, 8500, tenant="a")

    async def waits() -> None:
        with pytest.raises(Rejected):
            await dead.acquire(0, 2000, tenant="a", max_wait=30)

    async with anyio.create_task_group() as group:
        group.start_soon(waits)
        await until(lambda: _waiting(alive, 1))
        group.cancel_scope.cancel()  # its process "dies": the lease is no longer renewed
    # (the cancelled waiter left its ticket; the lease sweeps whatever is left)
    handle = await alive.acquire(0, 8500, tenant="b", max_wait=3)
    stats = {s.tenant: s for s in alive.tenants()}
    assert stats["a"].held == 0
    assert stats["a"].token_seconds > 0
    await alive.release(handle)
    await at_zero(alive)


@pytest.mark.redis
@pytest.mark.anyio
async def test_gateways_with_different_fair_terms_cannot_share(
    redis_server: RedisServer, closing: None
) -> None:
    await gateway(redis_server)
    with pytest.raises(LedgerConflict):
        await gateway(redis_server, FairPolicy(tenants={"a": Tenant(weight=2.0)}))


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(3))
async def test_three_gateways_admit_release_and_leave_back_to_zero_within_every_limit(
    redis_server: RedisServer, closing: None, seed: int
) -> None:
    """Random requests from three gateways and three tenants (one limited to a quarter), some
    given up while waiting: after each commit no tenant holds past its limit and the budget is
    never overdrawn; at the end nothing is held, queued or remembered."""
    rng = random.Random(seed)
    policy = FairPolicy(tenants=POLICY.tenants, max_queued=12)
    queues = [await gateway(redis_server, policy, max_wait=2.0) for _ in range(3)]
    outcomes = {"admitted": 0, "refused": 0, "gave up": 0}
    breaches: list[str] = []

    async def check() -> None:
        now = await state(queues[0])
        held: dict[str, int] = {}
        for tokens, _, _, tenant in now.holders.values():
            held[tenant] = held.get(tenant, 0) + tokens
        if now.reserved > queues[0].ledger.usable_tokens:
            breaches.append(f"reserved {now.reserved}")
        for tenant, tokens in held.items():
            if tokens > queues[0].fair.limit(tenant):
                breaches.append(f"{tenant} holds {tokens}")

    async def one(i: int) -> None:
        queue = rng.choice(queues)
        tenant = rng.choice(["a", "b", "small"])
        cap = rng.choice([200, 800, 1500, 2000])
        give_up = rng.random() < 0.2
        with anyio.move_on_after(rng.uniform(0.05, 0.5) if give_up else 30) as scope:
            try:
                handle = await queue.acquire(0, cap, tenant=tenant, priority=rng.choice([0, 5]))
            except Rejected:
                outcomes["refused"] += 1
                return
            outcomes["admitted"] += 1
            try:
                await check()
                await anyio.sleep(rng.uniform(0.0, 0.15))
            finally:  # as the gateway does, whatever ends the request
                with anyio.CancelScope(shield=True):
                    await queue.release(handle)
        if scope.cancelled_caught:
            outcomes["gave up"] += 1

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for i in range(40):
                group.start_soon(one, i)
                await anyio.sleep(rng.uniform(0.0, 0.03))
    assert not breaches
    assert outcomes["admitted"] > 0
    await at_zero(queues[0])
    for queue in queues:
        assert queue.ledger.stats().reserved_tokens == 0


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_waiter_that_looks_again_and_still_does_not_fit_writes_nothing(
    redis_server: RedisServer, closing: None
) -> None:
    one = await gateway(redis_server)
    held = await one.acquire(0, 8500, tenant="a")
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: one.acquire(0, 2000, tenant="b", max_wait=1.0))
        await until(lambda: _waiting(one, 1))
        before = (await state(one)).version
        await anyio.sleep(0.3)  # it polls every 20 ms (no pub/sub here): about 15 looks
        assert (await state(one)).version == before  # others' decisions are never made stale
        group.cancel_scope.cancel()
    await one.release(held)
    await at_zero(one)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_newcomer_after_a_lull_starts_at_the_system_virtual_time_across_gateways(
    redis_server: RedisServer, closing: None
) -> None:
    """A holds most of the budget on one gateway, then again (its start tag is the system
    virtual time, kept in Redis), then goes: nobody is active. B arrives on another gateway and
    is lifted to that time all the same, so it cannot take every admission until its counter
    has caught up with A's."""
    one, two = await gateway(redis_server), await gateway(redis_server)
    first = await one.acquire(0, 8000, tenant="a")
    await anyio.sleep(0.3)  # A takes about 2,400 token-seconds
    await one.release(first)
    again = await one.acquire(0, 100, tenant="a")
    await one.release(again)
    vtime = (await state(one)).fair["vtime"]
    assert vtime >= 8000 * 0.3
    handle = await two.acquire(0, 100, tenant="b")
    assert (await state(two)).per_tenant("offset")["b"] == pytest.approx(vtime)
    await two.release(handle)
    await at_zero(one)
