"""``kvclient bench URL``: load-test any OpenAI-compatible server without becoming a storm."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from .._exceptions import KVClientError
from .._tokens import HuggingFaceCounter, TiktokenCounter, TokenCounter
from ._metrics import SLO, RequestRecord, Summary, summarize
from ._report import metric_delta, parse_prometheus_text, print_table, summary_rows
from ._schedule import arrival_offsets
from ._workload import MIXED, Shape, SyntheticWorkload, WorkItem, cycle, load_jsonl

DEFAULT_NUM_REQUESTS = 100


def _range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvclient bench",
        description="Load-test an OpenAI-compatible server. Arrivals are planned before the run "
        "(open loop) so a slow server cannot slow them; retries follow the server's Retry-After; "
        "every 429, 503 and failure is counted, and latencies include backoff.",
    )
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", help="bearer token")
    p.add_argument("--context-window", type=int, help="default: /v1/models max_model_len")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="count with this local model directory (HuggingFaceCounter.from_pretrained) "
        "instead of tiktoken cl100k_base",
    )
    loop = p.add_argument_group("arrivals (one of --rate or --concurrency)")
    loop.add_argument("--rate", type=float, help="open loop: requests per second")
    loop.add_argument("--arrival", choices=["poisson", "constant", "gamma"], default="poisson")
    loop.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    loop.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    loop.add_argument("--num-requests", type=int, help=f"default {DEFAULT_NUM_REQUESTS}")
    loop.add_argument("--duration", type=float, help="seconds; no new sends after it")
    loop.add_argument("--grace", type=float, default=30.0, help="seconds allowed after --duration")
    work = p.add_argument_group("workload (default: the seed's adversarial mix)")
    work.add_argument("--workload-file", type=Path, help="JSONL: prompt or messages, max_tokens")
    work.add_argument("--prompt-tokens", type=_range, help="synthetic prompt length MIN:MAX")
    work.add_argument("--max-tokens", type=_range, help="synthetic output cap MIN:MAX")
    work.add_argument("--unset-cap-share", type=float, default=0.0, help="share sent with no cap")
    work.add_argument("--chat", action="store_true", help="send synthetic prompts as chat")
    work.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true", help="no SSE: no TTFT or ITL")
    p.add_argument("--naive", action="store_true", help="baseline: retry at once, no Retry-After")
    p.add_argument("--request-deadline", type=float, default=60.0, help="seconds per request")
    p.add_argument("--max-attempts", type=int, default=6)
    p.add_argument("--slo-ttft", type=float, help="goodput: TTFT goal in seconds")
    p.add_argument("--slo-tpot", type=float, help="goodput: time-per-output-token goal, seconds")
    p.add_argument("--slo-latency", type=float, help="goodput: end-to-end goal in seconds")
    p.add_argument("--json", type=Path, dest="json_path", help="write the summary here")
    p.add_argument("--records", action="store_true", help="with --json: per-request records too")
    p.add_argument("--plot", type=Path, help="PNG of latency and rejections over time")
    p.add_argument("--no-progress", action="store_true")
    return p


@dataclass(frozen=True, slots=True)
class BenchResult:
    summary: Summary
    records: list[RequestRecord]
    server_metrics: dict[str, float | None]

    def to_json(self, *, with_records: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {"summary": self.summary.to_json()}
        data["server"] = self.server_metrics
        if with_records:
            data["records"] = [r.to_json() for r in self.records]
        return data


def make_counter(args: argparse.Namespace) -> TokenCounter:
    """The run's counter: ``--tokenizer PATH`` or tiktoken's cl100k_base."""
    path = getattr(args, "tokenizer", None)
    return HuggingFaceCounter.from_pretrained(path) if path else TiktokenCounter()


def build_items(
    args: argparse.Namespace, count: int, counter: TokenCounter | None = None
) -> list[WorkItem]:
    counter = counter if counter is not None else make_counter(args)
    if args.workload_file is not None:
        return list(cycle(load_jsonl(args.workload_file, counter), count))
    if args.prompt_tokens is None and args.max_tokens is None:
        shapes: Sequence[Shape] = MIXED
    else:
        shapes = [
            Shape(
                prompt_tokens=args.prompt_tokens or (100, 1000),
                max_tokens=args.max_tokens or (50, 500),
                unset_cap_share=args.unset_cap_share,
            )
        ]
    return SyntheticWorkload(shapes=shapes, chat=args.chat, seed=args.seed).items(count, counter)


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    try:
        response = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return parse_prometheus_text(response.text)


SERVER_COUNTERS = ("kv_rejected_total", "kv_admitted_total", "kv_oom_events_total")


async def run_bench(args: argparse.Namespace) -> BenchResult:
    """Run one benchmark as the parsed arguments say (also used by the demo and bench/)."""
    from .._client import AsyncClient
    from .._retry import RetryPolicy
    from ._kvsender import KVClientSender
    from ._naive import NaiveSender
    from ._runner import run_load

    if (args.rate is None) == (args.concurrency is None):
        raise SystemExit("kvclient bench: give exactly one of --rate and --concurrency")
    count = args.num_requests
    if count is None:
        count = DEFAULT_NUM_REQUESTS if args.duration is None else 1_000_000
    offsets = None
    if args.rate is not None:
        offsets = arrival_offsets(
            rate=args.rate,
            kind=args.arrival,
            num_requests=count,
            duration=args.duration,
            burstiness=args.burstiness,
            seed=args.seed,
        )
        count = len(offsets)
    else:
        count = min(count, 100_000)
    counter = make_counter(args)
    items = build_items(args, count, counter)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.request_deadline, connect=10.0)
    async with httpx.AsyncClient(
        base_url=args.url.rstrip("/").removesuffix("/v1"),
        headers=headers,
        limits=limits,
        timeout=timeout,
    ) as http:
        before = await _scrape(http)
        if args.naive:
            sender: Any = NaiveSender(
                http,
                model=args.model,
                max_attempts=args.max_attempts,
                deadline=args.request_deadline,
            )
            client = None
        else:
            client = AsyncClient(
                base_url=args.url,
                model=args.model,
                api_key=args.api_key,
                context_window=args.context_window,
                counter=counter,
                retry=RetryPolicy(max_attempts=args.max_attempts, deadline=args.request_deadline),
                http_client=http,
            )
            sender = KVClientSender(client, stream=not args.no_stream)
        progress = _Progress(len(items), enabled=not args.no_progress)
        with progress:
            records, wall = await run_load(
                items,
                sender,
                offsets=offsets,
                concurrency=args.concurrency,
                duration=args.duration,
                grace=args.grace,
                on_done=progress.advance,
            )
        after = await _scrape(http)
    slo = None
    if args.slo_ttft or args.slo_tpot or args.slo_latency:
        slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot, latency=args.slo_latency)
    server = {name: metric_delta(before, after, name) for name in SERVER_COUNTERS}
    return BenchResult(summarize(records, duration=wall, slo=slo), records, server)


class _Progress:
    """A live progress bar with rich when installed; silent otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._failed = 0
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import Progress
            except ImportError:
                return
            self._bar = Progress(transient=True)
            self._task = self._bar.add_task("requests", total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, record: RequestRecord) -> None:
        if self._bar is None:
            return
        self._failed += not record.ok
        self._bar.update(self._task, advance=1, description=f"requests ({self._failed} failed)")


