"""Value objects of the contract suite: its options, one check's result, the whole report."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "CHECK_NAMES",
    "CHECK_TITLES",
    "DEFAULT_BURST",
    "DEFAULT_CAPACITY_WAIT",
    "DEFAULT_RETRY_TRIES",
    "DEFAULT_TIMEOUT",
    "CheckResult",
    "CheckStatus",
    "ContractOptions",
    "ContractReport",
]

#: Requests in a saturating burst.
DEFAULT_BURST = 64
#: Seconds one check may take, all its requests and waits included.
DEFAULT_TIMEOUT = 60.0
#: Retries after the advised wait before Retry-After is judged dishonest.
DEFAULT_RETRY_TRIES = 3
#: Seconds to wait for capacity to come back after dropped streams.
DEFAULT_CAPACITY_WAIT = 15.0

#: Every check, in the order it runs, with the one-line promise it verifies.
CHECK_TITLES: Mapping[str, str] = MappingProxyType(
    {
        "context_window": "advertises its context window (/v1/models max_model_len)",
        "bad_input": "bad input gets a 4xx JSON error and the server keeps serving",
        "prompt_too_long": "a prompt over the context gets a non-retryable 4xx JSON error",
        "unset_max_tokens": "unset max_tokens is accepted; output stays within context - prompt",
        "explicit_max_tokens": "an explicit max_tokens is respected",
        "saturation": "saturated: 429/503 with Retry-After, never 5xx; admitted requests complete",
        "retry_after_honest": "Retry-After is honest: a retry after the advised wait is admitted",
        "capacity_returns": "capacity comes back after a burst and dropped streams (no leak)",
    }
)
CHECK_NAMES: tuple[str, ...] = tuple(CHECK_TITLES)


class CheckStatus(str, enum.Enum):
    """How a check ended.

    ``unsupported``: the server legitimately lacks what the check needs (no ``/v1/models``, never
    refuses, no Retry-After when allowed); reported apart from failures, never fails a run.
    ``skipped``: not run (not selected, or a prerequisite is unknown).
    """

    PASS = "pass"
    FAIL = "fail"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class ContractOptions:
    """How to run the suite. Every field has a default that works against a local server.

    ``context_window`` and ``model`` override what ``/v1/models`` says (or stand in when it says
    nothing). ``burst_max_tokens`` sets the burst's max_tokens, each request sent so that
    it runs to it (``ignore_eos``, ``min_tokens``); by default the burst asks for four times the
    server's KV pool (the whole context when the pool is unknown); lower it for slow real
    models. ``require_retry_after=False`` reports a 429 without Retry-After as unsupported
    instead of failed (TGI, llama.cpp). ``api="chat"`` sends ``/v1/chat/completions`` requests
    instead of ``/v1/completions``.
    """

    model: str | None = None
    api_key: str | None = None
    context_window: int | None = None
    burst: int = DEFAULT_BURST
    timeout: float = DEFAULT_TIMEOUT
    retry_tries: int = DEFAULT_RETRY_TRIES
    capacity_wait: float = DEFAULT_CAPACITY_WAIT
    burst_max_tokens: int | None = None
    require_retry_after: bool = True
    api: Literal["completions", "chat"] = "completions"
    only: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def positive_seconds(name: str, value: object) -> None:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

        positive_int("burst", self.burst)
        positive_int("retry_tries", self.retry_tries)
        positive_seconds("timeout", self.timeout)
        positive_seconds("capacity_wait", self.capacity_wait)
        if self.context_window is not None:
            positive_int("context_window", self.context_window)
        if self.burst_max_tokens is not None:
            positive_int("burst_max_tokens", self.burst_max_tokens)
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if self.only is not None:
            unknown = [name for name in self.only if name not in CHECK_TITLES]
            if unknown:
                raise ValueError(
                    f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECK_NAMES)}"
                )

    def selected(self, name: str) -> bool:
        return self.only is None or name in self.only


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check's verdict and the one line of evidence behind it.

    ``details`` holds the raw numbers (statuses seen, waits, counts) for ``--json``.
    """

    name: str
    status: CheckStatus
    evidence: str
    required: bool = True
    duration: float = 0.0
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return CHECK_TITLES.get(self.name, self.name)

    @property
    def failed(self) -> bool:
        return self.status is CheckStatus.FAIL

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status.value,
            "required": self.required,
            "evidence": self.evidence,
            "duration_s": round(self.duration, 3),
            "details": dict(self.details),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ContractReport:
    """Every check's result against one server. ``ok`` when no required check failed."""

    base_url: str
    model: str | None
    context_window: int | None
    results: tuple[CheckResult, ...]
    duration: float

    @property
    def ok(self) -> bool:
        return not any(r.failed and r.required for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(name)

    def counts(self) -> dict[str, int]:
        """How many checks ended in each status."""
        counts = {status.value: 0 for status in CheckStatus}
        for result in self.results:
            counts[result.status.value] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "context_window": self.context_window,
            "ok": self.ok,
            "counts": self.counts(),
            "duration_s": round(self.duration, 3),
            "checks": [r.to_dict() for r in self.results],
        }
