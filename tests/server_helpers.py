"""Shared by the tests that run the real reference server on a loopback port."""

from __future__ import annotations

import time
from collections.abc import Callable

from reference_server import RunningServer


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
