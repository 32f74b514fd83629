"""KV-cache accounting: pure arithmetic, no I/O.

A request's KV-cache footprint is bounded by the context it may reach, which is its prompt *plus*
its output cap, not the prompt alone. These functions price that worst case; the client uses them to
clamp ``max_tokens`` and the reference server's ledger uses them to reserve memory.

>>> kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128)   # Llama-3.1-8B, fp16
131072
>>> effective_output_cap(None, prompt_tokens=200, context_window=8192)
7992
>>> reservation_tokens(200, 4000)
4200
>>> sequences_reservation_tokens(1000, 100, sequences=8, block_size=16, shared_prompt=True)
1888
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ModelProfile",
    "effective_output_cap",
    "kv_bytes_per_token",
    "reservation_bytes",
    "reservation_tokens",
    "round_up_to_blocks",
    "sequences_reservation_tokens",
    "shared_prompt_tokens",
]

#: vLLM and TGI page the KV cache in blocks of 16 tokens.
DEFAULT_BLOCK_SIZE = 16


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if type(value) is int and value >= minimum:  # the common case, first
        return value
    # bool is an int subclass; True as a token count is always a bug on the caller's side.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not isinstance(value, int):
        try:
            value = operator.index(value)  # type: ignore[arg-type]  # numpy integers and other true integers
        except TypeError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int = 2
) -> int:
    """Bytes of KV cache one token occupies: keys and values, in every layer.

    Uses the number of *KV* heads, not query heads: grouped-query attention shares each KV head
    across several query heads, which shrinks the cache 4-8x against the naive formula.
    """
    num_layers = _check_int("num_layers", num_layers, minimum=1)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = _check_int("head_dim", head_dim, minimum=1)
    bytes_per_element = _check_int("bytes_per_element", bytes_per_element, minimum=1)
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def effective_output_cap(
    requested_max_output: int | None, prompt_tokens: int, context_window: int
) -> int | None:
    """The output cap a request is really allowed to reach.

    An unset cap (``None``) means "up to the context window", the largest promise a request can
    make, so it becomes ``context_window - prompt_tokens``. A larger cap is clamped to that. When
    the prompt alone fills the context the answer is ``None``: reject, never truncate silently.
    """
    prompt_tokens = _check_int("prompt_tokens", prompt_tokens, minimum=0)
    context_window = _check_int("context_window", context_window, minimum=1)
    if requested_max_output is not None:
        requested_max_output = _check_int("max_tokens", requested_max_output, minimum=1)
    remaining = context_window - prompt_tokens
    if remaining <= 0:
        return None
    if requested_max_output is None:
        return remaining
    return min(requested_max_output, remaining)


def round_up_to_blocks(tokens: int, block_size: int) -> int:
    """Round a token count up to whole KV blocks (a paged cache allocates by the block)."""
    tokens = _check_int("tokens", tokens, minimum=0)
    block_size = _check_int("block_size", block_size, minimum=1)
    return -(-tokens // block_size) * block_size


def reservation_tokens(
    prompt_tokens: int, output_cap: int, *, block_size: int | None = None
) -> int:
    """The worst case a request may reach: prompt + output cap, optionally in whole blocks."""
    prompt_tokens = _check_int("prompt_tokens", prompt_tokens, minimum=0)
    output_cap = _check_int("output_cap", output_cap, minimum=0)
    tokens = prompt_tokens + output_cap
    return tokens if block_size is None else round_up_to_blocks(tokens, block_size)


def shared_prompt_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens that sequences of one request can share through a prefix cache: the
    full blocks before its last token (an engine computes at least that token itself, so a
    prompt of exactly whole blocks shares one block less).

    >>> shared_prompt_tokens(1000, 16), shared_prompt_tokens(1024, 16), shared_prompt_tokens(16, 16)
    (992, 1008, 0)
    """
    prompt_tokens = _check_int("prompt_tokens", prompt_tokens, minimum=0)
    block_size = _check_int("block_size", block_size, minimum=1)
    return max(0, prompt_tokens - 1) // block_size * block_size


