"""The load generator is not the bottleneck: the highest open-loop rate it sustains on one core.

The generator runs pinned to CPU 0; an instant-answer server runs in another process on CPU 1.
For each rate of a ladder, a constant-rate open loop sends ``rate x seconds`` requests through
kvclient (token counting, clamping, retry machinery included) and we measure the achieved send
rate and the lag between planned and actual send times. "Sustained" means: achieved >= 95 % of the
target, p99 lag <= 50 ms, every request completed.

    python bench/loadgen_capacity.py [--quick]
"""

from __future__ import annotations

import argparse
import os

import anyio
import httpx
from _common import instant_server_process, print_table, write_json

from kvclient import AsyncClient, RetryPolicy, TiktokenCounter
from kvclient.loadgen import SyntheticWorkload, arrival_offsets, run_load, summarize
from kvclient.loadgen._kvsender import KVClientSender
from kvclient.loadgen._workload import Shape

MAX_LAG_P99 = 0.050
MIN_ACHIEVED = 0.95


async def one_rate(url: str, rate: float, seconds: float, stream: bool) -> dict[str, float]:
    n = int(rate * seconds)
    items = SyntheticWorkload(shapes=[Shape((100, 300), (16, 64))], seed=1).items(
        n, TiktokenCounter()
    )
    offsets = arrival_offsets(rate=rate, kind="constant", num_requests=n)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        client = AsyncClient(base_url=url, http_client=http, retry=RetryPolicy(max_attempts=3))
        records, wall = await run_load(
            items, KVClientSender(client, stream=stream), offsets=offsets
        )
    s = summarize(records, duration=wall)
    sent_times = [r.sent for r in records if r.sent is not None]
    span = max(sent_times) - min(sent_times) if len(sent_times) > 1 else 0.0
    achieved = (len(sent_times) - 1) / span if span > 0 else 0.0
    return {
        "target_rate": rate,
        "achieved_rate": achieved,
        "lag_p50": s.schedule_lag.p50 or 0.0,
        "lag_p99": s.schedule_lag.p99 or 0.0,
        "completed": s.completed,
        "sent": s.sent,
        "latency_p50": s.latency.p50 or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    args = parser.parse_args()
    pinned = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    if pinned:
        os.sched_setaffinity(0, {0})
    ladder = [100, 200, 400] if args.quick else [100, 200, 300, 400, 600, 800, 1200]
    seconds = 1.5 if args.quick else 3.0
    results = []
    with instant_server_process(cpu=1 if pinned else None) as url:
        anyio.run(one_rate, url, 50.0, 0.5, args.stream)  # warm-up: imports, encoding, sockets
        for rate in ladder:
            r = anyio.run(one_rate, url, float(rate), seconds, args.stream)
            r["sustained"] = float(
                r["achieved_rate"] >= MIN_ACHIEVED * rate
                and r["lag_p99"] <= MAX_LAG_P99
                and r["completed"] == r["sent"]
            )
            results.append(r)
    best = max((r["target_rate"] for r in results if r["sustained"]), default=0.0)
    rows = [
        [
            f"{r['target_rate']:.0f}",
            f"{r['achieved_rate']:.0f}",
            f"{r['lag_p50'] * 1000:.1f} ms",
            f"{r['lag_p99'] * 1000:.1f} ms",
            f"{r['completed']:.0f}/{r['sent']:.0f}",
            "yes" if r["sustained"] else "no",
        ]
        for r in results
    ]
    mode = "streamed" if args.stream else "non-streamed"
    print_table(
        f"Load generator on one core ({'pinned' if pinned else 'NOT pinned'}), {mode}, "
        "against an instant server on another",
        ["target req/s", "achieved req/s", "lag p50", "lag p99", "completed", "sustained"],
        rows,
    )
    print(f"\nhighest sustained rate: {best:.0f} req/s")
    write_json(
        f"loadgen_capacity{'_stream' if args.stream else ''}",
        {"pinned": pinned, "highest_sustained_rate": best, "results": results},
    )


if __name__ == "__main__":
    main()
