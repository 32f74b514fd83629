"""The real models' chat templates: the traced-skeleton cache equals a full render, property-based.

For each model (Llama 3 and 3.1, Qwen3, Gemma 3, Mistral Nemo, DeepSeek-V3), hypothesis draws
conversations of every shape (system / user / assistant / tool turns in any order, names, tool
calls, tools, reasoning, list-of-parts content with media, empty and whitespace-padded content,
content that looks like ``<think>`` blocks or tool responses, the marker character itself) and
renders each, plus a sibling of the same shape with other contents, through one long-lived cached
template and through an uncached one: text, media count and rejections must be identical.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvclient import ChatTemplateError
from kvclient._chat_template import DEFAULT_CACHE_SHAPES, ChatTemplate
from kvclient._tokens import _model_template
from tests.helpers.real_tokenizers import MODELS, model_dir

pytest.importorskip("jinja2")

SPECIAL = [
    "",
    " ",
    "\n",
    "  padded  ",
    "\nlines\n\n",
    "<think>\nreason\n</think>\n\nanswer",
    "</think>tail",
    "<tool_response>\nout\n</tool_response>",
    "<tool_response>",
    "[INST]",
    "<|im_start|>",
    "\U000f0000\U000f0105\U000f0001",  # a well-formed marker, as content
    "漢字 🚀",
]
TEXT = st.one_of(
    st.sampled_from(SPECIAL),
    st.lists(st.sampled_from([*"ab <>/\n\t", "think", "\U000f0000"]), max_size=8).map("".join),
)
PART = st.one_of(
    TEXT.map(lambda t: {"type": "text", "text": t}),
    TEXT,
    st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
)
CONTENT = st.one_of(TEXT, st.none(), st.lists(PART, max_size=3))
CALL = st.builds(
    lambda name, args, call_id: {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": args},
    },
    st.sampled_from(["get_weather", "search"]),
    st.sampled_from(['{"city": "Paris"}', "{}", "not json", '{"q": [1, 2.5, true, null]}']),
    st.sampled_from(["abcdefghi", "call_1", "123456789"]),
)
TOOLS = st.one_of(
    st.none(),
    st.just(
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather for a city.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ]
    ),
)


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "user", "user", "assistant", "assistant", "tool"]))
    message: dict[str, Any] = {"role": role, "content": draw(CONTENT)}
    if draw(st.booleans()) and draw(st.booleans()):
        message["name"] = draw(st.sampled_from(["ann", "bob", "x\U000f0000"]))
    if role == "assistant" and draw(st.booleans()):
        message["tool_calls"] = draw(st.lists(CALL, min_size=1, max_size=2))
    if role == "assistant" and draw(st.booleans()) and draw(st.booleans()):
        message["reasoning_content"] = draw(TEXT)
    if role == "tool" and draw(st.booleans()):
        message["tool_call_id"] = draw(st.sampled_from(["abcdefghi", "short"]))
    return message


def _with_contents(messages: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
    """The same conversation with every string content replaced (shape kept: empty stays
    empty, non-empty stays non-empty)."""
    pool = iter(texts)

    def other(value: str) -> str:
        if not value:
            return value
        return next(pool, "z") or "z"

    out = []
    for message in messages:
        copy = dict(message)
        content = copy["content"]
        if isinstance(content, str):
            copy["content"] = other(content)
        elif isinstance(content, list):
            copy["content"] = [
                other(p)
                if isinstance(p, str)
                else {**p, "text": other(p["text"])}
                if p.get("type") == "text"
                else p
                for p in content
            ]
        out.append(copy)
    return out


_TEMPLATES: dict[str, tuple[ChatTemplate, ChatTemplate]] = {}


def _templates(model: str) -> tuple[ChatTemplate, ChatTemplate]:
    if model not in _TEMPLATES:
        # As from_pretrained loads it, without the tokenizer (rendering needs none).
        _, _, template = _model_template(model_dir(model), None, DEFAULT_CACHE_SHAPES)
        assert template is not None
        plain = ChatTemplate(
            template.source,
            special_tokens=template.special_tokens,
            content_format=template.content_format,
            cache_shapes=0,
        )
        _TEMPLATES[model] = (template, plain)
    return _TEMPLATES[model]


def _render(template: ChatTemplate, messages: Any, tools: Any) -> Any:
    try:
        return template.render(messages, tools=tools)
    except ChatTemplateError as exc:
        return ("rejected", str(exc))


@pytest.mark.parametrize("model", MODELS)
def test_cached_renders_equal_full_renders(model: str) -> None:
    cached, plain = _templates(model)
    before = cached.cache_info()

    @settings(
        max_examples=80,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        st.lists(_message(), min_size=1, max_size=6),
        TOOLS,
        st.lists(TEXT, min_size=8, max_size=8),
    )
    def check(messages: list[dict[str, Any]], tools: Any, others: list[str]) -> None:
        for conversation in (messages, _with_contents(messages, others), messages):
            assert _render(cached, conversation, tools) == _render(plain, conversation, tools)

    check()
    # Not vacuous: skeletons were replayed.
    assert cached.cache_info().hits > before.hits
