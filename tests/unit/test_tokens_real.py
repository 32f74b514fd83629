"""Exact counts with real open models' tokenizers, against ``transformers`` as the reference.

For each model (Llama 3 and 3.1, Qwen3, Gemma 3, Mistral Nemo, DeepSeek-V3):

- raw prompts: ``count`` equals the length of what ``AutoTokenizer(text)`` encodes (the BOS a
  server's ``/tokenize`` adds included) on 320 varied texts;
- chats: ``count_messages`` (and ``encode_messages`` id for id) equals
  ``apply_chat_template(..., tokenize=True, add_generation_prompt=True)`` on 110 varied
  conversations, the messages given to the reference as vLLM prepares them (list-of-parts joined
  with newlines, or kept as text parts for a template that iterates over them); a conversation
  the template rejects raises ``ChatTemplateError`` here and an error there.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from kvclient import ChatTemplateError
from tests.helpers import tokenizer_corpus as corpus
from tests.helpers.real_tokenizers import MODELS, counter, reference_tokenizer

#: What vLLM detects for each template: only Gemma 3's iterates over content parts.
CONTENT_FORMAT = dict.fromkeys(MODELS, "string") | {"gemma3": "openai"}
#: Models whose templates render tool calls and tool results (the others get no tool turns).
TOOL_MODELS = {"qwen3", "mistral_nemo", "deepseek_v3"}
#: Models whose templates refuse roles that do not alternate.
STRICT_ROLES = {"gemma3", "mistral_nemo"}

#: Models whose raw prompts start with a BOS (post-processor or add_bos_token).
BOS_MODELS = {"llama3_1", "gemma3", "mistral_nemo", "deepseek_v3"}

TEXTS = corpus.texts()


def _as_vllm_prepares(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` restated for the corpus's messages (text parts only)."""
    out = []
    for message in messages:
        content = message.get("content")
        texts = (
            []
            if content is None
            else [content]
            if isinstance(content, str)
            else [p["text"] for p in content]
        )
        role = message["role"]
        copy: dict[str, Any] = {"role": role}
        if fmt == "openai" and role != "tool":
            copy["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            copy["content"] = "\n".join(texts)
        if message.get("tool_calls"):
            copy["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
        for key in ("tool_call_id", "name"):
            if key in message:
                copy[key] = message[key]
        out.append(copy)
    return out


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_corpus_is_large_and_varied() -> None:
    conversations = corpus.conversations()
    assert len(TEXTS) >= 300
    assert len(set(TEXTS)) >= 295
    assert sum(len(text) >= 2048 for text in TEXTS) >= 20  # the counters' fast path
    assert len(conversations) >= 100
    flat = [m for messages, _ in conversations for m in messages]
    assert any("name" in m for m in flat)
    assert any(isinstance(m.get("content"), list) for m in flat)
    assert any(m["role"] == "system" for m in flat)
    assert any(m.get("tool_calls") for m in flat)
    assert sum(len(messages) > 3 for messages, _ in conversations) > 20


def test_raw_prompts_count_as_the_server_tokenizes(model: str) -> None:
    ours = counter(model)
    reference = reference_tokenizer(model)
    counts = [(text, ours.count(text), len(reference.encode(text))) for text in TEXTS]
    assert [c for c in counts if c[1] != c[2]] == []
    # Not vacuous: the BOS the server adds is counted where the model adds one.
    assert ours.count("") == (1 if model in BOS_MODELS else 0)


def test_chats_count_as_the_chat_template_renders(model: str) -> None:
    ours = counter(model)
    reference = reference_tokenizer(model)
    assert ours.chat_template is not None
    assert ours.chat_template.content_format == CONTENT_FORMAT[model]
    compared = rejected = 0
    mismatches = []
    reasons: set[str] = set()
    for messages, tools in corpus.conversations(tools=model in TOOL_MODELS):
        prepared = _as_vllm_prepares(messages, CONTENT_FORMAT[model])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = reference.apply_chat_template(
                    prepared, tools=tools, tokenize=True, add_generation_prompt=True
                )
        except Exception as exc:  # jinja2's TemplateError and whatever a template trips on
            reference_error = str(exc)
        else:
            reference_error = None
        if reference_error is not None:
            with pytest.raises(ChatTemplateError, match="rejects this conversation"):
                ours.count_messages(messages, tools=tools)
            rejected += 1
            reasons.add(reference_error)
            continue
        compared += 1
        count = ours.count_messages(messages, tools=tools)
        if count != len(expected) or ours.encode_messages(messages, tools=tools) != expected:
            mismatches.append((messages, count, len(expected)))
    assert mismatches == []
    assert compared >= 90
    if model in STRICT_ROLES:
        assert rejected >= 8
        assert any("alternate" in reason for reason in reasons)
    else:
        assert rejected == 0
