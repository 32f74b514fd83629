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

    def mark_first_token(self) -> None:
        if self.record.first_token is None:
            self.record.first_token = self.now()

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
class Summary:
    sent: int
    completed: int
    failed: int
    failed_by_cause: dict[str, int]
    http_429: int
    http_503: int
    attempts: int
    attempts_per_completed: float | None
    backoff_seconds: float
    duration: float
    request_throughput: float
    output_token_throughput: float
    goodput: float | None
    latency: Distribution
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    schedule_lag: Distribution

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    records: Iterable[RequestRecord], *, duration: float, slo: SLO | None = None
) -> Summary:
    """Aggregate a run. ``duration`` is the wall time of the run in seconds."""
    records = list(records)
    sent = [r for r in records if r.sent is not None]
    done = [r for r in sent if r.ok]
    causes = Counter(r.error or "unknown" for r in sent if not r.ok)
    attempts = sum(r.attempts for r in sent)
    itl: list[float] = []
    for r in done:
        itl.extend(r.inter_token_latencies())
    wall = max(duration, 1e-9)

    def collect(values: Iterable[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    return Summary(
        sent=len(sent),
        completed=len(done),
        failed=len(sent) - len(done),
        failed_by_cause=dict(sorted(causes.items())),
        http_429=sum(r.http_429 for r in sent),
        http_503=sum(r.http_503 for r in sent),
        attempts=attempts,
        attempts_per_completed=attempts / len(done) if done else None,
        backoff_seconds=sum(r.backoff for r in sent),
        duration=duration,
        request_throughput=len(done) / wall,
        output_token_throughput=sum(r.output_tokens for r in done) / wall,
        goodput=None if slo is None else sum(slo.met_by(r) for r in done) / wall,
        latency=Distribution.of(collect(r.latency for r in done)),
        ttft=Distribution.of(collect(r.ttft for r in done)),
        tpot=Distribution.of(collect(r.tpot for r in done)),
        itl=Distribution.of(itl),
        schedule_lag=Distribution.of(collect(r.schedule_lag for r in sent)),
    )
