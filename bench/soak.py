"""Soak: a bounded mixed load with random hang-ups and injected faults; nothing may pile up.

The reference server runs in its own process (``python -m reference_server --fault-rate ...``,
reserve admission, the default budget) so its memory can be read from ``/proc/PID/status``. One
seeded open-loop trace of the seed's mix (short prompts with large or unset caps, long prompts with
small caps) arrives at ``--load`` (1.75x) the capacity estimated from the server's budget and the
workload (Little's law: usable tokens / mean reservation / mean duration) for ``--duration``
seconds, through:

- ``kvclient.AsyncClient``, streamed and not (cooldown, Retry-After, retries);
- raw ``httpx`` streams (``--hang-up-share``) that hang up at a random moment, mid-stream;
- raw sockets that stop reading (``--stall-share``): a small receive buffer, a few streamed
  requests pipelined, nothing read for ``--stall-seconds``, then closed. The server runs with
  ``--send-timeout`` and a small ``--socket-send-buffer``, so their answers really block its
  writes and must be cut.

Of the kvclient requests, ``--short-share`` ask for ``max_tokens: 1`` (short-output traffic
that drags the quantile of recent outputs towards zero) and ``--long-share`` for 2,000 tokens
(long holders), the mix that made Retry-After say "fits now" while budget was held.

The engine fails ``--fault-rate`` of the requests on purpose (500 ``injected_fault``, or an error
event mid-stream). Every ``--sample-every`` seconds the server's RSS and ledger are sampled.

Criteria (exit code 1 if any fails): no KV-cache OOM; no 5xx other than the injected ones (none
seen by a client, as a status or as a broken stream, none logged by the server on its stderr, and
no 5xx status in its own count beyond the injected faults no client reported); the ledger at zero
at the end (no reservation, no request in flight); RSS growth after warm-up (the first
``--warm-up`` of the run) at most ``--max-rss-growth-mb``; no 429 told "fits now" (1 ms or
less) while capacity really returned later. The table and ``bench/results/soak.json`` give the
figures, the JSON also the samples.

Retry-After is checked against the server's own admission log (``--admission-log``): for every
429, the advice against the time until a request of that size would really have fitted beside
the reservations held when it was refused (``reference_server.admission.journal.check_advice``).

    python bench/soak.py                 # the full soak: 60 s of load, about 80 s in all
    python bench/soak.py --quick         # 10 s
    python bench/soak.py --duration 5    # the shortened form the test suite runs
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
from _common import pin_to_cpu, print_table, write_json
from _soak_senders import LONG_MAX_TOKENS, SoakSender
from _soak_server import (
    MEGABYTE,
    Sampler,
    ServerProcess,
    rss_bytes,
    server_5xx,
    server_process,
    settle,
)

from kvclient import (
    AsyncClient,
    RetryPolicy,
    TiktokenCounter,
    effective_output_cap,
    reservation_tokens,
)
from kvclient.loadgen import (
    MIXED,
    RequestRecord,
    SyntheticWorkload,
    WorkItem,
    arrival_offsets,
    run_load,
    summarize,
)
from reference_server.admission.journal import AdviceCheck, check_advice, read_log
from reference_server.admission.ledger import DEFAULT_SAFETY_FRACTION
from reference_server.simulated.config import (
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_DECODE_RATE,
    DEFAULT_KV_TOKENS,
    DEFAULT_MEAN_OUTPUT_TOKENS,
)

SEED = 2026
#: Advice this much shorter than the real wait is timing noise (two ticks of the engine).
ADVICE_TOLERANCE = 0.02


# --- the load ------------------------------------------------------------------------------------


def estimated_capacity(items: Sequence[WorkItem]) -> float:
    """Requests per second the default server completes for this workload (Little's law).

    Concurrency is bounded by usable tokens / mean reservation; each request lasts, on average,
    E[min(natural length, cap)] / decode rate, natural lengths being exponential.
    """
    usable = math.floor(DEFAULT_KV_TOKENS * DEFAULT_SAFETY_FRACTION)
    mean = DEFAULT_MEAN_OUTPUT_TOKENS
    needs, durations = [], []
    for item in items:
        cap = effective_output_cap(item.max_tokens, item.prompt_tokens, DEFAULT_CONTEXT_WINDOW)
        assert cap is not None
        needs.append(reservation_tokens(item.prompt_tokens, cap))
        durations.append(mean * (1 - math.exp(-cap / mean)) / DEFAULT_DECODE_RATE)
    concurrency = usable / (sum(needs) / len(needs))
    return concurrency / (sum(durations) / len(durations))


# --- the run -------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    url, pid = server.url, server.pid
    counter = TiktokenCounter()
    probe = SyntheticWorkload(MIXED, seed=SEED + 1).items(400, counter)
    capacity = estimated_capacity(probe)
    rate = args.load * capacity
    offsets = arrival_offsets(rate=rate, duration=args.duration, seed=args.seed)
    items = SyntheticWorkload(MIXED, seed=args.seed).items(len(offsets), counter)
    deadline = min(20.0, max(3.0, args.duration / 4))
    print(
        f"soak: {len(offsets)} requests at {rate:.1f}/s ({args.load:g}x the estimated capacity "
        f"of {capacity:.1f}/s) for {args.duration:g} s, fault rate {args.fault_rate:g}, "
        f"{args.hang_up_share:.0%} raw hang-ups, {args.stall_share:.0%} stalled readers, "
        f"kvclient {args.short_share:.0%} max_tokens 1 and {args.long_share:.0%} "
        f"max_tokens {LONG_MAX_TOKENS}, deadline {deadline:g} s",
        flush=True,
    )
    sampler = Sampler(url, pid, args.sample_every)
    rss_start = rss_bytes(pid)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    start = time.monotonic()
    async with (
        AsyncClient(
            base_url=url,
            retry=RetryPolicy(deadline=deadline),
            http_client=httpx.AsyncClient(limits=limits, timeout=60),
        ) as client,
        httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as raw,
        anyio.create_task_group() as group,
    ):
        group.start_soon(sampler.run, start)
        host, port = url.removeprefix("http://").split(":")
        sender = SoakSender(
            client,
            raw,
            args.hang_up_share,
            args.seed,
            stall_share=args.stall_share,
            stall_seconds=args.stall_seconds,
            short_share=args.short_share,
            long_share=args.long_share,
            address=(host, int(port)),
        )
        records, wall = await run_load(
            items, sender, offsets=offsets, duration=args.duration, grace=deadline + 10
        )
        group.cancel_scope.cancel()
    final = await settle(url)
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(url + "/metrics")).text
        await sampler.sample(http, start)
    await client._http.aclose()  # passed in, so not closed by the client
    rss_end = rss_bytes(pid)
    advice = check_advice(
        read_log(server.admission_log),
        round(final["kv_usable_tokens"]),
        tolerance=ADVICE_TOLERANCE,
    )
    return report(
        args,
        records,
        wall,
        sender,
        sampler,
        final,
        text,
        server.internal_errors(),
        rss_start,
        rss_end,
        rate,
        advice,
    )


def report(
    args: argparse.Namespace,
    records: list[RequestRecord],
    wall: float,
    sender: SoakSender,
    sampler: Sampler,
    final: dict[str, float],
    metrics_text: str,
    internal_errors: list[str],
    rss_start: int | None,
    rss_end: int | None,
    rate: float,
    advice: AdviceCheck | None = None,
) -> dict[str, Any]:
    summary = summarize(records, duration=wall)
    causes = summary.failed_by_cause
    injected_500 = causes.get("injected_fault", 0)
    # What clients saw: a 5xx status that was not an injected fault, a stream broken by a server
    # error event that was not one (an OOM, say) or cut short by the server.
    unexpected_seen = {
        cause: n
        for cause, n in causes.items()
        if cause.startswith("http_5") or cause in ("bad_response", "raw: stream cut")
    }
    seen_5xx_status = injected_500 + sum(
        n for cause, n in unexpected_seen.items() if cause.startswith("http_5")
    )
    answered_5xx = server_5xx(metrics_text)
    # What the server says: its own count of 5xx statuses beyond those the clients read (a
    # client that timed out may miss one), and every unexpected exception it logged.
    unseen_5xx = max(0, answered_5xx - seen_5xx_status)
    unexpected_5xx = sum(unexpected_seen.values()) + len(internal_errors)
    rss = [s["rss_mb"] for s in sampler.samples if "rss_mb" in s]
    warm = [s["rss_mb"] for s in sampler.samples if "rss_mb" in s and s["t"] >= args.warm_up]
    rss_warm = warm[0] if warm else (rss[0] if rss else None)
    rss_end_mb = None if rss_end is None else rss_end / MEGABYTE
    growth = None if rss_end_mb is None or rss_warm is None else rss_end_mb - rss_warm
    criteria = {
        "no OOM": final["kv_oom_events_total"] == 0,
        "no unexpected 5xx": unexpected_5xx == 0
        and unseen_5xx <= injected_unseen_allowance(final, injected_500, causes),
        "ledger at zero": final["kv_reserved_tokens"] == 0 and final["kv_inflight_requests"] == 0,
        f"RSS growth <= {args.max_rss_growth_mb:g} MB": growth is None
        or growth <= args.max_rss_growth_mb,
        'no 429 told "fits now" while held': advice is None or advice.fits_now_lies == 0,
    }
    return {
        "duration": args.duration,
        "wall_seconds": round(wall, 1),
        "seed": args.seed,
        "rate": round(rate, 2),
        "load": args.load,
        "fault_rate": args.fault_rate,
        "requests": len(records),
        "sent": summary.sent,
        "by_kind": dict(sender.kinds),
        "completed": summary.completed,
        "completed_per_second": round(summary.request_throughput, 2),
        "failed": summary.failed,
        "failed_by_cause": causes,
        "http_429_seen": summary.http_429,
        "server_rejected_429": final["kv_rejected_total"],
        "server_admitted": final["kv_admitted_total"],
        "injected_faults": final["kv_injected_faults_total"],
        "oom_events": final["kv_oom_events_total"],
        "server_5xx": answered_5xx,
        "injected_500_seen": injected_500,
        "server_5xx_unseen": unseen_5xx,
        "unexpected_5xx": unexpected_5xx,
        "unexpected_5xx_seen_by_clients": unexpected_seen,
        "server_internal_errors": internal_errors[:20],
        "reserved_tokens_end": final["kv_reserved_tokens"],
        "inflight_end": final["kv_inflight_requests"],
        "rss_mb": {
            "start": None if rss_start is None else round(rss_start / MEGABYTE, 1),
            "after_warm_up": None if rss_warm is None else round(rss_warm, 1),
            "end": None if rss_end_mb is None else round(rss_end_mb, 1),
            "max": round(max([*rss, rss_end_mb or 0.0]), 1) if rss else None,
            "growth_after_warm_up": None if growth is None else round(growth, 1) + 0.0,
        },
        "send_timeouts": final.get("kv_send_timeouts_total", 0.0),
        "retry_after": None if advice is None else advice_summary(advice),
        "samples": sampler.samples,
        "criteria": criteria,
        "passed": all(criteria.values()),
    }


def advice_summary(advice: AdviceCheck) -> dict[str, Any]:
    return {
        "refused": advice.refused,
        "checked": advice.checked,
        "told_less": advice.told_less,
        "told_less_share": round(advice.told_less_share, 4),
        "tolerance_seconds": advice.tolerance,
        "fits_now_lies": advice.fits_now_lies,
        "worst_shortfall_seconds": round(advice.worst_shortfall, 3),
        "advised_over_real": {
            q: round(advice.ratio_quantile(p), 3)
            for q, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))
        },
    }


def injected_unseen_allowance(
    final: dict[str, float], injected_500: int, causes: dict[str, int]
) -> int:
    """5xx statuses no client read can only be injected faults no client reported."""
    reported = injected_500 + causes.get("injected_fault (mid-stream)", 0)
    return max(0, round(final["kv_injected_faults_total"]) - reported)


def print_report(data: dict[str, Any]) -> None:
    rss = data["rss_mb"]

    def mb(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} MB"

    causes = ", ".join(f"{cause} {n}" for cause, n in data["failed_by_cause"].items()) or "none"
    rows = [
        ["requests (sent)", f"{data['requests']} ({data['sent']})"],
        ["  by kind", ", ".join(f"{k} {n}" for k, n in sorted(data["by_kind"].items()))],
        ["completed", f"{data['completed']} ({data['completed_per_second']}/s)"],
        ["failed, by cause", f"{data['failed']}: {causes}"],
        [
            "429s seen by clients / sent by the server",
            f"{data['http_429_seen']} / {data['server_rejected_429']:.0f}",
        ],
        ["injected faults (server)", f"{data['injected_faults']:.0f}"],
        ["OOM events", f"{data['oom_events']:.0f}"],
        ["5xx other than injected", f"{data['unexpected_5xx']}"],
        [
            "ledger at the end",
            f"{data['reserved_tokens_end']:.0f} tokens reserved, "
            f"{data['inflight_end']:.0f} in flight",
        ],
        [
            "server RSS start / after warm-up / end / max",
            f"{mb(rss['start'])} / "
            f"{mb(rss['after_warm_up'])} / {mb(rss['end'])} / {mb(rss['max'])}",
        ],
        ["RSS growth after warm-up", mb(rss["growth_after_warm_up"])],
        ["answers cut by the send timeout", f"{data['send_timeouts']:.0f}"],
    ]
    advice = data.get("retry_after")
    if advice:
        ratios = advice["advised_over_real"]
        rows += [
            [
                "429s checked against the admission log",
                f"{advice['checked']} of {advice['refused']}",
            ],
            [
                f"  told less than the real wait (> {advice['tolerance_seconds']:g} s short)",
                f"{advice['told_less']} ({advice['told_less_share']:.1%}), worst "
                f"{advice['worst_shortfall_seconds']:.3f} s short",
            ],
            ['  told "fits now" (<= 1 ms) while held', f"{advice['fits_now_lies']}"],
            [
                "  advised / real wait, p10 / p50 / p90",
                f"{ratios['p10']} / {ratios['p50']} / {ratios['p90']}",
            ],
        ]
    print_table(
        f"Soak: {data['duration']:g} s of the seed's mix at {data['rate']}/s "
        f"({data['load']:g}x the estimated capacity), fault rate {data['fault_rate']:g}, "
        f"seed {data['seed']}",
        ["", "value"],
        rows,
    )
    verdicts = "; ".join(
        f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in data["criteria"].items()
    )
    print(f"\ncriteria: {verdicts}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--duration", type=float, help="seconds of arrivals (default: 60, --quick 10)")
    add("--quick", action="store_true", help="a 10 s soak")
    add("--load", type=float, default=1.75, help="x the estimated capacity (default: %(default)s)")
    add("--fault-rate", type=float, default=0.02, help="injected faults (default: %(default)s)")
    add("--hang-up-share", type=float, default=0.15, help="raw clients that hang up")
    add("--stall-share", type=float, default=0.01, help="raw clients that stop reading")
    add(
        "--stall-seconds",
        type=float,
        help="how long they keep the socket open (default: 12, at most --duration)",
    )
    add("--short-share", type=float, default=0.3, help="kvclient requests with max_tokens 1")
    add(
        "--long-share",
        type=float,
        default=0.05,
        help=f"kvclient requests with max_tokens {LONG_MAX_TOKENS}",
    )
    add("--send-timeout", type=float, default=2.0, help="the server's (default: %(default)s)")
    add("--seed", type=int, default=SEED)
    add("--sample-every", type=float, help="seconds between samples (default: duration / 30)")
    add("--warm-up", type=float, help="seconds before the RSS baseline (default: duration / 4)")
    add("--max-rss-growth-mb", type=float, default=20.0, help="after warm-up (default: 20)")
    add(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the server (repeat), e.g. --server-arg=--admission "
        "--server-arg=prompt to watch the soak fail",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.duration = args.duration or (10.0 if args.quick else 60.0)
    args.sample_every = args.sample_every or max(0.25, args.duration / 30)
    args.warm_up = args.duration / 4 if args.warm_up is None else args.warm_up
    args.stall_seconds = args.stall_seconds or min(12.0, args.duration)
    pinned = pin_to_cpu(0)
    server_args = ["--fault-rate", str(args.fault_rate), "--seed", str(args.seed)]
    server_args += ["--send-timeout", str(args.send_timeout), "--socket-send-buffer", "16384"]
    server_args += args.server_arg
    with server_process(server_args, 1 if pinned else None) as server:
        data = anyio.run(soak, args, server)
    data["pinned"] = pinned
    data["server_args"] = server_args
    print_report(data)
    write_json("soak", data)
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
