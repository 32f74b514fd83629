"""The retry budget: a token bucket that bounds retries to a share of traffic (pure)."""

from __future__ import annotations

import math
import threading

__all__ = ["RetryBudget"]


class RetryBudget:
    """A token bucket bounding retries to a share of traffic (gRPC retry throttling).

    The bucket starts full with ``max_tokens``. Each retryable failure spends one token, each
    success earns ``token_ratio`` back. Retries are allowed only while more than half the bucket
    is left, so a server that keeps failing sees retries fall to about ``token_ratio`` of
    traffic, while a server that is merely pacing (some successes between 429s) keeps them.
    Thread-safe; share one budget between clients to bound them together.
    """

    __slots__ = ("_lock", "_tokens", "max_tokens", "token_ratio")

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if not (max_tokens > 0 and math.isfinite(max_tokens)):
            raise ValueError(f"max_tokens must be a positive number, got {max_tokens!r}")
        if not (0 < token_ratio <= max_tokens):
            raise ValueError(f"token_ratio must be in (0, max_tokens], got {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self._tokens = float(max_tokens)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RetryBudget(tokens={self.tokens:.2f}/{self.max_tokens}, ratio={self.token_ratio})"

    @property
    def tokens(self) -> float:
        return self._tokens

    def record_success(self) -> None:
        with self._lock:
            self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)

    def record_failure(self) -> None:
        with self._lock:
            self._tokens = max(0.0, self._tokens - 1.0)

    def allows_retry(self) -> bool:
        with self._lock:
            return self._tokens > self.max_tokens / 2
