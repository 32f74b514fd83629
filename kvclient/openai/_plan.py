"""What the transport decides about one request, without I/O.

Which requests are generation requests, how many prompt tokens they carry, the clamped output
cap written back into the body under the caller's own key, and the answers kvclient gives in the
SDK's place (a local refusal, "gave up"), built as the ``httpx.Response`` objects the SDK maps to
its own exception classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from .._client import BaseClient
from .._exceptions import APIStatusError, ChatTemplateError, PromptTooLongError, ServerBusyError
from .._tokens import TokenCounter

__all__ = [
    "LOCAL_HEADER",
    "LOCAL_REASON",
    "NO_RETRY_HEADER",
    "Plan",
    "base_url_of",
    "busy_response",
    "generation_kind",
    "invalid_response",
    "local_error_response",
    "passed_on",
    "plan_request",
    "refusal_response",
]

#: The header the SDK obeys over its own retry rules; every answer kvclient has already retried
#: (or decided not to) carries "false", so the SDK never retries on top of kvclient.
NO_RETRY_HEADER = "x-should-retry"
#: Marks an answer that kvclient made up itself: no byte of the request reached the server.
LOCAL_HEADER = "x-kvclient-local"
#: Ends the reason phrase of such an answer. The SDK's httpx client logs every answer its
#: transport returns as an "HTTP Request" line; ``_base_transport`` drops the lines of these
#: ones.
LOCAL_REASON = "(answered by kvclient, not sent)"

_CHAT_SUFFIX = "/chat/completions"
_TEXT_SUFFIX = "/completions"
# The output caps a caller may use, in the order kvclient adds one when the caller used none
# (``max_tokens`` is the one every OpenAI-compatible engine understands).
_CAP_KEYS = ("max_tokens", "max_completion_tokens")
# Hop-by-hop or body-describing headers that a rebuilt (already decoded) answer must not carry.
_BODY_HEADERS = frozenset({"content-length", "content-encoding", "transfer-encoding"})
# Headers of the server's last refusal worth keeping on the answer kvclient gives instead.
_KEPT_ON_BUSY = ("retry-after", "retry-after-ms", "x-request-id")


def generation_kind(method: str, path: str) -> str | None:
    """``"chat"`` or ``"text"`` for the POSTs kvclient takes over, None for everything else."""
    if method != "POST":
        return None
    if path.endswith(_CHAT_SUFFIX):
        return "chat"
    if path.endswith(_TEXT_SUFFIX):
        return "text"
    return None


def base_url_of(url: httpx.URL, kind: str) -> str:
    """The API's base URL, from a generation request to it (``.../v1/chat/completions``)."""
    suffix = _CHAT_SUFFIX if kind == "chat" else _TEXT_SUFFIX
    path = url.path[: -len(suffix)]
    return str(url.copy_with(path=path or "/", query=None, fragment=None)).rstrip("/")


@dataclass(frozen=True, slots=True)
class Plan:
    """A generation request as kvclient sends it."""

    content: bytes  # the body, its output cap made explicit and clamped
    prompt_tokens: int  # counted locally (the longest prompt of a batch)
    max_tokens: int  # the cap sent
    size: int  # KV tokens it may reserve: prompt + cap for every prompt of the request
    stream: bool


def _text_prompts(prompt: Any, counter: TokenCounter) -> list[int] | None:
    """Token counts of each prompt of a completions request, None for a shape kvclient cannot
    count (the server will answer that one itself)."""
    if isinstance(prompt, str):
        return [counter.count(prompt)]
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [len(prompt)]  # one prompt as token ids
    if all(isinstance(p, str) for p in prompt):
        return [counter.count(p) for p in prompt]
    if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        return [len(p) for p in prompt]
    return None


def _prompt_counts(kind: str, body: Mapping[str, Any], counter: TokenCounter) -> list[int] | None:
    if kind == "text":
        return _text_prompts(body.get("prompt"), counter)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    try:
        return [counter.count_messages(messages)]
    except ChatTemplateError:
        raise  # the transport answers it as the server would: a 400
    except TypeError:  # not a list of mappings: the server's 400 says it best
        return None


class InvalidCap(ValueError):
    """The caller's output cap is not a positive integer."""

    def __init__(self, key: str, value: Any) -> None:
        super().__init__(f"{key} must be a positive integer, got {value!r}")
        self.key = key