def _plot(records: list[RequestRecord], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "kvclient bench: --plot needs matplotlib: pip install 'kvclient[plot]'", file=sys.stderr
        )
        return
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ok = [r for r in records if r.ok and r.latency is not None]
    top.scatter([r.planned for r in ok], [r.latency for r in ok], s=6, label="completed")
    failed = [r for r in records if not r.ok and r.end is not None]
    top.scatter(
        [r.planned for r in failed], [r.latency for r in failed], s=10, c="red", label="failed"
    )
    top.set_ylabel("end-to-end latency (s)")
    top.legend()
    bottom.bar([r.planned for r in records], [r.http_429 for r in records], width=0.05)
    bottom.set_ylabel("429s received")
    bottom.set_xlabel("planned send time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_result(result: BenchResult, *, title: str = "kvclient bench") -> None:
    rows = summary_rows(result.summary)
    for name, value in result.server_metrics.items():
        if value is not None:
            rows.append((f"server: {name} (this run)", f"{value:,.0f}"))
    print_table(title, ["metric", "value"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = anyio.run(run_bench, args)
    except (KVClientError, ValueError, OSError) as exc:
        print(f"kvclient bench: {exc}", file=sys.stderr)
        return 2
    print_result(result)
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(result.to_json(with_records=args.records), indent=2))
    if args.plot is not None:
        _plot(result.records, args.plot)
    return 0
