"""One AsyncClient over several real reference servers on loopback (asyncio and trio).

Requests go where the advertised room is; a replica stopped mid-run costs the streams it was
sending (each ends with a clear error) and nothing else: requests not yet streaming go to the
others, nothing is lost and nothing hangs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import pytest

from kvclient import AsyncClient, RetryPolicy
from kvclient._exceptions import APIConnectionError, KVClientError
from reference_server import RunningServer, running_server
from tests.helpers.servers import at_zero, wait_for

BASE: dict[str, Any] = {
    "context_window": 2048,
    "mean_output_tokens": 1e6,  # every answer runs to its cap
    "tick_seconds": 0.005,
}


@contextlib.contextmanager
def replicas(*configs: dict[str, Any]) -> Iterator[tuple[list[RunningServer], list[Any]]]:
    """Start one server per config; yields them and the ExitStack that stops each."""
    with contextlib.ExitStack() as outer:
        servers, stacks = [], []
        for config in configs:
            stack = outer.enter_context(contextlib.ExitStack())
            servers.append(stack.enter_context(running_server(**BASE, **config)))
            stacks.append(stack)
        yield servers, stacks


def admitted(server: RunningServer) -> int:
    return int(server.metrics()["kv_admitted_total"])


@pytest.mark.anyio
async def test_requests_split_by_the_advertised_free_budget() -> None:
    small = {"kv_tokens": 4096, "decode_rate": 4000.0}  # usable 3686: 8 requests of 416
    large = {"kv_tokens": 16384, "decode_rate": 4000.0}  # usable 14745: 35
    with replicas(small, large) as (servers, _):
        client = AsyncClient(
            base_url=[s.base_url for s in servers],
            retry=RetryPolicy(deadline=20.0),
        )
        async with client:
            for _ in range(2):  # one answer from each: now the client knows their room
                await client.complete("x", max_tokens=400)
            async with anyio.create_task_group() as tg:
                for _ in range(30):
                    tg.start_soon(partial(client.complete, "x", max_tokens=400))
        a, b = (admitted(s) for s in servers)
        assert a + b >= 32
        assert b > 2 * a, (a, b)  # the one with four times the room takes most
        for server in servers:
            wait_for(lambda server=server: at_zero(server))  # type: ignore[misc]
        assert all(r.requests == 0 and r.tokens == 0 for r in client._replicas)


@pytest.mark.anyio
async def test_a_replica_stopped_mid_run() -> None:
    # Streams of 600 tokens at 200 tokens/s run 3 s: far longer than the 1 s a stopping server
    # waits for them (reference_server.testing), so those on the stopped one are cut, however
    # late a busy machine starts the stop.
    config = {"kv_tokens": 16384, "decode_rate": 200.0}
    deadline = 10.0
    with replicas(config, config, config) as (servers, stacks):
        client = AsyncClient(
            base_url=[s.base_url for s in servers], retry=RetryPolicy(deadline=deadline)
        )
        streams: list[str] = []
        plain: list[str] = []
        started = time.monotonic()

        async def stream() -> None:
            try:
                async with client.complete_stream("x", max_tokens=600) as s:
                    async for _ in s:
                        pass
                streams.append("ok")
            except APIConnectionError as exc:
                clear = "the stream broke after" in str(exc) and "not retried" in str(exc)
                streams.append("broken" if clear else f"unclear: {exc}")

        async def request() -> None:
            try:
                await client.complete("x", max_tokens=20)
                plain.append("ok")
            except KVClientError as exc:  # pragma: no cover - reported by the assertion below
                plain.append(f"failed: {exc}")

        with anyio.fail_after(deadline + 5):
            async with client, anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(stream)
                await anyio.sleep(0.3)  # the streams are running
                tg.start_soon(anyio.to_thread.run_sync, stacks[2].close)  # stop one replica
                for _ in range(12):
                    await anyio.sleep(0.1)
                    tg.start_soon(request)
        elapsed = time.monotonic() - started
        assert len(streams) == 6  # none lost
        assert set(streams) <= {"ok", "broken"}, streams
        assert len(plain) == 12
        assert plain == ["ok"] * 12  # not yet streaming: they went to the others
        assert streams.count("broken") >= 1  # the stopped one's streams end with a clear error
        assert streams.count("ok") >= 3
        assert elapsed < deadline
        assert all(r.requests == 0 and r.tokens == 0 for r in client._replicas)
        for server in servers[:2]:
            wait_for(lambda server=server: at_zero(server))  # type: ignore[misc]
