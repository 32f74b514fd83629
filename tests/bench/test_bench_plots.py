"""The bench scripts' pictures: each plotting path draws a valid PNG or SVG from a tiny input
(a small result in the shape the script writes, or a tiny bounded run), into a temporary
directory. What the figures show is the scripts' business; that they are drawn is ours.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: The names the docs use.
PICTURES = ("retry_storm.png", "kv_reserved.png", "gateway_cost.png", "contract.svg")
MAX_PICTURE_BYTES = 160_000


def run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVCLIENT_BENCH_RESULTS": str(tmp_path), "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def assert_png(path: Path, *, min_width: int = 600, min_height: int = 300) -> tuple[int, int]:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_width, (width, height)
    assert height >= min_height, (width, height)
    with Image.open(path) as image:
        image.verify()  # the whole file decodes: chunks and checksums
    with Image.open(path) as image:
        assert image.size == (width, height)
    assert len(data) > 10_000  # something was drawn, not an empty canvas
    return width, height


def assert_svg(path: Path, *texts: str) -> ET.Element:
    root = ET.fromstring(path.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    width, height = (float(v) for v in root.get("viewBox", "").split()[2:])
    assert width >= 500
    assert height >= 250
    drawn = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for text in texts:
        assert text in drawn, text
    return root


def _client(name: str, attempts: float | None, p50: float, p99: float, done: int) -> dict[str, Any]:
    return {
        "client": name,
        "requests": 20,
        "completed": done,
        "completed_within_deadline": done,
        "attempts_per_completed": attempts,
        "latency_p50": p50,
        "latency_p99": p99,
    }


RETRY_STORM = {
    "machine": {"date": "2026-12-02", "python": "3.11.7", "cpus": 2, "machine": "x86_64"},
    "capacity": {"completed_per_second": 2.0, "given": True},
    "rate": 6.0,
    "requests": 20,
    "burst_seconds": 3.0,
    "deadline": 10.0,
    "ceiling": _client("kvclient pace=False", 1.0, 4.0, 8.0, 20),
    "results": [
        _client("naive", 30.5, 1.5, 6.0, 14),
        _client("openai", 3.2, 0.4, 2.0, 9),
        _client("kvclient", 1.02, 2.0, 9.0, 20),
        _client("kvclient.openai", None, 0.0, 0.0, 0),  # nothing completed: drawn as a gap
    ],
}


def _path(name: str, connections: int, cpu_ms: float | None) -> dict[str, Any]:
    return {"path": name, "connections": connections, "cpu_ms_per_request": cpu_ms}


def gateway_result(*, litellm: bool) -> dict[str, Any]:
    paths = {"direct": None, "nginx": 0.12, "gateway (upstream /tokenize)": 3.1}
    if litellm:
        paths["LiteLLM proxy"] = 29.7
    return {
        "machine": RETRY_STORM["machine"],
        "results": [_path(p, c, cpu) for p, cpu in paths.items() for c in (1, 16)],
        "streams": {
            "direct": {"cpu_us_per_event": None},
            "nginx": {"cpu_us_per_event": 31.7},
            "gateway (upstream /tokenize)": {"cpu_us_per_event": 66.5},
            **({"LiteLLM proxy": {"cpu_us_per_event": 1211.0}} if litellm else {}),
        },
        "litellm": {"version": "1.108.7"} if litellm else None,
        "notes": [] if litellm else ["LiteLLM row skipped: --no-litellm"],
    }


def test_retry_storm_plots_from_a_stored_result(tmp_path: Path) -> None:
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(RETRY_STORM))
    png = tmp_path / "img" / "retry_storm.png"
    proc = run(tmp_path, "retry_storm.py", "--plot", str(png), "--plot-only", str(stored))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {png}" in proc.stdout
    assert_png(png)
    # No run happened: nothing was measured, nothing written beside the picture.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "stored.json"]


def test_retry_storm_plot_only_reads_the_scripts_own_result_by_default(tmp_path: Path) -> None:
    (tmp_path / "retry_storm.json").write_text(json.dumps(RETRY_STORM))
    svg = tmp_path / "retry_storm.svg"
    proc = run(tmp_path, "retry_storm.py", "--plot", str(svg), "--plot-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_svg(svg, "Attempts per completed request", "naive (retries at once)")


@pytest.mark.parametrize("litellm", [True, False])
def test_gateway_cost_plots_from_a_stored_result(tmp_path: Path, litellm: bool) -> None:
    stored = tmp_path / "gateway_overhead.json"
    stored.write_text(json.dumps(gateway_result(litellm=litellm)))
    png = tmp_path / "gateway_cost.png"
    proc = run(tmp_path, "gateway_overhead.py", "--plot", str(png), "--plot-only", str(stored))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_png(png)


def test_plot_only_needs_a_picture_to_draw_and_a_result_to_draw_from(tmp_path: Path) -> None:
    proc = run(tmp_path, "gateway_overhead.py", "--plot-only")
    assert proc.returncode == 2
    assert "--plot-only draws into --plot PATH" in proc.stderr
    proc = run(tmp_path, "kv_timeline.py", "--plot", str(tmp_path / "x.png"), "--plot-only")
    assert proc.returncode == 2
    assert "no result at" in proc.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_kv_timeline_runs_a_tiny_bounded_workload_and_plots_it(tmp_path: Path) -> None:
    png = tmp_path / "kv_reserved.png"
    proc = run(
        tmp_path,
        "kv_timeline.py",
        *("--requests", "8", "--rate", "40", "--deadline", "5", "--decode-rate", "4000"),
        *("--plot", str(png)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| run" in proc.stdout
    data = json.loads((tmp_path / "kv_timeline.json").read_text())
    assert [r["key"] for r in data["runs"]] == ["direct", "gateway"]
    for r in data["runs"]:
        assert r["requests"] == 8
        assert len(r["t"]) == len(r["used"]) == len(r["reserved"]) > 0
        assert r["pool_tokens"] == data["pool_tokens"]
    assert data["runs"][1]["oom_events"] == 0  # the gateway never lets the engine overflow
    assert_png(png, min_height=500)  # two panels
    # The same result drawn again from the stored JSON, as SVG.
    svg = tmp_path / "kv_reserved.svg"
    proc = run(tmp_path, "kv_timeline.py", "--plot", str(svg), "--plot-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_svg(svg, "KV tokens", "seconds from the first request")


def test_contract_drawing(tmp_path: Path) -> None:
    svg = tmp_path / "contract.svg"
    proc = run(tmp_path, "contract_drawing.py", "--out", str(svg))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_svg(svg, "Client", "Server", "429 Too Many Requests")
    assert "Retry-After" in svg.read_text()


@pytest.mark.parametrize("name", PICTURES)
def test_the_pictures_the_docs_show_are_committed_and_valid(name: str) -> None:
    path = ROOT / "docs" / "img" / name
    assert path.is_file(), f"{path} is missing: see bench/README.md, Pictures"
    assert path.stat().st_size <= MAX_PICTURE_BYTES
    if name.endswith(".png"):
        assert_png(path)
    else:
        assert_svg(path, "Client", "Server")
