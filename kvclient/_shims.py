"""Where sync and async I/O differ: small pairs of the same shape, one async, one sync.

``kvclient/_async_client.py`` is written once, against the async names here;
``scripts/unasync.py`` rewrites it into ``kvclient/_sync_client.py``, where ``AsyncX`` becomes
``X`` and ``async_x`` becomes ``x``. Everything else the two clients do is in the pure core
(:class:`kvclient._client.BaseClient`).
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import httpx

__all__ = [
    "AsyncLock",
    "AsyncSignal",
    "Lock",
    "Signal",
    "async_close_chain",
    "async_drop",
    "async_eager",
    "close_chain",
    "drop",
    "eager",
    "finish_generators",
]

# Bounds on finishing an abandoned async stream (see finish_generators).
_DRAIN_EVENTS = 10_000
_DRAIN_SECONDS = 1.0

Lock = threading.Lock


class AsyncLock:
    """An anyio lock made at first use: anyio locks bind to the event loop that first uses
    them, and a client may be built outside any."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock: anyio.Lock | None = None

    async def __aenter__(self) -> None:
        if self._lock is None:
            self._lock = anyio.Lock()
        await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        assert self._lock is not None
        self._lock.release()


class Signal:
    """Wakes the threads waiting for a change (a send-window slot): a condition variable.

    Hold it (``with``) while checking and waiting, so that a change between the check and the
    wait is not missed; :meth:`notify_all` takes it too.
    """

    __slots__ = ("_condition",)

    def __init__(self) -> None:
        self._condition = threading.Condition()

    def __enter__(self) -> None:
        self._condition.acquire()

    def __exit__(self, *exc: object) -> None:
        self._condition.release()

    def wait(self, seconds: float) -> None:
        self._condition.wait(timeout=seconds)

    def notify_all(self) -> None:
        with self._condition:
            self._condition.notify_all()


class AsyncSignal:
    """:class:`Signal` for tasks: each waiter waits on an event of its own, every change sets
    them all (nothing runs between a task's check and its wait, so holding it is a no-op)."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[anyio.Event] = []

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def wait(self, seconds: float) -> None:
        event = anyio.Event()
        self.waiters.append(event)
        try:
            with anyio.move_on_after(seconds):
                await event.wait()
        finally:
            if event in self.waiters:
                self.waiters.remove(event)

    def notify_all(self) -> None:
        waiters, self.waiters = self.waiters, []
        for event in waiters:
            event.set()


def eager(prepare: Any) -> Any:
    """A sync stream is counted and clamped at the call (a prompt too long raises there)."""
    return prepare()


def async_eager(prepare: Any) -> Any:
    """An async stream is counted and clamped when entered: discovery may have to await."""
    return None


def drop(stream: Any) -> None:
    """A sync stream dropped unclosed: close it (the window gets its room back, the
    connection its pool)."""
    stream.close()


def async_drop(stream: Any) -> None:
    """An async stream dropped unclosed: nothing can be awaited here, but the window gets its
    room back at once."""
    stream._give_back_slot()


async def finish_generators(events: Any) -> None:
    """Run the generator chain under an abandoned stream to its end, the connection closed.

    httpx reads a stream through nested async generators; aclose() on ours leaves the inner ones
    suspended, and trio warns when it collects an unfinished one. With the response closed,
    resuming them ends at once (buffered lines, then the closed stream), so they finish cleanly.
    """
    with anyio.move_on_after(_DRAIN_SECONDS):
        try:
            for _ in range(_DRAIN_EVENTS):
                await events.__anext__()
        except Exception:  # StopAsyncIteration, the closed stream's error, a bad last event
            return


def close_chain(response: httpx.Response, events: Any, lines: Any) -> None:
    """Close a streamed response and the generators reading it."""
    try:
        response.close()
    finally:
        for generator in (events, lines):
            if generator is not None:
                generator.close()


async def async_close_chain(response: httpx.Response, events: Any, lines: Any) -> None:
    """Close a streamed response and finish both generators reading it (ours, then httpx's)."""
    try:
        await response.aclose()
        for generator in (events, lines):
            if generator is not None:
                await finish_generators(generator)
    finally:
        for generator in (events, lines):
            if generator is not None:
                await generator.aclose()
