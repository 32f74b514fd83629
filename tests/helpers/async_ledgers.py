"""One async interface over both ledgers, for the tests that run the same rules against each:
the in-process :class:`~reference_server.admission.ledger.KVAdmissionController` (wrapped by
:class:`LocalLedger`) and the shared :class:`~reference_server.shared_ledger.ledger.RedisLedger`.

Async, because the shared one speaks to Redis; the in-process one answers at once. Both price
requests with the same ``pricing`` (a ``KVAdmissionController``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from reference_server.admission.ledger import Handle, KVAdmissionController

__all__ = ["AsyncLedger", "LocalLedger"]


class AsyncLedger(Protocol):
    """Admit and release reservations against one budget; estimate when one fits."""

    @property
    def pricing(self) -> KVAdmissionController: ...

    async def try_admit(
        self, prompt_tokens: int, output_cap: int, *, need: int | None = None
    ) -> Handle | None: ...

    async def release(self, handle: Handle) -> None: ...

    async def retry_after(self, need: int, *, duration: float = 0.0) -> tuple[float, int]:
        """(seconds until ``need`` fits, requests waiting ahead)."""
        ...

    async def load(self) -> tuple[int, int]:
        """(tokens reserved, requests in flight)."""
        ...


class LocalLedger:
    """:class:`AsyncLedger` over an in-process ledger, on ``clock``."""

    def __init__(
        self, ledger: KVAdmissionController, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ledger = ledger
        self._clock = clock

    @property
    def pricing(self) -> KVAdmissionController:
        return self.ledger

    async def try_admit(
        self, prompt_tokens: int, output_cap: int, *, need: int | None = None
    ) -> Handle | None:
        return self.ledger.try_admit(prompt_tokens, output_cap, now=self._clock(), need=need)

    async def release(self, handle: Handle) -> None:
        self.ledger.release(handle, self._clock())

    async def retry_after(self, need: int, *, duration: float = 0.0) -> tuple[float, int]:
        return self.ledger.retry_after(need, self._clock(), duration=duration), 0

    async def load(self) -> tuple[int, int]:
        return self.ledger.load()
