"""The bench scripts' pictures, drawn with matplotlib from the results the scripts write.

Every ``plot_*`` function takes a result as its script writes it to ``bench/results/NAME.json``,
so a figure is the same whether it is drawn right after a run (``--plot PATH``) or later from a
stored result (``--plot PATH --plot-only [JSON]``), without re-running anything. The figures go
to ``docs/img/``; PNG or SVG by the path's suffix. Drawn on matplotlib's ``Figure`` alone
(no pyplot, no GUI backend) and saved without dates, so a redrawn file only changes when its
figures do.

    python bench/retry_storm.py --plot docs/img/retry_storm.png
    python bench/gateway_overhead.py --plot docs/img/gateway_cost.png --plot-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import result_path

#: Dots per inch of a PNG: the figures are 10 inches wide, so 1,000 px, sharp in a page column
#: and under 150 KB.
DPI = 100
STYLE = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e6e6e6",
    "axes.axisbelow": True,
    "legend.frameon": False,
    "svg.fonttype": "none",  # text stays text in an SVG: small, searchable, sharp
    "svg.hashsalt": "kvclient",  # stable ids: a redrawn SVG differs only where the figure does
}
KVCLIENT = "#2ca02c"
OTHERS = {"naive": "#d62728", "openai": "#ff7f0e", "nginx": "#1f77b4", "LiteLLM": "#d62728"}
GREY = "#8c8c8c"
HATCHES = ("", "///", "...")

Draw = Callable[[dict[str, Any], Path], Path]


# --- the scripts' options -----------------------------------------------------------------------


def add_plot_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--plot PATH`` and ``--plot-only [JSON]`` for the script whose result is ``NAME.json``."""
    group = parser.add_argument_group("pictures (matplotlib: the plot extra)")
    group.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="draw the figure into PATH (.png or .svg) from the run's result",
    )
    group.add_argument(
        "--plot-only",
        nargs="?",
        const="",
        metavar="JSON",
        help=f"do not run: draw --plot from a stored result (default bench/results/{name}.json)",
    )


def plot_only(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, draw: Draw
) -> bool:
    """With ``--plot-only``: draw ``--plot`` from the stored result; whether it did (then the
    script has nothing more to do)."""
    if args.plot_only is None:
        return False
    if args.plot is None:
        parser.error("--plot-only draws into --plot PATH: give one")
    source = Path(args.plot_only) if args.plot_only else result_path(name)
    if not source.is_file():
        parser.error(f"--plot-only: no result at {source} (run the script first, or give a JSON)")
    draw(json.loads(source.read_text()), args.plot)
    return True


def plot_result(args: argparse.Namespace, written: Path, draw: Draw) -> None:
    """With ``--plot``: draw the result the run just wrote (read back, as ``--plot-only`` would)."""
    if args.plot is not None:
        draw(json.loads(written.read_text()), args.plot)


# --- drawing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _style() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as PNG or SVG (by the suffix), without a date or a version in it."""
    path = Path(path)
    kind = path.suffix.lower().lstrip(".")
    if kind not in ("png", "svg"):
        raise SystemExit(f"--plot: a .png or .svg path, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Software": None} if kind == "png" else {"Date": None, "Creator": None}
    fig.savefig(path, dpi=DPI, metadata=metadata)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    return path


def _legend_outside(
    fig: Any, axes: Sequence[Any], *, ncols: int = 4, keys: Sequence[tuple[Any, str]] = ()
) -> None:
    """One legend for the figure, below the plots (the title is above): it never covers a line.
    ``keys``: (handle, label) pairs drawn first."""
    handles, labels, seen = [h for h, _ in keys], [label for _, label in keys], set()
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in seen:
                seen.add(label)
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(ncols, len(labels)))


