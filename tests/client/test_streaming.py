"""SSE parsing and streamed calls: retried only before the first event, never after."""

from __future__ import annotations

import gc

import httpx
import pytest

from kvclient import APIConnectionError, APIResponseError, AsyncStream, CompletionChunk, Usage
from kvclient._streaming import SSEDecoder, iter_events
from tests.helpers.client import (
    CONTEXT,
    COUNTER,
    BrokenStream,
    FakeServer,
    broken_sse,
    busy,
    make_async_client,
    make_client,
    new_server,
    sse,
    text_events,
)

PROMPT = "Count to three."
MESSAGES = [{"role": "user", "content": "Count to three."}]


@pytest.fixture
def server() -> FakeServer:
    return new_server()


# --- the pure parser -------------------------------------------------------------------------


def feed_all(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    out = [data for line in lines if (data := decoder.feed(line)) is not None]
    tail = decoder.flush()
    return [*out, tail] if tail is not None else out


def test_sse_decoder_joins_data_lines_and_skips_comments_and_fields() -> None:
    lines = [
        ": keep-alive",
        "event: message",
        "id: 7",
        "retry: 1000",
        'data: {"a":',
        "data:1}",
        "",
        "data: second\r",
        "\r",
        "data: third",
    ]
    assert feed_all(lines) == ['{"a":\n1}', "second", "third"]


def test_iter_events_stops_at_done_and_ignores_what_follows() -> None:
    lines = ['data: {"n": 1}', "", "data: [DONE]", "", 'data: {"n": 2}', ""]
    assert list(iter_events(lines)) == [{"n": 1}, None]


def test_iter_events_rejects_non_json_and_error_events() -> None:
    with pytest.raises(APIResponseError, match="not JSON"):
        list(iter_events(["data: {oops", ""]))
    with pytest.raises(APIResponseError, match="mid-stream"):
        list(iter_events(['data: {"error": {"message": "engine died"}}', ""]))
    with pytest.raises(APIResponseError, match="not a JSON object"):
        list(iter_events(["data: [1, 2]", ""]))


# --- sync streams ----------------------------------------------------------------------------


def test_complete_stream_yields_chunks_and_aggregates(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("one", " two", " three")))
    with make_client(server) as client, client.complete_stream(PROMPT) as stream:
        chunks = list(stream)
    assert [c.text for c in chunks] == ["one", " two", " three"]
    assert isinstance(chunks[0], CompletionChunk)
    assert chunks[-1].finish_reason == "stop"
    body = server.posts[0].body
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == CONTEXT - COUNTER.count(PROMPT)
    assert server.posts[0].headers["accept"] == "text/event-stream"
    completion = stream.completion
    assert completion.text == "one two three"
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage(4, 3, 7)
    assert completion.max_tokens == body["max_tokens"]
    assert completion.attempts == 1


def test_chat_stream_reads_deltas(server: FakeServer) -> None:
    server.add("/v1/chat/completions", sse(*text_events("a", "b", chat=True, usage=False)))
    with make_client(server) as client:
        stream = client.chat_stream(MESSAGES, max_tokens=5)
        with stream:
            assert [c.text for c in stream] == ["a", "b"]
    assert stream.completion.text == "ab"
    assert stream.completion.usage is None
    assert server.posts[0].body["max_tokens"] == 5


def test_completion_before_the_end_is_an_error(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("x", "y")))
    with make_client(server) as client, client.complete_stream(PROMPT) as stream:
        next(stream)
        with pytest.raises(RuntimeError, match="not finished"):
            _ = stream.completion


def test_stream_is_retried_before_its_first_event(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        busy("1"),
        httpx.ConnectError("refused"),
        httpx.Response(200, stream=BrokenStream([])),  # connection dropped before any event
        sse(*text_events("ok")),
    )
    with make_client(server) as client, client.complete_stream(PROMPT) as stream:
        assert [c.text for c in stream] == ["ok"]
    assert len(server.posts) == 4
    assert stream.completion.attempts == 4
    assert len({s.headers["idempotency-key"] for s in server.posts}) == 1


