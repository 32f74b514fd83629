"""What the gateway takes from upstreams and clients is checked before it steers anything:
advice, usage figures, failures blamed on the right party, credentials kept apart."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import llama_engine
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reference_server.gateway import GatewayConfig
from reference_server.gateway.upstream import Upstream
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import discoverable, scripted_upstream


def _reserved(gateway: Any) -> int:
    return sum(k.ledger.stats().reserved_tokens for k in gateway.gateway.known)


@pytest.mark.parametrize(
    ("given", "expected"),
    [("-5", "1"), ("soon", "1"), ("", "1"), ("NaN", "1"), ("1.5", "2"), ("5, 6", "6"),
     ("7", "7"), (None, "1")],
)  # fmt: skip
def test_an_upstream_429s_advice_reaches_the_client_in_valid_syntax(
    given: str | None, expected: str
) -> None:
    """RFC 9110 allows a non-negative integer or an HTTP-date: anything else is replaced."""

    async def busy(request: Request) -> Response:
        headers = {} if given is None else {"Retry-After": given}
        return JSONResponse({"error": {"message": "busy"}}, 429, headers=headers)

    app = discoverable([Route("/v1/completions", busy, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi"})
        wait_for(lambda: _reserved(gw) == 0)
    assert answer.status_code == 429
    assert answer.headers.get_list("retry-after") == [expected]
    assert int(answer.headers["retry-after-ms"]) >= 1


def test_one_lying_usage_figure_moves_the_decode_rate_little() -> None:
    upstream = Upstream("http://127.0.0.1:1", None, GatewayConfig(upstreams=("http://a:1",)))

    class _Ledger:
        decode_rate = 50.0

        def set_speed(self, decode_rate: float, throughput: float | None, now: float) -> None:
            self.decode_rate = decode_rate

    class _Known:
        ledger = _Ledger()

    upstream.known = _Known()  # type: ignore[assignment]
    for _ in range(10):
        upstream.observe(100, 2.0)  # 50 tokens/s
    honest = upstream.measured_rate
    upstream.observe(10**300, 2.0)  # one answer claiming 10^300 tokens
    assert honest == pytest.approx(50.0)
    assert upstream.measured_rate == pytest.approx(50.0)
    upstream.observe(100, float("inf"))  # nonsense durations are ignored
    assert upstream.measured_rate == pytest.approx(50.0)


def test_a_huge_usage_figure_is_relayed_not_a_500() -> None:
    """A ``completion_tokens`` of 5,000 digits is the engine's business: the answer passes."""
    digits = "9" * 5000

    async def liar(request: Request) -> Response:
        usage = '"usage":{"completion_tokens":' + digits + "}"
        text = '{"choices":[{"index":0,"text":"x"}],' + usage + "}"
        return Response(text, media_type="application/json")

    app = discoverable([Route("/v1/completions", liar, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 9})
        wait_for(lambda: _reserved(gw) == 0)
        assert answer.status_code == 200
        rate = gw.gateway.upstreams[0].measured_rate
    assert rate is None or rate < 1e6  # capped by the 9 tokens it was allowed


def test_errors_one_requests_content_causes_do_not_set_the_upstream_aside() -> None:
    """Three engine 500s for one client's images, then everyone else is still served."""

    async def engine(request: Request) -> Response:
        body = await request.json()
        if body["prompt"] == "image":
            return JSONResponse({"error": {"message": "image input is not supported"}}, 500)
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "usage": {}})

    app = discoverable([Route("/v1/completions", engine, methods=["POST"])])
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), failure_threshold=3)
        with running_gateway(config) as gw, httpx.Client(base_url=gw.base_url) as http:
            for _ in range(4):
                bad = http.post("/v1/completions", json={"prompt": "image", "max_tokens": 4})
                assert bad.status_code == 500
            good = http.post("/v1/completions", json={"prompt": "text", "max_tokens": 4})
            assert good.status_code == 200, good.text
            assert http.get("/health").json()["upstreams"][0]["in_service"] is True


