"""Turning summaries into tables, and reading a server's Prometheus metrics (pure, plus print).

Tables print with rich when it is installed (the ``bench`` extra) and as aligned plain text
otherwise, so a report never needs more than the core install.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import IO

from .._prometheus import parse_samples
from ..engines.metrics import KVLosses, kv_losses_from_metrics
from ._metrics import Distribution, Summary
from ._results import BenchResult, SweepResult

__all__ = [
    "SWEEP_HEADERS",
    "format_count",
    "format_seconds",
    "kv_losses_during",
    "parse_prometheus_text",
    "print_result",
    "print_table",
    "result_rows",
    "summary_rows",
    "sweep_rows",
]


def format_seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value < 0.01:
        return f"{value * 1000:.2g} ms"
    if value < 1.0:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def format_count(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def _dist(d: Distribution) -> str:
    if not d.count:
        return "-"
    return (
        f"p50 {format_seconds(d.p50)} · p90 {format_seconds(d.p90)} · p99 {format_seconds(d.p99)}"
    )


def _share(part: int, whole: int) -> str:
    return f"{part:,} ({part / whole:.0%})" if whole else f"{part:,}"


def summary_rows(s: Summary, *, top_failures: int = 3) -> list[tuple[str, str]]:
    """The rows of a bench summary, in reading order."""
    causes = ", ".join(f"{k} {v}" for k, v in s.failed_by_cause.items()) or "-"
    deadline = f"the {s.deadline:g} s deadline" if s.deadline is not None else "their latency"
    rows = [
        ("offered (requests planned)", format_count(s.offered)),
        ("refused locally (prompt cannot fit; never sent)", _share(s.refused_locally, s.offered)),
        ("sent", _share(s.sent, s.offered)),
        ("admitted (the server started work)", _share(s.admitted, s.offered)),
        ("completed", _share(s.completed, s.offered)),
        (
            "not completed (by cause)",
            f"{s.offered - s.completed} ({causes})" if s.offered > s.completed else "0",
        ),
    ]
    for group in s.failures[:top_failures]:
        rows.append((f"  {group.cause} ×{group.count}", group.message[:120]))
    rows += [
        ("429s received", format_count(s.http_429)),
        ("503s received", format_count(s.http_503)),
        ("attempts per completed request", format_count(s.attempts_per_completed)),
        (
            "backoff per request (mean; summed over all)",
            f"{format_seconds(s.backoff_seconds / s.sent if s.sent else None)} "
            f"({format_seconds(s.backoff_seconds)})",
        ),
        ("end-to-end latency, completed requests", _dist(s.latency)),
        (f"end-to-end latency, all (failures at {deadline})", _dist(s.latency_all)),
        ("time to first token (streamed)", _dist(s.ttft)),
        ("time per output token (after the first)", _dist(s.tpot)),
        ("inter-chunk latency (between streamed chunks)", _dist(s.itl)),
        ("request throughput (completed)", f"{s.request_throughput:.2f} req/s"),
        ("output token throughput", f"{s.output_token_throughput:.1f} tok/s"),
        ("schedule lag (planned → sent)", _dist(s.schedule_lag)),
        ("wall time", format_seconds(s.duration)),
    ]
    if s.goodput is not None and s.slo_met is not None:
        rows.append(
            (
                "goodput (completed within the SLOs)",
                f"{s.goodput:.2f} req/s ({_share(s.slo_met, s.offered)} of offered)",
            )
        )
    return rows


def print_table(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    file: IO[str] | None = None,
) -> None:
    """Print a table: rich when available, plain aligned columns otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(title, headers, rows, file=file)
        return
    table = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(file=file, width=max(100, sum(len(h) for h in headers) + 40)).print(table)


def _print_plain(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, file: IO[str] | None
) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    print("\n".join(lines), file=file)


def result_rows(result: BenchResult) -> list[tuple[str, str]]:
    """A run's summary, then what the server's own counters said changed during it."""
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
    """One row per rate tried (under ``SWEEP_HEADERS``), lowest rate first."""
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


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition, by name (labelled ones are skipped;
    read by :func:`kvclient._prometheus.parse_samples`).

    >>> parse_prometheus_text("# HELP x y\\nkv_rejected_total 3.0\\n")
    {'kv_rejected_total': 3.0}
    """
    return {sample.name: sample.value for sample in parse_samples(text) if not sample.labels}


def metric_delta(
    before: Mapping[str, float], after: Mapping[str, float], name: str
) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def kv_losses_during(before: str | None, after: str | None) -> KVLosses | None:
    """What the engine lost for lack of KV between two ``/metrics`` texts, in its own dialect
    (:func:`~kvclient.engines.metrics.kv_losses_from_metrics`); None when either is unknown."""
    if before is None or after is None:
        return None
    now = kv_losses_from_metrics(after)
    return None if now is None else now.since(kv_losses_from_metrics(before))