def _requested_cap(body: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    caps = []
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidCap(key, value)
        caps.append(value)
    return min(caps) if caps else None


def plan_request(client: BaseClient, kind: str, body: dict[str, Any]) -> Plan | None:
    """Count and clamp one generation request with ``client``'s counter and context window.

    None when the body is not one kvclient can count (it goes to the server untouched). Raises
    :class:`PromptTooLongError` for a prompt that leaves no room for output and
    :class:`InvalidCap` for an output cap that is not a positive integer.
    """
    counts = _prompt_counts(kind, body, client.counter)
    if counts is None:
        return None
    keys = _CAP_KEYS if kind == "chat" else _CAP_KEYS[:1]
    requested = _requested_cap(body, keys)
    longest = max(counts)
    cap = client.clamp(requested, longest)
    used = [key for key in keys if body.get(key) is not None]
    rewritten = dict(body)
    # The caller's own key (both, if it sent both); never a second one it did not use.
    for key in used or keys[:1]:
        rewritten[key] = cap
    return Plan(
        content=json.dumps(rewritten).encode(),
        prompt_tokens=longest,
        max_tokens=cap,
        size=sum(counts) + cap * len(counts),
        stream=bool(body.get("stream")),
    )


def _json_response(
    status: int, error: dict[str, Any], headers: Mapping[str, str]
) -> httpx.Response:
    reason = f"{httpx.codes.get_reason_phrase(status)} {LOCAL_REASON}"
    return httpx.Response(
        status,
        headers={**headers, NO_RETRY_HEADER: "false"},
        json={"error": error},
        extensions={"reason_phrase": reason.encode("ascii")},
    )


def refusal_response(error: PromptTooLongError, kind: str) -> httpx.Response:
    """A 400 in OpenAI's shape (the SDK raises ``BadRequestError``) for a prompt that cannot fit:
    nothing was sent."""
    return _json_response(
        400,
        {
            "message": error.message,
            "type": "invalid_request_error",
            "param": "messages" if kind == "chat" else "prompt",
            "code": "context_length_exceeded",
            "prompt_tokens": error.prompt_tokens,
            "context_window": error.context_window,
        },
        {LOCAL_HEADER: "refused"},
    )


def invalid_response(error: InvalidCap) -> httpx.Response:
    """A 400 for an output cap that is not a positive integer: nothing was sent."""
    return _json_response(
        400,
        {
            "message": f"{error}; nothing was sent",
            "type": "invalid_request_error",
            "param": error.key,
            "code": "invalid_value",
        },
        {LOCAL_HEADER: "refused"},
    )


def local_error_response(message: str, code: str) -> httpx.Response:
    """A 400 for a request kvclient cannot prepare (e.g. the context window is unknown)."""
    return _json_response(
        400,
        {"message": message, "type": "invalid_request_error", "param": None, "code": code},
        {LOCAL_HEADER: "refused"},
    )


def busy_response(error: ServerBusyError) -> httpx.Response:
    """A 429 (the SDK raises ``RateLimitError``) for a call kvclient gave up on: attempts,
    deadline or wait cap ran out. It keeps the server's Retry-After, and says how many attempts
    were made."""
    last = error.last_error
    headers: dict[str, str] = {LOCAL_HEADER: "gave-up"}
    last_status = None
    if isinstance(last, APIStatusError):
        last_status = last.status_code
        for name in _KEPT_ON_BUSY:
            value = last.response.headers.get(name)
            if value is not None:
                headers[name] = value
    return _json_response(
        429,
        {
            "message": error.message,
            "type": "server_busy",
            "param": None,
            "code": "server_busy",
            "attempts": error.attempts,
            "retry_after": error.retry_after,
            "last_status": last_status,
        },
        headers,
    )


def passed_on(response: httpx.Response) -> httpx.Response:
    """The server's own (read) error answer, marked so that the SDK does not retry it again."""
    headers = [(k, v) for k, v in response.headers.multi_items() if k not in _BODY_HEADERS]
    headers.append((NO_RETRY_HEADER, "false"))
    return httpx.Response(
        response.status_code,
        headers=headers,
        content=response.content,
        extensions={
            k: v for k, v in response.extensions.items() if k in ("http_version", "reason_phrase")
        },
    )
