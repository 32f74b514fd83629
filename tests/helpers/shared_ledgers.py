"""What the shared ledger's tests on a real Redis share: redis-py's asyncio client (the
``anyio_backend`` fixture), and the ledgers a test opened (``OPENED``), closed in the test's own
loop (the ``closing`` fixture, :func:`close_all`). A module imports the fixtures by name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from reference_server.shared_ledger.ledger import RedisLedger

__all__ = ["OPENED", "anyio_backend", "close_all", "closing"]

#: The ledgers the running test opened, to be closed in its loop.
OPENED: list[RedisLedger] = []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's asyncio client


async def close_all() -> None:
    while OPENED:
        await OPENED.pop().aclose()


@pytest.fixture
async def closing() -> AsyncIterator[None]:
    """Closes the ledgers the test opened, in its loop."""
    yield
    await close_all()
