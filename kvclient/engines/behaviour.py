"""What engines do, as measured: which report progress in their streams, which share a request's
prompt among its sequences, what keys their prefix caches, what makes them run to the cap, what
they do when a connection is reset (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "PREFIX_SALT_FIELD",
    "PROGRESS_ENGINES",
    "PROMPT_SHARING_ENGINES",
    "prefix_salt",
    "run_to_cap_fields",
    "runs_on_after_reset",
    "streams_as_asked",
    "text_only",
]

#: Engines whose streams report, in every chunk, how many tokens the request has generated so
#: far, when asked with ``stream_options: {"include_usage": true, "continuous_usage_stats":
#: true}``: vLLM's OpenAI server, and ours. The gateway's peak rule follows each holder's
#: progress from them; other engines' holders count at their whole caps.
PROGRESS_ENGINES = frozenset({"vllm", "kvclient"})

#: Engines whose sequences of one request share the prompt's full KV blocks through their
#: prefix cache, when it is on (vLLM V1 runs ``n`` as ``n`` child requests that each keep their
#: own partial last block; SGLang's radix cache); elsewhere, or with the prefix cache off
#: (llama.cpp runs each in a slot of its own), each sequence holds its own prompt.
PROMPT_SHARING_ENGINES = frozenset({"vllm", "sglang"})


#: Fields that make each engine generate up to the cap instead of stopping at its end-of-sequence
#: token: vLLM's and SGLang's ``ignore_eos`` and ``min_tokens``, llama.cpp's ``ignore_eos`` (its
_RUN_TO_CAP_FIELDS: dict[str, tuple[str, ...]] = {
    "vllm": ("ignore_eos", "min_tokens"),
    "sglang": ("ignore_eos", "min_tokens"),
    "llama.cpp": ("ignore_eos",),
    "tgi": (),
    "ollama": (),
}


def run_to_cap_fields(engine: str | None, cap: int) -> dict[str, Any]:
    """Body fields that make ``engine`` generate all of ``cap`` tokens, however early its model
    would stop: for load that must really fill a KV cache. An engine not known here gets vLLM's
    (the dialect our servers speak too); other engines ignore fields they do not know.

    >>> run_to_cap_fields("vllm", 64)
    {'ignore_eos': True, 'min_tokens': 64}
    """
    names = _RUN_TO_CAP_FIELDS.get(engine or "vllm", _RUN_TO_CAP_FIELDS["vllm"])
    values: dict[str, Any] = {"ignore_eos": True, "min_tokens": cap}
    return {name: values[name] for name in names}


#: Engines that go on generating a request whose connection was reset, as measured: llama.cpp
#: stops a stream at its next token, but runs a plain (non-streamed) request to its end.
_RUNS_ON_AFTER_RESET: dict[str, frozenset[bool]] = {"llama.cpp": frozenset({False})}


def runs_on_after_reset(engine: str | None, *, stream: bool) -> bool:
    """Whether ``engine`` keeps generating a request (streamed or not) after its connection is
    reset: then the KV it holds is freed only when it finishes."""
    return stream in _RUNS_ON_AFTER_RESET.get(engine or "", frozenset())


#: The request field that salts an engine's prefix-cache keys (vLLM's ``cache_salt``): requests
#: with different salts, or one with a salt and one without, never share a block.
PREFIX_SALT_FIELD = "cache_salt"

#: Fields of a completion request that put something other than text in the prompt (vLLM's
#: ``prompt_embeds`` and ``multi_modal_data``).
_NON_TEXT_FIELDS = ("prompt_embeds", "multi_modal_data")


def prefix_salt(body: Mapping[str, Any]) -> str | None:
    """The salt an engine mixes into the prefix-cache keys of ``body``'s prompt, or None.

    >>> prefix_salt({"cache_salt": "tenant-a"}), prefix_salt({})
    ('tenant-a', None)
    """
    salt = body.get(PREFIX_SALT_FIELD)
    return None if salt is None else str(salt)


def text_only(body: Mapping[str, Any]) -> bool:
    """Whether the prompt of ``body`` is text alone (messages whose parts are all ``text``, no
    embeddings or multimodal data). Only then do equal token ids mean equal KV: an engine's
    token ids stand for an image, audio, a video or a file by placeholder tokens that are the
    same for different contents (vLLM keys those blocks by the part's own hash as well).

    >>> text_only({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    True
    >>> text_only({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    False
    """
    if any(body.get(name) is not None for name in _NON_TEXT_FIELDS):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and not all(
            isinstance(part, Mapping) and part.get("type") == "text" for part in content
        ):
            return False
    return True


#: Fields an engine refuses in a stream request when set (vLLM: "prompt_logprobs are not
#: available when stream is enabled", for any value but 0 and null).
_PLAIN_ONLY_FIELDS = ("prompt_logprobs",)


def streams_as_asked(body: Mapping[str, Any]) -> bool:
    """Whether a plain request may go to the engine as a stream (its plain answer assembled
    from it): not when it sets a field engines take only in a plain request.

    >>> streams_as_asked({"prompt": "x"}), streams_as_asked({"prompt_logprobs": 1})
    (True, False)
    """
    return all(body.get(name) in (None, 0) for name in _PLAIN_ONLY_FIELDS)
