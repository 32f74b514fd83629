"""Streamed calls: chunks and the aggregated completion, retried only before the first event.

The source of tests/client/_sync/test_streams.py (``python scripts/unasync.py``): edit this
file. The SSE parser itself, and what only one flavour expresses, are in
tests/client/test_streaming.py.
"""

from __future__ import annotations

import httpx
import pytest

from kvclient import APIConnectionError, APIResponseError, AsyncStream, CompletionChunk, Usage
from tests.helpers.client import (
    CONTEXT,
    COUNTER,
    BrokenStream,
    FakeServer,
    broken_sse,
    busy,
    make_async_client,
    new_server,
    sse,
    text_events,
)

pytestmark = pytest.mark.anyio

PROMPT = "Count to three."
MESSAGES = [{"role": "user", "content": "Count to three."}]


@pytest.fixture
def server() -> FakeServer:
    return new_server()


async def collect(stream: AsyncStream, into: list[str]) -> None:
    """Each chunk's text into ``into`` as it arrives (kept when the stream then breaks)."""
    async for chunk in stream:
        into.append(chunk.text)


async def test_complete_stream_yields_chunks_and_aggregates(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("one", " two", " three")))
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        chunks = [chunk async for chunk in stream]
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


async def test_chat_stream_reads_deltas(server: FakeServer) -> None:
    server.add("/v1/chat/completions", sse(*text_events("a", "b", chat=True, usage=False)))
    async with make_async_client(server) as client:
        stream = client.chat_stream(MESSAGES, max_tokens=5)
        async with stream:
            assert [c.text async for c in stream] == ["a", "b"]
    assert stream.completion.text == "ab"
    assert stream.completion.usage is None
    assert server.posts[0].body["max_tokens"] == 5


async def test_completion_before_the_end_is_an_error(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("x", "y")))
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        await stream.__anext__()
        with pytest.raises(RuntimeError, match="not finished"):
            _ = stream.completion


async def test_stream_is_retried_before_its_first_event(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        busy("1"),
        httpx.ConnectError("refused"),
        httpx.Response(200, stream=BrokenStream([])),  # connection dropped before any event
        sse(*text_events("ok")),
    )
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        assert [c.text async for c in stream] == ["ok"]
    assert len(server.posts) == 4
    assert stream.completion.attempts == 4
    assert len({s.headers["idempotency-key"] for s in server.posts}) == 1


async def test_stream_is_not_retried_after_its_first_event(server: FakeServer) -> None:
    events = text_events("one", " two", " three", usage=False)
    server.add("/v1/completions", broken_sse(events[0]), sse(*events))
    got: list[str] = []
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        with pytest.raises(APIConnectionError, match="not retried") as info:
            await collect(stream, got)
    assert got == ["one"]
    assert len(server.posts) == 1
    assert not info.value.retryable


async def test_truncated_stream_is_an_error_not_a_short_answer(server: FakeServer) -> None:
    events = text_events("one", " two", " three", usage=False)
    server.add("/v1/completions", sse(*events[:2], done=False))
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        with pytest.raises(APIResponseError, match="without \\[DONE\\]"):
            [chunk async for chunk in stream]
    assert len(server.posts) == 1


async def test_finish_reason_without_done_is_complete(server: FakeServer) -> None:
    server.add("/v1/completions", sse(*text_events("one", " two"), done=False))
    async with make_async_client(server) as client, client.complete_stream(PROMPT) as stream:
        assert "".join([c.text async for c in stream]) == "one two"
    assert stream.completion.finish_reason == "stop"


async def test_empty_stream_is_an_error(server: FakeServer) -> None:
    server.add("/v1/completions", sse(done=False))
    async with make_async_client(server) as client:
        with pytest.raises(APIResponseError, match="first event"):
            await client.complete_stream(PROMPT).__aenter__()
    assert len(server.posts) == 1


async def test_stream_error_status_is_classified(server: FakeServer) -> None:
    server.add(
        "/v1/completions",
        httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}}),
    )
    async with make_async_client(server) as client:
        with pytest.raises(Exception, match="400") as info:
            [chunk async for chunk in client.complete_stream(PROMPT)]
    assert type(info.value).__name__ == "BadRequestError"
