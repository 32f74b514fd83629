"""scripts/progress.py: a long build's output condensed to a line every few seconds, with its
last lines when it fails. On canned output and a given clock; nothing is built."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "progress.py"
    spec = importlib.util.spec_from_file_location("setup_progress", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


progress = _load()

# What `cmake --build ... --target llama-server` prints (Makefile generator), abridged.
CMAKE = """\
[  1%] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
[  2%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.cpp.o
/src/ggml.c:123:5: warning: unused variable 'x' [-Wunused-variable]
[ 10%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/gguf.cpp.o
[ 42%] Building CXX object src/CMakeFiles/llama.dir/llama-model.cpp.o
[ 42%] Building CXX object src/CMakeFiles/llama.dir/llama-vocab.cpp.o
[ 97%] Building CXX object tools/server/CMakeFiles/llama-server.dir/server.cpp.o
[100%] Linking CXX executable ../../bin/llama-server
[100%] Built target llama-server
""".splitlines()


def test_percent_of_make_and_ninja_lines() -> None:
    assert progress.percent_of("[ 42%] Building CXX object x.o") == 42
    assert progress.percent_of("[100%] Built target llama-server") == 100
    assert progress.percent_of("[120/480] Building CXX object x.o") == 25
    assert progress.percent_of("/src/ggml.c:123:5: warning: [ 42%]") is None
    assert progress.percent_of("-- Configuring done") is None


def test_a_build_is_a_line_every_interval_and_one_at_100_percent() -> None:
    timed = [(30.0 * i, line) for i, line in enumerate(CMAKE)]  # a line every 30 s
    said = progress.condense(timed, "building", start=0.0, interval=60.0)
    assert said == [
        "building: 2% after 1m00s | [  2%] Building CXX object "
        "ggml/src/CMakeFiles/ggml-base.dir/ggml.cpp.o",  # not the warning printed after it
        "building: 42% after 2m00s | [ 42%] Building CXX object "
        "src/CMakeFiles/llama.dir/llama-model.cpp.o",
        "building: 97% after 3m00s | [ 97%] Building CXX object "
        "tools/server/CMakeFiles/llama-server.dir/server.cpp.o",
        "building: 100% after 3m30s | [100%] Linking CXX executable ../../bin/llama-server",
    ]


def test_quiet_output_is_one_line_per_interval() -> None:
    """Thousands of lines in a few seconds (pip, a fast compile) print a handful."""
    timed = [(i * 0.01, f"Collecting package-{i}") for i in range(3000)]  # 30 s of output
    said = progress.condense(timed, "pip install", start=0.0, interval=10.0)
    assert len(said) == 2
    assert said[0].startswith("pip install: running after 10s | Collecting package-10")


def test_a_silent_command_still_reports_on_tick() -> None:
    condenser = progress.Condenser("linking", start=0.0, interval=10.0)
    assert condenser.feed("[ 99%] Linking CXX executable llama-server", 1.0) is None
    assert condenser.tick(5.0) is None
    assert condenser.tick(12.0) == (
        "linking: 99% after 12s | [ 99%] Linking CXX executable llama-server"
    )
    assert condenser.tick(13.0) is None


def test_long_lines_are_cut() -> None:
    condenser = progress.Condenser("x", start=0.0, interval=0.0)
    said = condenser.feed("y" * 500, 1.0)
    assert said is not None
    assert len(said) < 200
    assert said.endswith("…")


def test_run_condenses_and_shows_the_tail_when_the_command_fails() -> None:
    script = "import sys\nfor i in range(50): print(f'[{2*i:3d}%] step {i}')\nsys.exit(3)"
    out = io.StringIO()
    ticks = iter(range(0, 10_000, 1))
    with pytest.raises(subprocess.CalledProcessError):
        progress.run(
            [sys.executable, "-c", script],
            step="build",
            interval=20.0,
            out=out,
            clock=lambda: float(next(ticks)),
        )
    text = out.getvalue()
    assert text.startswith("build: $ ")
    # The clock advances once per line (and once per second without one): some progress
    # lines, each with a step line of the build, far fewer than its 50 lines.
    said = [line for line in text.splitlines() if line.startswith("build: ") and "% after " in line]
    assert 1 <= len(said) <= 5, text
    assert all("| [" in line for line in said)
    assert "build: failed (exit status 3); its last lines:" in text
    assert "  [ 98%] step 49" in text
