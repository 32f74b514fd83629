"""The load generator of ``gateway_overhead.py``: a minimal raw HTTP/1.1 client (asyncio
protocols and httptools, on uvloop when it is installed), keep-alive connections in a closed
loop, each next request written from the callback that completed the answer before it."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def _request(port: int, body: bytes) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _LoadConnection(asyncio.Protocol):
    """One keep-alive connection of the closed loop: the next request is written from the
    callback that completes the answer before it (no task, no stream reader), parsed by
    httptools. The load generator shares its core with the proxy, so what it costs is taken
    from the proxy's share: this costs about a third of an asyncio-streams client (whose 0.12 ms
    a request was more than nginx's whole work)."""

    def __init__(
        self,
        request: bytes,
        remaining: list[int],
        latencies: list[float],
        statuses: list[int],
        done: asyncio.Future[int],
    ) -> None:
        import httptools

        self.request = request
        self.remaining = remaining
        self.latencies = latencies
        self.statuses = statuses
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.events = 0
        self.started = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._next()

    def _next(self) -> None:
        assert self.transport is not None
        if self.remaining[0] <= 0:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(self.events)
            return
        self.remaining[0] -= 1
        self.started = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.latencies.append(time.perf_counter() - self.started)
        self.statuses.append(self.parser.get_status_code())
        if self.body:
            self.events += b"".join(self.body).count(b"data:")
            self.body = []
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"the connection was lost: {exc}"))


async def _closed_loop(
    port: int, body: bytes, requests: int, concurrency: int
) -> tuple[list[float], list[int], int]:
    loop = asyncio.get_running_loop()
    remaining = [requests]
    latencies: list[float] = []
    statuses: list[int] = []
    request = _request(port, body)
    done = [loop.create_future() for _ in range(concurrency)]
    for future in done:
        await loop.create_connection(
            lambda f=future: _LoadConnection(request, remaining, latencies, statuses, f),  # type: ignore[misc]
            "127.0.0.1",
            port,
        )
    events = await asyncio.gather(*done)
    return latencies, statuses, sum(events)


def _run(coroutine: Any) -> Any:
    """On uvloop when it is installed (the gateway extra): the load generator's loop costs less
    of the core it shares with the proxy, whichever proxy it is."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def load(url: str, body: bytes, requests: int, concurrency: int) -> tuple[list[float], int, int]:
    """(latencies, non-200 answers, SSE events received) of a closed loop."""
    port = int(url.rsplit(":", 1)[1])
    latencies, statuses, events = _run(_closed_loop(port, body, requests, concurrency))
    return latencies, sum(1 for s in statuses if s != 200), events


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
