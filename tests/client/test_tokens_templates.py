"""Chat templates, model directories, media parts and the additive margin, on small local files.

The real models' tokenizers are compared with transformers in test_tokens_real.py; these tests
pin the rules themselves on tokenizers built here.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvclient import (
    ChatTemplateError,
    Client,
    HuggingFaceCounter,
    PromptTooLongError,
    TiktokenCounter,
    TokenizerError,
)
from kvclient._chat_template import ChatTemplate, detect_content_format
from kvclient._tokens import DEFAULT_NON_TEXT_PART_TOKENS, count_chat_request
from tests.helpers.client import CONTEXT, COUNTER, FakeServer, make_client, new_server, ok_chat

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

VOCAB = ["<bos>", "<eos>", "<unk>", "<turn>", "user", "assistant", "system", "hello", "world"]
STRING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<turn>{{ message['role'] }} "
    "{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}<turn>assistant{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{{ part['text'] }};{% endfor %}{% endfor %}"
)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 30_000}}


def _tokenizer(*, bos_in_post_processor: bool) -> Any:
    from tokenizers import models, pre_tokenizers, processors

    tok = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>", "<eos>", "<turn>"])
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 0)]
        )
    return tok


def _model_dir(
    tmp_path: Path,
    *,
    config: dict[str, Any] | None = None,
    bos_in_post_processor: bool = False,
    jinja: str | None = None,
) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    _tokenizer(bos_in_post_processor=bos_in_post_processor).save(str(tmp_path / "tokenizer.json"))
    base: dict[str, Any] = {"bos_token": "<bos>", "eos_token": "<eos>"}
    base.update(config or {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(base))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


# --- the template's content format --------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (STRING_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        (
            "{% for m in messages[1:] %}{% for p in m.content %}{{ p.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        (
            "{% set loop_messages = messages %}{% for m in loop_messages %}"
            "{% for p in m['content'] | list %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # A loop over something merely assigned from content is not a parts loop (vLLM's rule).
        (
            "{% for m in messages %}{% set c = m.content %}{% for x in c %}{{ x }}{% endfor %}"
            "{% endfor %}",
            "string",
        ),
        (
            "{% for m in messages %}{% for t in m['tool_calls'] %}{{ t }}{% endfor %}{% endfor %}",
            "string",
        ),
    ],
)
def test_content_format_follows_vllms_detection(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_list_of_parts_is_joined_for_string_templates_and_kept_for_parts_templates() -> None:
    parts = [{"type": "text", "text": "a"}, "b", IMAGE, {"type": "text", "text": "c"}]
    string = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert string.render([{"role": "user", "content": parts}]) == ("[a\nb\nc]", 1)
    kept = ChatTemplate(PARTS_TEMPLATE)
    assert kept.render([{"role": "user", "content": parts}]) == ("a;b;c;", 1)
    # A string is one text part to a parts template, and None no part at all.
    assert kept.render([{"role": "user", "content": "x"}, {"role": "user", "content": None}]) == (
        "x;",
        0,
    )


def test_messages_reach_the_template_as_vllm_passes_them() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m | tojson }}\n{% endfor %}")
    messages = [
        {"role": "user", "content": "hé <b>", "name": "zoë", "extra": "dropped"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "ok"}]},
    ]
    lines = template.render(messages)[0].splitlines()
    assert [json.loads(line) for line in lines] == [
        {"role": "user", "content": "hé <b>", "name": "zoë"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "1"},
    ]
    # HF's tojson: no HTML escaping, non-ASCII kept.
    assert lines[0].startswith('{"role": "user", "content": "hé <b>"')


def test_tools_special_tokens_and_strftime_reach_the_template() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% if tools %}{{ tools | length }} tools{% endif %}"
        "{{ strftime_now('%Y') | length }}",
        special_tokens={"bos_token": "<bos>"},
    )
    assert template.render([], tools=[{"type": "function"}])[0] == "<bos>1 tools4"
    assert template.render([])[0] == "<bos>4"


def test_a_template_that_rejects_the_conversation_raises_a_clear_error() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system role here') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="rejects this conversation: no system role here"):
        template.render([{"role": "system", "content": "x"}])
    # The sandbox holds: reaching into Python internals is refused, not executed.
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.render([])
    with pytest.raises(TokenizerError, match="does not parse"):
        ChatTemplate("{% for %}")
    with pytest.raises(TypeError):
        template.render("not a list")  # type: ignore[arg-type]


# --- model directories ----------------------------------------------------------------------------


def test_from_pretrained_renders_the_template_and_adds_no_special_token_twice(
    tmp_path: Path,
) -> None:
    directory = _model_dir(
        tmp_path, config={"chat_template": STRING_TEMPLATE}, bos_in_post_processor=True
    )
    counter = HuggingFaceCounter.from_pretrained(directory)
    messages = [{"role": "user", "content": "hello world"}]
    # <bos> <turn> user hello world <turn> assistant: one BOS, from the template only.
    assert counter.encode_messages(messages) == [0, 3, 4, 7, 8, 3, 5]
    assert counter.count_messages(messages) == 7
    assert counter.count("hello") == 2  # the post-processor's BOS
    assert counter.count("") == 1
    assert counter.encode("hello") == [7]  # ids of the text alone (the engine's words)


def test_add_bos_token_counts_the_bos_a_post_processor_does_not_add(tmp_path: Path) -> None:
    plain = HuggingFaceCounter.from_pretrained(_model_dir(tmp_path / "a", config={}))
    assert plain.count("hello") == 1
    flagged = HuggingFaceCounter.from_pretrained(
        _model_dir(tmp_path / "b", config={"add_bos_token": True})
    )
    assert flagged.count("hello") == 2
    assert flagged.count("") == 1
    both = HuggingFaceCounter.from_pretrained(
        _model_dir(tmp_path / "c", config={"add_bos_token": True}, bos_in_post_processor=True)
    )
    assert both.count("hello") == 2  # not three: the post-processor's BOS is the one
    eos = HuggingFaceCounter.from_pretrained(
        _model_dir(
            tmp_path / "d",
            config={"add_bos_token": True, "add_eos_token": True},
            bos_in_post_processor=True,
        )
    )
    assert eos.count("hello") == 3  # the post-processor's BOS, the config's EOS


def test_chat_template_files_take_precedence_over_the_config(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "{{ 'default' }}"}, {"name": "x", "template": "x"}]
    from_config = HuggingFaceCounter.from_pretrained(
        _model_dir(tmp_path / "a", config={"chat_template": named})
    )
    assert from_config.render([])[0] == "default"
    directory = _model_dir(
        tmp_path / "b", config={"chat_template": "config"}, jinja="{{ 'jinja file' }}"
    )
    assert HuggingFaceCounter.from_pretrained(directory).render([])[0] == "jinja file"
    (tmp_path / "b" / "chat_template.jinja").unlink()
    (tmp_path / "b" / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert HuggingFaceCounter.from_pretrained(directory).render([])[0] == "json"
    override = HuggingFaceCounter.from_pretrained(directory, chat_template="override")
    assert override.render([])[0] == "override"


def test_from_pretrained_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no model directory"):
        HuggingFaceCounter.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        HuggingFaceCounter.from_pretrained(tmp_path)
    directory = _model_dir(tmp_path / "bare", config={})
    counter = HuggingFaceCounter.from_pretrained(directory)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        counter.count_messages([{"role": "user", "content": "hello"}])
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        HuggingFaceCounter.from_pretrained(directory)


# --- media parts ----------------------------------------------------------------------------------


def test_media_parts_cost_a_stated_amount_never_their_url_characters(tmp_path: Path) -> None:
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    with_image = [{"role": "user", "content": [{"type": "text", "text": "hello world"}, IMAGE]}]
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"x" * 9000).decode()}}
    with_both = [{"role": "user", "content": [IMAGE, audio, {"type": "text", "text": "hello"}]}]

    tiktoken = TiktokenCounter()
    assert DEFAULT_NON_TEXT_PART_TOKENS == 576
    assert tiktoken.count_messages(with_image) == (
        tiktoken.count_messages(text_only) + DEFAULT_NON_TEXT_PART_TOKENS
    )
    cheap = TiktokenCounter(non_text_part_tokens=100)
    assert (
        cheap.count_messages(with_both)
        == cheap.count_messages([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
        + 200
    )

    directory = _model_dir(tmp_path, config={"chat_template": STRING_TEMPLATE})
    hf = HuggingFaceCounter.from_pretrained(directory, non_text_part_tokens=256)
    assert hf.count_messages(with_image) == hf.count_messages(text_only) + 256
    formula = HuggingFaceCounter(str(directory / "tokenizer.json"), non_text_part_tokens=10)
    assert formula.count_messages(with_image) == formula.count_messages(text_only) + 10
    with pytest.raises(ValueError, match="non_text_part_tokens"):
        TiktokenCounter(non_text_part_tokens=-1)


def test_a_large_image_no_longer_fills_a_small_context() -> None:
    """The issue's case: a 30 KB data: URL was 28,650 tokens of base64 against a 4,096 window."""
    server = new_server(default=ok_chat())
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]
    with make_client(server, context_window=4096) as client:
        result = client.chat(messages, max_tokens=100)
    assert result.max_tokens == 100
    assert result.prompt_tokens < 700


