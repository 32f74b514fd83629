"""Shared by the tests that run the real reference server on a loopback port."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from reference_server import RunningServer


def bench_summary_run(url: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    """``kvclient bench URL`` (seed 7) with ``extra`` arguments: its JSON report. Failures are
    what these runs measure: the exit status does not depend on how many."""
    from kvclient.loadgen import cli as bench_cli

    out = tmp_path / f"bench-{time.monotonic_ns()}-{threading.get_ident()}.json"
    argv = [url, "--json", str(out), "--no-progress", "--seed", "7", *extra]
    assert bench_cli.main([*argv, "--max-failure-rate", "1"]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def at_zero(server: RunningServer) -> bool:
    """Nothing reserved, in flight, used or running: the server is back at rest."""
    m = server.metrics()
    return (
        m["kv_reserved_tokens"] == 0
        and m["kv_inflight_requests"] == 0
        and m["kv_used_tokens"] == 0
        and server.engine.stats().running == 0
    )


def hold(server: RunningServer, max_tokens: int) -> threading.Thread:
    """Occupy the ledger with one raw request (not through the client under test)."""

    def run() -> None:
        httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": "x", "max_tokens": max_tokens},
            timeout=30,
        )

    before = server.metrics()["kv_admitted_total"]
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: server.metrics()["kv_admitted_total"] > before)
    return thread
