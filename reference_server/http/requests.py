"""Reading and validating request bodies; every failure an :class:`APIError`.

Hostile input gets a 4xx with a clear message, never a 500: broken JSON, invalid UTF-8, deep
nesting, wrong types, caps below 1, a body over the limit or one that stalls. Unknown fields are
ignored, as OpenAI does. Only :func:`read_body` does I/O (ASGI ``receive``); the rest is pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from starlette.types import Receive, Scope

from kvclient import ChatTemplateError, TokenCounter, count_chat_request
from kvclient.engines.spend import SpendError, request_spend

from .errors import APIError, bad_request

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DRAIN_LIMIT_BYTES",
    "THREAD_TOKENIZE_CHARS",
    "ClientGone",
    "GenerationRequest",
    "Kind",
    "check_content_type",
    "count_prompt",
    "parse_generation",
    "parse_json_object",
    "preferred_wait",
    "read_body",
    "scope_header",
]

#: How much of an oversized body is read and discarded before answering 413, so the client sees
#: the answer instead of a reset connection.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
#: The request body limit unless configured otherwise.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Prompts longer than this many characters are tokenized in a worker thread.
THREAD_TOKENIZE_CHARS = 32 * 1024
#: The longest a request body may go without a byte arriving (nginx's client_body_timeout).
BODY_IDLE_TIMEOUT = 30.0


class ClientGone(Exception):
    """The client went away while its request was being read."""


def scope_header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case, as ASGI gives names)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


_WAIT_PREFERENCE = re.compile(r'^\s*wait\s*=\s*"?(\d{1,9})"?\s*(?:;.*)?$', re.I)


def preferred_wait(scope: Scope) -> float | None:
    """The seconds the client says it will wait (RFC 7240 ``Prefer: wait=N``), None when it says
    nothing: a request waits in the admission queue no longer than that. ``wait=0`` asks for
    an answer at once (a 429 when there is no room). Several ``wait`` preferences: the
    shortest; one that is not a whole number of seconds is ignored, as RFC 7240 asks."""
    waits = [
        int(found.group(1))
        for key, value in scope["headers"]
        if key == b"prefer"
        for preference in value.decode("latin-1").split(",")
        if (found := _WAIT_PREFERENCE.match(preference))
    ]
    return float(min(waits)) if waits else None


def too_large(limit: int, *, unread: bool = False) -> APIError:
    """The 413; ``unread``: the rest of the body is not read, so the connection cannot carry
    another request and is closed after the answer (instead of read on to the body's end)."""
    return APIError(
        413,
        f"the request body exceeds the server's limit of {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"} if unread else None,
    )


async def read_body(
    scope: Scope, receive: Receive, limit: int, *, idle_timeout: float = BODY_IDLE_TIMEOUT
) -> bytes:
    """The whole body; a 413 after draining (bounded) what the client still sends; a 408 when
    no byte of it arrives for ``idle_timeout`` seconds."""
    declared = scope_header(scope, b"content-length")
    declared_size: int | None = None
    if declared is not None:
        try:
            declared_size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", code="invalid_request") from None
    if declared_size is not None and (declared_size < 0 or declared_size > DRAIN_LIMIT_BYTES):
        # Too much to drain: answer at once (before the client has sent it all, if ever).
        raise (
            too_large(limit, unread=True)
            if declared_size > 0
            else APIError(400, "invalid Content-Length header", code="invalid_request")
        )
    chunks: list[bytes] = []
    total = 0
    over = declared_size is not None and declared_size > limit
    while True:
        with anyio.move_on_after(idle_timeout) as waited:
            message = await receive()
        if waited.cancelled_caught:
            raise APIError(
                408,
                f"the request body stalled: no byte for {idle_timeout:g} seconds",
                code="request_timeout",
                headers={"Connection": "close"},
            )
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            over = True
        if not over:
            chunks.append(chunk)
        more: bool = message.get("more_body", False)
        if not more or total > DRAIN_LIMIT_BYTES:
            break
    if over:
        raise too_large(limit, unread=more)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


