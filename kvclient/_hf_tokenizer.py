"""The Hugging Face counter: :class:`HuggingFaceCounter` and what it reads from a model directory.

``HuggingFaceCounter.from_pretrained(model_dir)`` counts exactly what a vLLM-style server counts:
the model's own chat template rendered (see ``_chat_template``), then tokenized without adding
special tokens again; raw prompts with the BOS the server's ``/tokenize`` adds. The template is
found where models keep it (``chat_template.jinja``, ``chat_template.json``, the tokenizer
config), and tiktoken's encoder stands in for ``tokenizers`` where it gives the same ids (see
``_fast_bpe``). A bare ``tokenizer.json`` estimates chats with OpenAI's per-message formula
(``_tokens.count_chat_tokens``). Needs the optional ``hf`` extra (``tokenizers``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._chat_template import ChatTemplate
from ._exceptions import ChatTemplateError, TokenizerError
from ._fast_bpe import FastBPE, agrees, fast_bpe
from ._tokens import (
    DEFAULT_NON_TEXT_PART_TOKENS,
    REPLY_PRIMING_TOKENS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    Message,
    _check_part_tokens,
    count_chat_tokens,
)

__all__ = ["HuggingFaceCounter"]


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