def sequences_reservation_tokens(
    prompt_tokens: int,
    output_cap: int,
    *,
    sequences: int = 1,
    block_size: int = 1,
    shared_prompt: bool = False,
) -> int:
    """The worst case of a request generating ``sequences`` sequences, in whole blocks, as an
    engine that runs each as a request of its own holds it (vLLM V1: ``n`` child requests).

    Each sequence holds its prompt and output cap in blocks of its own; with ``shared_prompt``
    (the engine's prefix cache is on) the prompt's full blocks before its last token
    (:func:`shared_prompt_tokens`) are held once for all, and each sequence keeps its own
    partial last block. One sequence is :func:`reservation_tokens` in whole blocks.

    >>> sequences_reservation_tokens(1000, 100, sequences=8, block_size=16)   # no prefix cache
    8832
    """
    prompt_tokens = _check_int("prompt_tokens", prompt_tokens, minimum=0)
    output_cap = _check_int("output_cap", output_cap, minimum=0)
    sequences = _check_int("sequences", sequences, minimum=1)
    shared = shared_prompt_tokens(prompt_tokens, block_size) if shared_prompt else 0
    own = round_up_to_blocks(prompt_tokens - shared + output_cap, block_size)
    return shared + sequences * own


def reservation_bytes(
    prompt_tokens: int,
    output_cap: int,
    per_token_bytes: int,
    *,
    block_size: int | None = None,
) -> int:
    """Bytes to reserve for a request: :func:`reservation_tokens` x per-token KV bytes."""
    per_token_bytes = _check_int("per_token_bytes", per_token_bytes, minimum=1)
    return reservation_tokens(prompt_tokens, output_cap, block_size=block_size) * per_token_bytes


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What admission control needs to know about a model.

    Build one from the architecture numbers with :meth:`from_architecture`, or take a preset:

    >>> ModelProfile.preset("llama-3.1-8b").kv_bytes_per_token
    131072
    """

    name: str
    context_window: int
    kv_bytes_per_token: int
    block_size: int = DEFAULT_BLOCK_SIZE

    PRESETS: ClassVar[dict[str, ModelProfile]]

    def __post_init__(self) -> None:
        _check_int("context_window", self.context_window, minimum=1)
        _check_int("kv_bytes_per_token", self.kv_bytes_per_token, minimum=1)
        _check_int("block_size", self.block_size, minimum=1)

    @classmethod
    def from_architecture(
        cls,
        name: str,
        *,
        context_window: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        bytes_per_element: int = 2,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> ModelProfile:
        per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_element)
        return cls(name, context_window, per_token, block_size)

    @classmethod
    def preset(cls, name: str) -> ModelProfile:
        """A profile for a popular open model, by name (case-insensitive)."""
        try:
            return cls.PRESETS[name.lower()]
        except KeyError:
            known = ", ".join(sorted(cls.PRESETS))
            raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None

    def reservation_bytes(self, prompt_tokens: int, output_cap: int) -> int:
        """Bytes to reserve for ``prompt_tokens + output_cap``, in whole blocks."""
        return reservation_bytes(
            prompt_tokens, output_cap, self.kv_bytes_per_token, block_size=self.block_size
        )

    def tokens_for_bytes(self, kv_bytes: int) -> int:
        """How many tokens of KV cache fit in ``kv_bytes`` (rounded down)."""
        return math.floor(kv_bytes / self.kv_bytes_per_token)


# Architecture numbers from each model's published config.json (fp16/bf16 KV cache).
ModelProfile.PRESETS = {
    p.name: p
    for p in (
        ModelProfile.from_architecture(
            "llama-3.1-8b", context_window=131072, num_layers=32, num_kv_heads=8, head_dim=128
        ),
        ModelProfile.from_architecture(
            "llama-3.1-70b", context_window=131072, num_layers=80, num_kv_heads=8, head_dim=128
        ),
        ModelProfile.from_architecture(
            "mistral-7b", context_window=32768, num_layers=32, num_kv_heads=8, head_dim=128
        ),
        ModelProfile.from_architecture(
            "qwen2.5-7b", context_window=32768, num_layers=28, num_kv_heads=4, head_dim=128
        ),
    )
}
