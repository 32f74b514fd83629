"""``kvclient bench --html FILE``: one self-contained page (pure: records in, HTML text out).

Inline SVG only (no script, no stylesheet or font fetched from anywhere), so the page opens
offline, can be mailed, and renders the same in any browser: the summary table, the latency
distributions, the timeline of in-flight KV tokens and refusals, and the sweep curve.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._metrics import RequestRecord, Summary
from ._report import summary_rows
from ._results import Sample

__all__ = ["COLORS", "Series", "render_html", "svg_chart"]

#: One colour per plotted quantity (the screenshot test looks for them).
COLORS = {
    "latency": "#1f77b4",
    "latency_all": "#ff7f0e",
    "ttft": "#17becf",
    "kv": "#2ca02c",
    "refusals": "#d62728",
    "goodput": "#9467bd",
    "throughput": "#8c564b",
    "ideal": "#bbbbbb",
}
# The charts' own coordinates (the viewBox): the page scales them to its full width, so these
# are proportions and font sizes at a 1,200 px wide chart, not pixels on the screen.
_W, _H = 1200, 380
_PAD_L, _PAD_R, _PAD_R_AXIS, _PAD_B = 84, 24, 84, 58
_FONT_TICK, _FONT_TITLE, _FONT_LEGEND = 14, 15, 14
_LEGEND_ROW, _LEGEND_TOP = 22, 20
_SWATCH = 26
#: Width of a legend label in em (a generous average for sans-serif glyphs): labels must not run
#: into each other, and a row too long wraps.
_EM_PER_CHAR = 0.56


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    color: str
    points: Sequence[tuple[float, float]]
    step: bool = False
    dots: bool = False
    dashed: bool = False
    axis: str = "left"  # "right": scaled to its own axis, drawn on the right


def _ticks(low: float, high: float, n: int = 5, *, whole: bool = False) -> list[float]:
    """About ``n`` round ticks from ``low`` to ``high``; ``whole``: whole numbers only (an
    axis that counts, such as 429s)."""
    if high <= low:
        return [low]
    raw = (high - low) / n
    if whole:
        raw = max(raw, 1.0)
    mag = 10 ** math.floor(math.log10(raw))
    multiples = (1, 2, 5, 10) if whole and mag == 1 else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in multiples if m * mag >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _extent(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    low, high = min(0.0, min(values)), max(values)
    return (low, high if high > low else low + 1.0)


def _legend_rows(
    series: Sequence[Series], left: float, right: float
) -> list[list[tuple[float, Series]]]:
    """Where each legend entry goes: rows of (x, series), laid out left to right above the plot
    and wrapped where a row would pass the plot's right edge."""
    rows: list[list[tuple[float, Series]]] = [[]]
    x = left
    for s in series:
        width = _SWATCH + 8 + len(s.label) * _FONT_LEGEND * _EM_PER_CHAR
        if rows[-1] and x + width > right:
            rows.append([])
            x = left
        rows[-1].append((x, s))
        x += width + 28
    return rows


def _legend(rows: Sequence[Sequence[tuple[float, Series]]]) -> str:
    out = ['<g class="legend">']
    for i, row in enumerate(rows):
        y = _LEGEND_TOP + i * _LEGEND_ROW
        for x, s in row:
            dash = ' stroke-dasharray="7 5"' if s.dashed else ""
            out.append(
                f'<line x1="{x:.1f}" x2="{x + _SWATCH:.1f}" y1="{y - 4}" y2="{y - 4}" '
                f'stroke="{s.color}" stroke-width="3"{dash}/>'
                f'<text x="{x + _SWATCH + 8:.1f}" y="{y}" font-size="{_FONT_LEGEND}">'
                f"{html.escape(s.label)}</text>"
            )
    out.append("</g>")
    return "".join(out)


