"""Per-request records and the run summary (pure).

Nothing is hidden: a request that failed stays in the counts with its cause, 429s and 503s are
counted even when a retry later succeeded, and latencies include the time spent backing off.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SLO",
    "Distribution",
    "FailureGroup",
    "RecordTimer",
    "RequestRecord",
    "Summary",
    "percentile",
    "summarize",
]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean and the usual percentiles of one latency, in seconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, None, None, None, None, None)
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds from the start of the run."""

    index: int
    planned: float
    prompt_tokens: int
    max_tokens_requested: int | None
    sent: float | None = None
    first_token: float | None = None
    end: float | None = None
    max_tokens_sent: int | None = None
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    attempts: int = 0
    http_429: int = 0
    http_503: int = 0
    backoff: float = 0.0
    ok: bool = False
    error: str | None = None  # the cause when not ok: "server_busy", "prompt_too_long", ...
    message: str | None = None  # the error's own words, kept whole
    refused_locally: bool = False  # the client refused it before sending (nothing was sent)
    admitted: bool = False  # the server started work on it (an answer or its first byte)
    finish_reason: str | None = None
    #: The server's own count (``usage.prompt_tokens``), to compare with ``prompt_tokens``.
    server_prompt_tokens: int | None = None

    @property
    def latency(self) -> float | None:
        """End-to-end: from the planned send time, so queueing in the generator counts too."""
        return None if self.end is None else self.end - self.planned

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.planned

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def schedule_lag(self) -> float | None:
        return None if self.sent is None else self.sent - self.planned

    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("token_times")
        data.update(latency=self.latency, ttft=self.ttft, tpot=self.tpot)
        return data


