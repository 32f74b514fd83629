"""Error answers and what they mean, in each engine's words (pure).

Each server words the same two situations differently. "The prompt does not fit the context": our
reference server's 413, OpenAI's and vLLM's 400 "maximum context length", TGI's 422 "`inputs`
tokens + `max_new_tokens` must be <= N", llama.cpp's 400 ``exceed_context_size_error``, vLLM's
400 "prompt contains at least N input tokens" (N a lower bound) and, for a prompt of exactly the
window, "max_tokens must be at least 1, got 0". "Full now, come back later": 429 (TGI says "Model
is overloaded") and 503 (vLLM, SGLang, Ollama's "server busy", llama.cpp's "Loading model").
:func:`classify_error` maps status + body to one exception class, whether a retry can help, and
the numbers the body carries; :func:`is_kv_exhaustion` tells an error that says the KV cache ran
out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .._exceptions import (
    APIStatusError,
    AuthenticationError,
    BadGatewayError,
    BadRequestError,
    GatewayTimeoutError,
    InsufficientQuotaError,
    InternalServerError,
    KVClientError,
    NotFoundError,
    PermissionDeniedError,
    PromptTooLongError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)

__all__ = [
    "RETRYABLE_STATUSES",
    "STATUS_ERRORS",
    "ErrorClass",
    "ErrorDetails",
    "classify_error",
    "is_kv_exhaustion",
    "parse_error_body",
]

STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    500: InternalServerError,
    502: BadGatewayError,
    503: ServiceUnavailableError,
    504: GatewayTimeoutError,
}

#: Answers a retry can fix: the server is full or a proxy could not reach it, now.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})

_MAX_MESSAGE = 1000

_CONTEXT_CODES = frozenset(
    {"context_length_exceeded", "exceed_context_size_error", "prompt_too_long"}
)
_CONTEXT_PATTERNS = (
    re.compile(r"maximum context length", re.I),  # OpenAI, vLLM, SGLang
    re.compile(r"`inputs` tokens \+ `max_new_tokens` must be", re.I),  # TGI
    re.compile(r"`inputs` must have less than \d+ tokens", re.I),  # TGI
    re.compile(r"exceeds the available context size", re.I),  # llama.cpp
    re.compile(r"context length exceeded|exceeds? the context window", re.I),
    re.compile(r"is longer than the model's context length", re.I),  # SGLang
    # vLLM >= 0.32, a prompt of exactly the window sent without max_tokens: the room left, 0, is
    # its default cap. (It says the same to a request that asks for 0 itself; kvclient never does.)
    re.compile(r"max_tokens must be at least 1, got 0\b", re.I),
)
_QUOTA = "insufficient_quota"

# Numbers in the messages: (pattern, group for the context window, group for prompt tokens).
_NUMBER_PATTERNS: tuple[tuple[re.Pattern[str], int | None, int | None], ...] = (
    # vLLM / OpenAI: "maximum context length is 8192 tokens. However, you requested 9000 tokens
    # (8000 in the messages, 1000 in the completion)"
    (re.compile(r"maximum context length is (\d+) tokens", re.I), 1, None),
    # vLLM >= 0.32 stops tokenizing one token past the window: "However, your prompt contains at
    # least 2049 input tokens" is a lower bound (_LOWER_BOUND below).
    (re.compile(r"contains at least (\d+) input tokens", re.I), None, 1),
    (re.compile(r"\((\d+) in the (?:messages|prompt)", re.I), None, 1),
    # vLLM >= 0.6: "However, your request has 9000 input tokens"; "your messages resulted in N"
    (re.compile(r"request has (\d+) input tokens", re.I), None, 1),
    (re.compile(r"(?:messages|prompt) resulted in (\d+) tokens", re.I), None, 1),
    (re.compile(r"prompt (?:has|contains|is|of) (\d+) tokens", re.I), None, 1),
    (re.compile(r"context window (?:is |of )(\d+) tokens", re.I), 1, None),
    # TGI: "must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`"
    (re.compile(r"must be <= (\d+)\. Given: (\d+) `inputs` tokens", re.I), 1, None),
    (re.compile(r"Given: (\d+) `inputs` tokens", re.I), None, 1),
    # TGI: "`inputs` must have less than 4096 tokens. Given: 5000"
    (re.compile(r"`inputs` must have less than (\d+) tokens\. Given: (\d+)", re.I), 1, None),
    (re.compile(r"`inputs` must have less than \d+ tokens\. Given: (\d+)", re.I), None, 1),
    # llama.cpp: "request (9412 tokens) exceeds the available context size (8192 tokens)"
    (re.compile(r"request \((\d+) tokens\) exceeds", re.I), None, 1),
    (re.compile(r"available context size \((\d+) tokens\)", re.I), 1, None),
    # SGLang: "The input (9000 tokens) is longer than the model's context length (8192 tokens)"
    (re.compile(r"input \((\d+) tokens\)", re.I), None, 1),
    (re.compile(r"context length \((\d+) tokens\)", re.I), 1, None),
)
#: A prompt count that is only a lower bound, when the number came from this pattern.
_LOWER_BOUND = _NUMBER_PATTERNS[1][0]


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What an error body says, whatever its server's shape."""

    message: str
    error_type: str | None = None
    code: str | None = None
    prompt_tokens: int | None = None
    context_window: int | None = None
    body: Any = None
    #: ``prompt_tokens`` is a lower bound ("at least N input tokens"), not the prompt's count.
    prompt_tokens_lower_bound: bool = False


