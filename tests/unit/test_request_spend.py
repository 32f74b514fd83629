"""What a request may make an engine hold, read from every engine's field names at once."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient.engines.spend import LENGTH_FIELDS, Spend, SpendError, request_spend
from kvclient.engines.tokenize import countable_render_fields
from reference_server.gateway.rewrite import with_cap


@pytest.mark.parametrize(
    ("body", "spend"),
    [
        ({}, Spend(None, 1)),
        ({"max_tokens": 8}, Spend(8, 1)),
        ({"max_tokens": 8, "n_predict": 300}, Spend(300, 1)),  # llama.cpp obeys n_predict
        ({"max_tokens": 8, "n_predict": -1}, Spend(None, 1)),  # -1: until the context is full
        ({"n_predict": 0}, Spend(None, 1)),
        ({"max_completion_tokens": 40, "max_tokens": 10}, Spend(40, 1)),
        ({"max_new_tokens": 12}, Spend(12, 1)),
        ({"max_tokens": 1e3}, Spend(1000, 1)),
        ({"n": 4}, Spend(None, 4)),
        ({"n_cmpl": 3, "max_tokens": 5}, Spend(5, 3)),  # llama.cpp's alias of n
        ({"n": 2, "best_of": 5}, Spend(None, 5)),  # vLLM generates best_of, returns n
        ({"use_beam_search": False, "n": 1}, Spend(None, 1)),
    ],
)
def test_the_largest_cap_and_sequence_count_any_field_allows(
    body: dict[str, Any], spend: Spend
) -> None:
    assert request_spend(body) == spend


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n_cmpl": [2]}, "n_cmpl"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"beam_width": 4}, "beam_width"),
    ],
)
def test_what_cannot_be_priced_is_refused_by_name(body: dict[str, Any], field: str) -> None:
    with pytest.raises(SpendError) as raised:
        request_spend(body)
    assert raised.value.field == field
    assert field in str(raised.value)


def test_render_fields_each_engines_count_can_take() -> None:
    assert countable_render_fields("vllm", ["chat_template", "chat_template_kwargs"]) is None
    assert countable_render_fields("vllm", ["chat_template", "documents"]) == "documents"
    assert countable_render_fields("llama.cpp", ["documents"]) is None
    assert countable_render_fields("tgi", ["chat_template"]) == "chat_template"
    assert countable_render_fields(None, ["add_generation_prompt"]) == "add_generation_prompt"


caps = st.integers(1, 10**6)
lengths = st.dictionaries(
    st.sampled_from(LENGTH_FIELDS), st.one_of(caps, st.integers(-2, 0)), max_size=4
)
others = st.dictionaries(st.sampled_from(["prompt", "n", "stream", "x"]), st.integers(1, 5))


@given(lengths=lengths, others=others, cap=caps)
def test_every_length_field_goes_upstream_as_the_reserved_cap(
    lengths: dict[str, int], others: dict[str, int], cap: int
) -> None:
    """Whatever field an engine obeys, it reads the cap that was reserved; nothing else moves."""
    body = {**others, **lengths}
    forwarded = json.loads(with_cap(json.dumps(body).encode(), body, cap))
    for name in LENGTH_FIELDS:
        if name in body:
            assert forwarded[name] == cap
    if not lengths:
        assert forwarded["max_tokens"] == cap
    assert {k: v for k, v in forwarded.items() if k not in LENGTH_FIELDS} == others
