"""Result types: frozen value objects, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Completion", "CompletionChunk", "RetryEvent", "Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage as the server reported it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_json(cls, data: Any) -> Usage | None:
        if not isinstance(data, dict):
            return None
        prompt = data.get("prompt_tokens")
        completion = data.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        total = data.get("total_tokens")
        return cls(prompt, completion, total if isinstance(total, int) else prompt + completion)


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """One failed attempt that kvclient retried, and how long it waited before the next."""

    attempt: int
    status_code: int | None
    error: str
    wait: float
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of ``complete`` or ``chat`` (or of a finished stream).

    ``max_tokens`` is the cap actually sent, ``prompt_tokens`` the count kvclient made locally
    (the server's own count is in ``usage``), ``attempts`` how many requests were sent,
    ``retry_wait`` the seconds spent waiting (retries and client-wide cooldown holds).
    """

    text: str
    finish_reason: str | None
    usage: Usage | None
    max_tokens: int
    prompt_tokens: int
    attempts: int
    retry_wait: float
    history: tuple[RetryEvent, ...] = ()
    model: str | None = None
    id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed delta: ``text`` is the new text of choice ``index``."""

    text: str
    finish_reason: str | None
    index: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