def _breaks_after_the_head(port_holder: list[int], calls: list[int]) -> threading.Thread:
    """A raw upstream that discovers as ours, then answers a completion's head and a piece of
    its body and closes: an answer that started, then broke."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port_holder.append(server.getsockname()[1])

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            line = data.split(b"\r\n", 1)[0]
            if line.startswith(b"GET /v1/models"):
                body = json.dumps({"data": [{"id": "m", "max_model_len": 1024}]}).encode()
            elif line.startswith(b"GET /metrics"):
                body = b"kv_physical_capacity_tokens 4096\n"
            elif line.startswith(b"POST /tokenize"):
                body = b'{"count": 3, "tokens": [1, 2, 3]}'
            else:
                calls.append(1)
                conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"choices":')
                return
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )

    def serve() -> None:
        with server:
            server.settimeout(20)
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_an_answer_that_started_is_never_retried_elsewhere() -> None:
    port: list[int] = []
    calls: list[int] = []
    _breaks_after_the_head(port, calls)
    other_calls: list[int] = []

    async def other(request: Request) -> Response:
        other_calls.append(1)
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "usage": {}})

    app = discoverable([Route("/v1/completions", other, methods=["POST"])], kv=1024)
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(f"http://127.0.0.1:{port[0]}", up.base_url))
        with running_gateway(config) as gw:
            answer = httpx.post(
                gw.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 5}
            )
            wait_for(lambda: _reserved(gw) == 0)
    assert calls == [1]  # the broken one was tried (it has the most room)...
    assert other_calls == []  # ...and its work never done twice
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "upstream_answer_broken"


def test_credentials_are_kept_apart_and_never_shown() -> None:
    seen: list[dict[str, str | None]] = []

    async def engine(request: Request) -> Response:
        seen.append({"authorization": request.headers.get("authorization")})
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "usage": {}})

    app = discoverable([Route("/v1/completions", engine, methods=["POST"])])
    with scripted_upstream(app) as up:
        with_user = up.base_url.replace("http://", "http://admin:s3cret@")
        config = GatewayConfig(upstreams=(with_user,), api_key="client-key")
        with running_gateway(config) as gw, httpx.Client(base_url=gw.base_url) as http:
            key = {"Authorization": "Bearer client-key"}
            answer = http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=key
            )
            shown = http.get("/metrics").text + http.get("/health").text
        with running_gateway(
            GatewayConfig(upstreams=(up.base_url,), upstream_api_key="engine-key")
        ) as gw2:
            httpx.post(gw2.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert answer.status_code == 200
    basic = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    assert seen[0] == {"authorization": basic}  # the URL's user, not the client's key
    assert seen[1] == {"authorization": "Bearer engine-key"}
    assert "s3cret" not in shown
    assert "admin" not in shown
    assert up.base_url in shown


def _models_nested(depth: int) -> bytes:
    return b'{"data": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("models", "metrics", "kv", "said"),
    [
        (None, "kv_physical_capacity_tokens +Inf\n", None, "no KV budget discovered"),
        (None, 'vllm:cache_config_info{block_size="1000000000",num_gpu_blocks="4"} 1\n', None,
         "no KV budget discovered"),
        (_models_nested(100_000), None, None, "no context window discovered"),
        (None, 'vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1\n', 15,
         "under one block"),
    ],
)  # fmt: skip
def test_an_upstream_whose_numbers_cannot_be_used_is_a_503_that_says_why(
    models: bytes | None, metrics: str | None, kv: int | None, said: str
) -> None:
    async def listing(request: Request) -> Response:
        if models is not None:
            return Response(models, media_type="application/json")
        return JSONResponse({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 1024}]})

    async def exposition(request: Request) -> Response:
        return Response(metrics or "")

    async def engine(request: Request) -> Response:
        return JSONResponse({"choices": [], "usage": {}})

    app = discoverable([Route("/v1/completions", engine, methods=["POST"])])
    app.router.routes[:2] = [Route("/v1/models", listing), Route("/metrics", exposition)]
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), kv_tokens=(kv,) if kv else ())
        with running_gateway(config) as gw:
            answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 503
    message = answer.json()["error"]["message"]
    assert up.base_url in message
    assert said in message


@pytest.fixture(scope="module")
def roomy_llama(llama_engine_ready: None) -> Iterator[llama_engine.LlamaServer]:
    """A real llama-server whose slots have room for an image's estimated 576 tokens."""
    with llama_engine.LlamaServer(ctx=4096, parallel=2) as server:
        yield server


@pytest.mark.llama_cpp
def test_image_chats_to_a_text_only_llama_cpp_do_not_stop_the_next_request(
    roomy_llama: llama_engine.LlamaServer,
) -> None:
    """llama.cpp without a vision projector answers a chat with an image with a 500: three of
    them from one client leave the upstream in service for everyone else."""
    llama = roomy_llama
    url = "data:image/png;base64,iVBORw0KGgo="
    image = {"type": "image_url", "image_url": {"url": url, "detail": "low"}}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}
    with (
        running_gateway(GatewayConfig(upstreams=(llama.url,))) as gw,
        httpx.Client(base_url=gw.base_url, timeout=60) as http,
    ):
        refused = [
            http.post("/v1/chat/completions", json={**chat, "max_tokens": 4}).status_code
            for _ in range(3)
        ]
        good = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        health = http.get("/health").json()
        wait_for(lambda: _reserved(gw) == 0)
    assert refused == [500, 500, 500], refused  # the engine's error, passed on
    assert good.status_code == 200, good.text
    assert health["upstreams"][0]["in_service"] is True
