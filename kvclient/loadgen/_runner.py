"""Drive a workload through a sender, open loop or closed loop, and record everything (I/O).

Open loop: each request is sent at its planned time (the schedule is fixed before the run), in
its own task, whatever the server is doing; the lag between planned and actual send is recorded so
a generator that fell behind shows it. Closed loop: ``concurrency`` workers each send the next
request when their previous one finished. Either way the run is bounded by the number of requests
and by ``duration`` (no new sends after it) plus ``grace`` (in-flight requests are then cancelled
and counted as failed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from ._metrics import RecordTimer, RequestRecord
from ._workload import WorkItem

__all__ = ["Sender", "run_load"]

_CANCELLED = "still in flight when the run ended (its duration + grace): cancelled"


class Sender(Protocol):
    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        """Send one request, filling ``timer.record``; must not raise for request failures."""
        ...


def _new_record(index: int, item: WorkItem, planned: float) -> RequestRecord:
    return RequestRecord(
        index=index,
        planned=planned,
        prompt_tokens=item.prompt_tokens,
        max_tokens_requested=item.max_tokens,
    )


async def _send_one(
    sender: Sender,
    item: WorkItem,
    timer: RecordTimer,
    on_done: Callable[[RequestRecord], None] | None,
) -> None:
    try:
        await sender.send(item, timer)
    except anyio.get_cancelled_exc_class():
        record = timer.record
        if record.end is None:
            record.ok = False
            record.error = "cancelled_at_end"
            record.message = _CANCELLED
            record.end = timer.now()
        raise
    except Exception as exc:  # a bug in a sender must not end the whole run unreported
        timer.record.ok = False
        timer.record.error = f"internal:{type(exc).__name__}"
        timer.record.message = f"the sender raised {type(exc).__name__}: {exc}"
        timer.mark_end()
    if on_done is not None:
        on_done(timer.record)


async def run_load(
    items: Sequence[WorkItem],
    sender: Sender,
    *,
    offsets: Sequence[float] | None = None,
    concurrency: int | None = None,
    duration: float | None = None,
    grace: float = 30.0,
    on_done: Callable[[RequestRecord], None] | None = None,
    clock: Callable[[], float] = anyio.current_time,
) -> tuple[list[RequestRecord], float]:
    """Run ``items`` through ``sender``; returns the records of the requests planned and the
    wall time of the run in seconds.

    Give ``offsets`` (planned send times, from :func:`arrival_offsets`) for an open loop, or
    ``concurrency`` for a closed loop.
    """
    if (offsets is None) == (concurrency is None):
        raise ValueError("give exactly one of offsets (open loop) or concurrency (closed loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if offsets is not None and len(offsets) > len(items):
        raise ValueError(f"{len(offsets)} planned sends but only {len(items)} work items")
    stop_sending_at = math.inf if duration is None else duration
    hard_stop = None if duration is None else duration + grace

    start = clock()
    records: list[RequestRecord] = []

    async def open_loop(tg: anyio.abc.TaskGroup) -> None:
        assert offsets is not None
        for index, offset in enumerate(offsets):
            if offset > stop_sending_at:
                break
            await anyio.sleep(max(0.0, start + offset - clock()))
            record = _new_record(index, items[index], offset)
            records.append(record)
            tg.start_soon(
                _send_one, sender, items[index], RecordTimer(record, clock, start), on_done
            )

    async def worker(queue: list[int]) -> None:
        while queue:
            now = clock() - start
            if now > stop_sending_at:
                return
            index = queue.pop()
            record = _new_record(index, items[index], now)
            records.append(record)
            await _send_one(sender, items[index], RecordTimer(record, clock, start), on_done)

    with anyio.move_on_after(math.inf if hard_stop is None else hard_stop):
        async with anyio.create_task_group() as tg:
            if offsets is not None:
                await open_loop(tg)
            else:
                assert concurrency is not None
                queue = list(reversed(range(len(items))))
                for _ in range(concurrency):
                    tg.start_soon(worker, queue)
    # Whatever was still running at the hard stop was cancelled: it failed, and says so.
    for record in records:
        if record.end is None:
            record.ok = False
            record.error = record.error or "cancelled_at_end"
            record.message = record.message or _CANCELLED
            record.end = clock() - start
    records.sort(key=lambda r: r.index)
    return records, clock() - start
