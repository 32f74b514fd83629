"""Debian's ``redis-server`` for the shared ledger's tests: found on PATH, or installed with
apt-get when it is missing (:mod:`debian_packages`)."""

from __future__ import annotations

import debian_packages


def ensure() -> str:
    """The path of ``redis-server``, installing Debian's package when it is missing."""
    return debian_packages.ensure("redis-server", "redis-server")
