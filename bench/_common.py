"""Shared by the bench/ scripts: timing, tables, JSON results, an instant-answer server."""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def best_of(fn: Callable[[], object], *, repeat: int = 5, number: int = 1) -> float:
    """Best wall time of ``repeat`` runs of ``number`` calls, per call, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def machine() -> dict[str, Any]:
    import os

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=True)]
        print("| " + " | ".join(cells) + " |")


def result_path(name: str) -> Path:
    """``bench/results/NAME.json`` (or under ``$KVCLIENT_BENCH_RESULTS``, for tests)."""
    import os

    return Path(os.environ.get("KVCLIENT_BENCH_RESULTS") or RESULTS) / f"{name}.json"


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write :func:`result_path` ``(name)``; the path written."""
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2))
    print(f"\nwrote {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def instant_server_process(*args: str, cpu: int | None = None) -> Iterator[str]:
    """bench/instant_server.py ARGS in its own process (own core when ``cpu`` is given)."""
    import subprocess
    import sys
    import urllib.request

    port = free_port()
    cmd = [sys.executable, str(Path(__file__).parent / "instant_server.py"), "--port", str(port)]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    proc = subprocess.Popen([*cmd, *args])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the instant server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def pin_to_cpu(cpu: int) -> bool:
    """Pin this process to ``cpu`` when the machine has two cores or more; whether it did."""
    import os

    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return False
    os.sched_setaffinity(0, {cpu})
    return True


def _wait_for(url: str, proc: Any, what: str, timeout: float = 20.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


@contextlib.contextmanager
def reference_server_process(*args: str, cpu: int | None = None) -> Iterator[str]:
    """``python -m reference_server ARGS`` in its own process (own core when ``cpu`` is given).

    Yields its URL; the server is terminated on exit.
    """
    with _serving(["-m", "reference_server", *args], "the reference server", cpu) as url:
        yield url


@contextlib.contextmanager
def gateway_process(upstream: str, *args: str, cpu: int | None = None) -> Iterator[str]:
    """``kvclient gateway --upstream UPSTREAM ARGS`` in its own process; yields its URL."""
    cmd = ["-m", "kvclient", "gateway", "--upstream", upstream, *args]
    with _serving(cmd, "the gateway", cpu) as url:
        yield url


@contextlib.contextmanager
def _serving(argv: list[str], what: str, cpu: int | None) -> Iterator[str]:
    """``python ARGV --port P --log-level error`` until ``/health`` answers; terminated on exit."""
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, *argv, "--port", str(port), "--log-level", "error"]
    proc = subprocess.Popen(cmd, preexec_fn=_pinner(cpu), stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url + "/health", proc, what)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _pinner(cpu: int | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the child to ``cpu`` (None when it cannot or need not)."""
    import os

    if cpu is None or not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


class MetricsSampler:
    """Scrapes a server's ``/metrics`` every ``interval`` seconds while :meth:`run` runs.

    ``samples`` holds ``(monotonic time, {metric: value})``; start :meth:`run` in a task group
    and cancel it (or set ``stop``) when the load is done.
    """

    def __init__(self, url: str, *, interval: float = 0.05) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = False

    async def run(self) -> None:
        import anyio
        import httpx

        from kvclient.loadgen._report import parse_prometheus_text

        async with httpx.AsyncClient(timeout=5) as http:
            while not self.stop:
                started = time.monotonic()
                try:
                    response = await http.get(self.url)
                    self.samples.append((started, parse_prometheus_text(response.text)))
                except httpx.HTTPError:
                    pass  # a missed scrape is a missing sample, not a failed run
                await anyio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def between(self, start: float, end: float) -> list[dict[str, float]]:
        return [m for t, m in self.samples if start <= t <= end]

    def last(self) -> dict[str, float]:
        return self.samples[-1][1] if self.samples else {}


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A local ``redis-server`` on a free loopback port, nothing saved; yields its URL."""
    path = shutil.which("redis-server")
    if path is None:
        raise SystemExit("redis-server is missing: run scripts/test_setup.py")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.Popen(
            [path, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
             "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(0.3)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)
