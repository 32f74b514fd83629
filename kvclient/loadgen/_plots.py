"""``kvclient bench --plot``: PNG figures of a run or a sweep, drawn by matplotlib (the ``plot``
extra), imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path

from ._metrics import RequestRecord
from ._results import SweepResult

__all__ = ["plot_run", "plot_sweep"]


def plot_run(records: list[RequestRecord], path: Path) -> None:
    """Latency by planned send time (completed and failed), and the 429s each request got."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 0.2 of a 429
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("planned send time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: SweepResult, path: Path) -> None:
    """Completed requests and goodput against the offered rate, with the knee."""
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
