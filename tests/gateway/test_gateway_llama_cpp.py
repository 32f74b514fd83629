"""In front of llama.cpp, which runs a plain request to its end after its client has gone but
stops a stream at its next token: the gateway asks a plain request upstream as a stream and
answers the plain answer assembled from it, so that a client that leaves stops the engine and
frees its reservation at once, plain or streamed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import llama_engine
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvclient import TiktokenCounter
from reference_server import RunningServer
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import scripted_upstream

NO_EOS = {"128009": -100, "128001": -100}  # the tiny model's end tokens: run to the cap
FIXED = {"temperature": 0, "seed": 11}


def _at_zero(gateway: Any) -> bool:
    return all(k.ledger.stats().reserved_tokens == 0 for k in gateway.gateway.known)


def _chunk(index: int, text: str, finish: str | None = None) -> bytes:
    choice = {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
    event = {"choices": [choice], "created": 1, "model": "m", "object": "text_completion"}
    return b"data: " + json.dumps({**event, "id": "cmpl-1"}).encode() + b"\n\n"


_USAGE = {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5}
_WHOLE = (
    _chunk(0, "Hello")
    + _chunk(0, " there", "length")
    + b"data: "
    + json.dumps({"choices": [], "usage": _USAGE}).encode()
    + b"\n\ndata: [DONE]\n\n"
)


def _llama_like(stream: bytes, seen: list[dict[str, Any]]) -> Starlette:
    """An upstream that discovers as llama.cpp (``meta.n_ctx``, ``/props``) and answers every
    completion with ``stream``'s bytes as an event stream."""

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "meta": {"n_ctx": 1024}}]})

    async def props(request: Request) -> Response:
        return JSONResponse({"default_generation_settings": {"n_ctx": 1024}, "total_slots": 4})

    async def completions(request: Request) -> Response:
        seen.append(await request.json())

        async def body() -> Any:
            yield stream

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"x-accel-buffering": "no"}
        )

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/props", props),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@contextmanager
def _gateway_over(stream: bytes, **config: Any) -> Iterator[tuple[RunningServer, list[Any]]]:
    seen: list[dict[str, Any]] = []
    with (
        scripted_upstream(_llama_like(stream, seen)) as up,
        running_gateway(
            GatewayConfig(upstreams=(up.base_url,), counter=TiktokenCounter(), **config)
        ) as gw,
    ):
        yield gw, seen


def _plain(gw: RunningServer, **body: Any) -> httpx.Response:
    body = {"prompt": "Once", "max_tokens": 8, **body}
    return httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)


def test_a_plain_request_goes_upstream_as_a_stream_and_comes_back_plain() -> None:
    with _gateway_over(_WHOLE) as (gw, seen):
        answer = _plain(gw, stream=False)
        wait_for(lambda: _at_zero(gw))
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert "x-accel-buffering" not in answer.headers
    assert answer.json() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "text": "Hello there", "logprobs": None, "finish_reason": "length"}
        ],
        "usage": _USAGE,
    }
    assert seen[0]["stream"] is True
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["max_tokens"] == 8


