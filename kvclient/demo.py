"""``kvclient demo``: the whole loop on one machine, in about a minute.

It starts the reference server embedded (a small KV budget, a fast simulated decode), then drives
one seeded workload of the seed post's adversarial mix (short prompts with large or unset caps,
long prompts with small caps) twice against a fresh server each time: through a naive client that
retries at once and ignores Retry-After, then through kvclient. It prints both side by side, with
what the server saw: 429s, OOM events, peak reserved against physically used KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

from ._tokens import TiktokenCounter
from .loadgen._metrics import RequestRecord, Summary, summarize
from .loadgen._report import format_count, format_seconds, parse_prometheus_text, print_table
from .loadgen._runner import Sender, run_load
from .loadgen._schedule import arrival_offsets
from .loadgen._workload import SyntheticWorkload, WorkItem

#: Small enough that the mix overloads it, large enough for the biggest request (one whole
#: context) to fit the usable budget.
DEMO_KV_TOKENS = 32_768
DEMO_CONTEXT = 8192
DEMO_DECODE_RATE = 4000.0
DEMO_MEAN_OUTPUT = 1500.0
DEMO_REQUESTS = 120
DEMO_RATE = 70.0
DEMO_DEADLINE = 45.0


@dataclass(frozen=True, slots=True)
class DemoRun:
    name: str
    summary: Summary
    server: dict[str, float]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvclient demo",
        description="Run the reference server embedded and drive one workload through a naive "
        "client (retries at once, ignores Retry-After) and through kvclient; print both.",
    )
    p.add_argument(
        "--admission",
        choices=["reserve", "prompt", "concurrency"],
        default="reserve",
        help="the server's admission strategy; 'prompt' shows the OOMs the seed warns about",
    )
    p.add_argument("--requests", type=int, default=DEMO_REQUESTS)
    p.add_argument("--rate", type=float, default=DEMO_RATE, help="arrivals per second (Poisson)")
    p.add_argument("--kv-tokens", type=int, default=DEMO_KV_TOKENS, help="server KV budget")
    p.add_argument("--decode-rate", type=float, default=DEMO_DECODE_RATE)
    p.add_argument("--max-concurrency", type=int, default=8, help="for --admission concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, dest="json_path", help="write both summaries here")
    return p


def _server_config(args: argparse.Namespace) -> Any:
    from reference_server import ServerConfig

    return ServerConfig(
        context_window=DEMO_CONTEXT,
        kv_tokens=args.kv_tokens,
        decode_rate=args.decode_rate,
        mean_output_tokens=DEMO_MEAN_OUTPUT,
        admission=args.admission,
        max_concurrency=args.max_concurrency if args.admission == "concurrency" else None,
        seed=args.seed,
    )


async def _drive(
    base_url: str,
    items: list[WorkItem],
    offsets: list[float],
    make_sender: Callable[[httpx.AsyncClient], Sender],
) -> tuple[list[RequestRecord], float, dict[str, float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=DEMO_DEADLINE) as http:
        records, wall = await run_load(
            items, make_sender(http), offsets=offsets, duration=None, grace=DEMO_DEADLINE
        )
        metrics = parse_prometheus_text((await http.get("/metrics")).text)
    return records, wall, metrics


def _naive(http: httpx.AsyncClient) -> Sender:
    from .loadgen._naive import NaiveSender

    return NaiveSender(http, max_attempts=50, deadline=DEMO_DEADLINE)


def _kvclient(http: httpx.AsyncClient) -> Sender:
    from ._client import AsyncClient
    from ._retry import RetryPolicy
    from .loadgen._kvsender import KVClientSender

    client = AsyncClient(
        base_url=str(http.base_url),
        http_client=http,
        retry=RetryPolicy(max_attempts=50, deadline=DEMO_DEADLINE),
    )
    return KVClientSender(client, stream=False)


def run_demo(args: argparse.Namespace) -> list[DemoRun]:
    from reference_server import running_server

    counter = TiktokenCounter()
    items = SyntheticWorkload(seed=args.seed).items(args.requests, counter)
    offsets = arrival_offsets(rate=args.rate, num_requests=args.requests, seed=args.seed)
    runs = []
    for name, make_sender in (("naive client", _naive), ("kvclient", _kvclient)):
        print(f"… {name}: {len(items)} requests at {args.rate:g}/s", file=sys.stderr)
        with running_server(_server_config(args)) as server:
            records, wall, metrics = anyio.run(
                partial(_drive, server.base_url, items, offsets, make_sender)
            )
        runs.append(DemoRun(name, summarize(records, duration=wall), metrics))
    return runs


def _pct(value: float | None, of: float | None) -> str:
    if value is None:
        return "-"
    share = f" ({value / of:.0%})" if of else ""
    return f"{value:,.0f}{share}"


def comparison_rows(runs: Sequence[DemoRun]) -> list[list[str]]:
    def row(label: str, cell: Callable[[DemoRun], str]) -> list[str]:
        return [label, *(cell(run) for run in runs)]

    def failed(run: DemoRun) -> str:
        s = run.summary
        causes = ", ".join(f"{k} {v}" for k, v in s.failed_by_cause.items())
        return f"{s.failed} ({causes})" if s.failed else "0"

    return [
        row("requests", lambda r: format_count(r.summary.sent)),
        row("completed", lambda r: format_count(r.summary.completed)),
        row("failed", failed),
        row("429s received", lambda r: format_count(r.summary.http_429)),
        row(
            "attempts per completed request",
            lambda r: format_count(r.summary.attempts_per_completed),
        ),
        row("OOM events (server)", lambda r: format_count(r.server.get("kv_oom_events_total"))),
        row(
            "peak reserved KV, tokens (% of usable)",
            lambda r: _pct(
                r.server.get("kv_peak_reserved_tokens"), r.server.get("kv_usable_tokens")
            ),
        ),
        row(
            "peak used KV, tokens (% of physical)",
            lambda r: _pct(
                r.server.get("kv_peak_used_tokens"), r.server.get("kv_physical_capacity_tokens")
            ),
        ),
        row("p50 latency", lambda r: format_seconds(r.summary.latency.p50)),
        row("p99 latency", lambda r: format_seconds(r.summary.latency.p99)),
        row("wall time", lambda r: format_seconds(r.summary.duration)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        runs = run_demo(args)
    except ImportError as exc:
        print(
            f"kvclient demo needs the server extra ({exc}): pip install 'kvclient[server]'",
            file=sys.stderr,
        )
        return 2
    title = (
        f"kvclient demo: {args.requests} requests of the seed's mix at {args.rate:g}/s, "
        f"reference server in '{args.admission}' admission, {args.kv_tokens:,} KV tokens"
    )
    print_table(title, ["", *(run.name for run in runs)], comparison_rows(runs))
    if args.json_path is not None:
        data = {run.name: {"summary": run.summary.to_json(), "server": run.server} for run in runs}
        args.json_path.write_text(json.dumps(data, indent=2))
    return 0