def _number(value: float) -> str:
    """3 significant digits, thousands separated, never in e-notation."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _log_if_wide(ax: Any, values: Sequence[float]) -> None:
    """A log scale when the values span more than a factor of 8 (LiteLLM beside nginx)."""
    from matplotlib.ticker import FuncFormatter

    positive = [v for v in values if v and v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > 8:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2, max(positive) * 4)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))
    elif positive:
        ax.set_xlim(0, max(positive) * 1.3)


def _annotate(ax: Any, bars: Any, fmt: Callable[[float], str]) -> None:
    for bar in bars:
        value = bar.get_width()
        if value and math.isfinite(value):
            y = bar.get_y() + bar.get_height() / 2
            ax.annotate(
                fmt(value), (value, y), xytext=(3, 0), textcoords="offset points",
                va="center", fontsize=8.5,
            )  # fmt: skip


def _titles(fig: Any, title: str, detail: str, data: dict[str, Any]) -> None:
    """The figure's title, and below it what was run, where and when."""
    machine = data.get("machine", {})
    where = (
        f"{machine.get('date', '?')}, {machine.get('cpus', '?')} cores, "
        f"Python {machine.get('python', '?')}"
    )
    fig.suptitle(f"{title}\n{detail} ({where})", fontsize=11, linespacing=1.5)


# --- bench/retry_storm.py -----------------------------------------------------------------------

CLIENT_NAMES = {
    "naive": "naive (retries at once)",
    "openai": "openai SDK (max_retries=2)",
    "openai max_retries=10": "openai SDK (max_retries=10)",
    "kvclient": "kvclient (defaults)",
    "kvclient pace=False": "kvclient (pace=False)",
    "kvclient cooldown_by_size": "kvclient (cooldown_by_size)",
    "kvclient pace_in_order": "kvclient (pace_in_order)",
    "kvclient.openai": "openai SDK through kvclient",
    "ceiling": "ceiling: FIFO queue, no 429s",
}


def _client_color(name: str) -> str:
    if name == "ceiling":
        return GREY
    if name.startswith("kvclient"):
        return KVCLIENT
    return OTHERS["naive"] if name == "naive" else OTHERS["openai"]


def plot_retry_storm(
    data: dict[str, Any], path: Path, *, goal_attempts: float | None = None
) -> Path:
    """Attempts per completed request, and p50/p99 latency, per client under the retry storm."""
    rows = [*data["results"], {**data["ceiling"], "client": "ceiling"}][::-1]  # first on top
    labels = [
        f"{CLIENT_NAMES.get(r['client'], r['client'])}\n"
        f"{r['completed_within_deadline']}/{r['requests']} within the deadline"
        for r in rows
    ]
    y = list(range(len(rows)))
    with _style():
        fig = _figure(10, 1.6 + 0.62 * len(rows))
        attempts_ax, latency_ax = fig.subplots(1, 2, sharey=True, width_ratios=(1, 1.25))
        attempts = [r["attempts_per_completed"] or math.nan for r in rows]
        bars = attempts_ax.barh(y, attempts, color=[_client_color(r["client"]) for r in rows])
        _annotate(attempts_ax, bars, lambda v: f"{v:.2f}")
        _log_if_wide(attempts_ax, [*attempts, 1.0])
        if goal_attempts is not None:
            attempts_ax.axvline(
                goal_attempts, color="#333", ls="--", lw=1,
                label=f"kvclient's goal: ≤ {goal_attempts:g} attempts per completed request",
            )  # fmt: skip
        attempts_ax.set_yticks(y, labels)
        attempts_ax.set_xlabel("attempts per completed request (server's count)")
        attempts_ax.set_title("Attempts per completed request")

        height = 0.38
        p50 = [r["latency_p50"] or math.nan for r in rows]
        p99 = [r["latency_p99"] or math.nan for r in rows]
        low = latency_ax.barh(
            [v + height / 2 for v in y], p50, height, color="#9ecae1", label="p50 latency"
        )
        high = latency_ax.barh(
            [v - height / 2 for v in y], p99, height, color="#2171b5", label="p99 latency"
        )
        _annotate(latency_ax, low, lambda v: f"{v:.1f} s")
        _annotate(latency_ax, high, lambda v: f"{v:.1f} s")
        deadline = data.get("deadline")
        if deadline:
            latency_ax.axvline(
                deadline, color="#d62728", ls=":", lw=1.5, label=f"deadline ({deadline:g} s)"
            )
        latency_ax.set_xlim(0, max([deadline or 0, *[v for v in p99 if math.isfinite(v)]]) * 1.15)
        latency_ax.set_xlabel("seconds from arrival to answer, completed requests")
        latency_ax.set_title("Latency (p50, p99)")
        latency_ax.tick_params(axis="y", length=0)
        for ax in (attempts_ax, latency_ax):
            ax.grid(axis="y", visible=False)
        _legend_outside(fig, [attempts_ax, latency_ax], ncols=4)
        if "users" in data:  # --users: the first burst
            title = (
                f"First burst: {data['users']} users of one client, {data['requests']} "
                f"requests, every first request at time 0, deadline {data['deadline']:g} s each"
            )
            subtitle = "the same users for each client, against a fresh reference server"
        else:
            overload = data["rate"] / data["capacity"]["completed_per_second"]
            title = (
                f"Retry storm: {data['requests']} requests at {data['rate']:.1f}/s "
                f"({overload:.3g}x capacity) for {data['burst_seconds']:g} s, "
                f"deadline {data['deadline']:g} s each"
            )
            subtitle = "the same trace for each client, against a fresh reference server"
        _titles(fig, title, subtitle + " (reserve mode)", data)
        return save(fig, path)


