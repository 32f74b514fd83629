"""``kvclient bench URL``: load-test any OpenAI-compatible server without becoming a storm.

Before the run, a preflight (reachable, authorised, model served, context window known) and the
outputs' needs are checked, each failure one line and exit status 2. After it, the exit status is
1 when more than ``--max-failure-rate`` of the offered requests did not complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from .._cli_options import (
    add_api_key,
    add_context_window,
    add_json,
    add_log_level,
    add_model,
    add_tokenizer,
    add_url,
    hidden_alias,
    load_tokenizer,
    no_url_message,
    resolve_client,
    setup_logging,
    to_stdout,
    write_json,
)
from .._dialects import Answer, Budget, KVLosses, Probe, discover_budget
from .._exceptions import KVClientError
from .._help import HelpFormatter
from .._tokens import TiktokenCounter, TokenCounter
from ._html import Sample, render_html
from ._metrics import SLO, RequestRecord, Summary, summarize
from ._preflight import PreflightError, Served, preflight
from ._report import (
    format_count,
    format_seconds,
    kv_losses_during,
    metric_delta,
    parse_prometheus_text,
    print_table,
    summary_rows,
)
from ._schedule import arrival_offsets
from ._sweep import DEFAULT_ATTAINMENT, SweepPoint, knee, next_rate, passes
from ._workload import MIXED, Shape, SyntheticWorkload, WorkItem, cycle, load_dataset

DEFAULT_NUM_REQUESTS = 100
DEFAULT_MAX_FAILURE_RATE = 0.01
DEFAULT_SWEEP_POINTS = 6
DEFAULT_SWEEP_SECONDS = 10.0
DEFAULT_PROBE_CONCURRENCY = 32
#: Without an arrival mode: the closed loop's concurrency when the KV pool is not discovered,
#: and the most it is set to when it is.
DEFAULT_CONCURRENCY = 8
MAX_DEFAULT_CONCURRENCY = 64
SAMPLE_INTERVAL = 0.25
EXIT_FAILURES = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Arguments that cannot work together, or an output that cannot be written: one line."""


