"""``kvclient demo``: the whole loop on one machine, in about a minute.

It starts the reference server embedded (a small KV budget, a fast simulated decode), then drives
one seeded workload of the seed post's adversarial mix (short prompts with large or unset caps,
long prompts with small caps) twice against a fresh server each time: through a naive client that
retries at once and ignores Retry-After, then through kvclient. It prints both side by side, with
what the server saw: 429s, OOM events, peak reserved against physically used KV cache, then what
the figures say in a few sentences. Each client runs ``--repeat`` times (3 by default) and each
figure is their median with its range, so the run-to-run variance is in the table, not hidden.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx

from ._tiktoken import TiktokenCounter
from .cli_options import (
    HelpFormatter,
    add_json,
    add_log_level,
    setup_logging,
    to_stdout,
    write_json,
)
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
#: Runs of each client: enough to show how much timing alone moves the figures.
DEMO_REPEAT = 3


@dataclass(frozen=True, slots=True)
class DemoRun:
    name: str
    summary: Summary
    server: dict[str, float]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
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
    p.add_argument(
        "--requests",
        type=int,
        metavar="N",
        default=DEMO_REQUESTS,
        help="requests per client",
    )
    p.add_argument("--rate", type=float, default=DEMO_RATE, help="arrivals per second (Poisson)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        metavar="TOKENS",
        default=DEMO_KV_TOKENS,
        help="the server's KV pool in tokens",
    )
    p.add_argument(
        "--decode-rate",
        type=float,
        metavar="TOKENS_PER_S",
        default=DEMO_DECODE_RATE,
        help="simulated tokens per second per sequence",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        metavar="N",
        default=8,
        help="the server's request cap, for --admission concurrency",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the workload and the arrivals (the same requests every run)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=DEMO_REPEAT,
        help="runs of each client; the table shows each figure's median and range "
        "(default %(default)s)",
    )
    add_json(p, "both clients' summaries")
    add_log_level(p)
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
    from ._async_client import AsyncClient
    from ._policy import RetryPolicy
    from .loadgen._kvsender import KVClientSender

    client = AsyncClient(
        base_url=str(http.base_url),
        http_client=http,
        retry=RetryPolicy(max_attempts=50, deadline=DEMO_DEADLINE),
    )
    return KVClientSender(client, stream=False)


def run_demo(args: argparse.Namespace) -> list[list[DemoRun]]:
    """``args.repeat`` rounds; each round runs both clients, each against a fresh server."""
    from reference_server import running_server

    counter = TiktokenCounter()
    items = SyntheticWorkload(seed=args.seed).items(args.requests, counter)
    offsets = arrival_offsets(rate=args.rate, num_requests=args.requests, seed=args.seed)
    rounds = []
    for round_number in range(1, args.repeat + 1):
        runs = []
        for name, make_sender in (("naive client", _naive), ("kvclient", _kvclient)):
            of = f" (run {round_number} of {args.repeat})" if args.repeat > 1 else ""
            print(f"… {name}: {len(items)} requests at {args.rate:g}/s{of}", file=sys.stderr)
            with running_server(_server_config(args)) as server:
                records, wall, metrics = anyio.run(
                    partial(_drive, server.base_url, items, offsets, make_sender)
                )
            runs.append(
                DemoRun(name, summarize(records, duration=wall, deadline=DEMO_DEADLINE), metrics)
            )
        rounds.append(runs)
    return rounds


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the comparison: a figure of a run, and how to print it."""

    label: str
    value: Callable[[DemoRun], float | None]
    fmt: Callable[[float | None], str] = format_count


def _share_of(part: str, whole: str) -> Callable[[DemoRun], float | None]:
    def share(run: DemoRun) -> float | None:
        value, total = run.server.get(part), run.server.get(whole)
        return None if value is None or not total else value / total

    return share


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


ROWS = (
    Row("requests", lambda r: r.summary.offered),
    Row("completed", lambda r: r.summary.completed),
    Row("not completed", lambda r: r.summary.offered - r.summary.completed),
    Row("429s received", lambda r: r.summary.http_429),
    Row("attempts per completed request", lambda r: r.summary.attempts_per_completed),
    Row("OOM events (server)", lambda r: r.server.get("kv_oom_events_total")),
    Row(
        "peak reserved KV (% of usable)",
        _share_of("kv_peak_reserved_tokens", "kv_usable_tokens"),
        _percent,
    ),
    Row(
        "peak used KV (% of physical)",
        _share_of("kv_peak_used_tokens", "kv_physical_capacity_tokens"),
        _percent,
    ),
    Row("p50 latency, completed", lambda r: r.summary.latency.p50, format_seconds),
    Row("p99 latency, completed", lambda r: r.summary.latency.p99, format_seconds),
    Row(
        "p99 latency, all (failures at the deadline)",
        lambda r: r.summary.latency_all.p99,
        format_seconds,
    ),
    Row("wall time", lambda r: r.summary.duration, format_seconds),
)


def _cell(row: Row, runs: Sequence[DemoRun]) -> str:
    """One run's figure, or the median of several with their range."""
    values = [v for v in (row.value(run) for run in runs) if v is not None]
    if not values:
        return "-"
    if len(runs) == 1:
        return row.fmt(values[0])
    mid, low, high = (row.fmt(v) for v in (statistics.median(values), min(values), max(values)))
    return mid if low == high else f"{mid} ({low}–{high})"