def test_a_streamed_request_is_relayed_as_it_came() -> None:
    with _gateway_over(_WHOLE) as (gw, seen):
        body = {"prompt": "Once", "max_tokens": 8, "stream": True}
        answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200
    assert answer.content == _WHOLE
    assert "stream_options" not in seen[0]


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        ({"code": 500, "message": "Context size has been exceeded.", "type": "server_error"},
         500, "server_error"),
        ({"code": 400, "message": "bad", "type": "invalid_request_error"}, 400, None),
    ],
)  # fmt: skip
def test_an_error_event_mid_stream_is_answered_as_the_plain_request_would_be(
    error: dict[str, Any], status: int, code: str | None
) -> None:
    """llama.cpp's error event carries the status its plain answer would have had: a 4xx
    passes as the engine's body, a 5xx in the gateway's shape (and counts as an engine
    failure), as when the engine answers the status itself."""
    stream = _chunk(0, "Hello") + b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    with _gateway_over(stream) as (gw, _):
        answer = _plain(gw)
        wait_for(lambda: _at_zero(gw))
        errors = gw.gateway.upstreams[0].errors
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    if status < 500:
        assert answer.json() == {"error": error}
        assert errors == 0
    else:
        assert answer.json()["error"]["code"] == code
        assert error["message"] in answer.json()["error"]["message"]
        assert errors == 1


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(_chunk(0, "Hello"), id="cut-off"),
        pytest.param(b'{"choices": []}', id="not-a-stream"),
    ],
)
def test_a_stream_that_is_no_whole_answer_is_a_broken_answer(stream: bytes) -> None:
    with _gateway_over(stream) as (gw, _):
        answer = _plain(gw)
        wait_for(lambda: _at_zero(gw))
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_answer_broken"


def test_a_stream_past_the_answer_limit_is_too_large() -> None:
    with _gateway_over(_WHOLE, max_answer_bytes=len(_WHOLE) - 1) as (gw, _):
        answer = _plain(gw)
        wait_for(lambda: _at_zero(gw))
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_answer_too_large"


# --- in front of the real llama.cpp --------------------------------------------------------


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    """What two answers to the same request must share (not their id, time, timings, or what
    the prompt cache held)."""
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    kept = {k: v for k, v in answer.items() if k not in ("id", "created", "timings")}
    return {**kept, "usage": usage}


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/completions", {"prompt": "Once", "n": 2, "logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ],
    ids=["chat", "completion", "completion-n2-logprobs", "chat-n2"],
)
def test_a_plain_answer_through_the_gateway_is_llama_cpps_own(
    llama: llama_engine.LlamaServer, path: str, body: dict[str, Any]
) -> None:
    """The same request, directly and through the gateway (which asks it as a stream): the
    same answer, but for what differs between any two answers."""
    body = {**body, **FIXED, "max_tokens": 24}
    direct = httpx.post(llama.url + path, json=body, timeout=60)
    with running_gateway(GatewayConfig(upstreams=(llama.url,))) as gw:
        through = httpx.post(gw.base_url + path, json=body, timeout=60)
        wait_for(lambda: _at_zero(gw))
    assert direct.status_code == through.status_code == 200, through.text
    assert through.headers["content-type"] == "application/json"
    assert _same(through.json()) == _same(direct.json())
    assert set(through.json()) == set(direct.json())  # timings too


def _slots_busy(url: str) -> int:
    slots = httpx.get(url + "/slots", timeout=5).json()
    return sum(1 for slot in slots if slot.get("is_processing"))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_stops_the_engine_and_frees_its_reservation(
    llama: llama_engine.LlamaServer, how: str, stream: bool, path: str
) -> None:
    """The client closes (FIN) or resets (RST) mid-generation, its request plain or streamed:
    the upstream stream is reset, llama.cpp stops at its next token, and within a second its
    slot is idle and the ledger at zero (the request would otherwise run for seconds)."""
    with running_gateway(GatewayConfig(upstreams=(llama.url,))) as gw:
        body: dict[str, Any] = {"max_tokens": 450, "logit_bias": NO_EOS, "stream": stream}
        if path == "/v1/completions":
            body["prompt"] = "Once"
        else:
            body["messages"] = [{"role": "user", "content": "Once"}]
        payload = json.dumps(body).encode()
        sock = socket.create_connection((gw.host, gw.port))
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: not _at_zero(gw))
        wait_for(lambda: _slots_busy(llama.url) == 1, timeout=10)
        if how == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        left = time.monotonic()
        sock.close()
        wait_for(lambda: _at_zero(gw) and _slots_busy(llama.url) == 0, timeout=1.0)
        assert time.monotonic() - left < 1.5
