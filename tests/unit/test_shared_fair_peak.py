"""Fair shares on the shared ledger under the peak rule, on a real Redis: the fair decision
admits by the peak of every gateway's holders (more at once than whole caps allow, once their
progress is published) and refuses what would overflow it; an admitted waiter, whichever
gateway admitted it, carries the records ADMIT writes; a decision on a state that changed
before its commit (a holder admitted, a lockstep break) does not land; a tenant's holders
count against its limit as the peak counts them; off the peak rule it counts whole caps; and
what a tenant is charged agrees between the scripts (where a holder goes) and the scheduler
restored from Redis (while it lives)."""

from __future__ import annotations

import anyio
import pytest

from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.admission.ledger import Handle, KVAdmissionController
from reference_server.admission.queue import Rejected
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.fair import FairState, SharedFairQueue
from reference_server.shared_ledger.fair_state import Decision, PeakAsk, Seat
from reference_server.shared_ledger.holding import charged
from reference_server.shared_ledger.ledger import Lease, RedisLedger
from reference_server.shared_ledger.scripts import BREAK, FAIR_COMMIT, FAIR_SNAPSHOT
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import OPENED, anyio_backend, closing

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name

POLICY = FairPolicy(tenants={"a": Tenant(), "b": Tenant(), "half": Tenant(max_share=0.5)})


def pricing(**kw: object) -> KVAdmissionController:
    """9,000 usable tokens in blocks of 16, 100 tokens/s, on the peak rule: two requests of
    prompt 100 and cap 4,000 (4,112 tokens each) fit on whole caps, three do not."""
    settings: dict[str, object] = {
        "total_kv_tokens": 10_000, "context_window": 8192, "decode_rate": 100.0, "rule": "peak",
    }  # fmt: skip
    settings.update(kw)
    return KVAdmissionController(**settings)  # type: ignore[arg-type]


async def gateway(server: RedisServer, *, max_wait: float = 0.0, **kw: object) -> SharedFairQueue:
    """One gateway process's fair queue on upstream ``u``: its own Redis client, lease and
    pricing ledger (``kw``: its settings)."""
    ledger = pricing(**kw)
    shared = RedisLedger(
        connect(server.url), name="u", pricing=ledger, lease=Lease(), fairness=POLICY
    )
    OPENED.append(shared)
    await shared.join()
    return SharedFairQueue(ledger, shared, policy=POLICY, max_wait=max_wait)


def field_of(queue: SharedFairQueue, mine: Handle) -> str:
    """The reservation's name in Redis of this gateway's holder ``mine``."""
    field = queue.shared.field_of(queue._links[mine.id][1])
    assert field is not None
    return field


async def made(queue: SharedFairQueue, mine: Handle, generated: int, cap: int = 4000) -> None:
    """Publish that ``mine`` (prompt 100) has made ``generated`` tokens, read just now."""
    await queue.shared.publish([(field_of(queue, mine), 100, cap, True, generated, 0.0, 0.0)])