def comparison_rows(rounds: Sequence[Sequence[DemoRun]]) -> list[list[str]]:
    """The table: one column per client, each cell over every round."""
    names = [run.name for run in rounds[0]]
    by_client = [[r[i] for r in rounds] for i in range(len(names))]
    rows = [[row.label, *(_cell(row, runs) for runs in by_client)] for row in ROWS]
    causes = []
    for runs in by_client:
        total: dict[str, int] = {}
        for run in runs:
            for cause, n in run.summary.failed_by_cause.items():
                total[cause] = total.get(cause, 0) + n
        causes.append(", ".join(f"{k} {v}" for k, v in sorted(total.items())) or "-")
    rows.insert(3, ["  why (all runs)", *causes])
    return rows


def _median(runs: Sequence[DemoRun], value: Callable[[DemoRun], float | None]) -> float | None:
    values = [v for v in map(value, runs) if v is not None]
    return statistics.median(values) if values else None


def interpret(rounds: Sequence[Sequence[DemoRun]], *, admission: str = "reserve") -> list[str]:
    """What the table says, in sentences computed from it and the server's ``admission``
    strategy (pure)."""
    naive = [r[0] for r in rounds]
    ours = [r[1] for r in rounds]
    lines = []
    ooms = sum(run.server.get("kv_oom_events_total", 0) for run in (*naive, *ours))
    if ooms == 0 and admission != "reserve":
        lines.append(
            f"No OOM event this time, but not by design: in '{admission}' admission the server "
            "does not reserve each request's output cap, so more load (or another seed) can "
            "overflow its KV cache; the 'reserve' default cannot."
        )
    elif ooms == 0:
        lines.append(
            "The server kept its half: no OOM event with either client, because it reserves "
            "prompt + output cap before admitting."
        )
    else:
        lines.append(
            f"The server admitted more than its KV cache holds: {ooms:.0f} OOM events over all "
            "runs, whichever client sent the requests. A client cannot save a server that admits "
            "by prompt length; that is why the contract has two halves."
        )
    a_naive = _median(naive, lambda r: r.summary.attempts_per_completed)
    a_ours = _median(ours, lambda r: r.summary.attempts_per_completed)
    r_naive = _median(naive, lambda r: r.summary.http_429)
    r_ours = _median(ours, lambda r: r.summary.http_429)
    # The naive client "grabs freed capacity by hammering" only if it did: more 429s and more
    # attempts than kvclient.
    hammered = False
    if a_naive is not None and a_ours is not None and r_naive is not None and r_ours is not None:
        hammered = r_naive > r_ours and a_naive > a_ours
        if r_naive or r_ours:
            lines.append(
                f"kvclient kept the client's half: {a_ours:.2f} attempts per completed request "
                f"against {a_naive:.2f}, and {r_ours:,.0f} 429s against {r_naive:,.0f}. The "
                "naive client's retries are load the server must parse, refuse and log."
            )
        else:
            lines.append(
                "Neither client got a 429 (median): the server admitted what it was sent, so "
                f"there was nothing to retry ({a_ours:.2f} attempts per completed request for "
                f"kvclient, {a_naive:.2f} for the naive client)."
            )
    missed = _median(naive, lambda r: r.summary.offered - r.summary.completed) or 0
    ours_missed = _median(ours, lambda r: r.summary.offered - r.summary.completed) or 0
    if missed or ours_missed:
        lines.append(
            f"Not completed (median): {missed:.0f} for the naive client, {ours_missed:.0f} for "
            "kvclient."
        )
    p_naive = _median(naive, lambda r: r.summary.latency.p50)
    p_ours = _median(ours, lambda r: r.summary.latency.p50)
    if p_naive is not None and p_ours is not None and p_ours > p_naive:
        higher = f"({format_seconds(p_ours)} against {format_seconds(p_naive)})"
        if hammered:
            lines.append(
                f"The price of waiting as the server asks: kvclient's median latency is higher "
                f"{higher}; the naive client grabs freed capacity by hammering. Against a server "
                "with a FIFO queue (kvclient serve --max-queue-wait) nobody needs to hammer."
            )
        else:
            lines.append(
                f"kvclient's median latency is higher {higher}, but not because the naive "
                "client hammered: it was not refused and did not retry more than kvclient. The "
                "difference is run-to-run timing."
            )
    if len(rounds) == 1:
        lines.append(
            "Variance: this is one run. Both clients' figures move from run to run (the naive "
            "client's most: its retries race the server's timing); run with --repeat 3 or more "
            "to see each figure's median and range."
        )
    else:
        lines.append(
            f"Variance: each cell is the median of {len(rounds)} runs of the same seeded "
            "workload, with the lowest and highest in brackets; timing alone moves them."
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    if args.repeat < 1:
        print("kvclient demo: --repeat must be at least 1", file=sys.stderr)
        return 2
    try:
        rounds = run_demo(args)
    except ImportError as exc:
        print(
            f"kvclient demo needs the server extra ({exc}): pip install 'kvclient[server]'",
            file=sys.stderr,
        )
        return 2
    runs = "one run" if args.repeat == 1 else f"median (range) of {args.repeat} runs"
    title = (
        f"kvclient demo: {args.requests} requests (random seed {args.seed}) of the seed post's "
        f"adversarial mix at {args.rate:g}/s, reference server in '{args.admission}' admission, "
        f"{args.kv_tokens:,} KV tokens; {runs}"
    )
    if not to_stdout(args.json_path):
        print_table(title, ["", *(run.name for run in rounds[0])], comparison_rows(rounds))
        print()
        for line in interpret(rounds, admission=args.admission):
            print(textwrap.fill(line, width=100, initial_indent="- ", subsequent_indent="  "))
    if args.json_path is not None:
        data: dict[str, Any] = {
            run.name: {"summary": run.summary.to_json(), "server": run.server} for run in rounds[0]
        }
        data["runs"] = [
            {run.name: {"summary": run.summary.to_json(), "server": run.server} for run in r}
            for r in rounds
        ]
        write_json(args.json_path, data)
    return 0
