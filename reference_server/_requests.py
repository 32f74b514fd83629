"""Reading and validating request bodies: pure functions, every failure an :class:`APIError`.

Hostile input gets a 4xx with a clear message, never a 500: broken JSON, invalid UTF-8, deep
nesting, wrong types, caps below 1. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvclient import ChatTemplateError, TokenCounter
from kvclient._tokens import count_chat_request

from ._errors import APIError, bad_request

__all__ = ["GenerationRequest", "Kind", "count_prompt", "parse_generation", "parse_json_object"]

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


def _optional_int(body: Mapping[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_json_type(value)}", param=name)
    if value < minimum:
        raise bad_request(f"{name} must be at least {minimum}, got {value}", param=name)
    return value


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
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False

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
    n = _optional_int(body, "n", minimum=1)
    if n not in (None, 1):
        raise bad_request("n must be 1: this server generates one choice per request", param="n")
    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if kind == "chat":
        newer = _optional_int(body, "max_completion_tokens", minimum=1)
        max_tokens = newer if newer is not None else max_tokens
    stream = _optional_bool(body, "stream") if kind in ("completions", "chat") else False
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", param="stream_options")
        include_usage = _optional_bool(options, "include_usage")

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
            stream=stream,
            include_usage=include_usage,
        )
    prompt, token_ids = _parse_prompt(body)
    if kind == "generate" and prompt is None:
        raise bad_request("prompt must be a string", param="prompt")
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        token_ids=token_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
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
