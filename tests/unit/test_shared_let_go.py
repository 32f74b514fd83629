"""The let-go race on the shared ledger, on a real Redis: a short request that lives wholly
between two of a gateway's reads of every gateway's holders is in neither, while the engine's
page, begun between them, may show it. Redis keeps the holders let go for a while (their last
records and when: see ``let_go.py``), and a gateway's books count them until the page is newer
than their release, as the in-process ledger counts its own."""

from __future__ import annotations

import pytest

from reference_server.admission.values import Handle
from reference_server.shared_ledger.ledger import RedisLedger
from reference_server.shared_ledger.let_go import LET_GO_SECONDS
from reference_server.shared_ledger.queue import SharedQueue
from reference_server.shared_ledger.view import PeakView, Record, explained_elsewhere
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import anyio_backend, closing
from tests.unit.test_shared_peak import gateway, pricing

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name

LET_GO = "{kvclient:u}:let_go"
LET_GO_RECORDS = "{kvclient:u}:let_go_records"


async def short(ledger: RedisLedger, generated: int = 50) -> tuple[Handle, str]:
    """A short request (prompt 100, cap 100) admitted by the peak, ``generated`` tokens
    published as read just now: its handle and its reservation's name."""
    handle = await ledger.try_admit(100, 100, peak=True, follow=True)
    assert handle is not None
    field = ledger.field_of(handle)
    assert field is not None
    await ledger.publish([(field, 100, 100, True, generated, 0.0, 0.0)])
    return handle, field


@pytest.mark.redis
@pytest.mark.anyio
async def test_another_gateways_request_between_two_reads_of_the_holders_explains_the_page(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    await queue.look_elsewhere()  # the watch's first read: nobody holds anything
    started = queue.now()  # the engine's page begins
    handle, _ = await short(b)  # b's short request, admitted and let go...
    await b.release(handle)
    await queue.look_elsewhere()  # ...before the second read: in neither
    now = queue.now()
    # The page still showed it (100 + 50 tokens: 10 blocks of 16), with the watch's margin.
    since = started - a.pricing.relay_lag
    assert a.pricing.engine_used(160, since, now) == 0
    assert a.pricing.caps_reason is None
    assert a.pricing.engine_used(160 + 2000, since, now) > 0  # someone unseen still shows
    assert a.pricing.caps_reason is not None


@pytest.mark.redis
@pytest.mark.anyio
async def test_its_own_request_between_two_reads_of_the_holders_explains_the_page(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    await queue.look_elsewhere()
    started = queue.now()
    mine = await queue.acquire(100, 100, follow=True)
    queue.progress(mine, 50)
    await queue.release(mine)  # its mirror remembers it, as the in-process ledger does
    await queue.look_elsewhere()
    assert a.pricing.engine_used(160, started - a.pricing.relay_lag, queue.now()) == 0
    assert a.pricing.caps_reason is None


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_holder_let_go_is_kept_with_its_records_for_a_while_and_read_when_asked(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    handle, field = await short(b, generated=7)
    await b.release(handle)
    assert (await a.peak_view()).let_go == []  # only when asked: admission needs none
    view = await a.peak_view(let_go=True)
    assert view.records == []
    ((released, record),) = view.let_go
    assert view.now - 1.0 <= released <= view.now
    assert (record.field, record.lease, record.tokens, record.cap) == (field, b.lease.id, 208, 100)
    assert (record.prompt, record.generated, record.tracked) == (100, 7, True)
    for key in (LET_GO, LET_GO_RECORDS):  # the keys go when nothing is let go for that long
        assert 0 < await a.client.pttl(key) <= LET_GO_SECONDS * 1000
    # Older than LET_GO_SECONDS: forgotten by the next script's sweep (the clock driven here
    # by its score).
    old = round(view.now * 1000 - LET_GO_SECONDS * 1000) - 1
    await a.client.zadd(LET_GO, {field: old})
    assert (await a.peak_view(let_go=True)).let_go == []
    assert await a.client.zcard(LET_GO) == 0
    assert await a.client.hlen(LET_GO_RECORDS) == 0


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_swept_lease_and_a_waiter_that_left_are_not_kept_as_let_go(
    redis_server: RedisServer, closing: None
) -> None:
    dead = await gateway(redis_server)
    alive = await gateway(redis_server)
    await short(dead)
    # Its lease lapsed (the clock driven by its expiry): swept at the next script.
    await alive.client.zadd("{kvclient:u}:leases", {dead.lease.id: 0})
    view = await alive.peak_view(let_go=True)
    assert (view.records, view.let_go) == ([], [])
    # A ticket admitted for a waiter that left before it was sent: never in the engine.
    ticket = alive.ticket(208)
    held = await alive.try_admit(100, 100, ticket=ticket, follow=True)
    assert held is not None
    await alive.leave(ticket)
    view = await alive.peak_view(let_go=True)
    assert (view.records, view.let_go) == ([], [])


def _record(field: str) -> Record:
    """A short holder of 100 + 100, 20 made as read at 10.5 s (Redis clock)."""
    return Record(
        field=field, lease=field.split(":")[0], tokens=208, cap=100, admitted_at=10.0,
        prompt=100, counted=100, tracked=True, generated=20, seen_at=10.5, first_seen_at=10.1,
    )  # fmt: skip


def test_a_holder_let_go_counts_until_the_page_is_newer_than_its_release() -> None:
    p = pricing(relay_lag=0.0)  # the shared margin: the 0.1 s publish interval alone
    gone = _record("b:1:208")
    view = PeakView(now=12.0, grown="1", records=[], pricing=p, let_go=[(10.5, gone)])
    # As it was when let go: its count and what twice 100 tokens/s make in the margin.
    assert explained_elsewhere([view], "a", 12.0, since=10.4) == 144  # 100 + 20 + 20: 9 blocks
    assert explained_elsewhere([view], "a", 12.0, since=10.5) == 144
    assert explained_elsewhere([view], "a", 12.0, since=10.6) == 0  # the page is newer
    assert explained_elsewhere([view], "b", 12.0, since=10.4) == 0  # its own: the mirror's
    # Live in the older view, let go in the newer: counted once, as live.
    live = PeakView(now=10.5, grown="1", records=[gone], pricing=p)
    alone = explained_elsewhere([live], "a", 12.0, since=0.0)
    assert alone > 144  # live, it may have made more by then
    assert explained_elsewhere([live, view], "a", 12.0, since=0.0) == alone


def test_a_snapshot_without_holders_let_go_reads_as_none() -> None:
    """``PEAK_SNAPSHOT``'s answer as a gateway of an older version's script gives it."""
    raw = [12_000, b"1", 0, [], [], [], b""]
    assert PeakView.parse(raw, pricing()).let_go == []
