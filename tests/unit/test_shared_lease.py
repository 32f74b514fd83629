"""The lease on a real Redis: renewed from a thread of its own while the event loop is blocked,
left to lapse once the loop has been wedged past its bound, a lapse that puts back the holders
still live (in Redis and in the gateway's mirror) instead of ending them, and no thread left
behind."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest
import redis

from reference_server.shared_ledger.connection import close_sync, connect, connect_sync
from reference_server.shared_ledger.lease import Lease
from reference_server.shared_ledger.ledger import RedisLedger
from reference_server.shared_ledger.queue import SharedQueue
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for
from tests.helpers.shared_ledgers import OPENED, anyio_backend, closing
from tests.unit.test_shared_peak import pricing

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name


pytestmark = [pytest.mark.redis, pytest.mark.anyio]

LEASES = "{kvclient:u}:leases"
PROGRESS = "{kvclient:u}:progress"
PREFIXES = "{kvclient:u}:prefixes"


async def gateway(
    server: RedisServer, *, ttl: float = 5.0, stall_limit: float | None = None
) -> RedisLedger:
    """One gateway process's shared ledger of upstream ``u`` (the peak rule)."""
    lease = Lease(ttl=ttl, stall_limit=stall_limit)
    ledger = RedisLedger(connect(server.url), name="u", pricing=pricing(), lease=lease)
    OPENED.append(ledger)
    await ledger.join()
    return ledger


def lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvclient-lease-")]


