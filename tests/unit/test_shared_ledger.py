"""The shared ledger on a real Redis: one budget across processes, FIFO, leases, Redis away, and
the ledger's property tests (the model machine, many threads) run against both ledgers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reference_server import Handle
from reference_server.admission.queue import LedgerUnavailable, Rejected
from reference_server.shared_ledger import queue as shared_queue
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.lease import Lease
from reference_server.shared_ledger.ledger import (
    LedgerConflict,
    RedisLedger,
    SharedState,
    fingerprint,
)
from reference_server.shared_ledger.queue import SharedQueue
from reference_server.shared_ledger.wakeups import Wakeups
from tests.helpers.async_ledgers import AsyncLedger, LocalLedger
from tests.helpers.redis_server import RedisSentinel, RedisServer, TLSFiles
from tests.helpers.shared_ledgers import OPENED, anyio_backend, close_all, closing
from tests.unit.test_server_ledger import make

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name


pricing = make  # the in-process ledger's settings: what prices every request


async def shared(server: RedisServer, name: str, *, ttl: float = 5.0, **kw: object) -> RedisLedger:
    ledger = RedisLedger(
        connect(server.url), name=name, pricing=pricing(**kw), lease=Lease(ttl=ttl)
    )
    OPENED.append(ledger)
    await ledger.join()
    return ledger


@pytest.mark.redis
@pytest.mark.anyio
async def test_two_gateways_share_one_budget_and_release_once(
    redis_server: RedisServer, closing: None
) -> None:
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    held = await a.try_admit(100, 4000)  # 4112 of 9000
    held2 = await b.try_admit(100, 4000)
    assert held is not None
    assert held2 is not None
    assert await b.try_admit(100, 1000) is None  # 8224 + 1136 > 9000: refused across processes
    assert await a.load() == (8224, 2)
    await a.release(held)
    await a.release(held)  # idempotent
    assert await b.load() == (4112, 1)
    await b.release(held2)
    assert await a.load() == (0, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_queue_is_fifo_across_processes(redis_server: RedisServer, closing: None) -> None:
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    big = await a.try_admit(0, 8000)
    assert big is not None
    first = b.ticket(a.pricing.need_tokens(0, 2000))
    assert await b.try_admit(0, 2000, ticket=first, enqueue=True) is None  # queued
    # A small one from the other process would fit, but waits behind the head.
    assert await a.try_admit(0, 10) is None
    wait, ahead = await a.retry_after(16)
    assert ahead == 1
    assert wait > 0
    await a.release(big)
    assert await a.try_admit(0, 10) is None  # the head goes first
    head = await b.try_admit(0, 2000, ticket=first, enqueue=True)
    assert head is not None
    assert await a.try_admit(0, 10) is not None


@pytest.mark.redis
@pytest.mark.anyio
async def test_retry_after_reads_the_holders_of_every_gateway(
    redis_server: RedisServer, closing: None
) -> None:
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    assert await b.retry_after(9000) == (0.0, 0)
    assert await a.try_admit(0, 5000) is not None  # ends by its cap in 50 s at 100 tokens/s
    wait, _ = await b.retry_after(5000)
    assert 49.0 < wait <= 50.1


@pytest.mark.redis
@pytest.mark.anyio
async def test_retry_after_follows_the_measured_speed_of_the_pricing_ledger(
    redis_server: RedisServer, closing: None
) -> None:
    """Two holders share the engine's steps: at 100 tokens/s alone and 200 in all, each decodes
    at 66.7 tokens/s while both run, so the first of 4000 tokens ends at 60 s, not 40 s."""
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    b.pricing.set_speed(100.0, 200.0, time.monotonic())
    assert await a.try_admit(0, 4000) is not None
    assert await a.try_admit(0, 4000) is not None
    wait, _ = await b.retry_after(5000)
    assert 59.0 < wait <= 60.1


@pytest.mark.redis
@pytest.mark.anyio
async def test_occupancy_counts_every_gateways_holders(
    redis_server: RedisServer, closing: None
) -> None:
    """What the speed measurement reads: the holders of both gateways, over the time they
    held (on the Redis clock), as the in-process ledger's ``occupancy`` counts its own."""
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    before = await b.occupancy()
    one = await a.try_admit(0, 100)
    two = await b.try_admit(0, 100)
    assert one is not None
    assert two is not None
    await asyncio.sleep(0.5)
    await a.release(one)
    await asyncio.sleep(0.5)
    await b.release(two)
    held, busy, admitted = (x - y for x, y in zip(await b.occupancy(), before, strict=True))
    assert admitted == 2
    assert 0.95 <= busy <= 1.2  # one or both held for about a second
    assert 1.45 <= held <= 1.7  # two for half a second, then one for half a second
    assert await a.occupancy() == await b.occupancy()  # nothing held: the integrals stand


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_shared_totals_count_every_gateways_holders_and_waiters(
    redis_server: RedisServer, closing: None
) -> None:
    dead = await shared(redis_server, "u", ttl=0.3)  # never renewed: it dies
    b = await shared(redis_server, "u")
    held = await dead.try_admit(0, 8000)
    assert held is not None
    assert dead.seen == SharedState(held.reserved_tokens, 1, 0)
    need = b.pricing.need_tokens(0, 2000)
    ticket = b.ticket(need)
    assert await b.try_admit(0, 2000, ticket=ticket, enqueue=True) is None
    assert b.seen == SharedState(held.reserved_tokens, 1, need)
    assert await dead.try_admit(0, 100, enqueue=True) is None
    assert dead.seen == SharedState(held.reserved_tokens, 1, need + 112)
    await asyncio.sleep(0.4)  # the dead gateway's reservation and ticket are swept
    assert await b.try_admit(0, 10) is None  # b's own ticket is ahead
    assert b.seen == SharedState(0, 0, need)
    await b.leave(ticket)
    assert await b.try_admit(0, 10) is not None
    assert b.seen == SharedState(16, 1, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_dead_gateways_reservations_come_back_when_its_lease_expires(
    redis_server: RedisServer, closing: None
) -> None:
    dead = await shared(redis_server, "u", ttl=0.3)  # never renewed: it died
    alive = await shared(redis_server, "u")
    assert await dead.try_admit(0, 8000) is not None
    assert await alive.try_admit(0, 2000) is None
    for _ in range(60):  # the lease is 0.3 s; 3 s at most
        if (await alive.load())[0] == 0:
            break
        await asyncio.sleep(0.05)
    assert await alive.load() == (0, 0)
    assert await alive.try_admit(0, 2000) is not None


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_slow_gateway_puts_back_what_its_lapsed_lease_held_and_never_releases_twice(
    redis_server: RedisServer, closing: None
) -> None:
    slow = await shared(redis_server, "u", ttl=0.2)
    other = await shared(redis_server, "u")
    back: list[Handle] = []
    slow.on_restore = back.extend
    handle = await slow.try_admit(0, 8000)
    assert handle is not None
    await asyncio.sleep(0.4)  # the lease lapses while it is busy elsewhere
    taken = await other.try_admit(0, 8000)
    assert taken is not None  # swept: the other gateway took the room
    await slow.renew()
    assert back == [handle]  # the engine still holds it: put back, even past the budget
    assert not handle.released
    assert slow.lease.lapsed_total == 1
    assert await other.load() == (taken.reserved_tokens + handle.reserved_tokens, 2)
    assert await other.try_admit(0, 10) is None
    await slow.release(handle)
    await slow.release(handle)  # nothing: it is not released a second time
    assert await other.load() == (taken.reserved_tokens, 1)


@pytest.mark.redis
@pytest.mark.anyio
async def test_gateways_configured_differently_for_one_upstream_is_an_error(
    redis_server: RedisServer, closing: None
) -> None:
    await shared(redis_server, "u", total_kv_tokens=10_000)
    with pytest.raises(LedgerConflict, match="configured differently"):
        await shared(redis_server, "u", total_kv_tokens=20_000)
    await shared(redis_server, "other", total_kv_tokens=20_000)  # another upstream: fine
    assert "usable=9000" in fingerprint(pricing())


@pytest.mark.redis
@pytest.mark.anyio
async def test_redis_away_is_unavailable_and_recovery_needs_no_restart(
    redis_server: RedisServer, closing: None
) -> None:
    states: list[bool] = []
    lease = Lease(on_state=states.append)
    ledger = RedisLedger(connect(redis_server.url), name="u", pricing=pricing(), lease=lease)
    OPENED.append(ledger)
    await ledger.join()
    handle = await ledger.try_admit(0, 100)
    assert handle is not None
    redis_server.stop()
    with pytest.raises(LedgerUnavailable):
        await ledger.try_admit(0, 100)
    await ledger.release(handle)  # kept to retry
    redis_server.start()
    await ledger.renew()  # retried; the lease starts afresh on the empty server
    assert await ledger.try_admit(0, 100) is not None
    assert states == [False, True]


@pytest.mark.redis
@pytest.mark.anyio
async def test_what_is_held_is_put_back_when_redis_lost_its_data(
    redis_server: RedisServer, closing: None
) -> None:
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    held = await a.try_admit(0, 4000)
    assert held is not None
    redis_server.stop()
    redis_server.start()  # in memory only: empty
    assert await b.load() == (0, 0)
    await a.renew()  # a finds its lease unknown (not expired): it puts back what it holds
    assert await b.load() == (held.reserved_tokens, 1)
    assert await b.try_admit(0, 8000) is None  # the engine still holds a's request
    await a.release(held)
    assert await b.load() == (0, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_an_admission_run_twice_reserves_once(
    redis_server: RedisServer, closing: None
) -> None:
    """The client retries a script once after a lost answer: it may have run already."""
    a = await shared(redis_server, "u")
    ticket = a.ticket(a.pricing.need_tokens(0, 100))
    first = await a.try_admit(0, 100, ticket=ticket)
    again = await a.try_admit(0, 100, ticket=ticket)
    assert first is not None
    assert again is not None
    assert await a.load() == (112, 1)
    await a.release(first)
    await a.release(again)
    assert await a.load() == (0, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_waiter_in_one_process_is_admitted_when_another_releases(
    redis_server: RedisServer, closing: None
) -> None:
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    queue_a = SharedQueue(a.pricing, a, max_wait=5)
    queue_b = SharedQueue(b.pricing, b, max_wait=5)
    big = await queue_a.acquire(0, 8000)
    got: list[Handle] = []
    async with anyio.create_task_group() as group:

        async def wait() -> None:
            got.append(await queue_b.acquire(0, 2000))

        group.start_soon(wait)
        await anyio.sleep(0.2)
        assert not got
        # A newcomer that would fit waits behind the other process's waiter: refused at once.
        with pytest.raises(Rejected) as refused:
            await SharedQueue(a.pricing, a, max_wait=0).acquire(0, 10)
        assert refused.value.queued_ahead == 1
        await queue_a.release(big)
    assert len(got) == 1
    await queue_b.release(got[0])
    assert await a.load() == (0, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_release_in_one_process_wakes_a_waiter_in_another_by_pub_sub(
    redis_server: RedisServer, closing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_queue, "FALLBACK_POLL_SECONDS", 30.0)  # no poll to fall back on
    a = await shared(redis_server, "u")
    b = await shared(redis_server, "u")
    wakeups = Wakeups(b.client)
    queue_a = SharedQueue(a.pricing, a, max_wait=5)
    queue_b = SharedQueue(b.pricing, b, max_wait=10, wakeups=wakeups)
    big = await queue_a.acquire(0, 8000)
    got: list[float] = []
    async with anyio.create_task_group() as group:
        group.start_soon(wakeups.run)
        for _ in range(500):
            if wakeups.subscribed:
                break
            await anyio.sleep(0.01)
        admitted = anyio.Event()

        async def wait() -> None:
            await queue_b.acquire(0, 2000)
            got.append(time.monotonic())
            admitted.set()

        group.start_soon(wait)
        await anyio.sleep(0.3)  # it polled once, then sleeps its 30 s unless woken
        assert queue_b.poll_seconds == 30.0
        released = time.monotonic()
        await queue_a.release(big)
        with anyio.fail_after(5):
            await admitted.wait()
        group.cancel_scope.cancel()
    assert got[0] - released < 1.0


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_subscription_outlives_redis_going_away_and_stray_messages(
    redis_server: RedisServer, closing: None
) -> None:
    b = await shared(redis_server, "u")
    wakeups = Wakeups(b.client)
    woken: list[int] = []
    wakeups.watch(b, lambda: woken.append(1))
    async with anyio.create_task_group() as group:
        group.start_soon(wakeups.run)
        await eventually(lambda: wakeups.subscribed)
        woken.clear()
        await b.client.publish(b.channel, "not ours")
        await eventually(lambda: bool(woken))  # woken all the same; still listening
        redis_server.stop()
        await eventually(lambda: not wakeups.subscribed)
        redis_server.start()
        await eventually(lambda: wakeups.subscribed)
        woken.clear()
        await b.client.publish(b.channel, "1 5 1 0")
        await eventually(lambda: bool(woken))
        assert b.seen == SharedState(5, 1, 0)
        group.cancel_scope.cancel()


async def eventually(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await anyio.sleep(0.01)
    pytest.fail("not within 5 s")


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_ledger_over_tls_verifies_redis_by_the_given_ca(
    tls_redis: tuple[RedisServer, TLSFiles], closing: None
) -> None:
    server, tls = tls_redis
    mine = {"client_cert": str(tls.client_cert), "client_key": str(tls.client_key)}

    def over_tls(**files: str) -> RedisLedger:
        ledger = RedisLedger(
            connect(server.url, **files), name="u", pricing=pricing(), lease=Lease()
        )
        OPENED.append(ledger)
        return ledger

    ledger = over_tls(ca_file=str(tls.ca), **mine)
    await ledger.join()
    handle = await ledger.try_admit(0, 100)
    assert handle is not None
    await ledger.release(handle)
    assert await ledger.load() == (0, 0)
    with pytest.raises(LedgerUnavailable, match="certificate verify failed"):
        await over_tls(**mine).join()  # the system's CAs do not know the test's
    with pytest.raises(LedgerUnavailable):
        await over_tls(ca_file=str(tls.ca)).join()  # Redis asks for a client certificate
    with pytest.raises(ValueError, match="rediss://"):
        connect("redis://127.0.0.1:1/0", ca_file=str(tls.ca))


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_ledger_behind_sentinel_follows_a_failover(
    redis_server_ready: str, tmp_path: Path, closing: None
) -> None:
    """A master, its replica and a Sentinel: the ledger finds the master through the Sentinel,
    and once the master dies and the replica is promoted it carries on with what was held."""
    with ExitStack() as stack:
        master = stack.enter_context(RedisServer(tmp_path))
        replica = stack.enter_context(RedisServer(tmp_path, replica_of=master.port))
        sentinel = stack.enter_context(RedisSentinel(tmp_path, master_port=master.port))
        ledger = RedisLedger(
            connect(sentinel.url), name="u", pricing=pricing(), lease=Lease(ttl=30)
        )
        OPENED.append(ledger)
        await ledger.join()
        held = await ledger.try_admit(0, 4000)
        assert held is not None
        for _ in range(20):  # on the replica too, once it has synced
            if await ledger.client.execute_command("WAIT", 1, 500) == 1:
                break
        else:
            pytest.fail("the replica never caught up")
        master.stop()
        with anyio.fail_after(30):  # Sentinel: down after 0.3 s, then the promotion
            while True:
                try:
                    load = await ledger.load()
                    break
                except LedgerUnavailable:
                    await anyio.sleep(0.2)
        assert load == (held.reserved_tokens, 1)
        assert (await ledger.client.config_get("port"))["port"] == str(replica.port)
        await ledger.release(held)
        assert await ledger.load() == (0, 0)
        assert await ledger.try_admit(0, 8000) is not None


def test_a_sentinel_url_names_its_sentinels_and_service() -> None:
    client = connect("redis+sentinel://:secret@10.0.0.1:26379,[::1]:26380/ledger/2")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["password"], kwargs["db"]) == ("secret", 2)
    sentinels = client.connection_pool.sentinel_manager.sentinels
    hosts = [s.connection_pool.connection_kwargs["host"] for s in sentinels]
    assert hosts == ["10.0.0.1", "::1"]
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h/ledger", "redis+sentinel://h:1/l/x"):
        with pytest.raises(ValueError, match="--ledger"):
            connect(bad)


def test_a_ledger_url_must_be_redis() -> None:
    with pytest.raises(ValueError, match="redis://"):
        connect("http://user:secret@host:6379")


def test_the_password_comes_from_the_url_or_else_the_environment() -> None:
    env = {"KVCLIENT_LEDGER_PASSWORD": "from-env"}
    from_env = connect("redis://127.0.0.1:1/0", environ=env)
    assert from_env.connection_pool.connection_kwargs["password"] == "from-env"
    in_url = connect("rediss://:in-url@127.0.0.1:1/0", environ=env)
    assert in_url.connection_pool.connection_kwargs["password"] == "in-url"
    assert (
        connect("redis://127.0.0.1:1/0", environ={}).connection_pool.connection_kwargs.get(
            "password"
        )
        is None
    )


# --- the property tests, against both ledgers ---------------------------------------------------


class _Bridge:
    """One event loop per machine, so a sync state machine drives the async interface."""

    def __init__(self, server: RedisServer | None, **kw: object) -> None:
        self.runner = asyncio.new_event_loop()  # asyncio.Runner is 3.11+
        if server is None:
            self.ledger: AsyncLedger = LocalLedger(pricing(**kw))
        else:
            name = uuid.uuid4().hex
            self.ledger = self.runner.run_until_complete(shared(server, name, **kw))

    def close(self) -> None:
        self.runner.run_until_complete(close_all())
        self.runner.close()


_SERVER: list[RedisServer] = []


@pytest.fixture(params=["in-process", pytest.param("redis", marks=pytest.mark.redis)])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer | None]:
    if request.param == "in-process":
        yield None
        return
    request.getfixturevalue("redis_server_ready")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


class LedgerMachine(RuleBasedStateMachine):
    """Reserved is always the sum of the live handles, whichever ledger."""

    server: RedisServer | None = None

    def __init__(self) -> None:
        super().__init__()
        self.bridge = _Bridge(self.server, total_kv_tokens=6000, max_concurrency=5)
        self.ledger = self.bridge.ledger
        self.live: list[Handle] = []
        self.dead: list[Handle] = []

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        return self.bridge.runner.run_until_complete(coroutine)

    @rule(prompt=st.integers(0, 4000), cap=st.integers(1, 4000))
    def admit(self, prompt: int, cap: int) -> None:
        need = self.ledger.pricing.need_tokens(prompt, cap)
        reserved, inflight = self.run(self.ledger.load())
        handle = self.run(self.ledger.try_admit(prompt, cap))
        fits = reserved + need <= self.ledger.pricing.usable_tokens and inflight < 5
        assert (handle is not None) == fits
        if handle is not None:
            assert handle.reserved_tokens == need
            self.live.append(handle)

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 100))
    def end(self, pick: int) -> None:
        handle = self.live.pop(pick % len(self.live))
        self.run(self.ledger.release(handle))
        self.dead.append(handle)

    @precondition(lambda self: bool(self.dead))
    @rule(pick=st.integers(0, 100))
    def release_again(self, pick: int) -> None:
        self.run(self.ledger.release(self.dead[pick % len(self.dead)]))

    @rule(need=st.integers(0, 5400))
    def estimate(self, need: int) -> None:
        wait, _ = self.run(self.ledger.retry_after(need))
        reserved, inflight = self.run(self.ledger.load())
        fits = reserved + need <= self.ledger.pricing.usable_tokens and inflight < 5
        assert wait >= 0.0
        assert (wait == 0.0) == fits

    @invariant()
    def reserved_is_the_sum_of_live_handles(self) -> None:
        reserved, inflight = self.run(self.ledger.load())
        assert reserved == sum(h.reserved_tokens for h in self.live)
        assert inflight == len(self.live)
        assert 0 <= reserved <= self.ledger.pricing.usable_tokens

    def teardown(self) -> None:
        for handle in self.live:
            self.run(self.ledger.release(handle))
        assert self.run(self.ledger.load()) == (0, 0)
        self.bridge.close()


def test_the_model_machine_holds_for_both_ledgers(backend: RedisServer | None) -> None:
    machine = type("Machine", (LedgerMachine,), {"server": backend})
    test = machine.TestCase
    test.settings = settings(
        max_examples=25 if backend else 60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    test().runTest()


def test_many_threads_admit_and_release_back_to_zero_on_both(backend: RedisServer | None) -> None:
    """Threads (each its own loop and, for Redis, its own connection: as many processes would)
    hammer one budget; it never goes past usable and ends at zero."""
    name = uuid.uuid4().hex
    local = LocalLedger(pricing(total_kv_tokens=5000))
    errors: list[str] = []

    def worker(seed: int) -> None:
        async def go() -> None:
            ledger = local if backend is None else await shared(backend, name, total_kv_tokens=5000)
            rng = random.Random(seed)
            held: list[Handle] = []
            for _ in range(150):
                if held and rng.random() < 0.5:
                    handle = held.pop(rng.randrange(len(held)))
                    await ledger.release(handle)
                    if rng.random() < 0.2:
                        await ledger.release(handle)
                else:
                    got = await ledger.try_admit(rng.randrange(200), rng.randrange(1, 600))
                    if got is not None:
                        held.append(got)
                reserved, _ = await ledger.load()
                if not 0 <= reserved <= ledger.pricing.usable_tokens:
                    errors.append(f"reserved out of range: {reserved}")
            for handle in held:
                await ledger.release(handle)
            if isinstance(ledger, RedisLedger):
                OPENED.remove(ledger)
                await ledger.aclose()

        asyncio.run(go())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors

    async def final() -> tuple[int, int]:
        if backend is None:
            return await local.load()
        ledger = await shared(backend, name, total_kv_tokens=5000)
        try:
            return await ledger.load()
        finally:
            await close_all()

    assert asyncio.run(final()) == (0, 0)
