"""What engines do, as measured: which report progress in their streams, which share a request's
prompt among its sequences, what makes them run to the cap, what they do when a connection is
reset (pure)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "PROGRESS_ENGINES",
    "PROMPT_SHARING_ENGINES",
    "run_to_cap_fields",
    "runs_on_after_reset",
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
