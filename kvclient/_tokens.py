"""Token counting's common ground: the counter protocols and the chat-request formula.

Every counter satisfies :class:`TokenCounter`, so the client and the reference server take any of
them: ``TiktokenCounter`` (``_tiktoken``), ``HuggingFaceCounter`` (``_hf_tokenizer``) and
``ServerTokenizeCounter`` (``_server_counter``). :func:`count_chat_tokens` is OpenAI's published
per-message formula, which the estimating counters share; :func:`count_chat_request` passes a
request's ``tools`` to the counters that render them.

Non-text content parts (``image_url``, ``input_audio``, ...) cost ``non_text_part_tokens`` each
in every counter (:data:`DEFAULT_NON_TEXT_PART_TOKENS`), never the characters of their URL.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DEFAULT_NON_TEXT_PART_TOKENS",
    "TokenCounter",
    "Tokenizer",
    "count_chat_request",
    "count_chat_tokens",
]

# OpenAI's documented chat overhead for cl100k-era models: every message is framed as
# <|start|>{role/name}\n{content}<|end|>\n (3 tokens), a name costs 1 more, and the reply is
# primed with <|start|>assistant<|message|> (3 tokens).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
#: What one image or audio part is assumed to cost: LLaVA-1.5's 576 image tokens (a 336 px image,
#: 24 x 24 patches). Servers differ (Gemma 3: 256 per image; Qwen2-VL: by resolution), so it is a
#: parameter of every counter; its characters (a base64 ``data:`` URL) are never counted.
DEFAULT_NON_TEXT_PART_TOKENS = 576
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})

Message = Mapping[str, Any]


@runtime_checkable
class TokenCounter(Protocol):
    """Anything that counts tokens the way the server will."""

    def count(self, text: str) -> int:
        """Tokens in a plain prompt."""
        ...

    def count_messages(self, messages: Sequence[Message]) -> int:
        """Tokens a chat request's messages occupy, framing overhead included."""
        ...


@runtime_checkable
class Tokenizer(TokenCounter, Protocol):
    """A counter that can also encode and decode (the simulated engine generates real tokens)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


def _is_media_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type", "text") not in _TEXT_PART_TYPES


def _message_text_parts(value: Any) -> list[str]:
    """The text a message field contributes: strings as they are, content parts by their text.

    Media parts are left out here (they are costed per part by the caller).
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        parts: list[str] = []
        for part in value:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            elif not _is_media_part(part):
                parts.append(json.dumps(part, separators=(",", ":"), sort_keys=True))
        return parts
    # tool_calls and other structured fields reach the model serialised.
    return [json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)]


def _media_parts(message: Mapping[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if _is_media_part(part))


def count_chat_tokens(
    messages: Sequence[Message],
    count: Callable[[str], int],
    *,
    tokens_per_message: int = TOKENS_PER_MESSAGE,
    tokens_per_name: int = TOKENS_PER_NAME,
    reply_priming: int = REPLY_PRIMING_TOKENS,
    non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS,
) -> int:
    """Count a chat request with OpenAI's published formula, using ``count`` for each field.

    Each non-text content part (image, audio) costs ``non_text_part_tokens``. Raises
    ``TypeError`` when ``messages`` is not a sequence of mappings.
    """
    checked: object = messages  # callers without type checking pass anything
    if isinstance(checked, (str, bytes)) or not isinstance(checked, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
    total = reply_priming
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"each message must be a mapping, got {type(message).__name__}")
        total += tokens_per_message + non_text_part_tokens * _media_parts(message)
        for key, value in message.items():
            for text in _message_text_parts(value):
                total += count(text)
            if key == "name":
                total += tokens_per_name
    return total


def _check_part_tokens(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"non_text_part_tokens must be an integer >= 0, got {value!r}")
    return value


def count_chat_request(
    counter: TokenCounter,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> int:
    """A chat request's prompt tokens, its ``tools`` passed to counters that render them.

    Counters that render the chat template (``accepts_tools = True``: from_pretrained, the
    server's ``/tokenize``) count the tool definitions as the template lays them out; the
    formula counters do not count them.
    """
    if tools is not None and getattr(counter, "accepts_tools", False):
        count: Callable[..., int] = counter.count_messages
        return count(messages, tools=tools)
    return counter.count_messages(messages)