@asynccontextmanager
async def renewing(ledger: RedisLedger, server: RedisServer) -> AsyncIterator[redis.Redis]:
    """``ledger``'s lease renewed as a gateway renews it (:meth:`Lease.run`) while inside;
    yields a synchronous client of the test's own. No thread is left once out."""
    client = connect_sync(server.url)
    renewal = connect_sync(server.url)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(ledger.lease.run, renewal)
            yield client
            group.cancel_scope.cancel()
    finally:
        close_sync(renewal)
        close_sync(client)
    assert lease_threads() == []


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate`` holds; fail after 10 seconds or more."""
    for _ in range(1000):
        if predicate():
            return
        await anyio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def expiry(client: redis.Redis, ledger: RedisLedger) -> float | None:
    """When the lease expires (ms of the Redis clock), None when Redis does not have it."""
    score: float | None = client.zscore(LEASES, ledger.lease.id)
    return score


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


async def test_a_loop_blocked_longer_than_the_lease_keeps_it_and_its_holder(
    redis_server: RedisServer, closing: None
) -> None:
    ttl = 1.5  # a stall of the renewal thread itself past it would lapse it (a loaded CI)
    # The bound far away: this is the thread renewing while the loop does not step.
    ledger = await gateway(redis_server, ttl=ttl, stall_limit=60)
    other = await gateway(redis_server)
    handle = await ledger.try_admit(100, 4000)
    assert handle is not None
    async with renewing(ledger, redis_server) as client:
        await until(lambda: lease_threads() != [])
        # The loop blocked (a synchronous wait, as in a busy process) for twice the lease, and
        # until the thread has renewed it twice meanwhile.
        seen = {expiry(client, ledger)}
        start = time.monotonic()

        def renewed_past_the_lease() -> bool:
            seen.add(expiry(client, ledger))
            return time.monotonic() - start > 2 * ttl and len(seen) >= 3

        wait_for(renewed_past_the_lease, timeout=30)
        assert (expiry(client, ledger) or 0) > redis_now(client)
        # The loop steps again: nothing was swept, nothing is put back.
        assert await other.load() == (handle.reserved_tokens, 1)
        await anyio.lowlevel.checkpoint()  # what the thread handed the loop meanwhile, if any
        await ledger.lease.tend()
        assert ledger.lease.lapsed_total == 0
        assert not handle.released
    await ledger.release(handle)
    assert await other.load() == (0, 0)


async def test_a_loop_wedged_past_its_bound_loses_its_lease_and_puts_back_on_its_return(
    redis_server: RedisServer, closing: None
) -> None:
    ledger = await gateway(redis_server, ttl=0.3, stall_limit=0.6)
    other = await gateway(redis_server)
    handle = await ledger.try_admit(100, 4000)
    assert handle is not None
    async with renewing(ledger, redis_server) as client:
        await until(lambda: lease_threads() != [])
        # A loaded machine may stall the renewal thread past so short a lease before the wedge
        # (a lapse put back at once): the wedge's own lapse is the one after those.
        earlier = ledger.lease.lapsed_total
        # Wedged: the loop does not step until the lease has expired in Redis (the thread
        # stopped renewing it once the heartbeat was older than the bound).
        wait_for(lambda: (expiry(client, ledger) or 0) < redis_now(client), timeout=30)
        assert await other.load() == (0, 0)  # swept: a dead process's holdings come back
        # The loop steps again: its heartbeat resumes, the thread renews, finds the lease
        # lapsed, and the loop puts back what it still holds.
        await until(lambda: ledger.lease.lapsed_total > earlier)
        # Counted when the thread's answer reached the loop; put back at the loop's next tend.
        for _ in range(1000):
            if await other.load() == (handle.reserved_tokens, 1):
                break
            await anyio.sleep(0.01)
        assert await other.load() == (handle.reserved_tokens, 1)
        assert not handle.released
    await ledger.release(handle)
    assert await other.load() == (0, 0)


async def test_a_lapse_puts_back_the_live_holders_with_their_records_and_mirror(
    redis_server: RedisServer, closing: None
) -> None:
    ledger = await gateway(redis_server)
    other = await gateway(redis_server)
    ledger.pricing.shares_prefixes = True
    prompt = list(range(200))  # 12 full blocks before its last token
    keys = ledger.pricing.prefix_keys(prompt, ("m", None))
    queue = SharedQueue(ledger.pricing, ledger, max_wait=0)
    mine = await queue.acquire(200, 1000, follow=True, prefix=keys)
    queue.progress(mine, 10)
    await queue.publish()
    (field,) = [f.decode() for f in await other.client.hkeys("{kvclient:u}:holders")]
    published = (await other.client.hget(PROGRESS, field)).decode()
    assert published.split(" ")[3] == "10"
    prefix = (await other.client.hget(PREFIXES, field)).decode()
    # Its lease lapses unrenewed (a process cut off from Redis for longer than the lease): the
    # next script of any gateway sweeps what it held, and its records.
    await other.client.zadd(LEASES, {ledger.lease.id: 0})
    assert await other.load() == (0, 0)
    assert await other.client.hget(PROGRESS, field) is None
    await ledger.renew()  # finds it lapsed: the engine still runs the request; it is put back
    assert ledger.lease.lapsed_total == 1
    assert not mine.released
    assert await other.load() == (mine.reserved_tokens, 1)
    assert (await other.client.hget(PREFIXES, field)).decode() == prefix
    restored = (await other.client.hget(PROGRESS, field)).decode().split(" ")
    assert restored[:4] == ["200", "1000", "1", "-1"]  # as admitted, before its first token
    # The mirror holds it still, and publishes its progress again.
    assert [h.id for h in queue.ledger.live_handles()] == [mine.id]
    await queue.publish()
    assert (await other.client.hget(PROGRESS, field)).decode().split(" ")[3] == "10"
    await queue.release(mine)
    assert await other.load() == (0, 0)
    assert queue.ledger.live_handles() == []
    assert [await other.client.hlen(k) for k in (PROGRESS, PREFIXES)] == [0, 0]


async def test_a_lapse_with_nothing_held_is_not_counted(
    redis_server: RedisServer, closing: None
) -> None:
    ledger = await gateway(redis_server)
    await ledger.client.zadd(LEASES, {ledger.lease.id: 0})
    await ledger.renew()
    assert ledger.lease.lapsed_total == 0
    assert await ledger.load() == (0, 0)
