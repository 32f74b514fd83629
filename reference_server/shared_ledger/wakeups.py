"""Waking waiters across processes: one Redis pub/sub subscription per process to every shared
ledger's ``released`` channel (see :mod:`.scripts`), so that a release in any gateway wakes the
waiters of every other within milliseconds, and each process knows the shared totals."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import anyio
import redis.asyncio as aioredis
import redis.exceptions

from .connection import COMMAND_TIMEOUT, LEDGER_ERRORS, reply_text
from .ledger import RedisLedger
from .state import SharedState

__all__ = ["Wakeups"]

logger = logging.getLogger("kvclient.gateway")

#: Seconds :class:`Wakeups` waits before subscribing again when Redis is away.
_RESUBSCRIBE_SECONDS = 0.5


class Wakeups:
    """One pub/sub subscription per process to every shared ledger's ``released`` channel:
    :meth:`watch` says whom to wake for a ledger. A message published by any process (this one
    too) updates the ledger's :attr:`~RedisLedger.seen` totals and, when it may let a waiter in,
    wakes them at once; while the subscription is down (Redis away, reconnecting),
    :attr:`subscribed` is False and waiters fall back on polling."""

    #: Every shared ledger's channel (see :attr:`RedisLedger.channel`).
    PATTERN = "{kvclient:*}:released"

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.subscribed = False
        self._watchers: dict[str, list[tuple[RedisLedger, Callable[[], None]]]] = {}

    def watch(self, ledger: RedisLedger, wake: Callable[[], None]) -> None:
        self._watchers.setdefault(ledger.channel, []).append((ledger, wake))

    def _dispatch(self, message: dict[str, Any]) -> None:
        flag, _, totals = reply_text(message["data"]).partition(" ")
        try:
            seen: SharedState | None = SharedState.parse(totals)
        except ValueError:  # not ours (another version's, a stray PUBLISH): wake all the same
            seen, flag = None, "1"
        for ledger, wake in self._watchers.get(reply_text(message["channel"]), ()):
            if seen is not None:
                ledger.seen = seen
            if flag == "1":
                wake()

    async def run(self) -> None:
        """Listen until cancelled, subscribing again after Redis was away. Never raises: a
        subscription Redis refuses (an ACL without PSUBSCRIBE) leaves the waiters polling."""
        refused = False
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(self.PATTERN)
                self.subscribed, refused = True, False
                for watchers in self._watchers.values():  # what was published meanwhile is lost
                    for _, wake in watchers:
                        wake()
                while True:
                    message = await pubsub.get_message(timeout=COMMAND_TIMEOUT)
                    if message is not None and message.get("type") == "pmessage":
                        self._dispatch(message)
            except LEDGER_ERRORS:
                pass  # Redis is away: the lease's renewals say so
            except redis.exceptions.RedisError as exc:
                if not refused:
                    logger.warning("shared ledger: no pub/sub (%s); waiters poll instead", exc)
                refused = True
            finally:
                self.subscribed = False
                with anyio.CancelScope(shield=True), contextlib.suppress(*LEDGER_ERRORS):
                    await pubsub.aclose()
            await anyio.sleep(_RESUBSCRIBE_SECONDS)