Kind = Literal["completions", "chat", "generate", "tokenize"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: One decoder for every body (json.loads with an argument builds a new one each call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only; a missing header is tolerated (curl and some SDKs omit it)."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {media!r}",
            code="unsupported_media_type",
        )


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        if text.startswith("\ufeff"):  # what json.loads refuses before decoding
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value = _DECODER.decode(text)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except ValueError as exc:  # huge integer literals, NaN/Infinity
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _optional_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {_json_type(value)}", param=name)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """A validated request; exactly one of ``prompt``/``token_ids``/``messages`` is set."""

    kind: Kind
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    #: A chat's tool definitions, for tokenizers whose chat template lays them out.
    tools: list[dict[str, Any]] | None = None
    #: Each sequence's output cap: the largest any length field allows (None: unset).
    max_tokens: int | None = None
    #: Sequences generated (``n``, ``n_cmpl``, ``best_of``: the largest).
    sequences: int = 1
    stream: bool = False
    include_usage: bool = False
    #: ``stream_options.continuous_usage_stats`` (vLLM's), with ``include_usage``: every chunk
    #: carries the usage so far.
    continuous_usage: bool = False

    @property
    def size_hint(self) -> int:
        """Rough characters to tokenize (to decide whether to count off the event loop).

        Every field of every message counts, not only ``content``: a 4 MB ``name`` is
        tokenized as surely as a 4 MB prompt.
        """
        if self.prompt is not None:
            return len(self.prompt)
        if self.messages is not None:
            return _json_size(self.messages)
        return 0


def _json_size(value: object) -> int:
    """Characters of the strings in a parsed JSON value, plus one per other item.

    A loop over an explicit stack, not recursion: the value may nest as deeply as the JSON
    parser allows (about a thousand levels), and ``str()`` or a recursive walk of that can
    exhaust the interpreter's stack.
    """
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            size += 1
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            size += 1
            stack.extend(item)
        else:
            size += 1
    return size


def _parse_prompt(body: Mapping[str, Any]) -> tuple[str | None, list[int] | None]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", param="prompt")
            return prompt[0], None
        if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
            return None, list(prompt)
    raise bad_request(
        "prompt must be a string, a list of one string, or a non-empty list of token ids",
        param="prompt",
    )


def _parse_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of messages", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(
                f"messages[{i}].content must be a string or an array of parts", param="messages"
            )
    return messages


def parse_generation(kind: Kind, body: Mapping[str, Any]) -> GenerationRequest:
    """Validate the fields this server uses; everything else is ignored."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {_json_type(model)}", param="model")
    try:
        spend = request_spend(body)
    except SpendError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    max_tokens, sequences = spend.max_tokens, spend.sequences
    stream = _optional_bool(body, "stream") if kind in ("completions", "chat") else False
    include_usage = continuous_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", param="stream_options")
        include_usage = _optional_bool(options, "include_usage")
        continuous = _optional_bool(options, "continuous_usage_stats")
        continuous_usage = include_usage and continuous

    if kind == "chat" or (kind == "tokenize" and "messages" in body and "prompt" not in body):
        tools = body.get("tools")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
        ):
            raise bad_request("tools must be an array of objects", param="tools")
        return GenerationRequest(
            kind=kind,
            messages=_parse_messages(body),
            tools=tools,
            max_tokens=max_tokens,
            sequences=sequences,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
        )
    prompt, token_ids = _parse_prompt(body)
    if kind == "generate" and prompt is None:
        raise bad_request("prompt must be a string", param="prompt")
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        token_ids=token_ids,
        max_tokens=max_tokens,
        sequences=sequences,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )


def count_prompt(request: GenerationRequest, counter: TokenCounter) -> int:
    """Prompt tokens, counted exactly as kvclient counts them (the chat formula, or the model's
    chat template with ``--tokenizer``; a conversation the template rejects is a 400)."""
    try:
        if request.messages is not None:
            return count_chat_request(counter, request.messages, request.tools)
        if request.token_ids is not None:
            return len(request.token_ids)
        assert request.prompt is not None
        return counter.count(request.prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    except RecursionError:
        # Structured message fields are serialised to be counted; nesting close to the JSON
        # parser's own limit can still exhaust the stack there.
        raise bad_request("a message field is nested too deeply", param="messages") from None
    except (TypeError, ValueError, UnicodeError) as exc:
        raise bad_request(f"cannot tokenize the prompt: {type(exc).__name__}") from None