@dataclass(frozen=True, slots=True)
class ErrorClass:
    """The verdict on an error answer."""

    exception: type[KVClientError]
    retryable: bool
    details: ErrorDetails


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def _code(value: Any, error_type: str | None) -> str | None:
    """The error's kind. llama.cpp (and vLLM >= 0.8) put the HTTP status in ``code`` as a number
    and the kind in ``type``: then the kind is the type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return error_type
    return _text(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_error_body(content: bytes | str) -> ErrorDetails:
    """The message, type, code and token numbers of an error body (any server's shape).

    Shapes: OpenAI ``{"error": {"message", "type", "code"}}`` (also vLLM >= 0.8, SGLang, our
    reference server, llama.cpp with its ``n_prompt_tokens``/``n_ctx``); vLLM's older flat
    ``{"object": "error", "message", "type", "code"}``; TGI's and Ollama's
    ``{"error": "...", "error_type": "..."}``; FastAPI's ``{"detail": ...}``; plain text.
    """
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body: Any = json.loads(text) if text.strip() else None
    except ValueError:
        body = None
    message: str | None = None
    error_type = code = None
    prompt_tokens = context_window = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = _text(error.get("message"))
            error_type = _text(error.get("type"))
            code = _code(error.get("code"), error_type)
            prompt_tokens = _int(error.get("n_prompt_tokens"))
            context_window = _int(error.get("n_ctx"))
        elif isinstance(error, str):
            message = error
            error_type = _text(body.get("error_type"))
            code = _text(body.get("code"))
        elif "message" in body:
            message = _text(body.get("message"))
            error_type = _text(body.get("type"))
            code = _code(body.get("code"), error_type)
        elif "detail" in body:
            detail = body["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)[:_MAX_MESSAGE]
    if message is None:
        message = text.strip() or "(empty body)"
    message = message[:_MAX_MESSAGE]
    lower_bound = False
    for pattern, window_group, prompt_group in _NUMBER_PATTERNS:
        match = pattern.search(message)
        if match is None:
            continue
        if window_group is not None and context_window is None:
            context_window = int(match.group(window_group))
        if prompt_group is not None and prompt_tokens is None:
            prompt_tokens = int(match.group(prompt_group))
            lower_bound = pattern is _LOWER_BOUND
    return ErrorDetails(message, error_type, code, prompt_tokens, context_window, body, lower_bound)


def _is_context_error(status: int, details: ErrorDetails) -> bool:
    if status == 413:
        return True
    if status not in (400, 422):
        return False
    if details.code in _CONTEXT_CODES or details.error_type in _CONTEXT_CODES:
        return True
    return any(pattern.search(details.message) for pattern in _CONTEXT_PATTERNS)


def classify_error(status: int, content: bytes | str) -> ErrorClass:
    """Which exception an error answer becomes, and whether a retry can help."""
    details = parse_error_body(content)
    if _is_context_error(status, details):
        return ErrorClass(PromptTooLongError, False, details)
    if status == 429 and _QUOTA in (details.code, details.error_type):
        return ErrorClass(InsufficientQuotaError, False, details)
    exception: type[APIStatusError] = STATUS_ERRORS.get(
        status, InternalServerError if status >= 500 else APIStatusError
    )
    return ErrorClass(exception, status in RETRYABLE_STATUSES, details)


#: Error codes and messages that say a request died because the KV cache ran out: our server's
#: ``kv_cache_oom``, llama.cpp's unified cache overflowing mid-decode, a CUDA OOM relayed by TGI.
_KV_EXHAUSTION_CODES = frozenset({"kv_cache_oom"})
_KV_EXHAUSTION_MESSAGES = re.compile(r"out of memory|context size has been exceeded", re.I)


def is_kv_exhaustion(code: str | None, message: str | None) -> bool:
    """Whether an error (its code, its message) says the engine ran out of KV cache."""
    if code is not None and code in _KV_EXHAUSTION_CODES:
        return True
    return message is not None and _KV_EXHAUSTION_MESSAGES.search(message) is not None
