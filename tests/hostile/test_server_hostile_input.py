"""Hostile chat messages: large fields other than ``content`` are
counted off the event loop, and nesting just under the JSON parser's limit in any message field
gets a 4xx JSON error or a success, never a 500, on the real server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from kvclient import TiktokenCounter
from reference_server import RunningServer, ServerConfig, create_app, running_server
from reference_server.http.requests import parse_generation
from tests.helpers.servers import at_zero, wait_for

FAST: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 2048,
    "decode_rate": 50_000.0,
    "mean_output_tokens": 5.0,
    "tick_seconds": 0.005,
}


class ThreadRecordingCounter:
    """tiktoken, remembering which threads counted chat messages."""

    def __init__(self) -> None:
        self.inner = TiktokenCounter()
        self.threads: list[int] = []

    def count(self, text: str) -> int:
        return self.inner.count(text)

    def count_messages(self, messages: Sequence[Any]) -> int:
        self.threads.append(threading.get_ident())
        return self.inner.count_messages(messages)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.inner.decode(tokens)


def test_the_size_hint_covers_every_field_of_every_message() -> None:
    big = "n" * 100_000
    for message in (
        {"role": "user", "content": "hi", "name": big},
        {"role": "user", "content": [{"type": "text", "text": big}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": big}}]},
        {"role": big},
    ):
        request = parse_generation("chat", {"messages": [message]})
        assert request.size_hint >= 100_000


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_a_large_name_field_is_counted_off_the_event_loop(path: str) -> None:
    counter = ThreadRecordingCounter()
    app = create_app(ServerConfig(tokenizer=counter, **FAST))
    body = {"messages": [{"role": "user", "content": "hi", "name": "n" * 200_000}]}
    small = {"messages": [{"role": "user", "content": "hi", "name": "n"}]}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        for payload in (small, body):
            response = await http.post(path, json={**payload, "max_tokens": 1})
            assert response.status_code in (200, 413), response.text  # counted either way
    here = threading.get_ident()
    assert counter.threads[0] == here  # a small one stays on the loop (no thread hop)
    assert counter.threads[1] != here  # the 200 kB name went to a worker thread


def nested(depth: int, kind: str) -> str:
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(**FAST) as running:
        yield running


def post(server: RunningServer, path: str, text: str) -> tuple[int, dict[str, Any]]:
    """One request in one write on a fresh connection (no delayed-ACK wait between writes)."""
    body = text.encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload)


def chat_body(depth: int, kind: str, field: str) -> str:
    value = nested(depth, kind)
    if field == "content" and kind == "dict":
        value = f"[{value}]"  # content is a string or an array of parts
    text = '"content":"hi",' if field != "content" else ""
    return '{"max_tokens":1,"messages":[{"role":"user",' + text + f'"{field}":{value}' + "}]}"


def parser_limit(server: RunningServer, path: str, kind: str, field: str) -> int:
    """The deepest nesting the server's JSON parser accepts here (it depends on the stack)."""
    low, high = 500, 1100  # accepted, refused by the parser
    while high - low > 1:
        mid = (low + high) // 2
        status, payload = post(server, path, chat_body(mid, kind, field))
        refused = status == 400 and "body is nested too deeply" in payload["error"]["message"]
        low, high = (low, mid) if refused else (mid, high)
    return low


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("kind", "field"), [("dict", "extra"), ("list", "extra"), ("dict", "content")]
)
def test_nesting_just_under_the_parser_limit_is_never_a_500(
    server: RunningServer, path: str, kind: str, field: str
) -> None:
    limit = parser_limit(server, path, kind, field)
    assert 800 < limit < 1100
    answers = []
    for depth in range(limit - 6, limit + 2):
        status, payload = post(server, path, chat_body(depth, kind, field))
        assert status in (200, 400, 413), (depth, payload)
        if status != 200:
            assert payload["error"]["message"]
        answers.append((status, payload.get("error", {}).get("message", "")))
    # Just under the limit the body parses and the count has to cope: a clear 400 at worst.
    assert any("nested too deeply" in message for _, message in answers)
    wait_for(lambda: at_zero(server))
