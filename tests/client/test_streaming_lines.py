"""SSE lines end at CR, LF or CRLF only; lines, events and streams are bounded while reading;
streamed tool calls and other delta fields reach the completion."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient import APIResponseError, AsyncClient, Client, RetryPolicy, ToolCall
from kvclient.contract._session import _consume
from kvclient.sse import (
    MAX_LINE_BYTES,
    AsyncLines,
    LineSplitter,
    event_limit,
    iter_events,
    iter_lines,
    merge_delta,
)
from tests.helpers.client import (
    COUNTER,
    MODEL,
    FakeServer,
    make_async_client,
    make_client,
    new_server,
    sse,
)
from tests.helpers.hostile import HostileServer, chat_events, sse_answer

MESSAGES = [{"role": "user", "content": "Say something odd."}]
# Unicode line breaks that str.splitlines (and so httpx's line iterators) split at, and SSE does
# not: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR, and the C0 ones JSON would escape anyway.
ODD = "a\u0085b\u2028c\u2029d"
ODD_PARTS = ["x\u0085", "\u2028y", "z\u2029", ODD]


def _split_reference(data: bytes) -> list[str]:
    """What SSE says the lines of ``data`` are (the last, unterminated one included)."""
    lines = re.split(rb"\r\n|\r|\n", data)
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.decode("utf-8", "replace") for line in lines]


def _feed(splitter: LineSplitter, chunks: list[bytes]) -> list[str]:
    out = [line for chunk in chunks for line in splitter.feed(chunk)]
    return out + splitter.flush()


# --- the pure splitter -------------------------------------------------------------------------


def test_lines_end_at_cr_lf_and_crlf_only() -> None:
    data = f"data: {ODD}\r\ndata: \x0b\x0c\x1c\x1d\x1e\rdata: e\n\ndata: tail".encode()
    lines = _feed(LineSplitter(), [data])
    assert lines == [f"data: {ODD}", "data: \x0b\x0c\x1c\x1d\x1e", "data: e", "", "data: tail"]
    assert f"data: {ODD}".splitlines() != [f"data: {ODD}"]  # what httpx's iterator does


def test_a_crlf_split_across_chunks_is_one_line_ending() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"data: a\r") == ["data: a"]
    # The LF ends nothing: with the CR before it, it was one line ending.
    assert splitter.feed(b"\ndata: b\r") == ["data: b"]
    assert splitter.feed(b"\r\n") == [""]
    assert splitter.flush() == []


def test_a_character_split_across_chunks_is_decoded_whole_and_a_bom_dropped() -> None:
    data = "\ufeffdata: é\u2028ü\n".encode()
    assert _feed(LineSplitter(), [data[i : i + 1] for i in range(len(data))]) == ["data: é\u2028ü"]


@given(
    st.lists(
        st.sampled_from(
            ["data: ", "\r", "\n", "\r\n", "é", "\u0085", "\u2028", "\u2029", "x", ":"]
        ),
        max_size=40,
    ),
    st.lists(st.integers(min_value=0, max_value=12), max_size=20),
)
def test_any_chunking_of_the_same_bytes_gives_the_same_lines(
    pieces: list[str], cuts: list[int]
) -> None:
    data = "".join(pieces).encode()
    chunks, at = [], 0
    for size in cuts:
        chunks.append(data[at : at + size])
        at += size
    chunks.append(data[at:])
    assert _feed(LineSplitter(), chunks) == _feed(LineSplitter(), [data]) == _split_reference(data)


def test_a_line_is_refused_once_it_passes_the_bound_never_buffered_whole() -> None:
    # 96 MB without a line ending, in 64 KiB chunks: refused after the bound, not at the end.
    chunk = b"x" * 65536
    splitter = LineSplitter()
    fed = 0

    def feed_96_mb() -> None:
        nonlocal fed
        for _ in range(96 * 1024 * 1024 // len(chunk)):
            fed += len(chunk)
            splitter.feed(chunk)

    with pytest.raises(APIResponseError, match="line longer than"):
        feed_96_mb()
    assert splitter.peak <= MAX_LINE_BYTES
    assert fed <= MAX_LINE_BYTES + len(chunk)
    assert MAX_LINE_BYTES < 17 * 1024 * 1024


def test_event_limit_rule() -> None:
    assert event_limit(16) == 4 * 16 + 64
    assert event_limit(16, choices=3) == 4 * 16 * 3 + 64
    assert event_limit(0) == 64


def test_an_endless_stream_is_cut_at_its_event_limit() -> None:
    def endless() -> Iterator[str]:
        for n in range(100_000):
            yield f'data: {{"n": {n}}}'
            yield ""

    with pytest.raises(APIResponseError, match="more than 128 events"):
        list(iter_events(endless(), max_events=event_limit(16)))
    assert len(list(_until_error(iter_events(endless(), max_events=128)))) == 128


def _until_error(events: Iterator[Any]) -> Iterator[Any]:
    """The events before the iterator raised APIResponseError (which it must)."""
    try:
        yield from events
    except APIResponseError:
        return
    raise AssertionError("the stream was not cut")


def test_comments_alone_are_bounded_too() -> None:
    def pings() -> Iterator[str]:
        yield 'data: {"n": 0}'
        yield ""
        while True:
            yield ": ping"

    with pytest.raises(APIResponseError, match="lines"):
        list(iter_events(pings(), max_events=event_limit(1)))


def test_merge_delta_concatenates_text_and_merges_tool_calls_by_index() -> None:
    message: dict[str, Any] = {}
    for delta in [
        {"role": "assistant", "reasoning_content": "Think"},
        {"role": "assistant", "reasoning_content": "ing."},
        {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}], "refusal": None},
    ]:
        merge_delta(message, delta)
    assert message == {
        "role": "assistant",
        "reasoning_content": "Thinking.",
        "tool_calls": [
            {
                "index": 0,
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1}'},
            },
            {"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}},
        ],
        "refusal": None,
    }


# --- through a real loopback server ------------------------------------------------------------


def _odd_stream() -> list[bytes]:
    """A chat stream whose tokens hold Unicode line breaks, with CRLF, CR and LF line endings,
    written in 3-byte pieces so that characters and CRLFs are cut between writes."""
    events = chat_events(*({"content": part} for part in ODD_PARTS))
    endings = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n"]
    body = b"".join(
        event[: -len(b"\n\n")] + endings[i % len(endings)] for i, event in enumerate(events)
    )
    return [body[i : i + 3] for i in range(0, len(body), 3)]


def _loopback_client(server: HostileServer) -> Client:
    return Client(
        base_url=server.base_url,
        model=MODEL,
        context_window=1000,
        counter=COUNTER,
        retry=RetryPolicy(deadline=10.0),
    )


def test_sync_stream_reads_unicode_line_breaks_in_tokens_intact() -> None:
    with (
        HostileServer(default=sse_answer(_odd_stream(), pause=0.001)) as server,
        _loopback_client(server) as client,
        client.chat_stream(MESSAGES, max_tokens=20) as stream,
    ):
        texts = [chunk.text for chunk in stream]
    assert texts == ODD_PARTS
    assert stream.completion.text == "".join(ODD_PARTS)
    assert stream.completion.finish_reason == "stop"


@pytest.mark.anyio
async def test_async_stream_reads_unicode_line_breaks_in_tokens_intact() -> None:
    with HostileServer(default=sse_answer(_odd_stream(), pause=0.001)) as server:
        async with (
            AsyncClient(
                base_url=server.base_url,
                model=MODEL,
                context_window=1000,
                counter=COUNTER,
                retry=RetryPolicy(deadline=10.0),
            ) as client,
            client.chat_stream(MESSAGES, max_tokens=20) as stream,
        ):
            texts = [chunk.text async for chunk in stream]
    assert texts == ODD_PARTS
    assert stream.completion.text == "".join(ODD_PARTS)


@pytest.mark.anyio
async def test_contract_suite_reads_unicode_line_breaks_in_tokens_intact() -> None:
    with HostileServer(default=sse_answer(_odd_stream(), pause=0.001)) as server:
        async with (
            httpx.AsyncClient(base_url=server.base_url) as http,
            http.stream("POST", "/v1/chat/completions", json={}) as response,
        ):
            assert await _consume(response) == (True, None, None)


# --- bounds through the client ---------------------------------------------------------------


class CountingBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body of ``prefix`` then ``total`` bytes of ``chunk``, counting what the client pulled;
    it stops when closed."""

    def __init__(self, chunk: bytes, total: int, prefix: bytes = b"") -> None:
        self.chunk = chunk
        self.total = total
        self.prefix = prefix
        self.pulled = 0
        self.closed = False

    def _more(self) -> bool:
        return not self.closed and self.pulled < self.total

    def __iter__(self) -> Iterator[bytes]:
        yield self.prefix
        while self._more():
            self.pulled += len(self.chunk)
            yield self.chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.prefix
        while self._more():
            self.pulled += len(self.chunk)
            yield self.chunk

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def _serve(server: FakeServer, body: CountingBody) -> None:
    server.add(
        "/v1/chat/completions",
        httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body),
    )


