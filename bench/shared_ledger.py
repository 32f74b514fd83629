"""The shared ledger (``kvclient gateway --ledger redis://...``) against the in-process one.

1. Admit + release pairs per second: the in-process ledger (one thread), and the shared one on
   a local ``redis-server`` (one Lua script each way, a round trip each) from one asyncio task
   and from 16 concurrent tasks on one connection pool.
2. Streamed events per second through 1, 2 and 4 gateway processes (``--workers N``) on one
   Redis in front of bench/instant_server.py (``--token-streams``: ``max_tokens`` events per
   stream), 32 streams at a time from a separate load process written with raw asyncio
   streams, counting ``data:`` events. On a 2-core machine the gateway processes, the load
   generator and the upstream share the cores, so the figure shows the ledger is not the
   bottleneck rather than how far more cores would take it.

    python bench/shared_ledger.py [--quick]

Needs ``redis-server`` on PATH (``scripts/test_setup.py`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (
    free_port,
    instant_server_process,
    print_table,
    redis_server,
    write_json,
)

from reference_server import KVAdmissionController
from reference_server.shared_ledger.connection import connect
from reference_server.shared_ledger.ledger import Lease, RedisLedger

STREAMS = 32
EVENTS_PER_STREAM = 64


def pricing() -> KVAdmissionController:
    return KVAdmissionController(total_kv_tokens=1_000_000, context_window=4096, decode_rate=50)


def in_process_pairs(seconds: float) -> float:
    ledger = pricing()
    done = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            handle = ledger.try_admit(100, 200, now=0.0)
            assert handle is not None
            ledger.release(handle)
        done += 1000
    return done / seconds


async def shared_pairs(url: str, seconds: float, tasks: int) -> float:
    ledger = RedisLedger(connect(url), name="bench", pricing=pricing(), lease=Lease())
    await ledger.join()
    done = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            handle = await ledger.try_admit(100, 200)
            assert handle is not None
            await ledger.release(handle)
            done += 1

    await asyncio.gather(*(worker() for _ in range(tasks)))
    await ledger.aclose()
    return done / seconds


LOAD = r"""
import asyncio, sys, time
host, port, streams, events = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
seconds = float(sys.argv[5])
body = ('{"prompt": "hi", "stream": true, "max_tokens": %d}' % events).encode()
head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
count = 0
async def one(end):
    global count
    while time.monotonic() < end:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + body)
        while True:
            line = await reader.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                count += 1
                if line.startswith(b"data: [DONE]"):
                    break
        writer.close()
async def main():
    end = time.monotonic() + seconds
    await asyncio.gather(*(one(end) for _ in range(streams)))
    print(count / seconds)
asyncio.run(main())
"""


def events_through(upstream: str, ledger: str, workers: int, seconds: float) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--upstream", upstream,
           "--port", str(port), "--ledger", ledger, "--workers", str(workers),
           "--log-level", "warning"]  # fmt: skip
    gateway = subprocess.Popen(cmd)
    try:
        import httpx

        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.1)
        args = ["127.0.0.1", str(port), str(STREAMS), str(EVENTS_PER_STREAM), str(seconds)]
        out = subprocess.run(
            [sys.executable, "-c", LOAD, *args], capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip())
    finally:
        gateway.terminate()
        gateway.wait(20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else 5.0
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    with redis_server() as url:
        pairs = {
            "in-process, 1 thread": in_process_pairs(seconds),
            "Redis, 1 task": asyncio.run(shared_pairs(url, seconds, 1)),
            "Redis, 16 tasks": asyncio.run(shared_pairs(url, seconds, 16)),
        }
        print_table(
            f"admit + release pairs per second ({date})",
            ["ledger", "pairs/s"],
            [[name, f"{value:,.0f}"] for name, value in pairs.items()],
        )
        events: dict[str, float] = {}
        with instant_server_process("--token-streams") as upstream:
            for workers in (1, 2, 4):
                events[str(workers)] = events_through(upstream, url, workers, seconds)
        print_table(
            f"streamed events per second through N gateway processes on one Redis ({date})",
            ["processes", "events/s"],
            [[n, f"{value:,.0f}"] for n, value in events.items()],
        )
    write_json(
        "shared_ledger", {"date": date, "pairs_per_second": pairs, "events_per_second": events}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
