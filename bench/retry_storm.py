"""Retry storm at about 3x overload: the same workload, the same server, several clients.

First the server's capacity for the workload is measured, to size the overload: a closed loop
through a server whose FIFO queue keeps it full without a single 429 (completed requests per
second). Then a burst of arrivals at ``--overload`` (3x) that capacity is sent, open loop, from
one seeded trace of the seed's mix, to a fresh reference server per client (reservation
admission, no queue: every shortage is a 429 with Retry-After):

- a naive client that retries 429s at once, ignoring Retry-After (``kvclient.loadgen.NaiveSender``);
- the official ``openai`` SDK, default ``max_retries=2``, and with ``max_retries=10`` (it honours
  Retry-After up to 60 s, else backs off 0.5 s x 2^n);
- ``kvclient.AsyncClient`` with its defaults (cooldown on 429, Retry-After + jitter, pacing from
  the server's RateLimit headers), with ``RetryPolicy(pace=False)`` (no pacing: what kvclient
  did before), with ``RetryPolicy(cooldown_by_size=True)`` (a 429 holds only requests at
  least as large) and with ``RetryPolicy(pace_in_order=True)`` (held requests go in the order
  their calls started);
- the same ``openai`` SDK calls through ``kvclient.openai.AsyncOpenAI`` (the one-line change:
  kvclient's transport underneath, the SDK's retries off), client name ``kvclient.openai``.

The ceiling is the same trace (the same open-loop burst, the same deadline) sent to a server
that queues every request in FIFO order (``--max-queue-wait 600``: no 429 at all), through
kvclient without pacing: what a perfect client could get from this server and this burst.

Every request has the same deadline. Attempts are counted by the server (admitted + rejected);
429s are the server's ``kv_rejected_total``; utilisation is the time average of reserved / usable
KV tokens from ``/metrics`` scraped every 50 ms, from the first send to the last answer.

Goal for kvclient (and for the SDK through it): at most 1.05 attempts per completed
request, every request completed within its deadline, a time-averaged reservation at least 95 %
of the ceiling run's, and a p99 latency at most 1.5x the ceiling run's. With ``--slow`` (300
tokens/s per sequence, 5x overload: long holds, as on a real engine), also
a time-averaged reservation at least the naive client's in the same run.

With ``--users N`` (the first burst): a closed loop of N users sharing one client instead of an
open-loop trace, their first requests all sent at time 0. kvclient is given neither the model nor
the context window, so it reads ``/v1/models`` first, as an application does, and the room that
answer advertises paces that first burst; the row ``kvclient no discovery`` is given both, so it
has no hint of the room before its first answers come back. No capacity run (the overload is
N users against the room the server has); the ceiling is the same users through a FIFO-queued
server. Goals there: at most 1.05 attempts per completed request, and a time-averaged
reservation at least the naive client's.

    python bench/retry_storm.py [--quick] [--slow] [--plot docs/img/retry_storm.png]
    python bench/retry_storm.py --slow --users 40 [--requests 120]  # the first burst
    python bench/retry_storm.py --plot docs/img/retry_storm.png --plot-only  # from the last run
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import anyio
from _common import pin_to_cpu, print_table, reference_server_process, write_json
from _plots import add_plot_arguments, plot_only, plot_result, plot_retry_storm
from _retry_storm_clients import CONTEXT, run_client

from kvclient import TiktokenCounter
from kvclient.loadgen import SyntheticWorkload, WorkItem, arrival_offsets

KV_TOKENS = 32_768
DECODE_RATE = 1000.0
MEAN_OUTPUT = 1500.0
SEED = 11
DEFAULT_OVERLOAD = 3.0
#: ``--slow``: what a real engine's long generations look like to the ledger: 300 tokens/s per
#: sequence, so a request holds its reservation for seconds. (Over half the pool, 16,384 KV
#: tokens, the ceiling itself, a FIFO queue that never refuses, missed deadlines at 5x: no
#: client could meet the goals there.)
SLOW_SERVER_ARGS = ("--decode-rate", "300")
SLOW_OVERLOAD = 5.0
GOAL_ATTEMPTS = 1.05
GOAL_CEILING_SHARE = 0.95  # of the ceiling's time-averaged reservation
GOAL_P99_RATIO = 1.5  # x the ceiling's p99
LABELS = {
    "naive": "naive (retries at once, up to 50 attempts)",
    "openai": "openai SDK, max_retries=2 (default)",
    "openai max_retries=10": "openai SDK, max_retries=10",
    "kvclient": "kvclient (defaults: paced from RateLimit)",
    "kvclient pace=False": "kvclient, RetryPolicy(pace=False)",
    "kvclient cooldown_by_size": "kvclient, RetryPolicy(cooldown_by_size=True)",
    "kvclient pace_in_order": "kvclient, RetryPolicy(pace_in_order=True)",
    "kvclient.openai": "openai SDK through kvclient",
    "kvclient no discovery": "kvclient, model and window given (no hint before its first answer)",
}
#: ``--users``: the rows run unless ``--clients`` says otherwise.
USERS_CLIENTS = "naive,kvclient no discovery,kvclient"
# The rows the goals are checked for.
GOAL_CLIENTS = ("kvclient", "kvclient pace=False", "kvclient pace_in_order", "kvclient.openai")
#: ``--users``: the requests each user sends unless ``--requests`` says how many in all.
REQUESTS_PER_USER = 3

SERVER_ARGS = (
    "--kv-tokens",
    str(KV_TOKENS),
    "--context-window",
    str(CONTEXT),
    "--decode-rate",
    str(DECODE_RATE),
    "--mean-output-tokens",
    str(MEAN_OUTPUT),
    "--seed",
    str(SEED),
)


#: The FIFO-queued server of the capacity and ceiling runs: a request waits up to this long in
#: the server's queue instead of being refused.
QUEUE_WAIT = "600"


def measure_capacity(
    items: list[WorkItem], cpu: int | None, deadline: float, extra: list[str]
) -> dict[str, Any]:
    """Completed requests per second of a server kept full by its FIFO queue (no 429s): a
    closed loop of 32, to size the overload (its latencies say nothing about a burst)."""
    args = (*SERVER_ARGS, *extra, "--max-queue-wait", QUEUE_WAIT)
    with reference_server_process(*args, cpu=cpu) as url:
        return anyio.run(_capacity, url, items, deadline)


async def _capacity(url: str, items: list[WorkItem], deadline: float) -> dict[str, Any]:
    # Not pacing: the server's own queue keeps it full.
    return await run_client("kvclient pace=False", url, items, None, deadline * 4, concurrency=32)


def measure_ceiling(
    items: list[WorkItem],
    offsets: list[float],
    cpu: int | None,
    deadline: float,
    extra: list[str],
) -> dict[str, Any]:
    """The same trace (arrivals and deadline) through a FIFO-queued server: no 429s, each
    request admitted in arrival order as soon as the budget has room for it."""
    args = (*SERVER_ARGS, *extra, "--max-queue-wait", QUEUE_WAIT)
    with reference_server_process(*args, cpu=cpu) as url:
        # Not pacing: the server's own queue orders and holds the requests.
        return anyio.run(run_client, "kvclient pace=False", url, items, offsets, deadline)


def measure_users_ceiling(
    items: list[WorkItem], users: int, cpu: int | None, deadline: float, extra: list[str]
) -> dict[str, Any]:
    """``--users``: the same users through a FIFO-queued server (no 429s)."""
    args = (*SERVER_ARGS, *extra, "--max-queue-wait", QUEUE_WAIT)
    with reference_server_process(*args, cpu=cpu) as url:
        run = functools.partial(run_client, concurrency=users)
        return anyio.run(run, "kvclient pace=False", url, items, None, deadline)


def one_client(
    name: str,
    items: list[WorkItem],
    offsets: list[float] | None,
    deadline: float,
    cpu: int | None,
    extra: list[str],
    users: int | None = None,
) -> dict[str, Any]:
    """One client against a fresh server: the open-loop trace, or ``users`` sharing it."""
    with reference_server_process(*SERVER_ARGS, *extra, cpu=cpu) as url:
        run = functools.partial(run_client, concurrency=users, discover=users is not None)
        return anyio.run(run, name, url, items, offsets, deadline)


def each_client(
    args: argparse.Namespace,
    items: list[WorkItem],
    offsets: list[float] | None,
    deadline: float,
    cpu: int | None,
    users: int | None = None,
) -> list[dict[str, Any]]:
    """:func:`one_client` for each of ``--clients`` in turn."""
    results = []
    for name in [c.strip() for c in args.clients.split(",") if c.strip()]:
        print(f"… {name}", flush=True)
        results.append(one_client(name, items, offsets, deadline, cpu, args.server_arg, users))
    return results


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


#: The columns of both tables (the storm's and the first burst's).
COLUMNS = [
    "client",
    "attempts / completed",
    "completed within deadline",
    "p50 latency",
    "p99 latency",
    "429s sent",
    "server KV utilisation",
]


def table_rows(
    results: list[dict[str, Any]],
    ceiling: dict[str, Any],
    ceiling_label: str,
    *,
    attempts: str,
    utilisation: str,
    share: bool,
) -> list[list[str]]:
    """A row of ``COLUMNS`` per client, the ceiling's (labelled ``ceiling_label``) last.
    ``attempts`` and ``utilisation``: their format specs; ``share``: the share of requests
    completed within the deadline before their count."""
    rows = []
    for r in [*results, ceiling]:
        label = ceiling_label if r is ceiling else LABELS.get(r["client"], r["client"])
        completed = f"{r['completed_within_deadline']}/{r['requests']}"
        if share:
            completed = f"{r['share_within_deadline']:.0%} ({completed})"
        rows.append(
            [
                label,
                fmt(r["attempts_per_completed"], attempts),
                completed,
                fmt(r["latency_p50"], ".1f", " s"),
                fmt(r["latency_p99"], ".1f", " s"),
                f"{r['http_429_server']:,.0f}",
                fmt(r["utilisation_reserved_over_usable"], utilisation),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--overload", type=float, default=DEFAULT_OVERLOAD, help="x measured capacity"
    )
    parser.add_argument("--burst", type=float, help="seconds of arrivals (default 12, --quick 3)")
    parser.add_argument("--deadline", type=float, help="per request (default 60 s, --quick 12 s)")
    parser.add_argument(
        "--clients",
        help="comma-separated subset to run (default: naive,openai,openai max_retries=10,"
        "kvclient pace=False,kvclient,kvclient cooldown_by_size,kvclient pace_in_order,"
        f"kvclient.openai; with --users: {USERS_CLIENTS})",
    )
    parser.add_argument(
        "--users",
        type=int,
        help="the first burst: a closed loop of this many users sharing one client, all "
        "sending their first requests at time 0; kvclient discovers the window first",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help=f"with --users: requests in all (default {REQUESTS_PER_USER} per user)",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        help="the server's capacity in req/s, instead of measuring it (for quick checks)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every reference server (repeat), e.g. "
        "--server-arg=--retry-after-quantile --server-arg=0.9",
    )
    parser.add_argument(
        "--slow",
        action="store_true",
        help="slow decoding and long holds: the reference servers decode 300 tokens/s per "
        "sequence, at 5x overload unless --overload says otherwise; kvclient must also keep at "
        "least as much of the budget reserved as the naive client",
    )
    add_plot_arguments(parser, "retry_storm")
    args = parser.parse_args()
    if args.slow:
        args.server_arg = [*SLOW_SERVER_ARGS, *args.server_arg]
        if args.overload == DEFAULT_OVERLOAD:
            args.overload = SLOW_OVERLOAD
    draw = functools.partial(plot_retry_storm, goal_attempts=GOAL_ATTEMPTS)
    if plot_only(parser, args, "retry_storm_first_burst" if args.users else "retry_storm", draw):
        return
    if args.users is not None and args.users < 1:
        parser.error("--users must be at least 1")
    if args.clients is None:
        args.clients = (
            USERS_CLIENTS
            if args.users
            else "naive,openai,openai max_retries=10,kvclient pace=False,kvclient,"
            "kvclient cooldown_by_size,kvclient pace_in_order,kvclient.openai"
        )
    burst = args.burst or (3.0 if args.quick else 12.0)
    deadline = args.deadline or (12.0 if args.quick else 60.0)
    pinned = pin_to_cpu(0)
    cpu = 1 if pinned else None
    counter = TiktokenCounter()
    if args.users:
        first_burst(args, deadline, cpu, counter)
        return

    if args.capacity:
        capacity: dict[str, Any] = {"completed_per_second": args.capacity, "given": True}
    else:
        size = 32 if args.quick else 120
        capacity_items = SyntheticWorkload(seed=SEED + 1).items(size, counter)
        print("… measuring capacity (closed loop, FIFO-queued server)", flush=True)
        capacity = measure_capacity(capacity_items, cpu, deadline, args.server_arg)
    rate = args.overload * capacity["completed_per_second"]
    n = max(1, round(rate * burst))
    items = SyntheticWorkload(seed=SEED).items(n, counter)
    offsets = arrival_offsets(rate=rate, num_requests=n, seed=SEED)
    print(
        f"capacity {capacity['completed_per_second']:.2f} req/s -> {n} requests at "
        f"{rate:.1f}/s over {burst:g} s, deadline {deadline:g} s",
        flush=True,
    )

    print("… ceiling: the same trace through a FIFO-queued server", flush=True)
    ceiling = measure_ceiling(items, offsets, cpu, deadline, args.server_arg)
    ceiling["client"] = "ceiling"
    results = each_client(args, items, offsets, deadline, cpu)

    # The ceiling: what a perfect client could get from this burst. The server queues every
    # request in arrival order and admits it the moment it fits (a large request at the head of
    # the queue leaves a gap behind it), never refusing one.
    label = "(ceiling: the same trace, FIFO-queued server, no 429s)"
    rows = table_rows(results, ceiling, label, attempts=".2f", utilisation=".0%", share=True)
    print_table(
        f"Retry storm: {n} requests of the seed's mix at {rate:.1f}/s ({args.overload:g}x the "
        f"measured capacity of {capacity['completed_per_second']:.2f} req/s) for {burst:g} s, "
        f"deadline {deadline:g} s each, reference server in reserve mode, one per client"
        + (f" ({' '.join(args.server_arg)})" if args.server_arg else ""),
        COLUMNS,
        rows,
    )
    by_client: dict[str, dict[str, Any]] = {}
    for kv in results:
        if kv["client"] not in GOAL_CLIENTS:
            continue
        ceiling_share = ceiling["utilisation_reserved_over_usable"]
        ceiling_p99 = ceiling["latency_p99"]
        share = (
            (kv["utilisation_reserved_over_usable"] or 0) / ceiling_share if ceiling_share else None
        )
        ratio = (kv["latency_p99"] or 0) / ceiling_p99 if ceiling_p99 else None
        naive = next((r for r in results if r["client"] == "naive"), None)
        goals = {
            "attempts_per_completed": (kv["attempts_per_completed"] or 99) <= GOAL_ATTEMPTS,
            "all_within_deadline": kv["completed_within_deadline"] == kv["requests"],
            "reservation_vs_ceiling": share is not None and share >= GOAL_CEILING_SHARE,
            "p99_vs_ceiling": ratio is not None and ratio <= GOAL_P99_RATIO,
        }
        if args.slow and naive is not None:
            goals["reservation_vs_naive"] = (kv["utilisation_reserved_over_usable"] or 0) >= (
                naive["utilisation_reserved_over_usable"] or 0
            )
        kv["reservation_share_of_ceiling"] = share
        kv["p99_ratio_to_ceiling"] = ratio
        by_client[kv["client"]] = goals

        def verdict(key: str, goals: dict[str, bool] = goals) -> str:
            return "met" if goals[key] else "NOT met"

        print(
            f"\n{kv['client']} goals: attempts/completed <= {GOAL_ATTEMPTS}: "
            f"{verdict('attempts_per_completed')} ({fmt(kv['attempts_per_completed'], '.3f')}); "
            f"every request within its deadline: {verdict('all_within_deadline')}; "
            f"reservation >= {GOAL_CEILING_SHARE:.0%} of the ceiling's: "
            f"{verdict('reservation_vs_ceiling')} ({fmt(share, '.1%')}); p99 <= "
            f"{GOAL_P99_RATIO:g}x the ceiling's: {verdict('p99_vs_ceiling')} ({fmt(ratio, '.2f')}x)"
            + (
                f"; reservation >= the naive client's: {verdict('reservation_vs_naive')}"
                if "reservation_vs_naive" in goals
                else ""
            )
        )
    written = write_json(
        "retry_storm",
        {
            "pinned": pinned,
            "capacity": capacity,
            "ceiling": ceiling,
            "rate": rate,
            "requests": n,
            "burst_seconds": burst,
            "deadline": deadline,
            "server_args": [*SERVER_ARGS, *args.server_arg],
            "goals_met": by_client.get("kvclient", {}),
            "goals_met_by_client": by_client,
            "results": results,
        },
    )
    plot_result(args, written, draw)


def first_burst(args: argparse.Namespace, deadline: float, cpu: int | None, counter: Any) -> None:
    """``--users``: N users of one client whose first requests all go at time 0."""
    users: int = args.users
    n = args.requests or REQUESTS_PER_USER * users
    items = SyntheticWorkload(seed=SEED).items(n, counter)
    print(f"{users} users, {n} requests, deadline {deadline:g} s", flush=True)
    print("… ceiling: the same users through a FIFO-queued server", flush=True)
    ceiling = measure_users_ceiling(items, users, cpu, deadline, args.server_arg)
    ceiling["client"] = "ceiling"
    results = each_client(args, items, None, deadline, cpu, users)
    label = "(ceiling: the same users, FIFO-queued server, no 429s)"
    rows = table_rows(results, ceiling, label, attempts=".3f", utilisation=".1%", share=False)
    print_table(
        f"First burst: {users} users of one client, {n} requests of the seed's mix, every user's "
        f"first request at time 0, deadline {deadline:g} s, reference server in reserve mode, "
        "one per client" + (f" ({' '.join(args.server_arg)})" if args.server_arg else ""),
        COLUMNS,
        rows,
    )
    naive = next((r for r in results if r["client"] == "naive"), None)
    by_client: dict[str, dict[str, bool]] = {}
    for kv in results:
        if not kv["client"].startswith("kvclient"):
            continue
        goals = {"attempts_per_completed": (kv["attempts_per_completed"] or 99) <= GOAL_ATTEMPTS}
        if naive is not None:
            goals["reservation_vs_naive"] = (kv["utilisation_reserved_over_usable"] or 0) >= (
                naive["utilisation_reserved_over_usable"] or 0
            )
        by_client[kv["client"]] = goals
        print(
            f"\n{kv['client']}: attempts/completed <= {GOAL_ATTEMPTS}: "
            f"{'met' if goals['attempts_per_completed'] else 'NOT met'} "
            f"({fmt(kv['attempts_per_completed'], '.3f')})"
            + (
                f"; reservation >= the naive client's: "
                f"{'met' if goals['reservation_vs_naive'] else 'NOT met'} "
                f"({fmt(kv['utilisation_reserved_over_usable'], '.1%')} vs "
                f"{fmt(naive['utilisation_reserved_over_usable'], '.1%')})"
                if naive is not None
                else ""
            )
        )
    written = write_json(
        "retry_storm_first_burst",
        {
            "pinned": cpu is not None,
            "users": users,
            "requests": n,
            "deadline": deadline,
            "ceiling": ceiling,
            "server_args": [*SERVER_ARGS, *args.server_arg],
            "goals_met_by_client": by_client,
            "results": results,
        },
    )
    draw = functools.partial(plot_retry_storm, goal_attempts=GOAL_ATTEMPTS)
    plot_result(args, written, draw)


if __name__ == "__main__":
    main()
