"""What ``kvclient bench`` measured: one run (``BenchResult``, with the server's gauges sampled
during it) or a sweep (``SweepResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engines.metrics import KVLosses
from ._metrics import RequestRecord, Summary
from ._sweep import SweepPoint

__all__ = ["BenchResult", "Sample", "SweepResult"]


@dataclass(frozen=True, slots=True)
class Sample:
    """The server's gauges at one moment of the run (seconds from its start)."""

    t: float
    kv_reserved: float | None
    refused_total: float | None


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
