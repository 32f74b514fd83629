"""What goes wrong between the gateway and an upstream, as exceptions the gateway's modules
share (the relay, discovery, the shared ledger's setup)."""

from __future__ import annotations

__all__ = ["UpstreamUnavailable"]


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or could not say what it has."""
