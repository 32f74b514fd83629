"""Shared prefix blocks on the shared ledger, on a real Redis: a newcomer at one gateway borrows
the blocks a holder of another computed (only where the engine shares them, and only once that
holder is past its prefill); a lender that leaves taints what it leaves as the in-process ledger
has it, the scripts holding ``tainted`` to ``tainted_after`` over random histories; the records
go with their holders; a record without prefix data, or one this version cannot read, counts
its whole prompt."""

from __future__ import annotations

import random

import anyio
import pytest

from reference_server.admission.ledger import Handle, KVAdmissionController
from reference_server.admission.peak import prefix_blocks
from reference_server.admission.queue import Rejected
from reference_server.shared_ledger.ledger import RedisLedger
from reference_server.shared_ledger.queue import SharedQueue
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import anyio_backend, closing
from tests.unit.test_shared_peak import gateway

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name


pytestmark = [pytest.mark.redis, pytest.mark.anyio]

#: The salt the gateway gives the keys: the model and the request's ``cache_salt``.
SALT = ("m", None)
#: One prompt's token ids: 124 full blocks of 16 before its last token.
PROMPT = list(range(2000))


async def sharing(server: RedisServer, *, shares: bool = True, **kw: object) -> RedisLedger:
    """A gateway's shared ledger of upstream ``u`` in front of an engine that shares prefix
    blocks (``shares``), or does not."""
    ledger = await gateway(server, **kw)
    ledger.pricing.shares_prefixes = shares
    return ledger


def keys_of(ledger: RedisLedger, ids: list[int]) -> tuple[bytes, ...]:
    """The keys the gateway gives a prompt (none where the engine shares nothing)."""
    return ledger.pricing.prefix_keys(ids, SALT)  # type: ignore[return-value]


async def record(ledger: RedisLedger, field: str) -> str | None:
    raw = await ledger.client.hget("{kvclient:u}:prefixes", field)
    return None if raw is None else raw.decode()


async def left_nothing(ledger: RedisLedger) -> bool:
    """Nothing of any prefix record is left in Redis."""
    client = ledger.client
    lengths = [
        await client.hlen("{kvclient:u}:prefixes"),
        await client.hlen("{kvclient:u}:blocks"),
        await client.scard("{kvclient:u}:tainted"),
    ]
    return lengths == [0, 0, 0]


@pytest.mark.parametrize("shares", [True, False])
async def test_a_newcomer_at_one_gateway_borrows_what_a_holder_of_another_computed(
    redis_server: RedisServer, closing: None, shares: bool
) -> None:
    """9,000 usable tokens; prompts of 2,000 tokens (124 shareable blocks) and caps of 2,500:
    4,512 each, two do not fit whole (9,024). Where the engine shares the prompt's blocks, a
    newcomer at b borrows the 124 that a's holder computed once a's holder is past its prefill
    (9,024 - 1,984 fit); before that, or where the engine shares nothing, it does not fit."""
    a = await sharing(redis_server, shares=shares)
    b = await sharing(redis_server, shares=shares)
    assert len(prefix_blocks(PROMPT, 16)) == 124
    lender = await a.try_admit(2000, 2500, peak=True, follow=True, prefix=keys_of(a, PROMPT))
    assert lender is not None
    field = a.field_of(lender)
    assert field is not None
    queue = SharedQueue(b.pricing, b, max_wait=0)
    with pytest.raises(Rejected):  # a's holder is still computing its prompt
        await queue.acquire(2000, 2500, follow=True, prefix=keys_of(b, PROMPT))
    await a.publish([(field, 2000, 2500, True, 10, 0.0, 0.0)])  # its first token
    if not shares:
        with pytest.raises(Rejected):
            await queue.acquire(2000, 2500, follow=True, prefix=keys_of(b, PROMPT))
        assert await record(a, field) is None  # nothing to share, nothing recorded
        return
    mine = await queue.acquire(2000, 2500, follow=True, prefix=keys_of(b, PROMPT))
    assert mine is not None
    view = await a.peak_view()
    (borrower,) = [r for r in view.records if r.lease == b.lease.id]
    assert borrower.prefix == prefix_blocks(PROMPT, 16, SALT)
    assert borrower.borrowed == 124
    assert view.handles[field].borrowed == 0  # the lender computed its own
    assert (await record(a, field) or "").startswith("0 0 ")
    assert view.model.stats(view.now).committed_tokens <= a.usable_tokens < view.reserved
    await a.release(lender)  # the lender goes: the borrower's blocks count once all the same
    await queue.release(mine)
    assert await left_nothing(a)