class RecordTimer:
    """Stamps a record with times on the run's clock (injected, so tests need no real time)."""

    __slots__ = ("_clock", "_origin", "record")

    def __init__(self, record: RequestRecord, clock: Callable[[], float], origin: float) -> None:
        self.record = record
        self._clock = clock
        self._origin = origin

    def now(self) -> float:
        return self._clock() - self._origin

    def mark_sent(self) -> None:
        if self.record.sent is None:
            self.record.sent = self.now()

    def mark_token(self) -> None:
        t = self.now()
        if self.record.first_token is None:
            self.record.first_token = t
        self.record.token_times.append(t)

    def mark_end(self) -> None:
        self.record.end = self.now()


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives for goodput; None means "no objective" for that metric."""

    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        for goal, value in ((self.ttft, record.ttft), (self.tpot, record.tpot)):
            if goal is not None and value is not None and value > goal:
                return False
        return self.latency is None or (
            record.latency is not None and record.latency <= self.latency
        )


@dataclass(frozen=True, slots=True)
class FailureGroup:
    """The failures of one cause, with each distinct message and how often it came."""

    cause: str
    count: int
    messages: tuple[tuple[str, int], ...]  # most common first

    @property
    def message(self) -> str:
        """The most common message (the cause itself when no message was kept)."""
        return self.messages[0][0] if self.messages else self.cause


@dataclass(frozen=True, slots=True)
class Summary:
    """A run, counted so that nothing hides.

    ``offered`` requests were planned; ``refused_locally`` of them never left the client (a
    prompt that cannot fit); ``sent`` the rest that were sent; ``admitted`` the ones the server
    started work on; ``completed`` the ones answered; ``failed`` = ``sent`` - ``completed``.
    ``latency`` is over completed requests; ``latency_all`` over every offered request with
    each failure counted at the deadline, so a server that refuses cannot look faster for it.
    """

    offered: int
    refused_locally: int
    sent: int
    admitted: int
    completed: int
    failed: int
    failed_by_cause: dict[str, int]
    failures: tuple[FailureGroup, ...]
    http_429: int
    http_503: int
    attempts: int
    attempts_per_completed: float | None
    backoff_seconds: float
    duration: float
    request_throughput: float
    output_token_throughput: float
    goodput: float | None
    slo_met: int | None
    deadline: float | None
    latency: Distribution
    latency_all: Distribution
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    schedule_lag: Distribution
    warnings: tuple[str, ...]

    @property
    def failure_rate(self) -> float:
        """Share of offered requests not completed (refused locally or failed)."""
        return (self.offered - self.completed) / self.offered if self.offered else 0.0

    @property
    def slo_attainment(self) -> float | None:
        """Share of offered requests completed within the SLOs."""
        if self.slo_met is None:
            return None
        return self.slo_met / self.offered if self.offered else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["failures"] = [
            {"cause": g.cause, "count": g.count, "messages": [list(m) for m in g.messages]}
            for g in self.failures
        ]
        data["warnings"] = list(self.warnings)
        data["failure_rate"] = self.failure_rate
        data["slo_attainment"] = self.slo_attainment
        return data


def _failure_groups(failed: Sequence[RequestRecord]) -> tuple[FailureGroup, ...]:
    by_cause: dict[str, Counter[str]] = {}
    for r in failed:
        cause = r.error or "unknown"
        by_cause.setdefault(cause, Counter())[r.message or cause] += 1
    groups = [
        FailureGroup(cause, sum(messages.values()), tuple(messages.most_common()))
        for cause, messages in by_cause.items()
    ]
    groups.sort(key=lambda g: (-g.count, g.cause))
    return tuple(groups)


def latency_warnings(
    *, offered: int, completed: int, latency: Distribution, latency_all: Distribution
) -> tuple[str, ...]:
    """A warning when failures dropped out of the latency percentiles would flatter them."""
    missing = offered - completed
    if not missing or latency.p99 is None:
        return ()
    if latency_all.p99 is not None and latency_all.p99 <= latency.p99 * 1.05:
        return ()
    over_all = (
        "no request completed"
        if latency_all.p50 is None
        else (f"p50 {latency_all.p50:.3g} s, p99 {latency_all.p99:.3g} s")
    )
    return (
        f"{missing} of {offered} requests did not complete: the latency of completed requests "
        f"(p50 {latency.p50:.3g} s, p99 {latency.p99:.3g} s) leaves them out and looks better "
        f"than it is; over all requests, failures at the deadline: {over_all}",
    )


def summarize(
    records: Iterable[RequestRecord],
    *,
    duration: float,
    slo: SLO | None = None,
    deadline: float | None = None,
) -> Summary:
    """Aggregate a run. ``duration`` is the wall time of the run in seconds; ``deadline`` the
    per-request deadline at which failures are counted in ``latency_all`` (without one, at their
    own latency or the longest completed one, whichever is longer)."""
    records = list(records)
    # A record neither sent nor failed was planned but never started (a hand-made one).
    offered = [r for r in records if r.sent is not None or r.error is not None]
    refused = [r for r in offered if r.refused_locally and not r.ok]
    sent = [r for r in offered if not (r.refused_locally and not r.ok)]
    done = [r for r in sent if r.ok]
    not_done = [r for r in offered if not r.ok]
    causes = Counter(r.error or "unknown" for r in not_done)
    attempts = sum(r.attempts for r in sent)
    itl: list[float] = []
    for r in done:
        itl.extend(r.inter_token_latencies())
    wall = max(duration, 1e-9)

    def collect(values: Iterable[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    latency = Distribution.of(collect(r.latency for r in done))
    worst = deadline if deadline is not None else (latency.max or 0.0)
    latency_all = Distribution.of(
        [
            r.latency if r.ok and r.latency is not None else max(worst, r.latency or 0.0)
            for r in offered
        ]
    )
    met = None if slo is None else sum(slo.met_by(r) for r in done)
    return Summary(
        offered=len(offered),
        refused_locally=len(refused),
        sent=len(sent),
        admitted=sum(r.ok or r.admitted for r in sent),
        completed=len(done),
        failed=len(sent) - len(done),
        failed_by_cause=dict(sorted(causes.items())),
        failures=_failure_groups(not_done),
        http_429=sum(r.http_429 for r in sent),
        http_503=sum(r.http_503 for r in sent),
        attempts=attempts,
        attempts_per_completed=attempts / len(done) if done else None,
        backoff_seconds=sum(r.backoff for r in sent),
        duration=duration,
        request_throughput=len(done) / wall,
        output_token_throughput=sum(r.output_tokens for r in done) / wall,
        goodput=None if met is None else met / wall,
        slo_met=met,
        deadline=deadline,
        latency=latency,
        latency_all=latency_all,
        ttft=Distribution.of(collect(r.ttft for r in done)),
        tpot=Distribution.of(collect(r.tpot for r in done)),
        itl=Distribution.of(itl),
        schedule_lag=Distribution.of(collect(r.schedule_lag for r in offered)),
        warnings=latency_warnings(
            offered=len(offered), completed=len(done), latency=latency, latency_all=latency_all
        ),
    )