def _range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {text!r}") from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in 0..1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in 0..1, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="kvclient bench",
        description="Load-test an OpenAI-compatible server. Arrivals are planned before the run "
        "(open loop) so a slow server cannot slow them; retries follow the server's Retry-After; "
        "every 429, 503 and failure is counted, and latencies include backoff. Exit status: 0, "
        "1 when more than --max-failure-rate of the requests did not complete (or a sweep "
        "found no rate within the SLOs), 2 when the server or the arguments cannot work.",
    )
    add_url(p)
    add_model(p, "the model to send (default: the first one /v1/models lists)")
    add_api_key(p)
    add_context_window(
        p, "the model's context window (default: discovered from the server, /v1/models)"
    )
    loop = p.add_argument_group(
        "arrivals (at most one of --rate, --concurrency or --sweep)",
        "Without any: a closed loop at the concurrency the server's KV pool holds at worst "
        "case (its whole context windows, or llama.cpp's slots; at most "
        f"{MAX_DEFAULT_CONCURRENCY}, {DEFAULT_CONCURRENCY} when the pool is not discovered). "
        "A closed loop cannot outrun the server, and every request it keeps in flight fits, so "
        "the run measures serving rather than refusals; the line it prints says what it chose.",
    )
    loop.add_argument(
        "--rate",
        type=float,
        help="open loop: requests per second (default: a closed loop, see above)",
    )
    loop.add_argument(
        "--arrival",
        choices=["poisson", "constant", "gamma"],
        default="poisson",
        help="how --rate's arrivals are spaced",
    )
    loop.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    loop.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="closed loop: requests in flight (default: matched to the server's KV pool)",
    )
    loop.add_argument(
        "--requests",
        type=int,
        dest="num_requests",
        metavar="N",
        help=f"requests to send (default {DEFAULT_NUM_REQUESTS}; with --duration, until it ends)",
    )
    hidden_alias(loop, "--num-requests", dest="num_requests", type=int)
    loop.add_argument(
        "--duration",
        type=float,
        help=f"seconds; no new sends after it (a sweep's seconds per rate, default "
        f"{DEFAULT_SWEEP_SECONDS:g})",
    )
    loop.add_argument("--grace", type=float, default=30.0, help="seconds allowed after --duration")
    sweep = p.add_argument_group(
        "sweep: the highest arrival rate whose goodput meets the --slo-* targets"
    )
    sweep.add_argument(
        "--sweep",
        action="store_true",
        help="measure the flat-out throughput (closed loop), then open loops at rates around "
        "it, bisecting towards the knee",
    )
    sweep.add_argument(
        "--sweep-points",
        type=int,
        default=DEFAULT_SWEEP_POINTS,
        help="rates to try (default %(default)s)",
    )
    sweep.add_argument(
        "--sweep-attainment",
        type=_share,
        default=DEFAULT_ATTAINMENT,
        help="share of the offered requests that must complete within the SLOs for a rate to "
        "pass (default %(default)s)",
    )
    sweep.add_argument(
        "--probe-concurrency",
        type=int,
        default=DEFAULT_PROBE_CONCURRENCY,
        help="closed-loop concurrency of the throughput probe (default %(default)s)",
    )
    sweep.add_argument(
        "--probe-requests", type=int, help="requests of the probe (default 4 x its concurrency)"
    )
    work = p.add_argument_group(
        "workload (default: the seed post's adversarial mix: 60% short prompts with large or "
        "unset caps, 40% long prompts with small caps)"
    )
    work.add_argument(
        "--dataset",
        type=Path,
        metavar="FILE",
        help="our JSONL (prompt or messages, max_tokens) or ShareGPT JSON (first human turn "
        "as prompt, the reply's length as max_tokens; default: a synthetic workload)",
    )
    hidden_alias(work, "--workload-file", dest="dataset", type=Path)
    work.add_argument(
        "--prompt-tokens",
        type=_range,
        metavar="MIN:MAX",
        help="synthetic prompts' length in tokens, drawn from MIN:MAX, or N "
        "(default: the seed's mix)",
    )
    work.add_argument(
        "--max-tokens-range",
        type=_range,
        metavar="MIN:MAX",
        help="synthetic requests' max_tokens, drawn from MIN:MAX, or N (default: the seed's mix)",
    )
    hidden_alias(work, "--max-tokens", dest="max_tokens_range", type=_range)
    work.add_argument("--unset-cap-share", type=float, default=0.0, help="share sent with no cap")
    work.add_argument("--chat", action="store_true", help="send prompts as chat")
    add_tokenizer(
        work,
        "counts tokens and makes synthetic prompts of exact lengths for it",
        "tiktoken cl100k_base",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the workload and the arrivals: the same seed replays the same run",
    )
    p.add_argument("--no-stream", action="store_true", help="no SSE: no TTFT or TPOT")
    p.add_argument("--naive", action="store_true", help="baseline: retry at once, no Retry-After")
    p.add_argument("--request-deadline", type=float, default=60.0, help="seconds per request")
    p.add_argument("--max-attempts", type=int, default=6, help="attempts per request at most")
    p.add_argument(
        "--max-failure-rate",
        type=_share,
        default=DEFAULT_MAX_FAILURE_RATE,
        help="exit 1 when a larger share of the offered requests did not complete "
        "(default %(default)s)",
    )
    p.add_argument("--slo-ttft", type=float, help="goodput: TTFT goal in seconds (default: none)")
    p.add_argument(
        "--slo-tpot",
        type=float,
        help="goodput: time-per-output-token goal, seconds (default: none)",
    )
    p.add_argument(
        "--slo-latency", type=float, help="goodput: end-to-end goal in seconds (default: none)"
    )
    add_json(p, "the summary")
    p.add_argument("--records", action="store_true", help="with --json: per-request records too")
    p.add_argument(
        "--plot",
        metavar="FILE",
        type=Path,
        help="PNG of latency and rejections, or the sweep curve (default: none)",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        type=Path,
        help="one self-contained page: summary, latency distributions, timeline of in-flight "
        "KV and refusals, sweep curve (default: none)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_log_level(p)
    return p


@dataclass(frozen=True, slots=True)
class BenchResult:
    summary: Summary
    records: list[RequestRecord]
    server_metrics: dict[str, float | None]
    samples: list[Sample] = field(default_factory=list)
    #: What the engine's own /metrics counted lost for lack of KV during the run (vLLM's
    #: preemptions, our OOM-failed requests, ...); None when it exposes no such counter.
    server_losses: KVLosses | None = None

    def to_json(self, *, with_records: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {"summary": self.summary.to_json()}
        data["server"] = self.server_metrics
        if self.server_losses is not None:
            losses = self.server_losses
            data["server_kv_losses"] = {
                "count": losses.total,
                "kind": losses.kind,
                "metric": losses.metric,
                "engine": losses.engine,
            }
        if with_records:
            data["records"] = [r.to_json() for r in self.records]
        return data


@dataclass(frozen=True, slots=True)
class SweepResult:
    probe: BenchResult
    points: list[SweepPoint]
    runs: list[BenchResult]
    knee: float | None

    @property
    def capacity(self) -> float:
        return self.probe.summary.request_throughput

    def at_knee(self) -> BenchResult | None:
        for point, run in zip(self.points, self.runs, strict=True):
            if point.rate == self.knee:
                return run
        return None

    def to_json(self, *, with_records: bool = False) -> dict[str, Any]:
        return {
            "sweep": {
                "probe_completed_per_second": self.capacity,
                "probe": self.probe.to_json(),
                "knee_rate": self.knee,
                "points": [
                    {"rate": p.rate, "passed": p.passed, **run.to_json(with_records=with_records)}
                    for p, run in sorted(
                        zip(self.points, self.runs, strict=True), key=lambda pr: pr[0].rate
                    )
                ],
            }
        }


# --- checks before anything runs --------------------------------------------------------------


def _writable(path: Path, flag: str) -> None:
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: cannot write there")


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be known wrong before the run, so no run is wasted on it."""
    resolve_client(args)
    if args.url is None:
        raise UsageError(no_url_message())
    kinds = sum(x is not None for x in (args.rate, args.concurrency)) + bool(args.sweep)
    if kinds > 1:
        raise UsageError("give at most one of --rate, --concurrency and --sweep")
    if args.sweep and not (args.slo_ttft or args.slo_tpot or args.slo_latency):
        raise UsageError("--sweep needs a target: --slo-latency, --slo-ttft or --slo-tpot")
    if args.sweep and args.sweep_points < 1:
        raise UsageError("--sweep-points must be at least 1")
    if args.dataset is not None and not args.dataset.is_file():
        raise UsageError(f"--dataset {args.dataset}: no such file")
    for flag, path in (("--json", args.json_path), ("--plot", args.plot), ("--html", args.html)):
        if path is not None and not (flag == "--json" and to_stdout(path)):
            _writable(path, flag)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'kvclient[plot]'") from None


def make_counter(tokenizer: Path | None) -> TokenCounter:
    """The run's token counter: the model's own tokenizer when given (a file or a directory)."""
    if tokenizer is None:
        return TiktokenCounter()
    try:
        return load_tokenizer(tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def default_concurrency(budget: Budget, context_window: int) -> tuple[int, str]:
    """The closed loop's concurrency when no arrival mode is given, and why (pure): the requests
    the KV pool holds when each reserves a whole context window (llama.cpp: its slots)."""
    if budget.max_concurrency is not None:
        n = budget.max_concurrency
        why = f"the server's {n} slots"
    elif budget.kv_tokens is not None and context_window > 0:
        n = budget.kv_tokens // context_window
        why = (
            f"its KV pool of {budget.kv_tokens:,} tokens holds {n} whole "
            f"{context_window:,}-token context windows"
        )
    else:
        return DEFAULT_CONCURRENCY, "the server's KV pool was not discovered"
    if n > MAX_DEFAULT_CONCURRENCY:
        return MAX_DEFAULT_CONCURRENCY, f"{why}; at most {MAX_DEFAULT_CONCURRENCY}"
    return max(1, n), why


async def find_budget(url: str, api_key: str | None) -> Budget:
    """The server's KV pool, through the engine dialects' probes; an unknown pool when it does
    not say (or cannot be reached)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    driver = discover_budget()
    async with httpx.AsyncClient(
        base_url=url.rstrip("/").removesuffix("/v1"), headers=headers, timeout=10.0
    ) as http:
        probe: Probe = next(driver)
        while True:
            try:
                response = await http.request(probe.method, probe.path, json=probe.json)
            except httpx.HTTPError:
                return Budget(None)
            payload: Any = response.text
            if probe.path != "/metrics":
                try:
                    payload = response.json()
                except ValueError:
                    payload = None
            try:
                probe = driver.send(Answer(response.status_code, payload))
            except StopIteration as stop:
                found: Budget = stop.value
                return found


def build_items(args: argparse.Namespace, count: int, counter: TokenCounter) -> list[WorkItem]:
    if args.dataset is not None:
        return list(cycle(load_dataset(args.dataset, counter, chat=args.chat), count))
    if args.prompt_tokens is None and args.max_tokens_range is None:
        shapes: Sequence[Shape] = MIXED
    else:
        shapes = [
            Shape(
                prompt_tokens=args.prompt_tokens or (100, 1000),
                max_tokens=args.max_tokens_range or (50, 500),
                unset_cap_share=args.unset_cap_share,
            )
        ]
    return SyntheticWorkload(shapes=shapes, chat=args.chat, seed=args.seed).items(count, counter)


# --- running ----------------------------------------------------------------------------------


async def _scrape_text(http: httpx.AsyncClient) -> str | None:
    try:
        response = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    text = await _scrape_text(http)
    return {} if text is None else parse_prometheus_text(text)


SERVER_COUNTERS = ("kv_rejected_total", "kv_admitted_total", "kv_oom_events_total")


class _Sampler:
    """The server's reserved-KV gauge and refusal counter every SAMPLE_INTERVAL (for --html)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http
        self.samples: list[Sample] = []
        self._base: float | None = None

    async def run(self, origin: float) -> None:
        while True:
            metrics = await _scrape(self._http)
            if "kv_reserved_tokens" not in metrics and "kv_rejected_total" not in metrics:
                return  # not our server's gauges: the page uses the client's estimate
            refused = metrics.get("kv_rejected_total")
            if refused is not None and self._base is None:
                self._base = refused
            self.samples.append(
                Sample(
                    t=anyio.current_time() - origin,
                    kv_reserved=metrics.get("kv_reserved_tokens"),
                    refused_total=None if refused is None else refused - (self._base or 0.0),
                )
            )
            await anyio.sleep(SAMPLE_INTERVAL)


def _slo(args: argparse.Namespace) -> SLO | None:
    if args.slo_ttft or args.slo_tpot or args.slo_latency:
        return SLO(ttft=args.slo_ttft, tpot=args.slo_tpot, latency=args.slo_latency)
    return None


def _api_key(args: argparse.Namespace) -> str | None:
    from .._client import API_KEY_ENV, from_env

    key: str | None = args.api_key or from_env(API_KEY_ENV)
    return key


async def run_bench(
    args: argparse.Namespace,
    served: Served,
    items: Sequence[WorkItem],
    *,
    offsets: list[float] | None,
    concurrency: int | None,
    duration: float | None,
    sample: bool = False,
    progress: bool = True,
) -> BenchResult:
    """One run as the arguments say, against a server the preflight has checked."""
    from .._async_client import AsyncClient
    from .._retry import RetryPolicy
    from ._kvsender import KVClientSender
    from ._naive import NaiveSender
    from ._runner import run_load

    api_key = _api_key(args)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.request_deadline, connect=10.0)
    async with httpx.AsyncClient(
        base_url=args.url.rstrip("/").removesuffix("/v1"),
        headers=headers,
        limits=limits,
        timeout=timeout,
    ) as http:
        before_text = await _scrape_text(http)
        before = parse_prometheus_text(before_text or "")
        sender: Any
        if args.naive:
            sender = NaiveSender(
                http,
                model=served.model,
                max_attempts=args.max_attempts,
                deadline=args.request_deadline,
            )
        else:
            client = AsyncClient(
                base_url=args.url,
                model=served.model,
                api_key=api_key,
                context_window=served.context_window,
                counter=args.counter,
                retry=RetryPolicy(max_attempts=args.max_attempts, deadline=args.request_deadline),
                http_client=http,
            )
            sender = KVClientSender(client, stream=not args.no_stream)
        sampler = _Sampler(http)
        bar = _Progress(len(items), enabled=progress and not args.no_progress)
        async with anyio.create_task_group() as tg:
            if sample:
                tg.start_soon(sampler.run, anyio.current_time())
            with bar:
                records, wall = await run_load(
                    items,
                    sender,
                    offsets=offsets,
                    concurrency=concurrency,
                    duration=duration,
                    grace=args.grace,
                    on_done=bar.advance,
                )
            tg.cancel_scope.cancel()
        after_text = await _scrape_text(http)
    after = parse_prometheus_text(after_text or "")
    server = {name: metric_delta(before, after, name) for name in SERVER_COUNTERS}
    summary = summarize(records, duration=wall, slo=_slo(args), deadline=args.request_deadline)
    losses = kv_losses_during(before_text, after_text)
    return BenchResult(summary, records, server, sampler.samples, losses)


def _schedule(args: argparse.Namespace, rate: float, duration: float | None) -> list[float]:
    count = args.num_requests
    if count is None and duration is None:
        count = DEFAULT_NUM_REQUESTS
    return arrival_offsets(
        rate=rate,
        kind=args.arrival,
        num_requests=count,
        duration=duration,
        burstiness=args.burstiness,
        seed=args.seed,
    )


async def run_one(args: argparse.Namespace, served: Served) -> BenchResult:
    if args.rate is not None:
        offsets = _schedule(args, args.rate, args.duration)
        items = build_items(args, len(offsets), args.counter)
        return await run_bench(
            args,
            served,
            items,
            offsets=offsets,
            concurrency=None,
            duration=args.duration,
            sample=args.html is not None,
        )
    count = args.num_requests
    if count is None:
        count = DEFAULT_NUM_REQUESTS if args.duration is None else 100_000
    items = build_items(args, min(count, 100_000), args.counter)
    return await run_bench(
        args,
        served,
        items,
        offsets=None,
        concurrency=args.concurrency,
        duration=args.duration,
        sample=args.html is not None,
    )


async def run_sweep(
    args: argparse.Namespace, served: Served, say: Callable[[str], None]
) -> SweepResult:
    """The probe, then up to ``--sweep-points`` open loops (see :mod:`._sweep`)."""
    probe_n = args.probe_requests or 4 * args.probe_concurrency
    say(f"… probe: {probe_n} requests, closed loop at concurrency {args.probe_concurrency}")
    probe = await run_bench(
        args,
        served,
        build_items(args, probe_n, args.counter),
        offsets=None,
        concurrency=args.probe_concurrency,
        duration=None,
        progress=False,
    )
    capacity = probe.summary.request_throughput
    if capacity <= 0:
        raise UsageError("the probe completed no request: nothing to sweep around")
    say(f"  flat out: {capacity:.2f} completed req/s")
    seconds = args.duration if args.duration is not None else DEFAULT_SWEEP_SECONDS
    points: list[SweepPoint] = []
    runs: list[BenchResult] = []
    while (rate := next_rate(points, capacity, args.sweep_points)) is not None:
        offsets = arrival_offsets(
            rate=rate,
            kind=args.arrival,
            duration=seconds,
            num_requests=args.num_requests,
            burstiness=args.burstiness,
            seed=args.seed + len(points),
        )
        items = build_items(args, len(offsets), args.counter)
        run = await run_bench(
            args,
            served,
            items,
            offsets=offsets,
            concurrency=None,
            duration=None,
            sample=args.html is not None,
            progress=False,
        )
        point = SweepPoint(rate, run.summary, passes(run.summary, args.sweep_attainment))
        points.append(point)
        runs.append(run)
        share = run.summary.slo_attainment or 0.0
        say(
            f"  {rate:.2f} req/s: {share:.0%} within the SLOs -> "
            f"{'pass' if point.passed else 'fail'}"
        )
    return SweepResult(probe, points, runs, knee(points))


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


# --- reporting --------------------------------------------------------------------------------


def _plot(records: list[RequestRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    plt.close(fig)


def _plot_sweep(sweep: SweepResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(zip(sweep.points, sweep.runs, strict=True), key=lambda pr: pr[0].rate)
    rates = [p.rate for p, _ in pts]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(rates, rates, color="#bbbbbb", label="offered = served (ideal)")
    ax.plot(rates, [r.summary.request_throughput for _, r in pts], "o-", label="completed")
    ax.plot(rates, [r.summary.goodput or 0 for _, r in pts], "o-", label="goodput (SLOs met)")
    if sweep.knee is not None:
        ax.axvline(sweep.knee, linestyle="--", color="#333", label=f"knee {sweep.knee:.3g}")
    ax.set_xlabel("offered arrival rate (req/s)")
    ax.set_ylabel("req/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_rows(result: BenchResult) -> list[tuple[str, str]]:
    rows = summary_rows(result.summary)
    for name, value in result.server_metrics.items():
        if value is not None:
            rows.append((f"server: {name} (this run)", f"{value:,.0f}"))
    losses = result.server_losses
    if losses is not None:
        rows.append((f"server: {losses.kind} ({losses.metric}, this run)", f"{losses.total:,.0f}"))
    return rows


def print_result(result: BenchResult, *, title: str = "kvclient bench") -> None:
    print_table(title, ["metric", "value"], result_rows(result))
    for warning in result.summary.warnings:
        print(f"warning: {warning}")


SWEEP_HEADERS = [
    "offered req/s",
    "completed req/s",
    "goodput req/s",
    "within SLOs",
    "p50 latency",
    "p99 latency (all)",
    "429s",
    "verdict",
]


def sweep_rows(sweep: SweepResult) -> list[list[str]]:
    rows = []
    for point, run in sorted(zip(sweep.points, sweep.runs, strict=True), key=lambda pr: pr[0].rate):
        s = run.summary
        rows.append(
            [
                f"{point.rate:.2f}",
                f"{s.request_throughput:.2f}",
                f"{s.goodput or 0:.2f}",
                f"{s.slo_attainment or 0:.0%}",
                format_seconds(s.latency.p50),
                format_seconds(s.latency_all.p99),
                format_count(s.http_429),
                ("knee" if point.rate == sweep.knee else "pass") if point.passed else "fail",
            ]
        )
    return rows


def _fail(message: str) -> int:
    print(f"kvclient bench: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        check_args(args)
        args.counter = make_counter(args.tokenizer)
        served = anyio.run(
            lambda: preflight(
                url=args.url,
                model=args.model,
                api_key=_api_key(args),
                context_window=args.context_window,
            )
        )
        if args.rate is None and args.concurrency is None and not args.sweep:
            budget = anyio.run(find_budget, args.url, _api_key(args))
            args.concurrency, why = default_concurrency(budget, served.context_window)
            print(
                f"kvclient bench: no arrival mode given: closed loop at --concurrency "
                f"{args.concurrency} ({why})",
                file=sys.stderr,
            )
    except (UsageError, PreflightError, KVClientError, ValueError, OSError) as exc:
        return _fail(str(exc))
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        if args.sweep:
            sweep = anyio.run(run_sweep, args, served, say)
            return _report_sweep(args, sweep)
        result = anyio.run(run_one, args, served)
    except (UsageError, KVClientError, ValueError, OSError) as exc:
        return _fail(str(exc))
    return _report_one(args, result)


def _report_one(args: argparse.Namespace, result: BenchResult) -> int:
    if not to_stdout(args.json_path):
        print_result(result)
    if args.json_path is not None:
        write_json(args.json_path, result.to_json(with_records=args.records))
    if args.plot is not None:
        _plot(result.records, args.plot)
    if args.html is not None:
        page = render_html(
            title=f"kvclient bench {args.url}",
            summary=result.summary,
            records=result.records,
            samples=result.samples,
        )
        args.html.write_text(page, encoding="utf-8")
    s = result.summary
    if s.failure_rate > args.max_failure_rate:
        print(
            f"kvclient bench: {s.offered - s.completed} of {s.offered} requests "
            f"({s.failure_rate:.1%}) did not complete, more than --max-failure-rate "
            f"{args.max_failure_rate:g}; the most common: "
            + "; ".join(f"{g.cause} ×{g.count}: {g.message}" for g in s.failures[:2]),
            file=sys.stderr,
        )
        return EXIT_FAILURES
    return 0


def _report_sweep(args: argparse.Namespace, sweep: SweepResult) -> int:
    slo = ", ".join(
        f"{name} <= {value:g} s"
        for name, value in (
            ("TTFT", args.slo_ttft),
            ("TPOT", args.slo_tpot),
            ("latency", args.slo_latency),
        )
        if value
    )
    title = (
        f"kvclient bench --sweep: {sweep.capacity:.2f} req/s flat out; a rate passes when "
        f"{args.sweep_attainment:.0%} of its requests complete within {slo}"
    )
    at_knee = sweep.at_knee()
    if not to_stdout(args.json_path):
        print_table(title, SWEEP_HEADERS, sweep_rows(sweep))
        if sweep.knee is None:
            print("no rate met the SLOs")
        else:
            print(f"knee: {sweep.knee:.2f} req/s ({sweep.knee / sweep.capacity:.0%} of flat out)")
    if args.json_path is not None:
        write_json(args.json_path, sweep.to_json(with_records=args.records))
    if args.plot is not None:
        _plot_sweep(sweep, args.plot)
    if args.html is not None:
        shown = at_knee or sweep.runs[0]
        curve = [
            (p.rate, r.summary.request_throughput, r.summary.goodput or 0.0)
            for p, r in sorted(
                zip(sweep.points, sweep.runs, strict=True), key=lambda pr: pr[0].rate
            )
        ]
        page = render_html(
            title=f"kvclient bench --sweep {args.url}",
            summary=shown.summary,
            records=shown.records,
            samples=shown.samples,
            sweep=curve,
            sweep_rows=sweep_rows(sweep),
            sweep_headers=SWEEP_HEADERS,
            knee_rate=sweep.knee,
        )
        args.html.write_text(page, encoding="utf-8")
    return 0 if sweep.knee is not None else EXIT_FAILURES


__all__ = ["BenchResult", "SweepResult", "main", "run_bench", "run_sweep"]
