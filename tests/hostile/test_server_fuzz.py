"""Hostile input against the real server: every answer a 4xx JSON error or a success, never a 500
or a dropped connection; the server keeps serving and the ledger is back at zero afterwards."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server import RunningServer, running_server

POST_ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"]
CONFIG: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 1024,
    "decode_rate": 100_000.0,
    "mean_output_tokens": 20.0,
    "tick_seconds": 0.005,
    "max_body_bytes": 256 * 1024,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(**CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        yield http


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str)
        assert error["message"]
        assert "Traceback" not in response.text


def settle(server: RunningServer) -> None:
    deadline = time.monotonic() + 5
    while server.metrics()["kv_inflight_requests"] or server.engine.stats().running:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.005)
    metrics = server.metrics()
    assert metrics["kv_reserved_tokens"] == 0
    assert metrics["kv_used_tokens"] == 0
    assert metrics["kv_oom_events_total"] == 0


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
field_values = st.one_of(
    json_values,
    st.integers(min_value=-5, max_value=3000),
    st.just(10**30),
    st.text(max_size=200),
    st.lists(st.integers(min_value=0, max_value=100_000), min_size=1, max_size=20),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"])},
            optional={"content": json_values, "name": json_values},
        ),
        max_size=3,
    ),
)
plausible_bodies = st.dictionaries(
    st.sampled_from(
        [
            "prompt",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "stream_options",
            "n",
            "model",
            "temperature",
            "unknown_field",
        ]
    ),
    field_values,
    max_size=6,
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(POST_ENDPOINTS), body=plausible_bodies | json_values)
def test_random_json_bodies_never_get_a_500(
    server: RunningServer, client: httpx.Client, path: str, body: Any
) -> None:
    check(client.post(path, json=body))


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(POST_ENDPOINTS), raw=st.binary(max_size=200))
def test_random_bytes_never_get_a_500(
    server: RunningServer, client: httpx.Client, path: str, raw: bytes
) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    check(response)
    assert response.status_code != 200 or raw.strip().startswith(b"{")


HOSTILE: list[tuple[str, dict[str, Any], int]] = [
    ("huge cap", {"json": {"prompt": "x", "max_tokens": 10**30}}, 200),
    ("integral float cap", {"json": {"prompt": "x", "max_tokens": 1e308}}, 200),
    ("fractional cap", {"json": {"prompt": "x", "max_tokens": 2.5}}, 400),
    ("negative cap", {"json": {"prompt": "x", "max_tokens": -1}}, 400),
    ("zero cap", {"json": {"prompt": "x", "max_tokens": 0}}, 400),
    ("cap as string", {"json": {"prompt": "x", "max_tokens": "100"}}, 400),
    (
        "5000-digit integer",
        {"content": b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"},
        400,
    ),
    ("deep nesting", {"content": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}, 400),
    ("deep objects", {"content": b'{"a":' * 20_000 + b"1" + b"}" * 20_000}, 400),
    ("megabytes of prompt", {"json": {"prompt": "token " * 1_000_000}}, 413),
    ("invalid UTF-8", {"content": b'{"prompt": "\xff\xfe\xfd"}'}, 400),
    ("lone surrogate", {"content": b'{"prompt": "a\\ud800b", "max_tokens": 3}'}, 200),
    ("NUL bytes", {"json": {"prompt": "a\x00b", "max_tokens": 3}}, 200),
    ("special-token text", {"json": {"prompt": "<|endoftext|>", "max_tokens": 3}}, 200),
    ("text/plain", {"content": b"prompt=x", "headers": {"content-type": "text/plain"}}, 415),
    ("form", {"data": {"prompt": "x"}}, 415),
    ("multipart", {"files": {"prompt": ("a.txt", b"x")}}, 415),
    ("no content type", {"content": b'{"prompt": "x", "max_tokens": 2}', "headers": {}}, 200),
    ("empty body", {"content": b""}, 400),
    ("missing prompt", {"json": {"max_tokens": 5}}, 400),
    ("null prompt", {"json": {"prompt": None}}, 400),
    ("token ids", {"json": {"prompt": [1, 2, 3], "max_tokens": 2}}, 200),
    ("bad token ids", {"json": {"prompt": [1, -2, "x"]}}, 400),
    ("unknown fields", {"json": {"prompt": "x", "max_tokens": 2, "zzz": [{"a": 1}]}}, 200),
    ("array body", {"json": [{"prompt": "x"}]}, 400),
]


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [pytest.param(kw, status, id=name) for name, kw, status in HOSTILE],
)
def test_hostile_completions(
    server: RunningServer, client: httpx.Client, request_kwargs: dict[str, Any], expected: int
) -> None:
    kwargs = dict(request_kwargs)
    headers = kwargs.pop("headers", None)
    if headers is None and "content" in kwargs:
        headers = {"content-type": "application/json"}
    response = client.post("/v1/completions", headers=headers, **kwargs)
    check(response)
    assert response.status_code == expected, response.text[:300]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": None, "tool_calls": [{"id": 1}]}]},
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 3},
        {"messages": [{"role": "user", "content": "x"}], "stream_options": "yes"},
        {"messages": [{"role": "user", "content": "x" * 10_000}]},
        {"messages": [{"role": 1}]},
        {"messages": {"role": "user"}},
    ],
)
def test_hostile_chat(server: RunningServer, client: httpx.Client, body: dict[str, Any]) -> None:
    check(client.post("/v1/chat/completions", json=body))


def test_body_limit_holds_on_every_endpoint(client: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * 300_000}).encode()
    for path in POST_ENDPOINTS:
        response = client.post(path, content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"


def test_chunked_oversized_body_is_413(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{",
        b"GARBAGE\r\n\r\n",
    ],
)
def test_malformed_http_gets_a_4xx_status_line(server: RunningServer, raw: bytes) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), answer[:200]


def test_still_serving_and_ledger_at_zero_afterwards(
    server: RunningServer, client: httpx.Client
) -> None:
    """Runs last in this module: everything above left nothing behind."""
    assert client.get("/health").json()["status"] == "ok"
    ok = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 5})
    assert ok.status_code == 200
    settle(server)
    responses = server.state.responses()
    assert not [key for key in responses if key[1] >= 500], responses