def svg_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    y2_label: str | None = None,
    marker: tuple[float, str] | None = None,
    y2_counts: bool = False,
) -> str:
    """A line chart as inline SVG, as wide as the page; ``marker`` draws a labelled vertical
    line at an x value. The legend sits above the plot area, never over a line; every axis has
    its title (``y2_label``: the right axis, for series with ``axis="right"``; ``y2_counts``: it
    counts, so its ticks are whole numbers)."""
    left = [s for s in series if s.axis == "left"]
    right = [s for s in series if s.axis == "right"]
    xs = [x for s in series for x, _ in s.points]
    x0, x1 = _extent(xs)
    y0, y1 = _extent([y for s in left for _, y in s.points])
    r0, r1 = _extent([y for s in right for _, y in s.points])
    pad_r = _PAD_R_AXIS if right else _PAD_R
    rows = _legend_rows(series, _PAD_L, _W - pad_r)
    top = _LEGEND_TOP + len(rows) * _LEGEND_ROW
    height = _H + top
    iw, ih = _W - _PAD_L - pad_r, _H - _PAD_B

    def px(x: float) -> float:
        return _PAD_L + (x - x0) / (x1 - x0) * iw

    def py(y: float, axis: str = "left") -> float:
        lo, hi = (y0, y1) if axis == "left" else (r0, r1)
        return top + ih - (y - lo) / (hi - lo) * ih

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="100%" '
        f'viewBox="0 0 {_W} {height}" preserveAspectRatio="xMidYMid meet" role="img" '
        f'aria-label="{html.escape(y_label)} against {html.escape(x_label)}">',
        f'<rect class="plot-area" x="{_PAD_L}" y="{top}" width="{iw}" height="{ih}" fill="#fff" '
        'stroke="#999"/>',
        _legend(rows),
    ]
    for t in _ticks(x0, x1):
        out.append(
            f'<text x="{px(t):.1f}" y="{top + ih + 20}" font-size="{_FONT_TICK}" '
            f'text-anchor="middle">{_fmt(t)}</text>'
        )
    for t in _ticks(y0, y1):
        out.append(
            f'<line x1="{_PAD_L}" x2="{_PAD_L + iw}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
            'stroke="#eee"/>'
            f'<text x="{_PAD_L - 8}" y="{py(t) + 4:.1f}" font-size="{_FONT_TICK}" '
            f'text-anchor="end">{_fmt(t)}</text>'
        )
    if right:
        for t in _ticks(r0, r1, whole=y2_counts):
            out.append(
                f'<text x="{_PAD_L + iw + 8}" y="{py(t, "right") + 4:.1f}" '
                f'font-size="{_FONT_TICK}">{_fmt(t)}</text>'
            )
    middle = top + ih / 2
    titles = [
        (_PAD_L + iw / 2, height - 12, 0, x_label),
        (20, middle, -90, y_label),
    ]
    if right:
        titles.append((_W - 20, middle, 90, y2_label or ", ".join(s.label for s in right)))
    for x, y, angle, label in titles:
        turn = f' transform="rotate({angle} {x:.1f} {y:.1f})"' if angle else ""
        out.append(
            f'<text class="axis-title" x="{x:.1f}" y="{y:.1f}" font-size="{_FONT_TITLE}" '
            f'text-anchor="middle"{turn}>{html.escape(label)}</text>'
        )
    if marker is not None:
        mx, label = marker
        out.append(
            f'<line x1="{px(mx):.1f}" x2="{px(mx):.1f}" y1="{top}" y2="{top + ih}" '
            'stroke="#333" stroke-dasharray="4 3"/>'
            # A white halo: the label stays readable where a line passes under it.
            f'<text x="{px(mx) + 6:.1f}" y="{top + 18}" font-size="{_FONT_TITLE}" '
            f'stroke="#fff" stroke-width="4" paint-order="stroke">{html.escape(label)}</text>'
        )
    for s in series:
        points = list(s.points)
        if s.step and points:
            stepped = [points[0]]
            for (_, ya), (xb, yb) in itertools.pairwise(points):
                stepped += [(xb, ya), (xb, yb)]
            points = stepped
        coords = " ".join(f"{px(x):.1f},{py(y, s.axis):.1f}" for x, y in points)
        if s.dots:
            out += [
                f'<circle cx="{px(x):.1f}" cy="{py(y, s.axis):.1f}" r="5" fill="{s.color}"/>'
                for x, y in points
            ]
        if len(points) > 1:
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{s.color}" stroke-width="3"'
                + (' stroke-dasharray="9 7"/>' if s.dashed else "/>")
            )
    out.append("</svg>")
    return "\n".join(out)


def _cdf(values: Sequence[float]) -> list[tuple[float, float]]:
    ordered = sorted(values)
    n = len(ordered)
    return [(v, (i + 1) / n) for i, v in enumerate(ordered)]


def latency_chart(records: Sequence[RequestRecord], summary: Summary) -> str:
    done = [r.latency for r in records if r.ok and r.latency is not None]
    worst = summary.deadline if summary.deadline is not None else max(done, default=0.0)
    offered = [r for r in records if r.sent is not None or r.error is not None]
    every = [
        r.latency if r.ok and r.latency is not None else max(worst, r.latency or 0.0)
        for r in offered
    ]
    ttft = [r.ttft for r in records if r.ok and r.ttft is not None]
    # Drawn dashed over the other: where the two agree (no failures), both stay visible.
    series = [
        Series("end-to-end, completed requests", COLORS["latency"], _cdf(done)),
        Series(
            "end-to-end, all requests (failures at the deadline)",
            COLORS["latency_all"],
            _cdf(every),
            dashed=True,
        ),
    ]
    if ttft:
        series.append(Series("time to first token", COLORS["ttft"], _cdf(ttft)))
    return svg_chart(series, x_label="seconds", y_label="share of requests (CDF)")


