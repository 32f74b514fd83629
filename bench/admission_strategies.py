"""Admission strategies on one seeded trace: the seed post's comparison table, measured.

The same open-loop trace (seeded Poisson arrivals of the seed's adversarial mix: short prompts with
large or unset caps, long prompts with small caps) is sent through kvclient's AsyncClient (which
honours 429 Retry-After, up to 100 attempts within a 60 s deadline per request, so that a request
fails only by OOM or by running out of time) to a fresh reference server per strategy:

- ``concurrency``: a request cap sized for the *average* request (physical pool / mean of prompt +
  expected output), the way a hand-tuned ``max_num_seqs`` is; and the cap that is safe for the
  worst case (pool / context window);
- ``prompt``: admission by the prompt's KV blocks alone;
- ``reserve``: prompt + output cap reserved for the request's whole life, 429 + Retry-After;
- ``reserve`` with the bounded FIFO queue (``--max-queue-wait``): waiting in arrival order.

The server runs in its own process (pinned to CPU 1 when there are two cores) and its ``/metrics``
are scraped every 50 ms for KV utilisation. "Largest 10 %" are the requests with the largest
reservation (prompt + effective cap); their worst end-to-end latency shows starvation.

    python bench/admission_strategies.py [--quick]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from _common import (
    MetricsSampler,
    mean,
    pin_to_cpu,
    print_table,
    reference_server_process,
    write_json,
)

from kvclient import AsyncClient, RetryPolicy, TiktokenCounter, effective_output_cap
from kvclient.loadgen import RequestRecord, SyntheticWorkload, arrival_offsets, run_load, summarize
from kvclient.loadgen._kvsender import KVClientSender

KV_TOKENS = 32_768
CONTEXT = 8192
DECODE_RATE = 1000.0
MEAN_OUTPUT = 1500.0
SAFETY = 0.9
DEADLINE = 60.0
#: About 1.5x what the reservation strategy sustains for this mix and budget.
RATE = 12.0
MAX_QUEUE_WAIT = 10.0
SEED = 7


@dataclass(frozen=True)
class Strategy:
    key: str
    name: str
    args: tuple[str, ...]


def expected_output(cap: int, mean_output: float = MEAN_OUTPUT) -> float:
    """E[min(natural, cap)] for the engine's exponential natural output length."""
    return mean_output * (1 - math.exp(-cap / mean_output))


def reservation(item: Any) -> int:
    cap = effective_output_cap(item.max_tokens, item.prompt_tokens, CONTEXT) or 0
    return int(item.prompt_tokens + cap)


