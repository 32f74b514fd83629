"""Result types: frozen value objects, no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import APIResponseError

__all__ = ["Completion", "CompletionChunk", "RetryEvent", "ToolCall", "Usage"]


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
class ToolCall:
    """One tool call the model made: ``arguments`` is the JSON text as the model wrote it."""

    id: str | None
    name: str
    arguments: str
    type: str = "function"

    @classmethod
    def from_message(cls, message: Any) -> tuple[ToolCall, ...]:
        """The tool calls of an OpenAI chat ``message`` (``message.tool_calls``), in order."""
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            return ()
        found = []
        for call in calls:
            if not isinstance(call, dict):
                continue
            function = call.get("function")
            function = function if isinstance(function, dict) else {}
            ident, kind = call.get("id"), call.get("type")
            name, arguments = function.get("name"), function.get("arguments")
            found.append(
                cls(
                    id=ident if isinstance(ident, str) else None,
                    name=name if isinstance(name, str) else "",
                    arguments=arguments if isinstance(arguments, str) else "",
                    type=kind if isinstance(kind, str) else "function",
                )
            )
        return tuple(found)


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of ``complete`` or ``chat`` (or of a finished stream).

    ``max_tokens`` is the cap actually sent, ``prompt_tokens`` the count kvclient made locally
    (the server's own count is in ``usage``), ``attempts`` how many requests were sent,
    ``retry_wait`` the seconds spent waiting (retries and client-wide cooldown holds).
    For chat, ``message`` is the assistant message as the server's non-streamed answer gives it
    (for a stream: its deltas merged, ``role``, ``tool_calls``, ``reasoning_content`` and all),
    and ``tool_calls`` the calls in it; for text completions ``message`` is None.
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
    message: dict[str, Any] | None = field(default=None, compare=False)
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def from_answer(
        cls,
        payload: dict[str, Any],
        *,
        chat: bool,
        max_tokens: int,
        prompt_tokens: int,
        attempts: int,
        retry_wait: float,
        history: tuple[RetryEvent, ...],
    ) -> Completion:
        """The result from a non-streamed answer's JSON (its first choice). Raises
        :class:`~kvclient.APIResponseError` when it has no choices."""
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise APIResponseError(f"answer has no choices: {json.dumps(payload)[:200]}")
        choice = choices[0]
        message: dict[str, Any] | None = None
        if chat:
            raw_message = choice.get("message")
            message = raw_message if isinstance(raw_message, dict) else {}
            text = message.get("content")
        else:
            text = choice.get("text")
        finish = choice.get("finish_reason")
        model = payload.get("model")
        ident = payload.get("id")
        return cls(
            text=text if isinstance(text, str) else "",
            finish_reason=finish if isinstance(finish, str) else None,
            usage=Usage.from_json(payload.get("usage")),
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            attempts=attempts,
            retry_wait=retry_wait,
            history=history,
            model=model if isinstance(model, str) else None,
            id=ident if isinstance(ident, str) else None,
            raw=payload,
            message=message,
            tool_calls=ToolCall.from_message(message),
        )


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed delta: ``text`` is the new text of choice ``index``.

    For chat, ``delta`` is the event's whole ``delta`` and ``tool_calls`` its tool-call
    fragments as sent (``index``, and parts of ``id``, ``function.name``, ``function.arguments``).
    """

    text: str
    finish_reason: str | None
    index: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    delta: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    tool_calls: tuple[dict[str, Any], ...] = ()