async def state(queue: SharedFairQueue) -> FairState:
    return FairState(await queue.shared.run(FAIR_SNAPSHOT))


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_fair_decision_admits_by_the_peak_of_every_gateways_holders(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    assert one.on_peak
    near = await one.acquire(100, 4000, tenant="a", follow=True)
    early = await two.acquire(100, 4000, tenant="b", follow=True)
    with pytest.raises(Rejected):  # before their first tokens: whole, 3 x 4,112 > 9,000
        await two.acquire(100, 4000, tenant="b", follow=True)
    await made(one, near, 3950)  # near its end
    await made(two, early, 10)
    third = await two.acquire(100, 4000, tenant="b", follow=True)
    now = await state(one)
    assert now.reserved == 3 * 4112 > one.ledger.usable_tokens
    with pytest.raises(Rejected):  # a fourth would overflow the peak: refused
        await one.acquire(100, 4000, tenant="a", follow=True)
    # Its records are the ones ADMIT writes: prompt, cap, followed, no count yet.
    (record,) = [r for r in now.view(one.ledger).records if r.field == field_of(two, third)]
    assert (record.prompt, record.counted, record.tracked, record.generated) == (
        100, 4000, True, None
    )  # fmt: skip
    for queue, handle in ((one, near), (two, early), (two, third)):
        await queue.release(handle)
    now = await state(one)
    assert (now.reserved, now.holders, now.queue) == (0, {}, [])
    assert await one.shared.client.hlen("{kvclient:u}:progress") == 0


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_waiter_admitted_by_another_gateway_comes_with_its_records(
    redis_server: RedisServer, closing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B waits at gateway two; A's first token, published at gateway one, makes room by the
    peak, and gateway one's decision admits B: B's record says what B's gateway asked (its
    prompt, followed), and gateway two adopts it and publishes its progress."""
    # Gateway two looks again only when woken (here by hand, as pub/sub would).
    monkeypatch.setattr(SharedFairQueue, "poll_seconds", property(lambda self: 30.0))
    one = await gateway(redis_server)
    two = await gateway(redis_server, max_wait=10.0)
    first = await one.acquire(100, 4000, tenant="a", follow=True)
    second = await one.acquire(100, 4000, tenant="a", follow=True)
    await made(one, first, 3950)
    got: list[Handle] = []
    admitted = anyio.Event()

    async def wait() -> None:
        got.append(await two.acquire(100, 4000, tenant="b", follow=True))
        admitted.set()

    async with anyio.create_task_group() as group:
        group.start_soon(wait)
        for _ in range(500):
            if len((await state(one)).queue) == 1:
                break
            await anyio.sleep(0.01)
        await made(one, second, 10)  # the second's first token: no longer whole
        await one.acquire(0, 16, tenant="a")  # one's decision (a small one fits on caps)
        now = await state(one)
        assert len(now.holders) == 4  # B admitted, by gateway one
        assert not now.queue
        two.notify()  # the commit's message
        with anyio.fail_after(5):
            await admitted.wait()
    (theirs,) = got
    assert theirs.tracked  # followed by its own gateway, which publishes its progress
    two.progress(theirs, 1)
    await two.publish()
    (record,) = [
        r for r in (await state(one)).view(one.ledger).records if r.field == field_of(two, theirs)
    ]
    assert (record.prompt, record.tracked, record.generated) == (100, True, 1)
    assert record.lease == two.shared.lease.id


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_decision_on_holders_that_changed_before_its_commit_does_not_land(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    near = await one.acquire(100, 4000, tenant="a", follow=True)
    early = await two.acquire(100, 4000, tenant="b", follow=True)
    await made(one, near, 3950)
    await made(two, early, 10)

    async def decided() -> tuple[list[object], str]:
        """A decision admitting one of ``one``'s newcomers by the peak, not written yet."""
        now = await state(one)
        decision = Decision(
            now, now.view(one.ledger), POLICY, one.ledger, peak=True, due=one.shared.due
        )
        seat = Seat(
            ticket=one.shared.ticket(4112), tenant="a", need=4112, priority=0,
            prompt_tokens=100, output_cap=4000, ask=PeakAsk(100, True),
        )  # fmt: skip
        outcome = decision.decide([seat], one.shared.lease.id)
        assert [w for w, _ in outcome.admitted] == [seat]
        assert outcome.args is not None
        return outcome.args, seat.ticket

    args, _ = await decided()
    extra = await two.acquire(0, 16, tenant="b")  # another holder admitted meanwhile
    status, _, _ = await one.shared.run(FAIR_COMMIT, *args)
    assert int(status) == 0  # read again
    await two.release(extra)
    args, _ = await decided()
    await one.shared.run(BREAK, "1 streams stalled while others advanced")  # version unmoved
    status, _, _ = await one.shared.run(FAIR_COMMIT, *args)
    assert int(status) == 0  # the break moved ``grown``: read again
    now = await state(one)
    assert now.view(one.ledger).drain is not None
    assert len(now.holders) == 2
    await one.release(near)
    await two.release(early)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_tenants_holders_count_against_its_limit_as_the_peak_counts_them(
    redis_server: RedisServer, closing: None
) -> None:
    """Tenant ``half`` may hold 4,500 of 9,000: one holder at its whole 4,112 leaves no room
    for another; past its first token it counts its prompt and what it made (and the relay's
    margin), and a second fits."""
    one, two = await gateway(redis_server), await gateway(redis_server)
    first = await one.acquire(100, 4000, tenant="half", follow=True)
    with pytest.raises(Rejected):
        await two.acquire(100, 4000, tenant="half", follow=True)
    await made(one, first, 10)
    second = await two.acquire(100, 4000, tenant="half", follow=True)
    stats = {s.tenant: s for s in two.tenants()}
    assert stats["half"].held < 2 * 4112  # the first counted by its progress
    await one.release(first)
    await two.release(second)


@pytest.mark.redis
@pytest.mark.anyio
async def test_off_the_peak_rule_the_fair_decision_counts_whole_caps(
    redis_server: RedisServer, closing: None
) -> None:
    one, two = await gateway(redis_server), await gateway(redis_server)
    two.ledger.engine_unseen("its /metrics could not be reached")  # blind: whole caps
    assert not two.on_peak
    near = await one.acquire(100, 4000, tenant="a", follow=True)
    early = await one.acquire(100, 4000, tenant="a", follow=True)
    await made(one, near, 3950)
    await made(one, early, 10)
    with pytest.raises(Rejected):  # the peak would let it in (see above): whole caps do not
        await two.acquire(100, 4000, tenant="b", follow=True)
    stats = {s.tenant: s for s in two.tenants()}
    assert stats["a"].held == 2 * 4112  # counted whole, as the rule in force counts them
    third = await one.acquire(100, 4000, tenant="b", follow=True)  # one is on the peak
    await one.release(third)
    await one.release(near)
    await one.release(early)


@pytest.mark.redis
@pytest.mark.anyio
async def test_what_a_tenant_is_charged_is_the_same_while_its_holder_lives_and_once_it_went(
    redis_server: RedisServer, closing: None
) -> None:
    one = await gateway(redis_server)
    mine = await one.acquire(100, 900, tenant="a", follow=True)  # 1,008 tokens
    await anyio.sleep(0.2)
    await made(one, mine, 30)
    await anyio.sleep(0.2)
    live = await state(one)
    tokens, _, admitted, _ = live.holders[field_of(one, mine)]
    (record,) = live.view(one.ledger).records
    expected = charged(
        tokens, admitted, live.now, prompt=100, generated=30, seen=record.seen_at,
        first=record.first_seen_at,
    )  # fmt: skip
    decision = Decision(
        live, live.view(one.ledger), POLICY, one.ledger, peak=True, due=one.shared.due
    )
    (stats,) = [s for s in decision.fair.stats(live.now) if s.tenant == "a"]
    assert stats.token_seconds == pytest.approx(expected)
    assert expected < tokens * (live.now - admitted)  # less than its whole reservation
    await one.release(mine)
    gone = await state(one)
    (taken,) = [v for k, v in gone.fair.items() if k == "taken:a"]
    at_release = charged(
        tokens, admitted, gone.now, prompt=100, generated=30, seen=record.seen_at,
        first=record.first_seen_at,
    )  # fmt: skip
    # Released between the two reads: what the scripts charged lies between the two formulas.
    assert expected * 1000 - 1 <= taken <= at_release * 1000 + 1


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_fair_holders_mirror_counts_its_shared_prefix_blocks_once(
    redis_server: RedisServer, closing: None
) -> None:
    """Admitted by a fair decision, a holder is mirrored in its gateway's own ledger with its
    prefix's keys, as through the plain shared queue: a newcomer of the same prompt borrows the
    blocks a holder past its prefill computed."""
    queue = await gateway(redis_server)
    queue.ledger.shares_prefixes = True
    keys = queue.ledger.prefix_keys(list(range(1000)), ("m", None))
    lender = await queue.acquire(1000, 100, tenant="a", follow=True, prefix=keys, model="m")
    queue.progress(lender, 1)
    borrower = await queue.acquire(1000, 100, tenant="b", follow=True, prefix=keys, model="m")
    assert [lender.prefix, borrower.prefix] == [keys, keys]
    assert borrower.borrowed == len(keys) > 0
    for handle in (borrower, lender):
        await queue.release(handle)
    assert await queue.shared.load() == (0, 0)


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_fair_holder_put_back_after_a_lapse_keeps_its_tenant_and_is_charged_once(
    redis_server: RedisServer, closing: None
) -> None:
    """Its gateway's lease lapsed: Redis swept the holder and charged its tenant for what it
    held until then. Put back (the engine still runs it), it counts for its tenant again, and
    is charged from its return on: not a second time for what the sweep charged."""
    queue = await gateway(redis_server)
    other = await gateway(redis_server)
    mine = await queue.acquire(100, 4000, tenant="a", follow=True)
    field = field_of(queue, mine)
    # Admitted 0.3 s earlier, as Redis has it (no waiting): 4,112 tokens held that long at least.
    holders = "{kvclient:u}:holders"
    lease, tokens, cap, admitted, tenant = (await other.shared.client.hget(holders, field)).split()
    earlier = f"{lease.decode()} {tokens.decode()} {cap.decode()} {int(admitted) - 300} a"
    assert tenant == b"a"
    await other.shared.client.hset(holders, field, earlier)
    await other.shared.client.zadd("{kvclient:u}:leases", {queue.shared.lease.id: 0})
    swept = await state(other)
    assert field not in swept.holders
    before = swept.per_tenant("taken")["a"]  # token-milliseconds
    assert before >= 4112 * 300
    await queue.shared.renew()  # finds the lease lapsed: puts back what it holds
    back = await state(other)
    tokens, _, returned, tenant = back.holders[field]
    assert (tokens, tenant) == (4112, "a")
    assert returned >= swept.now  # charged from its return
    # Its progress published again, every gateway counts it by it.
    await made(queue, mine, 10)
    (record,) = (await state(other)).view(other.ledger).records
    assert (record.field, record.prompt, record.generated) == (field, 100, 10)
    await queue.release(mine)
    ended = await state(other)
    assert before < ended.per_tenant("taken")["a"] <= before + 4112 * (ended.now - returned) * 1000
