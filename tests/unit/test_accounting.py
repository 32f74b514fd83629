from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient import (
    ModelProfile,
    effective_output_cap,
    kv_bytes_per_token,
    reservation_bytes,
    reservation_tokens,
    round_up_to_blocks,
    sequences_reservation_tokens,
    shared_prompt_tokens,
)


@pytest.mark.parametrize(
    ("layers", "kv_heads", "head_dim", "expected"),
    [
        (32, 8, 128, 131_072),  # Llama-3.1-8B
        (80, 8, 128, 327_680),  # Llama-3.1-70B
        (28, 4, 128, 57_344),  # Qwen2.5-7B
    ],
)
def test_kv_bytes_per_token_published_models(
    layers: int, kv_heads: int, head_dim: int, expected: int
) -> None:
    assert kv_bytes_per_token(layers, kv_heads, head_dim) == expected


def test_kv_bytes_per_token_uses_bytes_per_element() -> None:
    assert kv_bytes_per_token(32, 8, 128, bytes_per_element=1) == 65_536  # fp8 cache


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", None, True])
def test_kv_bytes_per_token_rejects_bad_numbers(bad: object) -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(32, bad, 128)  # type: ignore[arg-type]


def test_seed_reservations() -> None:
    # The seed post's numbers: the short prompt is the bigger promise.
    assert reservation_tokens(200, 4000) == 4200
    assert reservation_tokens(3000, 200) == 3200


def test_seed_unset_cap_means_rest_of_context() -> None:
    assert effective_output_cap(None, 200, 8192) == 7992


def test_seed_prompt_over_context_is_rejected() -> None:
    assert effective_output_cap(None, 9000, 8192) is None
    assert effective_output_cap(100, 9000, 8192) is None
    assert effective_output_cap(100, 8192, 8192) is None


def test_cap_is_clamped_to_what_remains() -> None:
    assert effective_output_cap(4000, 6000, 8192) == 2192
    assert effective_output_cap(100, 200, 8192) == 100
    assert effective_output_cap(1, 8191, 8192) == 1


@pytest.mark.parametrize(
    ("requested", "prompt", "context", "match"),
    [
        (0, 10, 100, "max_tokens must be >= 1"),
        (-5, 10, 100, "max_tokens"),
        (1.5, 10, 100, "max_tokens must be an integer"),
        (10, -1, 100, "prompt_tokens"),
        (10, 10, 0, "context_window"),
        ("10", 10, 100, "max_tokens must be an integer"),
        (True, 10, 100, "max_tokens must be an integer"),
    ],
)
def test_effective_output_cap_rejects_invalid(
    requested: object, prompt: object, context: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        effective_output_cap(requested, prompt, context)  # type: ignore[arg-type]


@given(
    requested=st.none() | st.integers(min_value=1, max_value=10**9),
    prompt=st.integers(min_value=0, max_value=10**7),
    context=st.integers(min_value=1, max_value=10**7),
)
def test_effective_cap_properties(requested: int | None, prompt: int, context: int) -> None:
    cap = effective_output_cap(requested, prompt, context)
    if prompt >= context:
        assert cap is None
        return
    assert cap is not None
    assert 1 <= cap <= context - prompt
    if requested is not None and requested <= context - prompt:
        assert cap == requested
    if requested is None:
        assert cap == context - prompt


@given(
    requested=st.one_of(st.none(), st.integers()),
    prompt=st.integers(),
    context=st.integers(),
)
def test_effective_cap_over_all_integers_returns_or_raises_value_error(
    requested: int | None, prompt: int, context: int
) -> None:
    try:
        cap = effective_output_cap(requested, prompt, context)
    except ValueError:
        assert (requested is not None and requested < 1) or prompt < 0 or context < 1
        return
    assert cap is None or 1 <= cap <= context - prompt


def test_round_up_to_blocks() -> None:
    assert round_up_to_blocks(0, 16) == 0
    assert round_up_to_blocks(1, 16) == 16
    assert round_up_to_blocks(16, 16) == 16
    assert round_up_to_blocks(4200, 16) == 4208


def test_sequences_are_priced_each_in_blocks_of_its_own() -> None:
    # vLLM V1 runs n as n child requests: with its prefix cache on they share the prompt's full
    # blocks and each keeps its partial last block; without it, n whole copies.
    def price(prompt: int, shared: bool) -> int:
        return sequences_reservation_tokens(
            prompt, 100, sequences=8, block_size=16, shared_prompt=shared
        )

    assert price(1000, True) == 62 * 16 + 8 * 7 * 16 == 1888
    assert price(1000, False) == 8 * 69 * 16 == 8832
    # A prompt of whole blocks: its last block is computed by each child (the engine computes
    # at least the last prompt token itself).
    assert shared_prompt_tokens(1024, 16) == 1008
    assert price(1024, True) == 1008 + 8 * round_up_to_blocks(16 + 100, 16)
    # One sequence: the plain reservation in whole blocks, whatever the sharing.
    for shared in (True, False):
        assert sequences_reservation_tokens(
            1000, 100, block_size=16, shared_prompt=shared
        ) == reservation_tokens(1000, 100, block_size=16)


def test_reservation_bytes_in_blocks() -> None:
    assert reservation_bytes(200, 4000, 131_072) == 4200 * 131_072
    assert reservation_bytes(200, 4000, 131_072, block_size=16) == 4208 * 131_072


@given(
    prompt=st.integers(min_value=0, max_value=10**6),
    cap=st.integers(min_value=0, max_value=10**6),
    block=st.integers(min_value=1, max_value=256),
)
def test_block_rounding_never_under_reserves(prompt: int, cap: int, block: int) -> None:
    tokens = reservation_tokens(prompt, cap, block_size=block)
    assert tokens % block == 0
    assert prompt + cap <= tokens < prompt + cap + block


def test_model_presets() -> None:
    llama8 = ModelProfile.preset("Llama-3.1-8B")
    assert llama8.kv_bytes_per_token == 131_072
    assert llama8.context_window == 131_072
    assert ModelProfile.preset("llama-3.1-70b").kv_bytes_per_token == 327_680
    assert ModelProfile.preset("qwen2.5-7b").kv_bytes_per_token == 57_344
    assert ModelProfile.preset("mistral-7b").context_window == 32_768
    assert llama8.reservation_bytes(200, 4000) == 4208 * 131_072
    assert llama8.tokens_for_bytes(131_072 * 10 + 5) == 10


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"llama-3\.1-8b"):
        ModelProfile.preset("gpt-5")


def test_model_profile_is_frozen_and_validated() -> None:
    profile = ModelProfile("m", 8192, 1024)
    with pytest.raises(AttributeError):
        profile.context_window = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="context_window"):
        ModelProfile("m", 0, 1024)