# --- tools and the additive margin ----------------------------------------------------------------


def test_tools_reach_counters_that_render_them_only(tmp_path: Path) -> None:
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}x{% endfor %}"
    directory = _model_dir(tmp_path, config={"chat_template": template})
    hf = HuggingFaceCounter.from_pretrained(directory)
    tools = [{"type": "function", "function": {"name": "hello"}}]
    messages = [{"role": "user", "content": "hi"}]
    assert count_chat_request(hf, messages, tools) > count_chat_request(hf, messages)
    tiktoken = TiktokenCounter()
    assert count_chat_request(tiktoken, messages, tools) == tiktoken.count_messages(messages)


def test_the_additive_margin_is_added_after_the_multiplicative_one(server: FakeServer) -> None:
    prompt = "hello there, general kenobi"
    counted = COUNTER.count(prompt)
    with make_client(server, safety_margin=2.5, safety_margin_tokens=7) as client:
        result = client.complete(prompt)
    assert result.max_tokens == CONTEXT - (math.ceil(counted * 3.5) + 7)
    # The BOS of an empty prompt: no ratio covers it, one token does.
    with make_client(server, context_window=1, safety_margin=10.0) as client:
        assert client.complete("").max_tokens == 1
    with (
        make_client(server, context_window=1, safety_margin_tokens=1) as client,
        pytest.raises(PromptTooLongError, match="with the safety margins"),
    ):
        client.complete("")


