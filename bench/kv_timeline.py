"""KV over time, with and without the gateway: the seed's failure and its fix, as a picture.

One seeded open-loop trace of the seed's mix (short prompts with large or unset caps, long
prompts with small caps), sent through kvclient's ``AsyncClient`` twice:

1. straight to ``kvclient serve --admission prompt``: the engine admits by the prompt alone, so
   the KV it really uses grows past what it reserved until the pool overflows and every
   in-flight request fails (the seed's mid-decode OOM);
2. to ``kvclient gateway`` in front of the same engine (``--admission prompt`` again: the
   gateway is the only one reserving): prompt + output cap are reserved for each request's
   whole life, what does not fit waits in the gateway's FIFO queue or gets 429 + Retry-After,
   and the engine's KV in use stays under the reservation, so under the pool.

Both servers run in this process on loopback ports chosen at run time
(``reference_server.testing``); their ``/metrics`` are sampled every ``--interval`` seconds:
``kv_used_tokens`` (the engine's KV in use), ``kv_reserved_tokens`` and ``kv_usable_tokens``
(the ledger's: the engine's own for the direct run, the gateway's behind it),
``kv_physical_capacity_tokens`` (the pool) and ``kv_oom_events_total``. Every request has a
deadline and the run a hard stop, so it is bounded in time whatever the servers do.

    python bench/kv_timeline.py [--quick] [--plot docs/img/kv_reserved.png]
    python bench/kv_timeline.py --plot docs/img/kv_reserved.png --plot-only  # from the last run
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
from _common import print_table, write_json
from _plots import add_plot_arguments, plot_kv_timeline, plot_only, plot_result

from kvclient import AsyncClient, RetryPolicy, TiktokenCounter
from kvclient.loadgen import SyntheticWorkload, WorkItem, arrival_offsets, run_load, summarize
from kvclient.loadgen._kvsender import KVClientSender
from kvclient.loadgen._report import parse_prometheus_text
from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway

KV_TOKENS = 32_768
CONTEXT = 8192
DECODE_RATE = 1000.0
MEAN_OUTPUT = 1500.0
#: About twice what reserving prompt + cap sustains for this mix and pool (admission_strategies
#: measures 1.5x at 12/s): enough for prompt-only admission to overflow the pool.
RATE = 16.0
DEADLINE = 60.0
MAX_QUEUE_WAIT = 10.0
INTERVAL = 0.1
SEED = 7
MODEL = "kvclient-sim"


@contextlib.contextmanager
def direct(decode_rate: float) -> Iterator[tuple[str, str, str]]:
    """The engine alone; yields (the URL to send to, the ledger's metrics, the engine's)."""
    with running_server(**_engine(decode_rate)) as engine:
        yield engine.base_url, engine.base_url, engine.base_url


@contextlib.contextmanager
def through_gateway(decode_rate: float) -> Iterator[tuple[str, str, str]]:
    with running_server(**_engine(decode_rate)) as engine:
        config = GatewayConfig(
            upstreams=(engine.base_url,), decode_rate=decode_rate, max_queue_wait=MAX_QUEUE_WAIT
        )
        with running_gateway(config) as gateway:
            yield gateway.base_url, gateway.base_url, engine.base_url


def _engine(decode_rate: float) -> dict[str, Any]:
    return {
        "kv_tokens": KV_TOKENS,
        "context_window": CONTEXT,
        "decode_rate": decode_rate,
        "mean_output_tokens": MEAN_OUTPUT,
        "admission": "prompt",
        "seed": SEED,
    }


RUNS = {
    "direct": (direct, "kvclient serve --admission prompt (reserves prompts only)"),
    "gateway": (through_gateway, "kvclient gateway (prompt + cap reserved) in front of it"),
}


async def drive(
    urls: tuple[str, str, str],
    items: list[WorkItem],
    offsets: list[float],
    deadline: float,
    interval: float,
) -> tuple[list[Any], float, list[tuple[float, dict[str, float], dict[str, float]]]]:
    """Send the trace to ``urls[0]``, scraping the ledger's and the engine's ``/metrics``."""
    url, ledger_url, engine_url = urls
    samples: list[tuple[float, dict[str, float], dict[str, float]]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    start = time.monotonic()

    async def scrape(http: httpx.AsyncClient) -> None:
        while True:
            at = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):  # a missed scrape is a missing sample
                ledger = parse_prometheus_text((await http.get(ledger_url + "/metrics")).text)
                engine = ledger
                if engine_url != ledger_url:
                    engine = parse_prometheus_text((await http.get(engine_url + "/metrics")).text)
                samples.append((at - start, ledger, engine))
            await anyio.sleep(max(0.0, interval - (time.monotonic() - at)))

    async with (
        httpx.AsyncClient(limits=limits, timeout=deadline) as http,
        httpx.AsyncClient(timeout=5) as scraper,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(scrape, scraper)
        client = AsyncClient(
            base_url=url,
            model=MODEL,
            context_window=CONTEXT,
            http_client=http,
            retry=RetryPolicy(max_attempts=100, deadline=deadline),
        )
        # A hard stop: the last arrival, then each request's deadline and a little more.
        records, wall = await run_load(
            items,
            KVClientSender(client, stream=False),
            offsets=offsets,
            duration=offsets[-1] + 0.01,
            grace=deadline + 2,
        )
        await anyio.sleep(interval * 2)  # the release of the last ones
        tg.cancel_scope.cancel()
    return records, wall, samples


def measure(
    key: str,
    items: list[WorkItem],
    offsets: list[float],
    *,
    deadline: float,
    interval: float,
    decode_rate: float,
) -> dict[str, Any]:
    servers, title = RUNS[key]
    with servers(decode_rate) as urls:
        records, wall, samples = anyio.run(drive, urls, items, offsets, deadline, interval)
    summary = summarize(records, duration=wall, deadline=deadline)
    oom_times, last_ooms = [], 0.0
    for t, _, engine in samples:
        ooms = engine.get("kv_oom_events_total", 0.0)
        if ooms > last_ooms:
            oom_times.append(round(t, 3))
        last_ooms = ooms
    final = samples[-1][2] if samples else {}
    return {
        "key": key,
        "title": title,
        "requests": len(records),
        "completed": summary.completed,
        "failed_by_cause": summary.failed_by_cause,
        "http_429": summary.http_429,
        "latency_p50": summary.latency.p50,
        "latency_p99": summary.latency.p99,
        "wall_seconds": wall,
        "oom_events": int(final.get("kv_oom_events_total", 0)),
        "oom_killed": int(final.get("kv_oom_failed_requests_total", 0)),
        "peak_used_tokens": int(final.get("kv_peak_used_tokens", 0)),
        "pool_tokens": int(final.get("kv_physical_capacity_tokens", KV_TOKENS)),
        "usable_tokens": int(samples[-1][1].get("kv_usable_tokens", 0)) if samples else None,
        "oom_times": oom_times,
        "t": [round(t, 3) for t, _, _ in samples],
        "used": [int(engine.get("kv_used_tokens", 0)) for _, _, engine in samples],
        "reserved": [int(ledger.get("kv_reserved_tokens", 0)) for _, ledger, _ in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, help="trace length (default 160, --quick 60)")
    parser.add_argument("--rate", type=float, default=RATE, help="arrivals per second (Poisson)")
    parser.add_argument("--deadline", type=float, help=f"per request (default {DEADLINE:g} s)")
    parser.add_argument(
        "--decode-rate", type=float, default=DECODE_RATE, help="tokens/s per sequence"
    )
    parser.add_argument("--interval", type=float, default=INTERVAL, help="seconds between scrapes")
    add_plot_arguments(parser, "kv_timeline")
    args = parser.parse_args()
    if plot_only(parser, args, "kv_timeline", plot_kv_timeline):
        return
    n = args.requests or (60 if args.quick else 160)
    deadline = args.deadline or (20.0 if args.quick else DEADLINE)
    items = SyntheticWorkload(seed=SEED).items(n, TiktokenCounter())
    offsets = arrival_offsets(rate=args.rate, num_requests=n, seed=SEED)
    runs = []
    for key in RUNS:
        print(f"… {RUNS[key][1]}", flush=True)
        runs.append(
            measure(
                key,
                items,
                offsets,
                deadline=deadline,
                interval=args.interval,
                decode_rate=args.decode_rate,
            )
        )
    print_table(
        f"KV over time: {n} requests of the seed's mix at {args.rate:g}/s (Poisson), "
        f"{KV_TOKENS:,}-token pool, context {CONTEXT}, {args.decode_rate:g} tok/s per sequence, "
        f"kvclient AsyncClient, deadline {deadline:g} s",
        ["run", "completed", "KV overflows", "killed by them", "peak KV in use", "429s", "p99"],
        [
            [
                r["title"],
                f"{r['completed']}/{r['requests']}",
                str(r["oom_events"]),
                str(r["oom_killed"]),
                f"{r['peak_used_tokens']:,} ({r['peak_used_tokens'] / r['pool_tokens']:.0%})",
                str(r["http_429"]),
                "-" if r["latency_p99"] is None else f"{r['latency_p99']:.1f} s",
            ]
            for r in runs
        ],
    )
    written = write_json(
        "kv_timeline",
        {
            "requests": n,
            "rate": args.rate,
            "deadline": deadline,
            "interval": args.interval,
            "pool_tokens": KV_TOKENS,
            "context_window": CONTEXT,
            "decode_rate": args.decode_rate,
            "mean_output_tokens": MEAN_OUTPUT,
            "max_queue_wait": MAX_QUEUE_WAIT,
            "runs": runs,
        },
    )
    plot_result(args, written, plot_kv_timeline)


if __name__ == "__main__":
    main()
