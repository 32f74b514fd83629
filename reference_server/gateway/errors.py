"""What goes wrong between the gateway and an upstream, as exceptions the gateway's modules
share (the relay, discovery, the shared ledger's setup)."""

from __future__ import annotations

import asyncio

import aiohttp

__all__ = ["UPSTREAM_ERRORS", "UpstreamUnavailable"]

#: What a failed upstream exchange raises: no answer, a broken one, a timeout.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or could not say what it has."""
