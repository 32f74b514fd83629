"""Test helpers: a fake clock so retry tests never sleep for real.

>>> from kvclient import RetryPolicy
>>> clock = FakeClock()
>>> policy = clock.policy(max_attempts=3)
>>> policy.sleep(2.5); clock.now
2.5

``FakeClock.async_sleep`` yields to other tasks, then moves time to the end of the sleep, so
concurrent sleepers overlap the way real ones do: two tasks sleeping 2 s each end at t=2, not 4.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio.lowlevel

from ._policy import RetryPolicy

__all__ = ["FakeClock"]

# An HTTP-date's zero: Thu, 01 Jan 2026 00:00:00 GMT.
DEFAULT_WALL_START = 1767225600.0


class FakeClock:
    """Virtual time for :class:`~kvclient.RetryPolicy`: sleeping advances it instantly.

    ``now`` is the monotonic reading, ``wall`` the matching Unix time, ``sleeps`` every sleep
    requested, in order.
    """

    def __init__(self, *, start: float = 0.0, wall_start: float = DEFAULT_WALL_START) -> None:
        self._lock = threading.Lock()
        self.now = start
        self._wall_offset = wall_start - start
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self._wall_offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self.now += max(0.0, seconds)

    async def async_sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            until = self.now + max(0.0, seconds)
        # Let the other tasks run first (as a real sleep would), then wake at our own end time.
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self.now = max(self.now, until)

    def policy(self, **overrides: Any) -> RetryPolicy:
        """A :class:`RetryPolicy` on this clock; keyword arguments override its fields."""
        options: dict[str, Any] = {
            "clock": self.monotonic,
            "wall_clock": self.wall,
            "sleep": self.sleep,
            "async_sleep": self.async_sleep,
        }
        options.update(overrides)
        return RetryPolicy(**options)
