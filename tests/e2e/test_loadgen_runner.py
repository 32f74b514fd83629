from __future__ import annotations

import anyio
import pytest

from kvclient.loadgen import RecordTimer, WorkItem, arrival_offsets, run_load, summarize

pytestmark = pytest.mark.anyio

ITEMS = [WorkItem(prompt="x", max_tokens=5, prompt_tokens=1) for _ in range(20)]


class FakeSender:
    """Answers after ``delay`` seconds; fails every ``fail_every``-th request."""

    def __init__(self, delay: float = 0.0, fail_every: int = 0, hang_from: int | None = None):
        self.delay = delay
        self.fail_every = fail_every
        self.hang_from = hang_from
        self.in_flight = 0
        self.peak = 0

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        r = timer.record
        timer.mark_sent()
        r.attempts = 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.hang_from is not None and r.index >= self.hang_from:
                await anyio.sleep_forever()
            await anyio.sleep(self.delay)
            if self.fail_every and r.index % self.fail_every == 0:
                r.error = "boom"
            else:
                r.ok = True
                r.output_tokens = 3
                timer.mark_token()
                timer.mark_token()
        finally:
            self.in_flight -= 1
        timer.mark_end()


async def test_open_loop_sends_on_schedule_regardless_of_slow_answers() -> None:
    # Answers take 50 ms but arrivals are every 2 ms: an open loop does not wait for answers.
    sender = FakeSender(delay=0.05)
    offsets = arrival_offsets(rate=500, kind="constant", num_requests=10)
    records, wall = await run_load(ITEMS, sender, offsets=offsets)
    assert len(records) == 10
    assert sender.peak >= 5
    assert all(r.ok for r in records)
    assert [r.index for r in records] == list(range(10))
    assert wall < 1.0


async def test_closed_loop_respects_concurrency() -> None:
    sender = FakeSender(delay=0.002)
    records, _ = await run_load(ITEMS, sender, concurrency=3)
    assert len(records) == 20
    assert sender.peak == 3


async def test_failures_are_recorded_and_counted() -> None:
    records, wall = await run_load(ITEMS[:9], FakeSender(fail_every=3), concurrency=2)
    s = summarize(records, duration=wall)
    assert (s.sent, s.completed, s.failed) == (9, 6, 3)
    assert s.failed_by_cause == {"boom": 3}


async def test_hard_stop_cancels_and_reports_in_flight() -> None:
    offsets = arrival_offsets(rate=1000, kind="constant", num_requests=5)
    records, wall = await run_load(
        ITEMS, FakeSender(hang_from=2), offsets=offsets, duration=0.01, grace=0.05
    )
    assert wall < 1.0
    assert [r.ok for r in records] == [True, True, False, False, False]
    assert {r.error for r in records[2:]} == {"cancelled_at_end"}
    assert all(r.end is not None for r in records)


async def test_sender_bug_is_reported_not_raised() -> None:
    class Broken:
        async def send(self, item: WorkItem, timer: RecordTimer) -> None:
            raise RuntimeError("oops")

    records, _ = await run_load(ITEMS[:2], Broken(), concurrency=1)
    assert [r.error for r in records] == ["internal:RuntimeError"] * 2
    assert [r.message for r in records] == ["the sender raised RuntimeError: oops"] * 2


async def test_argument_checks() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        await run_load(ITEMS, FakeSender())
    with pytest.raises(ValueError, match="only 20 work items"):
        await run_load(ITEMS, FakeSender(), offsets=[0.0] * 21)