def test_stream_is_not_retried_after_its_first_event(server: FakeServer) -> None:
    events = text_events("one", " two", " three", usage=False)
    server.add("/v1/completions", broken_sse(events[0]), sse(*events))
    got: list[str] = []
    with (
        make_client(server) as client,
        client.complete_stream(PROMPT) as stream,
        pytest.raises(APIConnectionError, match="not retried") as info,
    ):
        got.extend(chunk.text for chunk in stream)
    assert got == ["one"]
    assert len(server.posts) == 1
    assert not info.value.retryable


def test_truncated_stream_is_an_error_not_a_short_answer(server: FakeServer) -> None:
    events = text_events("one", " two", " three", usage=False)
    server.add("/v1/completions", sse(*events[:2], done=False))
    with (
        make_client(server) as client,
        client.complete_stream(PROMPT) as stream,
        pytest.raises(APIResponseError, match="without \\[DONE\\]"),
    ):
        list(stream)
    assert len(server.posts) == 1


def test_finish_reason_without_done_is_complete(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("one", " two"), done=False))
    with make_client(server) as client, client.complete_stream(PROMPT) as stream:
        assert "".join(c.text for c in stream) == "one two"
    assert stream.completion.finish_reason == "stop"


def test_empty_stream_is_an_error(server: FakeServer) -> None:
    server.add("/v1/completions", sse(done=False))
    with make_client(server) as client, pytest.raises(APIResponseError, match="first event"):
        client.complete_stream(PROMPT).__enter__()
    assert len(server.posts) == 1


def test_stream_error_status_is_classified(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}}),
    )
    with make_client(server) as client, pytest.raises(Exception, match="400") as info:
        list(client.complete_stream(PROMPT))
    assert type(info.value).__name__ == "BadRequestError"


# --- async streams ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_stream_yields_and_aggregates(server: FakeServer) -> None:
    server.add("/v1/chat/completions", sse(*text_events("x", "y", "z", chat=True)))
    async with make_async_client(server) as client, client.chat_stream(MESSAGES) as stream:
        texts = [chunk.text async for chunk in stream]
    assert texts == ["x", "y", "z"]
    assert stream.completion.text == "xyz"
    assert stream.completion.usage == Usage(4, 3, 7)
    assert server.posts[0].body["max_tokens"] == CONTEXT - COUNTER.count_messages(MESSAGES)


async def collect(stream: AsyncStream, into: list[str]) -> None:
    async for chunk in stream:
        into.append(chunk.text)


@pytest.mark.anyio
async def test_async_stream_retried_only_before_first_event(server: FakeServer) -> None:
    events = text_events("one", " two", usage=False)
    server.add("/v1/completions", busy("1"), broken_sse(events[0]), sse(*events))
    got: list[str] = []
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        with pytest.raises(APIConnectionError, match="not retried"):
            await collect(stream, got)
    assert got == ["one"]
    assert len(server.posts) == 2  # the 429 was retried; the broken stream was not


@pytest.mark.anyio
async def test_async_stream_truncated(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("a", "b", usage=False)[:1], done=False))
    async with make_async_client(server) as client:
        stream = client.complete_stream(PROMPT)
        with pytest.raises(APIResponseError, match="without \\[DONE\\]"):
            async for _ in stream:
                pass
        await stream.aclose()


@pytest.mark.anyio
async def test_async_stream_prompt_too_long_raises_on_enter(server: FakeServer) -> None:
    from kvclient import PromptTooLongError

    async with make_async_client(server) as client:
        stream = client.complete_stream("token " * (CONTEXT + 5))
        with pytest.raises(PromptTooLongError):
            async with stream:
                pass
    assert server.seen == []


@pytest.mark.anyio
async def test_async_stream_left_early_closes_cleanly(server: FakeServer) -> None:
    """Breaking out leaves no half-read generator behind (trio warns about those)."""
    server.add("/v1/completions", sse(*text_events("a", "b", "c", "d")))
    async with make_async_client(server) as client:
        async with client.complete_stream(PROMPT) as stream:
            async for _chunk in stream:
                break
        gc.collect()
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.completion


def test_sync_stream_left_early_closes_cleanly(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("a", "b", "c", "d")))
    with make_client(server) as client, client.complete_stream(PROMPT) as stream:
        assert next(stream).text == "a"
    assert stream._response is not None
    assert stream._response.is_closed
