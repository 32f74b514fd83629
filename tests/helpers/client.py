"""Shared fixtures for the client tests: a scripted fake server and clients on a fake clock."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvclient import AsyncClient, Client, TiktokenCounter
from kvclient.headers import format_ratelimit
from kvclient.testing import FakeClock

BASE_URL = "http://kv.test"
MODEL = "test-model"
CONTEXT = 1000

Reply = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


@dataclass
class Seen:
    """One request as the fake server saw it."""

    method: str
    path: str
    headers: httpx.Headers
    body: Any
    at: float


@dataclass
class FakeServer:
    """Answers each request with the next scripted reply for its path, then ``default``.

    A reply may be a response, an exception to raise (a transport failure), or a function of the
    request. Every request is recorded with the fake clock's time, so tests can check *when* it
    reached the server.
    """

    clock: FakeClock
    default: Reply | None = None
    script: dict[str, list[Reply]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def add(self, path: str, *replies: Reply) -> FakeServer:
        self.script.setdefault(path, []).extend(replies)
        return self

    def handler(self, request: httpx.Request) -> httpx.Response:
        body: Any = None
        if request.content:
            body = json.loads(request.content)
        self.seen.append(
            Seen(request.method, request.url.path, request.headers, body, self.clock.now)
        )
        queue = self.script.get(request.url.path)
        reply = queue.pop(0) if queue else self.default
        if reply is None:
            reply = ok_completion()
        if isinstance(reply, Exception):
            raise reply
        if callable(reply) and not isinstance(reply, httpx.Response):
            return reply(request)
        return reply

    @property
    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]


def ok_completion(text: str = "hello", finish: str = "stop", **extra: Any) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            **extra,
        },
    )


def ok_chat(text: str = "hi there", finish: str = "stop") -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
        },
    )


def busy(
    retry_after: str | None = "2", *, ms: str | None = None, status: int = 429
) -> httpx.Response:
    """Our reference server's 429: KV cache full, with Retry-After and retry-after-ms."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    if ms is not None:
        headers["retry-after-ms"] = ms
    return httpx.Response(
        status,
        headers=headers,
        json={
            "error": {
                "message": "KV cache budget exhausted; retry later",
                "type": "server_overloaded",
                "code": "kv_cache_full",
            }
        },
    )


def models(*entries: dict[str, Any]) -> httpx.Response:
    data = list(entries) or [{"id": MODEL, "object": "model", "max_model_len": CONTEXT}]
    return httpx.Response(200, json={"object": "list", "data": data})


def sse(*events: dict[str, Any] | str, done: bool = True) -> httpx.Response:
    """A text/event-stream answer; dict events are JSON-encoded."""
    lines = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        lines.append(f"data: {data}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content="".join(lines).encode()
    )


def text_events(*parts: str, chat: bool = False, usage: bool = True) -> list[dict[str, Any]]:
    """Stream events for ``parts``, the last one finishing with "stop", then a usage chunk."""
    events: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        finish = "stop" if i == len(parts) - 1 else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": part}
        else:
            choice["text"] = part
        events.append({"id": "s-1", "model": MODEL, "choices": [choice]})
    if usage:
        events.append(
            {
                "id": "s-1",
                "model": MODEL,
                "choices": [],
                "usage": {"prompt_tokens": 4, "completion_tokens": len(parts)},
            }
        )
    return events


class BrokenStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that yields ``chunks`` and then fails like a dropped connection."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = list(chunks)

    def __iter__(self) -> Any:
        yield from self._chunks
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")

    async def __aiter__(self) -> Any:
        for chunk in self._chunks:
            yield chunk
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


def broken_sse(*events: dict[str, Any]) -> httpx.Response:
    chunks = [f"data: {json.dumps(event)}\n\n".encode() for event in events]
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=BrokenStream(chunks)
    )


COUNTER = TiktokenCounter()


def room(response: httpx.Response, remaining: int, quota: int = 10_000) -> httpx.Response:
    """``response`` advertising ``remaining`` free KV tokens of ``quota`` (RateLimit headers)."""
    policy, current = format_ratelimit(quota=quota, remaining=remaining, reset=5.0)
    response.headers["RateLimit-Policy"] = policy
    response.headers["RateLimit"] = current
    return response


def refused(request: httpx.Request) -> httpx.Response:
    """A replica that refuses connections."""
    raise httpx.ConnectError("connection refused", request=request)


def client_options(server: FakeServer, **overrides: Any) -> dict[str, Any]:
    """Client options for the scripted ``server``; with ``http_client=`` there is no transport."""
    options: dict[str, Any] = {
        "base_url": BASE_URL,
        "model": MODEL,
        "context_window": CONTEXT,
        "counter": COUNTER,
        "retry": server.clock.policy(),
    }
    if "http_client" not in overrides:
        options["transport"] = httpx.MockTransport(server.handler)
    options.update(overrides)
    return options


def make_client(server: FakeServer, **overrides: Any) -> Client:
    return Client(**client_options(server, **overrides))


def make_async_client(server: FakeServer, **overrides: Any) -> AsyncClient:
    return AsyncClient(**client_options(server, **overrides))


def new_server(**kwargs: Any) -> FakeServer:
    return FakeServer(clock=FakeClock(), **kwargs)
