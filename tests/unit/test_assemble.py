"""The plain answer assembled from a stream (reference_server/gateway/assemble.py), checked
against real llama.cpp: each case of ``llama_cpp_streams.json`` is one request asked plain and
as a stream (temperature 0, a seed), captured by ``scripts/capture_llama_streams.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reference_server.gateway.assemble import Assembler, BrokenStream, EngineError, assemble
from reference_server.gateway.rewrite import as_stream, assembled_headers

CAPTURED: dict[str, Any] = json.loads(
    (Path(__file__).with_name("llama_cpp_streams.json")).read_text(encoding="utf-8")
)
ANSWERED = sorted(name for name, case in CAPTURED.items() if case["plain"]["status"] == 200)

#: What differs between any two answers of llama.cpp, whatever they say.
_PER_ANSWER = ("id", "created", "timings")


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    same = {k: v for k, v in answer.items() if k not in _PER_ANSWER}
    usage = dict(same["usage"])
    usage.pop("prompt_tokens_details")  # cached_tokens: what the cache held at the time
    return {**same, "usage": usage}


def _assembled(name: str) -> dict[str, Any]:
    case = CAPTURED[name]
    return assemble(case["stream"]["body"].encode(), chat=case["path"] == "/v1/chat/completions")


@pytest.mark.parametrize("name", ANSWERED)
def test_the_assembled_answer_is_llama_cpps_plain_answer(name: str) -> None:
    plain = CAPTURED[name]["plain"]["body"]
    assembled = _assembled(name)
    assert _comparable(assembled) == _comparable(plain)
    assert set(assembled) == set(plain)  # timings, system_fingerprint: passed through
    assert assembled["id"].startswith("chatcmpl-")
    assert isinstance(assembled["created"], int)


def test_the_cases_cover_what_they_are_named_for() -> None:
    """The captures hold what the tests above rely on them for."""
    finishes = {c["finish_reason"] for n in ANSWERED for c in _assembled(n)["choices"]}
    assert finishes == {"length", "stop"}
    assert len(_assembled("chat_n2")["choices"]) == 2
    assert [c["index"] for c in _assembled("completion_n_cmpl3")["choices"]] == [0, 1, 2]
    logprobs = _assembled("chat_logprobs")["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == 5
    assert all(len(p["top_logprobs"]) == 2 for p in logprobs)
    assert len(_assembled("completion_logprobs")["choices"][0]["logprobs"]["content"]) == 5
    assert _assembled("chat_eos")["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert "timings" in _assembled("chat")


def test_several_choices_carry_choice_0s_usage_as_llama_cpp_plain_answer_does() -> None:
    """llama.cpp streams one usage per choice (a chat's in a chunk without choices, right after
    that choice's finish); its plain answer gives choice 0's."""
    stream = (
        _chunk(0, {"content": "a"}) + _chunk(1, {"content": "b"})
        + _chunk(1, {}, "length") + _usage(7)
        + _chunk(0, {}, "stop") + _usage(3)
        + b"data: [DONE]\n\n"
    )  # fmt: skip
    answer = assemble(stream, chat=True)
    assert answer["usage"]["completion_tokens"] == 3
    assert [c["message"]["content"] for c in answer["choices"]] == ["a", "b"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "length"]


def test_an_error_mid_stream_is_the_error_the_plain_request_got() -> None:
    """A unified KV pool overrun fails a request mid-decode: a plain one with a 500, a stream
    with an error event after its first tokens. The event is that 500, body and all."""
    case = CAPTURED["completion_overrun"]
    assert case["stream"]["status"] == 200
    with pytest.raises(EngineError) as raised:
        assemble(case["stream"]["body"].encode(), chat=False)
    assert raised.value.status == case["plain"]["status"] == 500
    assert raised.value.body == case["plain"]["body"]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ({"code": 400, "message": "m", "type": "exceed_context_size_error"}, 400),
        ({"code": 503, "message": "m"}, 503),
        ({"code": 200, "message": "m"}, 500),
        ({"code": "oops", "message": "m"}, 500),
        ({"message": "m"}, 500),
    ],
)
def test_an_error_events_status_is_its_code_when_an_error_status(
    error: dict[str, Any], status: int
) -> None:
    stream = _chunk(0, {"content": "a"}) + b"data: " + json.dumps({"error": error}).encode()
    with pytest.raises(EngineError) as raised:
        assemble(stream + b"\n\n", chat=True)
    assert raised.value.status == status
    assert raised.value.body == {"error": error}


def test_a_string_error_gets_the_error_shape() -> None:
    with pytest.raises(EngineError) as raised:
        assemble(b'data: {"error": "went wrong"}\n\n', chat=False)
    assert (raised.value.status, raised.value.body) == (500, {"error": {"message": "went wrong"}})


@pytest.mark.parametrize("name", ["chat_n2", "completion_n_cmpl3", "chat_logprobs"])
def test_any_split_of_the_bytes_assembles_the_same(name: str) -> None:
    case = CAPTURED[name]
    data = case["stream"]["body"].encode()
    chat = case["path"] == "/v1/chat/completions"
    for size in (1, 7, 1000):
        assembler = Assembler(chat=chat)
        for at in range(0, len(data), size):
            assembler.feed(data[at : at + size])
        assert assembler.end() == assemble(data, chat=chat)


def test_crlf_line_endings_comments_and_other_fields_are_read_as_sse() -> None:
    stream = (
        b": ping\r\n\r\nevent: message\r\nid: 1\r\n"
        + _chunk(0, {"role": "assistant", "content": "a"}).replace(b"\n", b"\r\n")
        + b":\n\n"
        + _chunk(0, {"content": "b"}, "stop").replace(b"\n", b"\r")
        + b"data: [DONE]\r\n\r\n"
    )
    answer = assemble(stream, chat=True)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "ab"}


def test_tool_calls_are_merged_by_index_with_their_arguments_joined() -> None:
    """Deltas in llama.cpp's shape (server_chat_msg_diff_to_json_oaicompat): the id, type and
    name first, the arguments in pieces; two calls, and two choices interleaved. The tiny test
    model cannot be made to call a tool, so these are written by hand."""
    call0 = {"index": 0, "id": "c0", "type": "function", "function": {"name": "get_weather"}}
    call1 = {"index": 1, "id": "c1", "type": "function", "function": {"name": "get_time"}}
    stream = (
        _chunk(0, {"role": "assistant", "content": None})
        + _chunk(1, {"role": "assistant", "content": None})
        + _chunk(0, {"tool_calls": [call0]})
        + _chunk(1, {"content": "no tools"})
        + _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})
        + _chunk(0, {"tool_calls": [call1]})
        + _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})
        + _chunk(0, {}, "tool_calls")
        + _chunk(1, {}, "stop")
        + b"data: [DONE]\n\n"
    )
    first, second = assemble(stream, chat=True)["choices"]
    assert first["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    }
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "no tools"}


def test_reasoning_content_is_joined_apart_from_the_content() -> None:
    stream = (
        _chunk(0, {"role": "assistant", "content": None})
        + _chunk(0, {"reasoning_content": "think"})
        + _chunk(0, {"reasoning_content": "ing"})
        + _chunk(0, {"content": "answer"}, "stop")
        + b"data: [DONE]\n\n"
    )
    message = assemble(stream, chat=True)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer", "reasoning_content": "thinking"}


def test_legacy_logprobs_lists_are_concatenated() -> None:
    def piece(text: str, offset: int, finish: str | None = None) -> bytes:
        logprobs = {
            "tokens": [text],
            "token_logprobs": [-1.0],
            "top_logprobs": [{text: -1.0}],
            "text_offset": [offset],
        }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"

    answer = assemble(piece("a", 0) + piece("b", 1, "length") + b"data: [DONE]\n\n", chat=False)
    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-1.0, -1.0],
        "top_logprobs": [{"a": -1.0}, {"b": -1.0}],
        "text_offset": [0, 1],
    }


def test_a_stream_that_ends_with_every_choice_finished_needs_no_done() -> None:
    answer = assemble(_chunk(0, {"content": "a"}, "stop"), chat=True)
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_what_follows_done_is_not_read() -> None:
    stream = _chunk(0, {"content": "a"}, "stop") + b"data: [DONE]\n\n" + b"data: nonsense\n\n"
    assert assemble(stream, chat=True)["choices"][0]["message"]["content"] == "a"


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'data: {"choices": []}\n\n', id="no-choice"),
        pytest.param(b'data: {"choices": []}\n\ndata: [DONE]\n\n', id="done-without-choice"),
        pytest.param(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', id="cut-off"),
        pytest.param(b"data: {not json\n\n", id="not-json"),
        pytest.param(b"data: [1, 2]\n\n", id="not-an-object"),
        pytest.param(b'data: {"choices": {"index": 0}}\n\n', id="choices-not-a-list"),
        pytest.param(b'data: {"choices": [{"index": -1, "text": "a"}]}\n\n', id="bad-index"),
        pytest.param(b'data: {"choices": [{"index": 0, "text": 5}]}\n\n', id="text-not-text"),
        pytest.param(b'{"choices": []}', id="plain-json"),
    ],
)
def test_a_stream_that_is_not_a_whole_completion_is_broken(stream: bytes) -> None:
    with pytest.raises(BrokenStream):
        assemble(stream, chat=False)


def test_a_chat_delta_that_is_not_an_object_is_broken() -> None:
    with pytest.raises(BrokenStream):
        assemble(b'data: {"choices": [{"index": 0, "delta": "a"}]}\n\n', chat=True)


# --- what goes upstream, what comes back --------------------------------------------------


def test_a_plain_body_is_asked_as_a_stream_with_usage_and_nothing_else_changed() -> None:
    body = {"prompt": "x", "max_tokens": 5, "n_predict": 5, "stream": False, "seed": 1}
    streamed = json.loads(as_stream(json.dumps(body).encode())[0])
    assert streamed == {**body, "stream": True, "stream_options": {"include_usage": True}}


def test_the_clients_own_stream_options_are_kept() -> None:
    body = {"prompt": "x", "stream_options": {"include_usage": False, "other": 1}}
    streamed = json.loads(as_stream(json.dumps(body).encode())[0])
    assert streamed["stream_options"] == {"include_usage": True, "other": 1}


def test_the_assembled_answers_headers_say_json() -> None:
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"x-accel-buffering", b"no"),
        (b"access-control-allow-origin", b""),
    ]
    assert assembled_headers(headers) == [
        (b"access-control-allow-origin", b""),
        (b"content-type", b"application/json"),
    ]


def _chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    payload = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + json.dumps({**payload, "choices": [choice]}).encode() + b"\n\n"


def _usage(completion: int) -> bytes:
    usage = {"prompt_tokens": 2, "completion_tokens": completion, "total_tokens": 2 + completion}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"


def test_every_field_the_engine_sent_is_kept_where_it_was_sent() -> None:
    """vLLM's chunks carry fields of their own: ``stop_reason`` and ``token_ids`` in a choice
    (a few ids per chunk), ``prompt_token_ids`` and ``kv_transfer_params`` at the top; the plain
    answer keeps them all, and a field no one here knows, where the engine put it."""
    events = [
        {"id": "c", "object": "chat.completion.chunk", "prompt_token_ids": [1, 2, 3],
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                      "token_ids": [10], "finish_reason": None, "stop_reason": None}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "!"}, "token_ids": [11, 12],
                                 "finish_reason": "stop", "stop_reason": 128009,
                                 "novel": {"kept": True}}],
         "kv_transfer_params": {"remote_block_ids": [4]}},
        {"id": "c", "choices": [], "usage": {"completion_tokens": 3}, "kv_transfer_params": None},
    ]  # fmt: skip
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    answer = assemble(stream.encode(), chat=True)
    assert answer["object"] == "chat.completion"
    assert answer["prompt_token_ids"] == [1, 2, 3]
    assert answer["kv_transfer_params"] == {"remote_block_ids": [4]}
    assert answer["usage"] == {"completion_tokens": 3}
    [choice] = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi!"}
    assert choice["token_ids"] == [10, 11, 12]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 128009)
    assert choice["novel"] == {"kept": True}