# --- bench/kv_timeline.py -----------------------------------------------------------------------


def plot_kv_timeline(data: dict[str, Any], path: Path) -> Path:
    """KV tokens over time, one panel per run (direct, through the gateway), against the pool."""
    runs = data["runs"]
    pool = data["pool_tokens"]
    with _style():
        fig = _figure(10, 2.0 + 2.6 * len(runs))
        axes = fig.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
        for ax, run in zip(axes, runs, strict=True):
            t = run["t"]
            ax.axhline(pool, color="#222", lw=1.5, label=f"KV pool ({pool:,} tokens)")
            usable = run.get("usable_tokens")
            if usable:
                ax.axhline(
                    usable, color="#222", lw=1, ls="--", label="usable budget (the ledger's)"
                )
            ax.step(
                t,
                run["reserved"],
                where="post",
                color="#1f77b4",
                lw=1.3,
                label="KV reserved (the ledger)",
            )
            ax.plot(t, run["used"], color=KVCLIENT, lw=1.6, label="KV in use (the engine)")
            ax.fill_between(t, run["used"], color=KVCLIENT, alpha=0.12, lw=0)
            for i, when in enumerate(run["oom_times"]):
                ax.axvline(
                    when, color="#d62728", lw=2, alpha=0.8,
                    label="KV overflow: every in-flight request failed" if i == 0 else None,
                )  # fmt: skip
            ax.set_title(
                f"{run['title']}: {run['completed']}/{run['requests']} completed, "
                + (
                    f"{_count(run['oom_events'], 'KV overflow')} killing "
                    f"{_count(run['oom_killed'], 'request')}"
                    if run["oom_events"]
                    else "no KV overflow"
                ),
                loc="left",
            )
            ax.set_ylabel("KV tokens")
            ax.set_ylim(0, pool * 1.12)
            ax.yaxis.set_major_formatter(_thousands())
        axes[-1].set_xlabel("seconds from the first request")
        _legend_outside(fig, list(axes), ncols=3)
        _titles(
            fig,
            f"KV over time: {data['requests']} requests of the seed's mix at {data['rate']:g}/s",
            f"the same trace twice, /metrics sampled every {data['interval']:g} s",
            data,
        )
        return save(fig, path)


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


# --- bench/gateway_overhead.py ------------------------------------------------------------------


def _path_color(path: str) -> str:
    if path.startswith("gateway"):
        return KVCLIENT
    return OTHERS["LiteLLM"] if path.startswith("LiteLLM") else OTHERS["nginx"]