def _huge_line() -> CountingBody:
    # One line of 96 MB: "data: xxxx..." with no line ending.
    return CountingBody(b"x" * 65536, 96 * 1024 * 1024, prefix=b"data: ")


def _endless_events() -> CountingBody:
    event = {"choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}
    return CountingBody(f"data: {json.dumps(event)}\n\n".encode(), 10_000 * 60)


def test_sync_stream_refuses_a_huge_line_before_buffering_it() -> None:
    server, body = new_server(), _huge_line()
    _serve(server, body)
    with (
        make_client(server) as client,
        pytest.raises(APIResponseError) as info,
        client.chat_stream(MESSAGES, max_tokens=16) as stream,
    ):
        list(stream)
    assert body.pulled <= MAX_LINE_BYTES + 2 * len(body.chunk)  # not 96 MB
    assert "line longer" in str(info.value)


@pytest.mark.anyio
async def test_async_stream_refuses_a_huge_line_before_buffering_it() -> None:
    server, body = new_server(), _huge_line()
    _serve(server, body)
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError) as info:
            async with client.chat_stream(MESSAGES, max_tokens=16) as stream:
                _ = [chunk async for chunk in stream]
    assert body.pulled <= MAX_LINE_BYTES + 2 * len(body.chunk)  # not 96 MB
    assert "line longer" in str(info.value)