def timeline_chart(records: Sequence[RequestRecord], samples: Sequence[Sample]) -> str:
    """In-flight KV tokens (the server's reserved gauge, or the client's estimate) and the
    refusals (429s) so far, over the run."""
    kv = [(s.t, s.kv_reserved) for s in samples if s.kv_reserved is not None]
    refused = [(s.t, s.refused_total) for s in samples if s.refused_total is not None]
    kv_label = "KV tokens reserved (the server's /metrics)"
    if not kv:
        kv_label = "KV tokens in flight (client's estimate: prompt + cap sent)"
        events: list[tuple[float, float]] = []
        for r in records:
            if r.sent is None or r.end is None or not r.admitted:
                continue
            size = r.prompt_tokens + (r.max_tokens_sent or r.max_tokens_requested or 0)
            events += [(r.sent + r.backoff, size), (r.end, -size)]
        level = 0.0
        kv = [(0.0, 0.0)]
        for t, delta in sorted(events):
            level += delta
            kv.append((t, level))
    if not refused:
        total = 0.0
        refused = [(0.0, 0.0)]
        for r in sorted((r for r in records if r.end is not None), key=lambda r: r.end or 0.0):
            total += r.http_429
            refused.append((r.end or 0.0, total))
    series = [
        Series(kv_label, COLORS["kv"], kv, step=True),
        Series("429s so far (right axis)", COLORS["refusals"], refused, step=True, axis="right"),
    ]
    return svg_chart(
        series,
        x_label="seconds from the start",
        y_label="KV tokens",
        y2_label="429s received so far",
        y2_counts=True,
    )


def sweep_chart(points: Sequence[tuple[float, float, float]], knee_rate: float | None) -> str:
    """``points``: (offered rate, completed per second, goodput per second)."""
    top = max((p[0] for p in points), default=1.0)
    series = [
        Series("offered = served (ideal)", COLORS["ideal"], [(0.0, 0.0), (top, top)]),
        Series("completed req/s", COLORS["throughput"], [(p[0], p[1]) for p in points], dots=True),
        Series(
            "goodput (within the SLOs) req/s",
            COLORS["goodput"],
            [(p[0], p[2]) for p in points],
            dots=True,
        ),
    ]
    marker = None if knee_rate is None else (knee_rate, f"knee {knee_rate:.3g} req/s")
    return svg_chart(series, x_label="offered arrival rate (req/s)", y_label="req/s", marker=marker)


_STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
svg.chart { display: block; width: 100%; height: auto; margin: 8px 0 20px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; font-size: 13px; }
td.v { text-align: right; font-variant-numeric: tabular-nums; }
.warn { background: #fff3cd; border: 1px solid #e0c36c; padding: 8px; margin: 8px 0; }
h2 { font-size: 17px; margin-top: 28px; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = [f"<td>{html.escape(row[0])}</td>"]
        cells += [f'<td class="v">{html.escape(c)}</td>' for c in row[1:]]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(
    *,
    title: str,
    summary: Summary,
    records: Sequence[RequestRecord],
    samples: Sequence[Sample] = (),
    sweep: Sequence[tuple[float, float, float]] = (),
    sweep_rows: Sequence[Sequence[str]] = (),
    sweep_headers: Sequence[str] = (),
    knee_rate: float | None = None,
) -> str:
    """The whole page. With a sweep, ``summary`` and ``records`` are the knee's run."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    parts += [f'<div class="warn">warning: {html.escape(w)}</div>' for w in summary.warnings]
    if sweep:
        parts.append("<h2>Sweep: goodput against the offered rate</h2>")
        parts.append(sweep_chart(sweep, knee_rate))
        if sweep_rows:
            parts.append(_table(sweep_headers, sweep_rows))
        parts.append(
            "<p>The summary and plots below are of the run at the knee.</p>"
            if knee_rate is not None
            else "<p>No rate met the SLOs.</p>"
        )
    parts.append("<h2>Summary</h2>")
    parts.append(_table(["metric", "value"], summary_rows(summary)))
    parts.append("<h2>Latency distributions</h2>")
    parts.append(latency_chart(records, summary))
    parts.append("<h2>Timeline: in-flight KV and refusals</h2>")
    parts.append(timeline_chart(records, samples))
    full = [
        f"<li>{html.escape(g.cause)} ×{g.count}: {html.escape(m)} (×{n})</li>"
        for g in summary.failures
        for m, n in g.messages
    ]
    if full:
        parts.append("<h2>Every failure message</h2><ul>" + "".join(full) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