def strategies(items: list[Any], *, quick: bool = False) -> list[Strategy]:
    caps = [effective_output_cap(i.max_tokens, i.prompt_tokens, CONTEXT) or 0 for i in items]
    avg_seq = sum(i.prompt_tokens + expected_output(c) for i, c in zip(items, caps, strict=True))
    avg_seq /= len(items)
    tuned = max(1, int(KV_TOKENS // avg_seq))
    safe = max(1, KV_TOKENS // CONTEXT)
    worst_case_safe = Strategy(
        "cap-safe",
        f"concurrency cap {safe} (safe for the worst case)",
        ("--admission", "concurrency", "--max-concurrency", str(safe)),
    )
    return [
        Strategy(
            "cap-mean",
            f"concurrency cap {tuned} (sized for the mean request)",
            ("--admission", "concurrency", "--max-concurrency", str(tuned)),
        ),
        *([] if quick else [worst_case_safe]),
        Strategy("prompt", "prompt-only admission", ("--admission", "prompt")),
        Strategy("reserve", "prompt + output reservation", ("--admission", "reserve")),
        Strategy(
            "fifo",
            f"reservation + FIFO queue ({MAX_QUEUE_WAIT:g} s)",
            ("--admission", "reserve", "--max-queue-wait", str(MAX_QUEUE_WAIT)),
        ),
    ]


async def drive(
    url: str, items: list[Any], offsets: list[float], deadline: float
) -> tuple[list[RequestRecord], float, MetricsSampler, tuple[float, float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    sampler = MetricsSampler(url, interval=0.05)
    async with (
        httpx.AsyncClient(limits=limits, timeout=deadline) as http,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(sampler.run)
        client = AsyncClient(
            base_url=url,
            model="kvclient-sim",
            context_window=CONTEXT,
            http_client=http,
            retry=RetryPolicy(max_attempts=100, deadline=deadline),
        )
        start = anyio.current_time()
        records, wall = await run_load(
            items, KVClientSender(client, stream=False), offsets=offsets, grace=deadline + 5
        )
        end = anyio.current_time()
        await anyio.sleep(0.1)  # one more scrape after the last request
        sampler.stop = True
        tg.cancel_scope.cancel()
    return records, wall, sampler, (start, end)


def measure(
    strategy: Strategy, items: list[Any], offsets: list[float], deadline: float, cpu: int | None
) -> dict[str, Any]:
    server_args = (
        "--kv-tokens",
        str(KV_TOKENS),
        "--context-window",
        str(CONTEXT),
        "--decode-rate",
        str(DECODE_RATE),
        "--mean-output-tokens",
        str(MEAN_OUTPUT),
        "--safety-fraction",
        str(SAFETY),
        "--seed",
        str(SEED),
        *strategy.args,
    )
    with reference_server_process(*server_args, cpu=cpu) as url:
        records, wall, sampler, (start, end) = anyio.run(drive, url, items, offsets, deadline)
    s = summarize(records, duration=wall)
    during = sampler.between(start, end)
    final = sampler.last()
    physical = [m["kv_used_tokens"] / m["kv_physical_capacity_tokens"] for m in during]
    reserved = [m for m in during if m["kv_reserved_tokens"] > 0]
    reserved_sum = sum(m["kv_reserved_tokens"] for m in reserved)
    used_sum = sum(m["kv_used_tokens"] for m in reserved)
    unused_share = 1 - used_sum / reserved_sum if reserved_sum else None
    sizes = sorted(range(len(items)), key=lambda i: reservation(items[i]), reverse=True)
    top = set(sizes[: max(1, len(items) // 10)])
    largest = [r for r in records if r.index in top]
    worst = max((r.latency for r in largest if r.latency is not None), default=None)
    return {
        "strategy": strategy.name,
        "server_args": list(server_args),
        "sent": s.sent,
        "completed": s.completed,
        "failed_by_cause": s.failed_by_cause,
        "oom_killed": int(final.get("kv_oom_failed_requests_total", 0)),
        "oom_events": int(final.get("kv_oom_events_total", 0)),
        "output_tokens_per_s": s.output_token_throughput,
        "mean_physical_kv_utilisation": mean(physical),
        "peak_physical_kv_utilisation": (
            final.get("kv_peak_used_tokens", 0) / final["kv_physical_capacity_tokens"]
            if final
            else None
        ),
        "reserved_unused_share": unused_share,
        "http_429": int(final.get("kv_rejected_total", 0)),
        "client_429": s.http_429,
        "attempts_per_completed": s.attempts_per_completed,
        "largest_10pct_completed": sum(r.ok for r in largest),
        "largest_10pct_count": len(largest),
        "largest_10pct_worst_latency": worst,
        "latency_p50": s.latency.p50,
        "latency_p99": s.latency.p99,
        "wall_seconds": wall,
        "metric_samples": len(during),
    }


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def unused(value: float | None) -> str:
    if value is None:
        return "n/a (nothing reserved)"
    if value < 0:
        return f"none: used {1 - value:.1f}x what was reserved"
    return pct(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, help="trace length (default 240, --quick 50)")
    parser.add_argument("--rate", type=float, default=RATE, help="arrivals per second (Poisson)")
    parser.add_argument(
        "--deadline", type=float, help=f"per request, seconds (default {DEADLINE:g}, --quick 8)"
    )
    parser.add_argument(
        "--strategies",
        help="comma-separated subset: cap-mean, cap-safe, prompt, reserve, fifo (default: all)",
    )
    args = parser.parse_args()
    n = args.requests or (50 if args.quick else 240)
    deadline = args.deadline or (8.0 if args.quick else DEADLINE)
    pinned = pin_to_cpu(0)
    items = SyntheticWorkload(seed=SEED).items(n, TiktokenCounter())
    offsets = arrival_offsets(rate=args.rate, num_requests=n, seed=SEED)
    results = []
    chosen = strategies(items, quick=args.quick)
    if args.strategies:
        keys = {k.strip() for k in args.strategies.split(",")}
        chosen = [s for s in strategies(items) if s.key in keys]
    for strategy in chosen:
        print(f"… {strategy.name}", flush=True)
        results.append(measure(strategy, items, offsets, deadline, 1 if pinned else None))
    rows = []
    for r in results:
        worst = r["largest_10pct_worst_latency"]
        rows.append(
            [
                r["strategy"],
                f"{r['completed']}/{r['sent']}",
                str(r["oom_killed"]),
                f"{r['output_tokens_per_s']:,.0f}",
                pct(r["mean_physical_kv_utilisation"]),
                unused(r["reserved_unused_share"]),
                str(r["http_429"]),
                f"{r['largest_10pct_completed']}/{r['largest_10pct_count']} done, worst "
                + ("-" if worst is None else f"{worst:.1f} s"),
            ]
        )
    print_table(
        f"Admission strategies, one seeded trace: {n} requests of the seed's mix at "
        f"{args.rate:g}/s (Poisson), {KV_TOKENS:,}-token KV pool ({SAFETY:.0%} usable), "
        f"context {CONTEXT}, {DECODE_RATE:g} tok/s per sequence, mean natural output "
        f"{MEAN_OUTPUT:g}; client: kvclient AsyncClient, deadline {deadline:g} s",
        [
            "strategy",
            "completed",
            "killed by OOM",
            "output tok/s",
            "mean physical KV use",
            "reserved but unused",
            "429s",
            "largest 10 %: completed, worst latency",
        ],
        rows,
    )
    write_json(
        "admission_strategies",
        {
            "pinned": pinned,
            "requests": n,
            "rate": args.rate,
            "kv_tokens": KV_TOKENS,
            "context_window": CONTEXT,
            "decode_rate": DECODE_RATE,
            "mean_output_tokens": MEAN_OUTPUT,
            "deadline": deadline,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