def plot_gateway_cost(
    data: dict[str, Any],
    path: Path,
    *,
    goal_ms_per_request: float | None = None,
    goal_us_per_event: float | None = None,
) -> Path:
    """The proxy's CPU per request (1 and 16 connections) and per streamed event, per path."""
    from matplotlib.patches import Patch

    paths = [p for p in dict.fromkeys(r["path"] for r in data["results"]) if p != "direct"]
    connections = sorted({r["connections"] for r in data["results"]})
    cpu = {(r["path"], r["connections"]): r["cpu_ms_per_request"] for r in data["results"]}
    per_event = [data["streams"].get(p, {}).get("cpu_us_per_event") or math.nan for p in paths]
    order = paths[::-1]  # first on top
    y = list(range(len(order)))
    with _style():
        fig = _figure(10, 2.0 + 0.55 * len(order) * max(1, len(connections) / 1.5))
        request_ax, event_ax = fig.subplots(1, 2, sharey=True)
        height = 0.8 / max(1, len(connections))
        values: list[float] = []
        keys: list[tuple[Any, str]] = []
        for i, conns in enumerate(connections):
            offset = (i - (len(connections) - 1) / 2) * height
            widths = [cpu.get((p, conns)) or math.nan for p in order]
            values += widths
            hatch = HATCHES[i % len(HATCHES)]
            bars = request_ax.barh(
                [v - offset for v in y], widths, height, color=[_path_color(p) for p in order],
                edgecolor="#444", hatch=hatch, lw=0.6,
            )  # fmt: skip
            _annotate(request_ax, bars, lambda v: f"{_number(v)} ms")
            # The key in neutral colours: the bars' colours tell the proxies apart.
            keys.append(
                (
                    Patch(facecolor="#fff", edgecolor="#444", hatch=hatch, lw=0.6),
                    f"{conns} connection{'s' if conns > 1 else ''}",
                )
            )
        _log_if_wide(request_ax, values)
        if goal_ms_per_request is not None:
            request_ax.axvline(
                goal_ms_per_request,
                color="#333",
                ls="--",
                lw=1,
                label=f"goal: ≤ {goal_ms_per_request:g} ms per request",
            )
        request_ax.set_yticks(y, order)
        request_ax.set_xlabel("the proxy's CPU per request, ms (utime + stime)")
        request_ax.set_title("CPU per non-streamed request")

        events = per_event[::-1]
        bars = event_ax.barh(y, events, 0.6, color=[_path_color(p) for p in order])
        _annotate(event_ax, bars, lambda v: f"{_number(v)} µs")
        _log_if_wide(event_ax, events)
        if goal_us_per_event is not None:
            event_ax.axvline(
                goal_us_per_event,
                color="#333",
                ls=":",
                lw=1.3,
                label=f"goal: ≤ {goal_us_per_event:g} µs per event",
            )
        event_ax.set_xlabel("the proxy's CPU per streamed event, µs")
        event_ax.set_title("CPU per relayed stream event")
        event_ax.tick_params(axis="y", length=0)
        for ax in (request_ax, event_ax):
            ax.grid(axis="y", visible=False)
        _legend_outside(fig, [request_ax, event_ax], ncols=4, keys=keys)
        litellm = (data.get("litellm") or {}).get("version")
        skipped = "; ".join(n.split(":")[0] for n in data.get("notes", []))
        _titles(
            fig,
            "kvclient gateway's CPU cost against nginx"
            + (f" and LiteLLM {litellm}" if litellm else ""),
            "one process each in front of an instant upstream"
            + (f"; {skipped}" if skipped else ""),
            data,
        )
        return save(fig, path)


# --- docs/img/contract.svg ----------------------------------------------------------------------


CLIENT_HALF = (
    "Counts the prompt's tokens before sending\n(tiktoken, the model's tokenizer, or /tokenize)",
    "Always sends an explicit max_tokens: unset\nmeans context − prompt, more is clamped;\n"
    "a prompt that fills the context is refused\nhere, and nothing is sent",
    "Honours 429 Retry-After, plus jitter so that\nclients told the same wait do not return"
    "\ntogether; one 429 cools the whole client down",
    "Retries only 429, 503, 502/504 and connection\nerrors, never past its deadline",
)
SERVER_HALF = (
    "Admits prompt + cap against the KV budget\n(in whole blocks; an unset cap counts as\n"
    "up to the context window)",
    "Holds the reservation for the whole request,\nstreamed or not",
    "Releases it in finally: on success, error,\ntimeout, cancellation and disconnect",
    "No room: 429 + Retry-After (also as\nretry-after-ms), from when the reservations\n"
    "held are due to end",
)


