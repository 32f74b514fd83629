"""``kvclient bench --html``: one self-contained page whose plots a real browser draws.

The screenshot test runs Debian's headless Chromium. Locally, without it, the test skips and
says why; in CI (``CI=true``) a missing Chromium fails the test: ``scripts/test_setup.py``
installs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvclient.loadgen import cli
from kvclient.loadgen._html import COLORS, render_html
from kvclient.loadgen._metrics import RequestRecord, summarize
from reference_server import running_server
from tests.helpers.chromium import pixels, screenshot

# Drawn lines are 3 px wide across hundreds of px; a legend swatch about 100 px. A steep
# distribution (every latency alike, as on a loaded machine) still draws some 280 px.
MIN_LINE_PIXELS = 150
#: The screenshot's width: a wide screen, where a fixed-width chart would fill 40 % of it.
WINDOW_WIDTH = 1600
#: A chart's plot area spans at least this share of the window (margins and axes take the rest).
MIN_PLOT_SHARE = 0.75
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def bench_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RequestRecord]]:
    """A real run's page and records, against a server small enough to say 429 sometimes."""
    tmp_path = tmp_path_factory.mktemp("html")
    page = tmp_path / "report.html"
    out = tmp_path / "run.json"
    with running_server(kv_tokens=4096, decode_rate=4000, mean_output_tokens=400, seed=2) as s:
        argv = [s.base_url, "--rate", "60", "--requests", "40", "--seed", "2"]
        argv += ["--prompt-tokens", "50:300", "--max-tokens-range", "300:1500", "--no-progress"]
        argv += ["--html", str(page), "--json", str(out), "--records", "--max-failure-rate", "1"]
        assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    records = []
    for r in data["records"]:
        for key in ("latency", "ttft", "tpot"):
            r.pop(key)
        records.append(RequestRecord(**r))
    return page, records


def test_the_page_is_self_contained_and_has_its_parts(
    bench_page: tuple[Path, list[RequestRecord]],
) -> None:
    page, _ = bench_page
    text = page.read_text()
    assert text.count("<svg") == 2  # latency distributions, timeline (no sweep in this run)
    for heading in ("Summary", "Latency distributions", "Timeline: in-flight KV and refusals"):
        assert heading in text
    assert "KV tokens reserved (the server&#x27;s /metrics)" in text  # sampled from the server
    # Nothing fetched from anywhere: no script, no external source, stylesheet or font.
    assert not re.search(r"<script|\bsrc=|\bhref=|url\(|@import", text)


def _charts(page: str) -> list[ET.Element]:
    return [ET.fromstring(svg) for svg in re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)]


def _plot_area(chart: ET.Element) -> ET.Element:
    (area,) = [r for r in chart.iter(f"{SVG}rect") if r.get("class") == "plot-area"]
    return area


def _y(element: ET.Element) -> float:
    return float(element.get("y", element.get("y1", "nan")))


def test_every_chart_is_page_wide_with_titled_axes_and_the_legend_above_the_plot(
    bench_page: tuple[Path, list[RequestRecord]],
) -> None:
    _, records = bench_page
    summary = summarize(records, duration=2.0, deadline=60.0)
    curve = [(2.0, 2.0, 2.0), (4.0, 3.9, 3.8), (6.0, 5.1, 3.0), (8.0, 5.2, 1.0)]
    page = render_html(title="t", summary=summary, records=records, sweep=curve, knee_rate=4.0)
    charts = _charts(page)
    assert len(charts) == 3  # sweep, latency distributions, timeline
    for chart in charts:
        # As wide as the page, its height following from the viewBox's proportions.
        assert chart.get("width") == "100%"
        assert chart.get("height") is None
        assert len(chart.get("viewBox", "").split()) == 4
        top = float(_plot_area(chart).get("y", "nan"))
        # The legend is above the plot area: no entry of it can cover a line.
        (legend,) = [g for g in chart.iter(f"{SVG}g") if g.get("class") == "legend"]
        entries = [e for e in legend if e.tag in (f"{SVG}text", f"{SVG}line")]
        assert entries
        assert all(_y(e) < top for e in entries), (top, [_y(e) for e in entries])
    # Every axis has its title: x and y, and the right axis where a series is drawn on it.
    titles = [
        [t.text for t in chart.iter(f"{SVG}text") if t.get("class") == "axis-title"]
        for chart in charts
    ]
    assert [len(t) for t in titles] == [2, 2, 3]
    assert all(all(text and text.strip() for text in t) for t in titles)
    assert titles[2] == ["seconds from the start", "KV tokens", "429s received so far"]
    # The right axis's title is on the right, beyond the plot area.
    timeline = charts[2]
    area = _plot_area(timeline)
    right_title = [t for t in timeline.iter(f"{SVG}text") if t.get("class") == "axis-title"][2]
    assert float(right_title.get("x", "nan")) > float(area.get("x", "0")) + float(
        area.get("width", "0")
    )


def test_chromium_renders_every_plot(
    tmp_path: Path, bench_page: tuple[Path, list[RequestRecord]]
) -> None:
    _, records = bench_page
    summary = summarize(records, duration=2.0, deadline=60.0)
    # The sweep curve from made-up points (a sweep run takes too long here): the page's last plot.
    curve = [(2.0, 2.0, 2.0), (4.0, 3.9, 3.8), (6.0, 5.1, 3.0), (8.0, 5.2, 1.0)]
    page = tmp_path / "all.html"
    page.write_text(
        render_html(title="t", summary=summary, records=records, sweep=curve, knee_rate=4.0)
    )
    png = screenshot(page, tmp_path / "shot.png", width=WINDOW_WIDTH, height=3000)
    if os.environ.get("KVCLIENT_SCREENSHOT"):  # to look at it: KVCLIENT_SCREENSHOT=shot.png
        shutil.copyfile(png, os.environ["KVCLIENT_SCREENSHOT"])
    colors = pixels(png)
    drawn = {name: colors[color] for name, color in COLORS.items()}
    expected = ("latency", "latency_all", "kv", "refusals", "goodput", "throughput", "ideal")
    missing = [name for name in expected if drawn[name] < MIN_LINE_PIXELS]
    assert not missing, drawn
    # The charts fill the page: the ideal line of the sweep runs across the whole plot area.
    left, right = _columns(png, COLORS["ideal"])
    assert right - left >= MIN_PLOT_SHARE * WINDOW_WIDTH, (left, right)


def _columns(png: Path, color: str) -> tuple[int, int]:
    """The leftmost and rightmost columns with a pixel of exactly ``color``."""
    import numpy as np
    from PIL import Image

    want = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB"))
    columns = np.flatnonzero((pixels == want).all(axis=2).any(axis=0))
    assert columns.size, f"no {color} in the screenshot"
    return int(columns[0]), int(columns[-1])
