"""The server side of ``soak.py``: the reference server in its own process (its stderr and its
admission log kept), its RSS from ``/proc``, the 5xx answers it counted, and the sampling of its
memory and ledger during the run and once the load is over."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from _common import free_port

from kvclient.loadgen._report import parse_prometheus_text

MEGABYTE = 1024 * 1024
#: How long the server may take to notice every hang-up once the load is over.
SETTLE_SECONDS = 10.0
_RESPONSES = re.compile(r'^kv_http_responses_total\{route="([^"]*)",status="(\d+)"\} (\S+)$', re.M)


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process (Linux ``/proc``); None where there is no such file."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class ServerProcess:
    url: str
    pid: int
    log: Any  # the server's stderr, a temporary file
    admission_log: str  # the server's --admission-log

    def internal_errors(self) -> list[str]:
        """Log lines of unexpected exceptions (the generic 500 path), ours or uvicorn's."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace")
        return [
            line
            for line in text.splitlines()
            if "unexpected " in line or "Exception in ASGI application" in line
        ]


@contextlib.contextmanager
def server_process(args: Sequence[str], cpu: int | None) -> Iterator[ServerProcess]:
    """``python -m reference_server ARGS`` on a free loopback port, its stderr kept."""
    port = free_port()
    cmd = [sys.executable, "-m", "reference_server", "--port", str(port), "--log-level", "warning"]

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory() as tmp:
        admission_log = os.path.join(tmp, "admission.jsonl")
        cmd += ["--admission-log", admission_log]
        proc = subprocess.Popen(
            [*cmd, *args], stderr=log, preexec_fn=pin if cpu is not None else None
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("the reference server did not start") from None
                    time.sleep(0.05)
            yield ServerProcess(url, proc.pid, log, admission_log)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def server_5xx(metrics_text: str) -> int:
    """5xx answers the server sent, all routes (its own count, by status)."""
    return sum(
        round(float(n)) for _, status, n in _RESPONSES.findall(metrics_text) if status >= "500"
    )


@dataclass
class Sampler:
    url: str
    pid: int
    interval: float
    samples: list[dict[str, float]] = field(default_factory=list)

    async def sample(self, http: httpx.AsyncClient, start: float) -> dict[str, float]:
        row: dict[str, float] = {"t": round(time.monotonic() - start, 2)}
        rss = rss_bytes(self.pid)
        if rss is not None:
            row["rss_mb"] = round(rss / MEGABYTE, 2)
        with contextlib.suppress(httpx.HTTPError):
            metrics = parse_prometheus_text((await http.get(self.url + "/metrics")).text)
            for name in ("kv_reserved_tokens", "kv_inflight_requests", "kv_used_tokens"):
                row[name] = metrics.get(name, math.nan)
        self.samples.append(row)
        return row

    async def run(self, start: float) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                await self.sample(http, start)
                await anyio.sleep(self.interval)


async def settle(url: str) -> dict[str, float]:
    """The server's metrics once nothing is in flight (or after SETTLE_SECONDS)."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            metrics = parse_prometheus_text((await http.get("/metrics")).text)
            if metrics["kv_inflight_requests"] == 0 or time.monotonic() > deadline:
                return metrics
            await anyio.sleep(0.05)
