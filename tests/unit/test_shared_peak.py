"""The peak rule on the shared ledger, on a real Redis: holders' progress published and read back,
two gateways admitting by the peak of each other's holders, the compare-and-set that refuses a
decision taken on a set of holders that has grown since, and a dead gateway's holders counted
from their last published progress until its lease lapses."""

from __future__ import annotations

import anyio
import pytest

from reference_server.admission.holders import as_holder, freshest
from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.queue import Rejected
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.lease import Lease
from reference_server.shared_ledger.ledger import RedisLedger
from reference_server.shared_ledger.queue import SharedQueue
from reference_server.shared_ledger.view import PeakView
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import OPENED, anyio_backend, closing

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name


def pricing(**kw: object) -> KVAdmissionController:
    """9,000 usable tokens in blocks of 16, 100 tokens/s: three requests of prompt 100 and cap
    4,000 (4,112 tokens each) do not fit on whole caps, two do."""
    settings: dict[str, object] = {
        "total_kv_tokens": 10_000,
        "context_window": 8192,
        "decode_rate": 100.0,
        "rule": "peak",
    }
    settings.update(kw)
    return KVAdmissionController(**settings)  # type: ignore[arg-type]


async def gateway(server: RedisServer, *, ttl: float = 5.0, **kw: object) -> RedisLedger:
    """One gateway process's shared ledger of upstream ``u`` (``kw``: its pricing's)."""
    ledger = RedisLedger(connect(server.url), name="u", pricing=pricing(**kw), lease=Lease(ttl=ttl))
    OPENED.append(ledger)
    await ledger.join()
    return ledger


async def holding(ledger: RedisLedger, generated: int | None, *, cap: int = 4000) -> str:
    """Admit a followed holder (prompt 100) by the peak and publish ``generated`` as read just
    now (None: nothing yet); its reservation's name."""
    handle = await ledger.try_admit(100, cap, peak=True, follow=True)
    assert handle is not None
    field = ledger.field_of(handle)
    assert field is not None
    if generated is not None:
        await ledger.publish([(field, 100, cap, True, generated, 0.0, 0.0)])
    return field