def test_sync_stream_that_never_ends_is_cut_with_a_clear_error() -> None:
    server, body = new_server(), _endless_events()
    _serve(server, body)
    with make_client(server) as client, client.chat_stream(MESSAGES, max_tokens=16) as stream:
        got = len(list(_until_error(iter(stream))))
    assert got == event_limit(16) == 128


@pytest.mark.anyio
async def test_async_stream_that_never_ends_is_cut_with_a_clear_error() -> None:
    server, body = new_server(), _endless_events()
    _serve(server, body)
    async with (
        make_async_client(server) as client,
        client.chat_stream(MESSAGES, max_tokens=16) as stream,
    ):
        got, error = await _count_until_error(stream)
    assert got == event_limit(16)
    assert "max_tokens" in str(error)


async def _count_until_error(stream: AsyncIterator[Any]) -> tuple[int, Exception]:
    got = 0
    try:
        async for _ in stream:
            got += 1
    except APIResponseError as exc:
        return got, exc
    raise AssertionError("the stream was not cut")


# --- tool calls and other delta fields -------------------------------------------------------

TOOL_DELTAS: list[dict[str, Any]] = [
    {"role": "assistant", "content": None, "reasoning_content": "Need the "},
    {"reasoning_content": "weather."},
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
    {
        "tool_calls": [
            {
                "index": 1,
                "id": "call_2",
                "type": "function",
                "function": {"name": "time", "arguments": "{}"},
            }
        ]
    },
    {},
]
EXPECTED_CALLS = (
    ToolCall(id="call_1", name="weather", arguments='{"city": "Oslo"}'),
    ToolCall(id="call_2", name="time", arguments="{}"),
)


def _tool_stream() -> httpx.Response:
    events = []
    for i, delta in enumerate(TOOL_DELTAS):
        finish = "tool_calls" if i == len(TOOL_DELTAS) - 1 else None
        events.append(
            {
                "id": "c",
                "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )
    return sse(*events)


def _check_tool_completion(completion: Any, chunks: list[Any]) -> None:
    assert completion.finish_reason == "tool_calls"
    assert completion.text == ""
    assert completion.tool_calls == EXPECTED_CALLS
    assert completion.message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
        ],
    }
    fragments = [call for chunk in chunks for call in chunk.tool_calls]
    assert [f["index"] for f in fragments] == [0, 0, 0, 1]
    assert chunks[0].delta["reasoning_content"] == "Need the "


def test_sync_stream_aggregates_tool_calls_and_other_delta_fields() -> None:
    server = new_server()
    server.add("/v1/chat/completions", _tool_stream())
    with make_client(server) as client, client.chat_stream(MESSAGES, max_tokens=50) as stream:
        chunks = list(stream)
    _check_tool_completion(stream.completion, chunks)


@pytest.mark.anyio
async def test_async_stream_aggregates_tool_calls_and_other_delta_fields() -> None:
    server = new_server()
    server.add("/v1/chat/completions", _tool_stream())
    async with (
        make_async_client(server) as client,
        client.chat_stream(MESSAGES, max_tokens=50) as stream,
    ):
        chunks = [chunk async for chunk in stream]
    _check_tool_completion(stream.completion, chunks)


def test_non_streamed_chat_carries_tool_calls_and_its_message() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
        ],
    }
    server = new_server()
    server.add(
        "/v1/chat/completions",
        httpx.Response(
            200,
            json={
                "id": "c",
                "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
            },
        ),
    )
    with make_client(server) as client:
        completion = client.chat(MESSAGES, max_tokens=50)
    assert completion.tool_calls == EXPECTED_CALLS
    assert completion.message == message
    assert completion.text == ""
    assert completion.finish_reason == "tool_calls"


def test_text_completions_have_no_message() -> None:
    server = new_server()
    server.add(
        "/v1/completions", sse({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]})
    )
    with make_client(server) as client, client.complete_stream("Hi", max_tokens=5) as stream:
        list(stream)
    assert stream.completion.message is None
    assert stream.completion.tool_calls == ()


def test_async_lines_is_a_plain_iterator() -> None:
    # Not an async generator: nothing of ours is left suspended when a stream is abandoned.
    async def chunks() -> AsyncIterator[bytes]:
        yield b""

    assert not hasattr(AsyncLines(chunks()), "aclose")
    assert list(iter_lines([b"a\rb", b"\nc"])) == ["a", "b", "c"]
