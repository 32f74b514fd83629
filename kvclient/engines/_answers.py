"""Numbers read from an engine's answers, validated before they steer anything (package-private)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_BLOCK", "MAX_TOKENS", "dig", "positive", "whole_sample"]

#: The most any engine's numbers are believed to be: a window or a KV pool of more tokens than
#: this, or KV blocks larger than ``MAX_BLOCK``, are a broken or lying answer, not a setting.
MAX_TOKENS = 1 << 40
MAX_BLOCK = 1 << 16


def positive(value: Any, most: int = MAX_TOKENS) -> int | None:
    """``value`` when it is a whole number from 1 to ``most`` (not a boolean); else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        return None
    return value


def whole_sample(value: float) -> int | None:
    """A Prometheus sample as a token count: finite, whole, within bounds; else None."""
    if not math.isfinite(value) or not value.is_integer():
        return None
    return positive(int(value))


def dig(payload: Any, *keys: str) -> Any:
    """``payload[k1][k2]...``, None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(payload, dict):
            return None
        payload = payload.get(key)
    return payload