def draw_contract(path: Path) -> Path:
    """The two halves of the admission contract, the requests between them in the middle."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    with _style():
        fig = _figure(11, 6.2)
        fig.set_layout_engine(None)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, 110)  # 10 units an inch, both ways
        ax.set_ylim(0, 62)
        ax.axis("off")
        line = 1.8  # a 9.5 pt line, in axis units

        def half(x: float, title: str, subtitle: str, lines: Sequence[str], color: str) -> None:
            ax.add_patch(
                FancyBboxPatch(
                    (x, 3), 36, 54, boxstyle="round,pad=0,rounding_size=1.5",
                    facecolor=color + "14", edgecolor=color, lw=1.5,
                )
            )  # fmt: skip
            ax.text(x + 18, 53.5, title, ha="center", va="center", fontsize=13, weight="bold")
            ax.text(x + 18, 50.3, subtitle, ha="center", va="center", fontsize=9, color="#555")
            top = 46.5
            for i, text in enumerate(lines):
                ax.text(x + 2, top, f"{i + 1}", fontsize=11, weight="bold", color=color, va="top")
                ax.text(x + 5, top, text, fontsize=9.5, va="top", linespacing=1.35)
                top -= line * (text.count("\n") + 1) + 3.2

        half(2, "Client", "kvclient: Client, AsyncClient, kvclient.openai", CLIENT_HALF, "#1f77b4")
        half(72, "Server", "kvclient serve, kvclient gateway", SERVER_HALF, KVCLIENT)

        # The server's budget: two holders and the free room; a new request needs more.
        ax.text(74, 15.2, "usable KV budget", fontsize=8.5, color="#555")
        ax.add_patch(Rectangle((74, 11), 26, 3.4, facecolor="#fff", edgecolor="#555", lw=1))
        for left, width, color in ((74, 10, "#9ecae1"), (84, 7, "#c6dbef")):
            ax.add_patch(
                Rectangle((left, 11), width, 3.4, facecolor=color, edgecolor="#555", lw=0.8)
            )
            ax.text(left + width / 2, 12.7, "held", fontsize=8, ha="center", va="center")
        ax.text(95.5, 12.7, "free", fontsize=8, ha="center", va="center", color="#555")
        ax.add_patch(
            Rectangle((91, 6.5), 14, 3.4, facecolor="#d6272814", edgecolor="#d62728", lw=1, ls="--")
        )
        ax.text(90.5, 8.2, "a new request: prompt + cap", fontsize=8, va="center", ha="right")
        ax.text(98, 4.6, "does not fit: 429", fontsize=8, ha="center", va="center", color="#d62728")

        def arrow(y: float, rightwards: bool, label: str, color: str) -> None:
            start, end = (38.5, 71.5) if rightwards else (71.5, 38.5)
            ax.add_patch(
                FancyArrowPatch(
                    (start, y), (end, y), arrowstyle="-|>", mutation_scale=16, lw=1.6,
                    color=color,
                )
            )  # fmt: skip
            ax.text(55, y + 1.2, label, ha="center", va="bottom", fontsize=9.5, linespacing=1.3)

        arrow(43, True, "POST /v1/completions\nprompt, max_tokens = cap (explicit)", "#1f77b4")
        arrow(
            31,
            False,
            "200: the tokens, at most cap of them\n(reservation released in finally)",
            KVCLIENT,
        )
        arrow(19, False, "429 Too Many Requests\nRetry-After: 3, retry-after-ms: 2750", "#d62728")
        ax.text(
            55, 11, "the client waits Retry-After + jitter\n(full-jitter backoff without one),\n"
            "then sends again",
            ha="center", va="center", fontsize=9, style="italic", color="#555", linespacing=1.3,
        )  # fmt: skip
        ax.text(
            55, 59.5, "The admission contract: both halves", ha="center", va="center",
            fontsize=14, weight="bold",
        )  # fmt: skip
        return save(fig, path)
