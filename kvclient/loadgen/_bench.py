"""``kvclient bench``'s runs: one run (open or closed loop) or a sweep, against a server the
preflight has checked, as a :class:`BenchConfig` says (I/O).

The command (:mod:`kvclient.loadgen.cli`) turns its options into the config; the decisions are
pure and elsewhere: the arrivals in :mod:`._schedule`, the sweep's rates in :mod:`._sweep`, the
run itself in :mod:`._runner`, the summary in :mod:`._metrics`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from .._tokens import TokenCounter
from ..engines.budget import Budget, discover_budget
from ..engines.discovery import Answer, Probe
from ._metrics import SLO, RequestRecord, summarize
from ._preflight import Served
from ._report import kv_losses_during, metric_delta, parse_prometheus_text
from ._results import BenchResult, Sample, SweepResult
from ._schedule import ArrivalKind, arrival_offsets
from ._sweep import DEFAULT_ATTAINMENT, SweepPoint, knee, next_rate, passes
from ._workload import MIXED, Shape, SyntheticWorkload, WorkItem, cycle, load_dataset

__all__ = [
    "BenchConfig",
    "NothingToSweep",
    "build_items",
    "default_concurrency",
    "find_budget",
    "run_bench",
    "run_one",
    "run_sweep",
]

DEFAULT_NUM_REQUESTS = 100
DEFAULT_SWEEP_POINTS = 6
DEFAULT_SWEEP_SECONDS = 10.0
DEFAULT_PROBE_CONCURRENCY = 32
#: Without an arrival mode: the closed loop's concurrency when the KV pool is not discovered,
#: and the most it is set to when it is.
DEFAULT_CONCURRENCY = 8
MAX_DEFAULT_CONCURRENCY = 64
SAMPLE_INTERVAL = 0.25
#: Our server's counters, reported as what changed during a run.
SERVER_COUNTERS = ("kv_rejected_total", "kv_admitted_total", "kv_oom_events_total")


class NothingToSweep(Exception):
    """The sweep's probe completed no request: there is no throughput to sweep around."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Everything a run needs, as ``kvclient bench``'s options set it."""

    url: str
    counter: TokenCounter
    api_key: str | None = None
    # What is sent: a dataset, or a synthetic workload (the seed's mix unless shaped here).
    dataset: Path | None = None
    chat: bool = False
    prompt_tokens: tuple[int, int] | None = None
    max_tokens_range: tuple[int, int] | None = None
    unset_cap_share: float = 0.0
    seed: int = 0
    # How each request is sent.
    naive: bool = False
    stream: bool = True
    max_attempts: int = 6
    request_deadline: float = 60.0
    # Arrivals: an open loop at ``rate``, else a closed loop at ``concurrency``.
    rate: float | None = None
    concurrency: int | None = None
    arrival: ArrivalKind = "poisson"
    burstiness: float = 1.0
    num_requests: int | None = None
    duration: float | None = None
    grace: float = 30.0
    # The sweep.
    sweep_points: int = DEFAULT_SWEEP_POINTS
    sweep_attainment: float = DEFAULT_ATTAINMENT
    probe_concurrency: int = DEFAULT_PROBE_CONCURRENCY
    probe_requests: int | None = None
    slo: SLO | None = None
    # What is watched while it runs: the server's gauges (for the HTML page), a progress bar.
    sample: bool = False
    progress: bool = True


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


def build_items(config: BenchConfig, count: int) -> list[WorkItem]:
    """``count`` requests to send: the dataset's, cycled, or a synthetic workload's."""
    counter = config.counter
    if config.dataset is not None:
        return list(cycle(load_dataset(config.dataset, counter, chat=config.chat), count))
    if config.prompt_tokens is None and config.max_tokens_range is None:
        shapes: Sequence[Shape] = MIXED
    else:
        shapes = [
            Shape(
                prompt_tokens=config.prompt_tokens or (100, 1000),
                max_tokens=config.max_tokens_range or (50, 500),
                unset_cap_share=config.unset_cap_share,
            )
        ]
    workload = SyntheticWorkload(shapes=shapes, chat=config.chat, seed=config.seed)
    return workload.items(count, counter)


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


async def run_bench(
    config: BenchConfig,
    served: Served,
    items: Sequence[WorkItem],
    *,
    offsets: list[float] | None,
    concurrency: int | None,
    duration: float | None,
    sample: bool = False,
    progress: bool = True,
) -> BenchResult:
    """One run as ``config`` says, against a server the preflight has checked."""
    from .._async_client import AsyncClient
    from .._policy import RetryPolicy
    from ._kvsender import KVClientSender
    from ._naive import NaiveSender
    from ._runner import run_load

    api_key = config.api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_deadline, connect=10.0)
    async with httpx.AsyncClient(
        base_url=config.url.rstrip("/").removesuffix("/v1"),
        headers=headers,
        limits=limits,
        timeout=timeout,
    ) as http:
        before_text = await _scrape_text(http)
        before = parse_prometheus_text(before_text or "")
        sender: Any
        if config.naive:
            sender = NaiveSender(
                http,
                model=served.model,
                max_attempts=config.max_attempts,
                deadline=config.request_deadline,
            )
        else:
            client = AsyncClient(
                base_url=config.url,
                model=served.model,
                api_key=api_key,
                context_window=served.context_window,
                counter=config.counter,
                retry=RetryPolicy(
                    max_attempts=config.max_attempts, deadline=config.request_deadline
                ),
                http_client=http,
            )
            sender = KVClientSender(client, stream=config.stream)
        sampler = _Sampler(http)
        bar = _Progress(len(items), enabled=progress and config.progress)
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
                    grace=config.grace,
                    on_done=bar.advance,
                )
            tg.cancel_scope.cancel()
        after_text = await _scrape_text(http)
    after = parse_prometheus_text(after_text or "")
    server = {name: metric_delta(before, after, name) for name in SERVER_COUNTERS}
    summary = summarize(records, duration=wall, slo=config.slo, deadline=config.request_deadline)
    losses = kv_losses_during(before_text, after_text)
    return BenchResult(summary, records, server, sampler.samples, losses)


def _schedule(config: BenchConfig, rate: float, duration: float | None) -> list[float]:
    count = config.num_requests
    if count is None and duration is None:
        count = DEFAULT_NUM_REQUESTS
    return arrival_offsets(
        rate=rate,
        kind=config.arrival,
        num_requests=count,
        duration=duration,
        burstiness=config.burstiness,
        seed=config.seed,
    )


async def run_one(config: BenchConfig, served: Served) -> BenchResult:
    """One open loop at ``config.rate``, else one closed loop at ``config.concurrency``."""
    if config.rate is not None:
        offsets = _schedule(config, config.rate, config.duration)
        items = build_items(config, len(offsets))
        return await run_bench(
            config,
            served,
            items,
            offsets=offsets,
            concurrency=None,
            duration=config.duration,
            sample=config.sample,
        )
    count = config.num_requests
    if count is None:
        count = DEFAULT_NUM_REQUESTS if config.duration is None else 100_000
    items = build_items(config, min(count, 100_000))
    return await run_bench(
        config,
        served,
        items,
        offsets=None,
        concurrency=config.concurrency,
        duration=config.duration,
        sample=config.sample,
    )


async def run_sweep(config: BenchConfig, served: Served, say: Callable[[str], None]) -> SweepResult:
    """The probe, then up to ``config.sweep_points`` open loops (see :mod:`._sweep`)."""
    probe_n = config.probe_requests or 4 * config.probe_concurrency
    say(f"… probe: {probe_n} requests, closed loop at concurrency {config.probe_concurrency}")
    probe = await run_bench(
        config,
        served,
        build_items(config, probe_n),
        offsets=None,
        concurrency=config.probe_concurrency,
        duration=None,
        progress=False,
    )
    capacity = probe.summary.request_throughput
    if capacity <= 0:
        raise NothingToSweep("the probe completed no request: nothing to sweep around")
    say(f"  flat out: {capacity:.2f} completed req/s")
    seconds = config.duration if config.duration is not None else DEFAULT_SWEEP_SECONDS
    points: list[SweepPoint] = []
    runs: list[BenchResult] = []
    while (rate := next_rate(points, capacity, config.sweep_points)) is not None:
        offsets = arrival_offsets(
            rate=rate,
            kind=config.arrival,
            duration=seconds,
            num_requests=config.num_requests,
            burstiness=config.burstiness,
            seed=config.seed + len(points),
        )
        items = build_items(config, len(offsets))
        run = await run_bench(
            config,
            served,
            items,
            offsets=offsets,
            concurrency=None,
            duration=None,
            sample=config.sample,
            progress=False,
        )
        point = SweepPoint(rate, run.summary, passes(run.summary, config.sweep_attainment))
        points.append(point)
        runs.append(run)
        share = run.summary.slo_attainment or 0.0
        say(
            f"  {rate:.2f} req/s: {share:.0%} within the SLOs -> "
            f"{'pass' if point.passed else 'fail'}"
        )
    return SweepResult(probe, points, runs, knee(points))
