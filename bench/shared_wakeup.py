"""How soon a waiter in one process is admitted after another process releases, on one Redis.

Two processes, each with its own shared ledger and queue on one local ``redis-server`` (as two
gateway processes have). Each round, the holder process fills the budget; the waiter process
asks for room and waits in the shared queue; the holder releases at a random moment (0-50 ms
later, so that the release falls anywhere in a poll's interval) and the time from just before
its release to the waiter's admission is measured on the machine's monotonic clock (one clock
for every process on Linux). Twice: the waiter woken by Redis pub/sub (the gateway's way, the
poll as a fallback every 0.5 s), and by polling alone, every 20 ms (as before pub/sub).

    python bench/shared_wakeup.py [--rounds N] [--quick]

Needs ``redis-server`` on PATH (``scripts/test_setup.py`` installs it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import anyio
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine, print_table, write_json
from shared_ledger import redis_server

from reference_server import KVAdmissionController
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.ledger import Lease, RedisLedger
from reference_server.shared_ledger.queue import POLL_SECONDS, SharedQueue
from reference_server.shared_ledger.wakeups import Wakeups

#: The upstream's budget: 9,000 usable tokens; the holder takes 8,000, the waiter asks 2,000.
NAME = "http://bench-upstream"
HOLD, WAIT = 8000, 2000


def _pricing() -> KVAdmissionController:
    return KVAdmissionController(total_kv_tokens=10_000, context_window=8192, decode_rate=100.0)


async def _ledger(url: str) -> RedisLedger:
    ledger = RedisLedger(connect(url), name=NAME, pricing=_pricing(), lease=Lease())
    await ledger.join()
    return ledger


async def _holder(url: str, rounds: int, pipe: Connection) -> list[float]:
    ledger = await _ledger(url)
    queue = SharedQueue(ledger.pricing, ledger, max_wait=10)
    delays = []
    try:
        for _ in range(rounds):
            held = await queue.acquire(0, HOLD)
            pipe.send("go")
            await anyio.to_thread.run_sync(pipe.recv)  # the waiter is in the queue
            await anyio.sleep(random.uniform(0, 0.05))
            released = time.monotonic()
            await queue.release(held)
            admitted: float = await anyio.to_thread.run_sync(pipe.recv)
            delays.append(admitted - released)
    finally:
        await ledger.aclose()
    return delays


async def _admit(queue: SharedQueue, admitted: list[float]) -> None:
    handle = await queue.acquire(0, WAIT)
    admitted.append(time.monotonic())
    await queue.release(handle)


async def _waiter(url: str, rounds: int, pubsub: bool, pipe: Connection) -> None:
    ledger = await _ledger(url)
    wakeups = Wakeups(ledger.client) if pubsub else None
    queue = SharedQueue(ledger.pricing, ledger, max_wait=10, wakeups=wakeups)
    async with anyio.create_task_group() as group:
        if wakeups is not None:
            group.start_soon(wakeups.run)
            for _ in range(500):
                if wakeups.subscribed:
                    break
                await anyio.sleep(0.01)
        for _ in range(rounds):
            await anyio.to_thread.run_sync(pipe.recv)
            admitted: list[float] = []
            async with anyio.create_task_group() as one:
                one.start_soon(_admit, queue, admitted)
                await anyio.sleep(0.03)  # its first try found no room: it waits in the queue
                pipe.send("waiting")
            pipe.send(admitted[0])
        group.cancel_scope.cancel()
    await ledger.aclose()


def _run_waiter(url: str, rounds: int, pubsub: bool, pipe: Connection) -> None:
    anyio.run(_waiter, url, rounds, pubsub, pipe)


def measure(url: str, rounds: int, pubsub: bool) -> list[float]:
    mine, theirs = multiprocessing.Pipe()
    waiter = multiprocessing.get_context("spawn").Process(
        target=_run_waiter, args=(url, rounds, pubsub, theirs)
    )
    waiter.start()
    try:
        return anyio.run(_holder, url, rounds, mine)
    finally:
        waiter.join(30)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="releases per way (default: 300)")
    parser.add_argument("--quick", action="store_true", help="20 rounds (a smoke test)")
    args = parser.parse_args()
    rounds = 20 if args.quick else args.rounds
    date = machine()["date"]
    results: dict[str, dict[str, float]] = {}
    with redis_server() as url:
        for way, pubsub in ((f"poll every {POLL_SECONDS * 1000:.0f} ms", False), ("pub/sub", True)):
            delays = measure(url, rounds, pubsub)
            results[way] = {
                "p50_ms": _quantile(delays, 0.5) * 1000,
                "p99_ms": _quantile(delays, 0.99) * 1000,
                "mean_ms": statistics.fmean(delays) * 1000,
                "max_ms": max(delays) * 1000,
                "rounds": len(delays),
            }
    print_table(
        f"release in one process -> admission of a waiter in another, one Redis ({date})",
        ["wake-up", "rounds", "p50 ms", "p99 ms", "mean ms", "max ms"],
        [
            [way, r["rounds"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['mean_ms']:.2f}",
             f"{r['max_ms']:.2f}"]
            for way, r in results.items()
        ],
    )  # fmt: skip
    write_json("shared_wakeup", {"date": date, "release_to_admission": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