@pytest.mark.parametrize(
    "options",
    [
        {"safety_margin": -0.1},
        {"safety_margin": math.inf},
        {"safety_margin": math.nan},
        {"safety_margin": True},
        {"safety_margin_tokens": -1},
        {"safety_margin_tokens": 1.5},
        {"safety_margin_tokens": True},
    ],
)
def test_margins_are_validated(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="safety_margin"):
        Client(base_url="http://127.0.0.1:9", context_window=100, **options)


@pytest.fixture
def server() -> FakeServer:
    return new_server()


# --- kvclient count -------------------------------------------------------------------------------


def test_count_cli_with_a_model_directory_and_a_chat_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvclient._count_cli import main

    directory = _model_dir(tmp_path / "model", config={"chat_template": STRING_TEMPLATE})
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "hello world"}]))
    assert main(["--tokenizer", str(directory), "--chat", str(chat)]) == 0
    assert capsys.readouterr().out == "prompt_tokens: 7\n"
    request = {"messages": [{"role": "user", "content": ["hello", IMAGE]}], "tools": []}
    chat.write_text(json.dumps(request))
    assert main(["--tokenizer", str(directory), "--chat", str(chat), "--media-tokens", "9"]) == 0
    assert capsys.readouterr().out == "prompt_tokens: 15\n"  # 6 + one image at 9
    assert main(["--tokenizer", str(directory), "hello", "--context-window", "10"]) == 0
    assert capsys.readouterr().out == "prompt_tokens: 1\nmax_tokens:    9\n"
    assert main(["--tokenizer", str(tmp_path / "missing"), "x"]) == 2
    assert "no model directory" in capsys.readouterr().err
    assert main(["--chat", str(tmp_path / "absent.json")]) == 2
    assert "cannot read the chat file" in capsys.readouterr().err
