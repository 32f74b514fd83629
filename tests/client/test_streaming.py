"""SSE parsing, and what only one flavour of stream expresses (an async stream counts when
entered; leaving early). Streamed calls on both clients: tests/client/_async/test_streams.py."""

from __future__ import annotations

import gc

import pytest

from kvclient import APIResponseError
from kvclient.sse import SSEDecoder, iter_events
from tests.helpers.client import (
    CONTEXT,
    FakeServer,
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


# --- async streams ---------------------------------------------------------------------------


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