async def test_a_lenders_twin_that_leaves_costs_the_next_borrower_a_copy(
    redis_server: RedisServer, closing: None
) -> None:
    """As ``test_a_freed_copy_of_a_duplicated_block_costs_its_borrower_a_copy`` in-process,
    across gateways: a's and b's holders computed one 4-block prefix at once (each its own
    copy); a's goes; b's newcomer borrows from b's holder and may be handed a's freed copy:
    the view counts the 4 blocks twice, as the in-process ledger does, until no holder has
    them."""
    settings = {"total_kv_tokens": 4000, "safety_fraction": 1.0}
    a = await sharing(redis_server, **settings)
    b = await sharing(redis_server, **settings)
    ids = list(range(65))
    keys = keys_of(a, ids)
    assert len(keys) == 4
    first = await a.try_admit(65, 10, peak=True, follow=True, prefix=keys)
    twin = await b.try_admit(65, 10, peak=True, follow=True, prefix=keys)
    assert first is not None
    assert twin is not None
    names = [a.field_of(first), b.field_of(twin)]
    view = await a.peak_view()
    assert [view.handles[n].borrowed for n in names if n] == [0, 0]
    assert view.model.stats(view.now).committed_tokens == 10 * 16  # each computed its own
    for ledger, name in zip((a, b), names, strict=True):
        assert name is not None
        await ledger.publish([(name, 65, 10, True, 1, 0.0, 0.0)])
    await a.release(first)
    assert {
        bytes.fromhex(k.decode()) for k in await a.client.smembers("{kvclient:u}:tainted")
    } == set(keys)
    borrower = await b.try_admit(65, 10, peak=True, follow=True, prefix=keys)
    assert borrower is not None
    view = await a.peak_view()
    assert view.handles[b.field_of(borrower) or ""].borrowed == 4
    assert view.tainted == set(keys)
    # The twin in 5 blocks, the borrower in 5: 2 of their own, the prefix twice.
    assert view.model.stats(view.now).committed_tokens == 10 * 16
    await b.release(twin)
    await b.release(borrower)
    assert await left_nothing(a)


async def _history(a: RedisLedger, rng: random.Random) -> int:
    """Random admissions (keyed, some borrowing; unkeyed), first tokens and releases, each one
    done to an in-process ledger and to the shared one ``a``: after every release both keep
    the same tainted blocks. Returns how many releases left some tainted."""
    ledger = KVAdmissionController(
        total_kv_tokens=1_000_000, context_window=8192, decode_rate=100.0, rule="peak"
    )
    ledger.shares_prefixes = True
    heads = [list(range(100, 164)), list(range(100, 132)) + list(range(500, 540))]
    live: list[tuple[Handle, Handle, str]] = []  # (in-process, shared, its field)
    tainted_seen = 0
    for step in range(60):
        now = step * 0.01
        await anyio.sleep(0.003)  # the Redis clock's milliseconds keep the events' order
        roll = rng.random()
        if roll < 0.45 or not live:
            ids = [*rng.choice(heads), *range(1000 * step, 1000 * step + rng.randint(1, 20))]
            keyed = rng.random() < 0.8
            keys = keys_of(a, ids) if keyed else ()
            mine = ledger.try_admit(len(ids), 10, now=now, prefix=keys, follow=True)
            held = await a.try_admit(len(ids), 10, peak=True, follow=True, prefix=keys)
            assert mine is not None
            assert held is not None
            field = a.field_of(held)
            assert field is not None
            live.append((mine, held, field))
            view = await a.peak_view()
            mirrored = view.handles[field]
            assert (mirrored.prefix, mirrored.borrowed, mirrored.unkeyed) == (
                mine.prefix,
                mine.borrowed,
                mine.unkeyed,
            )
        elif roll < 0.7:
            waiting = [entry for entry in live if entry[0].generated is None]
            if waiting:
                mine, _, field = rng.choice(waiting)
                ledger.progress(mine, 1, now)
                await a.publish([(field, mine.prompt_tokens, 10, True, 1, 0.0, 0.0)])
        else:
            mine, held, _ = live.pop(rng.randrange(len(live)))
            ledger.release(mine, now)
            await a.release(held)
            kept = {
                bytes.fromhex(k.decode()) for k in await a.client.smembers("{kvclient:u}:tainted")
            }
            assert kept == ledger.tainted
            tainted_seen += bool(kept)
    for mine, held, _ in live:
        ledger.release(mine)
        await a.release(held)
    assert ledger.tainted == set()
    return tainted_seen