@pytest.mark.redis
@pytest.mark.anyio
async def test_progress_is_published_and_read_back_and_goes_with_its_holder(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    handle = await a.try_admit(100, 4000, peak=True, follow=True)
    assert handle is not None
    field = a.field_of(handle)
    assert field is not None
    (record,) = (await b.peak_view()).records
    assert (record.prompt, record.counted, record.tracked) == (100, 4000, True)
    assert record.generated is None
    assert await a.publish([(field, 100, 4000, True, 7, 0.05, 0.2)]) == 1  # its first count
    view = await b.peak_view()
    (record,) = view.records
    assert record.generated == 7
    assert view.now - 0.2 <= record.seen_at - 0.05 <= view.now  # stamped when it was read
    assert record.first_seen_at <= record.seen_at
    assert await a.publish([(field, 100, 4000, True, 5, 0.0, 0.0)]) == 0  # an older batch
    assert (await b.peak_view()).records[0].generated == 7
    assert await b.publish([(field, 100, 4000, True, 9, 0.0, 0.0)]) == 0  # not b's holder
    assert (await b.peak_view()).records[0].generated == 7
    await a.publish([(field, 100, 4000, False, 7, 0.0, 0.0)])  # its relay let it go
    view = await b.peak_view()
    assert not view.records[0].tracked
    assert view.handles[field].reserved_tokens == 4112
    assert (
        as_holder(view.handles[field], view.now, decode_rate=100.0, relay_lag=0.25).held == 4112
    )  # counted whole
    await a.release(handle)
    assert (await b.peak_view()).records == []
    assert await a.client.hlen("{kvclient:u}:progress") == 0


@pytest.mark.redis
@pytest.mark.anyio
async def test_two_gateways_admit_by_the_peak_of_each_others_holders(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(a, 3950)  # near its end
    await holding(b, None)  # before its first token: whole
    assert await b.try_admit(100, 4000, peak=True) is None  # 3 x 4,112 on caps; 2 whole by the peak
    late = await a.peak_view()
    b_field = next(r.field for r in late.records if r.lease == b.lease.id)
    await b.publish([(b_field, 100, 4000, True, 10, 0.0, 0.0)])  # b's holder has begun
    assert await b.try_admit(100, 4000) is None  # whole caps still refuse
    third = await b.try_admit(100, 4000, peak=True)
    assert third is not None  # the one near its end leaves room before the other grows
    assert (await a.peak_view()).reserved == 3 * 4112 > a.usable_tokens


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_decision_on_a_set_of_holders_grown_since_is_read_again(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(a, 3950)
    await holding(b, 10)
    reads = 0
    real = a.peak_view

    async def racing() -> PeakView:  # b admits between a's snapshot and a's commit
        nonlocal reads
        view = await real()
        reads += 1
        if reads == 1:
            assert view.fits(100, 4000, 4112)
            assert await b.try_admit(100, 4000, peak=True) is not None
        return view

    a.peak_view = racing  # type: ignore[method-assign]
    assert await a.try_admit(100, 4000, peak=True) is None  # read again: no room left
    assert reads == 2
    assert (await b.peak_view()).reserved == 3 * 4112


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_release_or_progress_since_the_snapshot_does_not_undo_its_decision(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(a, 3950)
    b_field = await holding(b, 10)
    extra = await b.try_admit(0, 16)  # a small holder on whole caps
    assert extra is not None
    real = a.peak_view
    reads = 0

    async def racing() -> PeakView:
        nonlocal reads
        view = await real()
        reads += 1
        await b.release(extra)
        await b.publish([(b_field, 100, 4000, True, 20, 0.0, 0.0)])
        return view

    a.peak_view = racing  # type: ignore[method-assign]
    assert await a.try_admit(100, 4000, peak=True) is not None
    assert reads == 1


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_dead_gateways_holders_count_from_their_last_progress_until_its_lease_lapses(
    redis_server: RedisServer, closing: None
) -> None:
    dead = await gateway(redis_server, ttl=1.5)  # never renewed: it dies with its holder early
    alive = await gateway(redis_server)
    dead_field = await holding(dead, 10)
    published = (await alive.peak_view()).records[0].seen_at
    for _ in range(100):  # until 0.4 s of the Redis clock have passed (1 s at most)
        view = await alive.peak_view()
        if view.now - published >= 0.4:
            break
        await anyio.sleep(0.01)
    await holding(alive, 3950)  # read just now: the dead holder's count is 0.4 s older
    view = await alive.peak_view()
    handles = view.model.live_handles()
    fresh = freshest(handles, view.now)
    dead_one = as_holder(
        view.handles[dead_field], fresh, decode_rate=100.0, relay_lag=view.model.relay_lag
    )
    # Its count, and what it could have made at twice the speed in the 0.4 s and the margin.
    assert dead_one.held >= 100 + 10 + 2 * 100 * (0.4 + 0.35)
    assert dead_one.steps_left == 4000 - 10 + 1  # counted from its last count
    for _ in range(300):  # the lease is 1.5 s; 3 s at most
        if len((await alive.peak_view()).records) == 1:
            break
        await anyio.sleep(0.01)
    (record,) = (await alive.peak_view()).records
    assert record.lease == alive.lease.id
    assert await alive.client.hlen("{kvclient:u}:progress") == 1


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_shared_queue_publishes_what_its_relay_reads(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    wakes: list[int] = []
    queue.publish_soon = lambda: wakes.append(1)
    assert queue.on_peak
    mine = await queue.acquire(100, 4000, follow=True)
    assert mine.tracked
    queue.progress(mine, 1)
    assert wakes == [1]  # the first token: at once
    await queue.publish()
    assert (await b.peak_view()).records[0].generated == 1
    queue.progress(mine, 5)
    queue.progress(mine, 16)
    assert wakes == [1]  # a few more: at the interval
    await queue.publish()
    assert (await b.peak_view()).records[0].generated == 16
    queue.progress(mine, 16 + 16)
    assert wakes == [1, 1]  # tokens enough
    a.pricing.unfollow(mine)
    await queue.publish()
    assert not (await b.peak_view()).records[0].tracked
    await queue.release(mine)
    assert (await b.peak_view()).records == []


@pytest.mark.redis
@pytest.mark.anyio
async def test_off_the_peak_rule_for_now_the_shared_queue_admits_on_caps_and_still_follows(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    a.pricing.engine_unseen("its /metrics could not be reached")
    assert not queue.on_peak
    first = await queue.acquire(100, 4000, follow=True)
    second = await queue.acquire(100, 4000, follow=True)
    for handle, made in ((first, 3950), (second, 10)):
        queue.progress(handle, made)
    await queue.publish()
    with pytest.raises(Rejected):  # the peak would let it in (see above): whole caps do not
        await queue.acquire(100, 4000, follow=True)
    records = (await a.peak_view()).records
    assert [r.generated for r in records] == [3950, 10]  # followed all the same


@pytest.mark.redis
@pytest.mark.anyio
async def test_off_the_peak_rule_for_good_a_holder_has_no_progress_record(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    a.pricing.set_caps_for_good("this engine does not report each stream's progress exactly")
    held = await queue.acquire(100, 4000, follow=True)
    assert not held.tracked
    (record,) = (await a.peak_view()).records
    assert record.prompt is None  # no progress record: whole, wherever it is read


@pytest.mark.redis
@pytest.mark.anyio
async def test_retry_after_by_the_peak_counts_every_gateways_progress(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(a, 3950)  # 50 tokens from its end: half a second
    await holding(b, None)  # whole
    assert await b.try_admit(100, 4000, peak=True) is None
    by_peak, _ = await b.retry_after(4112, peak=True)
    by_caps, _ = await b.retry_after(4112)
    assert 0 < by_peak <= 1.0  # the one near its end leaves room
    assert by_caps > 30  # its whole cap's worth, at 100 tokens/s


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_refusal_counts_on_this_gateways_cut_requests_to_end_soon(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    held = [await queue.acquire(100, 4000, follow=True) for _ in range(2)]
    for handle in held:
        queue.progress(handle, 10)  # 3,990 tokens from their caps: 40 s at 100 tokens/s
    await queue.publish()
    with pytest.raises(Rejected) as running:
        await queue.acquire(100, 4000, follow=True)
    assert running.value.retry_after > 30
    # Their clients went away: the relay reset their streams, and the engine lets them go
    # within a step and the relay's lag (their records cannot say so: this gateway knows).
    for handle in held:
        a.pricing.cut(handle, queue.now() + 0.5)
    with pytest.raises(Rejected) as cut:
        await queue.acquire(100, 4000, follow=True)
    assert cut.value.retry_after <= 2


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_engines_books_count_the_other_gateways_holders(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(b, 200)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    mine = await queue.acquire(100, 4000, follow=True)
    queue.progress(mine, 100)
    await queue.publish()  # and a view of every gateway's holders
    now = queue.now()
    # b's holder (300 tokens, and its margin) and this one's (200): nothing unexplained.
    assert a.pricing.engine_used(496, now - 0.1, now) == 0
    assert a.pricing.caps_reason is None
    assert a.pricing.engine_used(496 + 2000, now - 0.1, now) > 0  # someone unseen
    assert a.pricing.caps_reason is not None


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_room_shown_is_the_peaks(redis_server: RedisServer, closing: None) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    await holding(b, 3950)
    queue = SharedQueue(a.pricing, a, max_wait=0)
    mine = await queue.acquire(100, 4000, follow=True)
    queue.progress(mine, 10)
    await queue.publish()
    on_caps = a.usable_tokens - 2 * 4112
    assert queue.room()[0] > on_caps + 3000  # the one near its end leaves room soon
    assert queue.headroom().free == queue.room()[0]


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_lockstep_break_seen_at_one_gateway_puts_every_gateway_on_caps_until_drained(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server)
    b = await gateway(redis_server)
    queue_a = SharedQueue(a.pricing, a, max_wait=0)
    queue_b = SharedQueue(b.pricing, b, max_wait=0)
    near = await queue_a.acquire(100, 4000, follow=True)
    early = await queue_b.acquire(100, 4000, follow=True)
    queue_a.progress(near, 3950)
    queue_b.progress(early, 10)
    await queue_a.publish()
    await queue_b.publish()
    reason = "1 streams stalled while others advanced"
    a.pricing.run_on_caps(reason)  # what the watch does at a's, which alone sees its streams
    queue_a.out_of_step(reason)
    await queue_a.publish()
    view = await b.peak_view()
    assert view.drain is not None
    assert view.drain.endswith(reason)
    assert b.pricing.caps_reason == f"another gateway: {reason}"
    assert not queue_b.on_peak
    assert await b.try_admit(100, 4000, peak=True) is None  # the peak would let it in
    await queue_a.release(near)
    await queue_b.release(early)
    assert (await b.peak_view()).drain is None
    assert b.pricing.caps_reason is None
    assert queue_b.on_peak


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_newcomer_on_the_engines_clock_carries_its_deadline_to_every_gateway(
    redis_server: RedisServer, closing: None
) -> None:
    a = await gateway(redis_server, start_clock=True)
    b = await gateway(redis_server, start_clock=True)
    assert not a.pricing.clock_runs()  # not before the engine's speed is measured
    for ledger in (a, b):  # from the engine's counters, step by step
        ledger.pricing.set_speed(100.0, None, 0.0, steps=True)
    assert a.pricing.clock_runs()
    # Two holders of 100 + 4,000 that end in about a second: a newcomer counted whole until
    # its first token (4,112) does not fit beside them in 9,000; counted from its admission it
    # holds 100 + the steps it has run, and they end before it outgrows the room.
    await holding(a, 3900)
    await holding(b, 3900)
    handle = await b.try_admit(100, 4000, peak=True, follow=True)
    assert handle is not None
    field = b.field_of(handle)
    assert field is not None
    view = await a.peak_view()
    (record,) = [r for r in view.records if r.field == field]
    assert record.start_by is not None
    assert view.now < record.start_by <= view.now + 1.0  # 9 steps and the margins
    # Its first count, published, ends the deadline; the deadline is kept in the record.
    await b.publish([(field, 100, 4000, True, 1, 0.0, 0.0)])
    (record,) = [r for r in (await a.peak_view()).records if r.field == field]
    assert record.generated == 1
    assert record.start_by is None
    raw = await a.client.hget("{kvclient:u}:progress", field)
    assert raw is not None
    assert raw.decode().split(" ")[6] != "0"


def test_a_first_token_past_its_deadline_stops_the_clock_for_every_newcomer() -> None:
    from reference_server.shared_ledger.view import Record

    p = pricing(start_clock=True)
    p.set_speed(100.0, None, 0.0, steps=True)

    def ending(name: str) -> Record:  # 100 + 4,000, 3,900 made: ends in about a second
        return Record(
            field=name, lease="g", tokens=4112, cap=4000, admitted_at=0.0, prompt=100,
            counted=4000, tracked=True, generated=3900, seen_at=1.0, first_seen_at=0.1,
        )  # fmt: skip

    small = Record(
        field="g:3:208", lease="g", tokens=208, cap=100, admitted_at=0.9, prompt=100,
        counted=100, tracked=True, start_by=1.05,
    )  # fmt: skip
    holders = [ending("g:1:4112"), ending("g:2:4112"), small]
    for clock, now, fits in ((True, 1.0, True), (False, 1.0, False), (True, 1.1, False)):
        view = PeakView(now=now, grown="3", records=holders, pricing=p, clock=clock)
        fit = view.fits(100, 4000, 4112, follow=True)
        assert (fit is not None) == fits, (clock, now)
        if fit is not None:
            assert fit.start_by is not None
