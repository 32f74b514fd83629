"""The forecast of outputs on the shared ledger, on a real Redis: a newcomer is counted to the
admitting gateway's forecast by every gateway (its record carries it), a holder that outlives its
forecast is published again at once, and the preemption budget weighs the engine's preemptions
against every gateway's requests."""

from __future__ import annotations

import pytest

from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.queue import Rejected
from reference_server.shared_ledger.queue import SharedQueue
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_ledgers import anyio_backend, closing
from tests.unit.test_shared_peak import gateway

__all__ = ["anyio_backend", "closing"]  # the fixtures, used by name

MODEL = "m"


def learnt(ledger: KVAdmissionController, lengths: list[int], cap: int = 4000) -> None:
    """Finished outputs of the model's requests, as the relay reports them."""
    for n in lengths:
        handle = ledger.try_admit(10, cap, now=0.0, follow=True, kind=(MODEL, None))
        assert handle is not None
        ledger.progress(handle, n, 0.0)
        ledger.ended(handle, by_itself=n < cap)
        ledger.release(handle, 0.0)


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.usefixtures("closing")
async def test_every_gateway_counts_a_newcomer_to_its_admitting_gateways_forecast(
    redis_server: RedisServer,
) -> None:
    a = await gateway(redis_server, preemption_budget=20)
    b = await gateway(redis_server, preemption_budget=20)
    for ledger in (a, b):  # outputs of 1..100 tokens, evenly, under caps of 4,000
        learnt(ledger.pricing, [n % 100 + 1 for n in range(400)])
    mine = SharedQueue(a.pricing, a, max_wait=0)
    theirs = SharedQueue(b.pricing, b, max_wait=0)
    wakes: list[int] = []
    mine.publish_soon = lambda: wakes.append(1)
    # Whole caps fit two holders of 100 + 4,000 in 9,000; by the forecast (the 0.75 quantile of
    # 1..100: 75) every one is 100 + 75 until it outlives it.
    held = [await mine.acquire(100, 4000, follow=True, model=MODEL) for _ in range(2)]
    held.append(await theirs.acquire(100, 4000, follow=True, model=MODEL))
    assert [h.counted_output for h in held] == [75, 75, 75]
    view = await b.peak_view()
    assert sorted(r.counted for r in view.records) == [75, 75, 75]
    assert all(r.tokens == 4112 for r in view.records)  # each reserves its worst case still
    # One outlives its forecast: counted further (0.9 of 76..100: 98) and published at once.
    mine.progress(held[0], 1)
    await mine.publish()
    wakes.clear()
    mine.progress(held[0], 75)
    assert held[0].counted_output == 98
    assert wakes == [1]
    await mine.publish()
    field = a.field_of(mine._links[held[0].id][1])
    (record,) = [r for r in (await b.peak_view()).records if r.field == field]
    assert (record.generated, record.counted) == (75, 98)
    for queue, handle in ((mine, held[0]), (mine, held[1]), (theirs, held[2])):
        await queue.release(handle)
    assert (await b.peak_view()).records == []


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.usefixtures("closing")
async def test_without_a_budget_or_outputs_learnt_a_newcomer_is_counted_to_its_cap(
    redis_server: RedisServer,
) -> None:
    exact = await gateway(redis_server)  # no preemption budget: the exact rule
    learnt(exact.pricing, [n % 100 + 1 for n in range(400)])
    queue = SharedQueue(exact.pricing, exact, max_wait=0)
    held = [await queue.acquire(100, 4000, follow=True, model=MODEL) for _ in range(2)]
    assert [r.counted for r in (await exact.peak_view()).records] == [4000, 4000]
    with pytest.raises(Rejected):  # two whole caps fill 9,000: a third does not fit
        await queue.acquire(100, 4000, follow=True, model=MODEL)
    for handle in held:
        await queue.release(handle)
    novice = await gateway(redis_server, preemption_budget=20)  # nothing learnt yet
    queue = SharedQueue(novice.pricing, novice, max_wait=0)
    handle = await queue.acquire(100, 4000, follow=True, model=MODEL)
    assert [r.counted for r in (await novice.peak_view()).records] == [4000]
    await queue.release(handle)


def test_the_budget_weighs_the_engines_preemptions_against_every_gateways_requests() -> None:
    ledger = KVAdmissionController(
        total_kv_tokens=10_000, context_window=8192, decode_rate=100.0, rule="peak",
        preemption_budget=20,
    )  # fmt: skip
    assert ledger.engine_seen(waiting=0, preemptions=0, requests=0) is None
    learnt(ledger, [50] * 60)  # this gateway followed 60 to their ends
    # A preemption every 120 requests: within the 4 allowed in any 200 of the 600 every gateway
    # ran, but 5 in this gateway's 60 would be over.
    for n in range(1, 6):
        assert ledger.engine_seen(waiting=0, preemptions=n, requests=120 * n) is None
    assert ledger.stats().forecast_quantile == 0.75
    alone = KVAdmissionController(
        total_kv_tokens=10_000, context_window=8192, decode_rate=100.0, rule="peak",
        preemption_budget=20,
    )  # fmt: skip
    alone.engine_seen(waiting=0, preemptions=0)
    learnt(alone, [50] * 60)
    said = alone.engine_seen(waiting=0, preemptions=5)
    assert said is not None
    assert "0.75 -> 0.9" in said