async def test_the_scripts_keep_the_tainted_blocks_as_the_in_process_ledger_does(
    redis_server: RedisServer, closing: None
) -> None:
    """The in-process ledger's own bookkeeping (``tainted_after`` at each release) and the
    scripts' (where the holder goes) over the same random histories agree release by release,
    and leave nothing behind."""
    a = await sharing(redis_server, total_kv_tokens=1_000_000)
    tainted = 0
    for seed in range(6):
        tainted += await _history(a, random.Random(seed))
        assert await left_nothing(a)
    assert tainted > 0  # the histories did taint blocks


async def test_prefix_records_go_with_their_holders_however_they_go(
    redis_server: RedisServer, closing: None
) -> None:
    """Released, left while admitted, or swept with a lease that lapsed: the holder's prefix
    record and its blocks' counts go."""
    a = await sharing(redis_server)
    dead = await sharing(redis_server, ttl=1.0)  # never renewed
    keys = keys_of(a, list(range(200)))
    released = await a.try_admit(200, 100, peak=True, follow=True, prefix=keys)
    ticket = a.ticket(a.pricing.need_tokens(200, 100))
    left = await a.try_admit(200, 100, ticket=ticket, peak=True, follow=True, prefix=keys)
    swept = await dead.try_admit(200, 100, peak=True, follow=True, prefix=keys)
    unkeyed = await a.try_admit(200, 100, peak=True, follow=True)  # no keys: blocks unknown
    assert released is not None
    assert left is not None
    assert swept is not None
    assert unkeyed is not None
    assert await a.client.hlen("{kvclient:u}:prefixes") == 4
    assert (await record(a, a.field_of(unkeyed) or "") or "").startswith("0 1 ")
    await a.release(released)
    await a.leave(ticket)
    await a.release(unkeyed)
    for _ in range(300):  # the lease is 1 s; 3 s at most
        if len((await a.peak_view()).records) == 0:
            break
        await anyio.sleep(0.01)
    assert await left_nothing(a)


async def test_a_record_without_prefix_data_or_one_unread_counts_its_whole_prompt(
    redis_server: RedisServer, closing: None
) -> None:
    """A holder admitted by a gateway that writes no prefix record (an older one, or an engine
    that shares nothing) lends nothing; nor does one whose record this version cannot read."""
    old = await sharing(redis_server, shares=False)
    a = await sharing(redis_server)
    keys = keys_of(a, PROMPT)
    whole = await old.try_admit(2000, 1000, peak=True, follow=True)
    odd = await a.try_admit(2000, 1000, peak=True, follow=True, prefix=keys)
    assert whole is not None
    assert odd is not None
    for ledger, handle in ((old, whole), (a, odd)):
        name = ledger.field_of(handle)
        assert name is not None
        await ledger.publish([(name, 2000, 1000, True, 10, 0.0, 0.0)])
    odd_field = a.field_of(odd) or ""
    assert await record(old, old.field_of(whole) or "") is None
    await a.client.hset("{kvclient:u}:prefixes", odd_field, "a future format")
    view = await a.peak_view()
    assert all(r.prefix == () and r.borrowed == 0 for r in view.records)
    assert view.lent(keys) == 0  # nobody lends
    await a.release(odd)  # an unread record goes all the same
    assert await record(a, odd_field) is None


async def test_a_gateways_mirror_of_its_holders_counts_their_shared_blocks_once(
    redis_server: RedisServer, closing: None
) -> None:
    """Admitted through the shared queue, a holder is mirrored in its gateway's own ledger with
    its prefix's keys: what the gateway takes its own holders to hold in the engine (the engine's
    books, the peak it relays) counts the blocks a newcomer borrows once, and no holder there is
    taken for one whose blocks are unknown."""
    a = await sharing(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    keys = keys_of(a, PROMPT)
    lender = await queue.acquire(2000, 100, follow=True, prefix=keys)
    queue.progress(lender, 1)  # past its prefill: its blocks are computed
    borrower = await queue.acquire(2000, 100, follow=True, prefix=keys)
    assert [lender.prefix, borrower.prefix] == [keys, keys]
    assert borrower.borrowed == 124
    assert not lender.unkeyed
    assert not borrower.unkeyed
    for handle in (borrower, lender):
        await queue.release(handle)
    assert await left_nothing(a)
