"""Real loopback sockets against the real server (uvicorn): a client that stops reading cannot
pin its reservation, and a client that half-closes or closes is gone at once. Every case ends
with the ledger back at zero."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reference_server import RunningServer, running_server
from tests.helpers.servers import at_zero, wait_for


def request_bytes(path: str, body: dict[str, Any], *, close: bool = False) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + payload


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


# --- a client that stops reading a stream ------------------------------------------------------

#: 1.5 M tokens at 1 M tok/s: due 1.5 s after admission, about 7 MB of text, more than the
#: loopback socket buffers can hold (about 4 MB here).
STALL: dict[str, Any] = {
    "kv_tokens": 4_000_000,
    "context_window": 2_000_000,
    "decode_rate": 1_000_000.0,
    "mean_output_tokens": 50_000_000.0,  # natural lengths far beyond the cap: runs to the cap
    "tick_seconds": 0.005,
    "send_timeout": 0.3,
    "socket_send_buffer": 8192,  # the server's writes back up soon after the client's buffer
}
STALL_CAP = 1_500_000


def test_a_client_that_stops_reading_a_stream_is_cut_and_releases(
    request: pytest.FixtureRequest,
) -> None:
    with running_server(**STALL) as server:
        reader = socket.socket()
        request.addfinalizer(reader.close)  # closed even when an assertion fails first
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small: fills at once
        reader.connect((server.host, server.port))
        body = {"prompt": "x", "max_tokens": STALL_CAP, "stream": True}
        reader.sendall(request_bytes("/v1/completions", body))
        wait_for(lambda: server.metrics()["kv_inflight_requests"] == 1)
        admitted = time.monotonic()
        [handle] = server.ledger.live_handles()
        # Once its writes wait on the client, the ledger expects it only when it is cut.
        wait_for(
            lambda: (
                handle.writing_since is not None and time.monotonic() - handle.writing_since > 0.1
            )
        )
        now = time.monotonic()
        since = handle.writing_since
        assert since is not None
        advice = server.ledger.retry_after(server.ledger.usable_tokens, now)
        assert advice == pytest.approx(since + 0.3 - now, abs=0.02)
        # Not one byte read, the socket kept open: released once a write has waited
        # send_timeout, long before its worst case (1.5 s), and before the client hangs up.
        wait_for(lambda: at_zero(server), timeout=3.0)
        held = time.monotonic() - admitted
        metrics = server.metrics()
        assert metrics["kv_send_timeouts_total"] == 1
        data = read_all(reader)  # what the buffers held, then the server's close
        reader.close()
        assert data.startswith(b"HTTP/1.1 200")
        assert b"data: [DONE]" not in data  # cut, not finished
        assert not data.endswith(b"0\r\n\r\n")
        assert held < 1.5


def test_a_cut_answer_is_one_info_line_not_an_error(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """A cut is the send timeout doing its job: one INFO line, no ERROR from uvicorn ("returned
    without completing response"), which logs to its own handlers, not the root's."""
    caplog.set_level(logging.INFO)
    with running_server(**STALL) as server:
        # Added once the server has configured uvicorn's loggers (which drops their handlers).
        uvicorn_error = logging.getLogger("uvicorn.error")
        uvicorn_error.addHandler(caplog.handler)
        request.addfinalizer(lambda: uvicorn_error.removeHandler(caplog.handler))
        reader = socket.socket()
        request.addfinalizer(reader.close)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((server.host, server.port))
        body = {"prompt": "x", "max_tokens": STALL_CAP, "stream": True}
        reader.sendall(request_bytes("/v1/completions", body))
        wait_for(lambda: server.metrics()["kv_send_timeouts_total"] == 1, timeout=5.0)
        wait_for(lambda: at_zero(server), timeout=3.0)
        read_all(reader)  # the server's close: uvicorn has had its say
        time.sleep(0.2)
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert [s for s in said if s[1] >= logging.WARNING] == [], said
    cuts = [s for s in said if "cut" in s[2]]
    assert len(cuts) == 1, said
    assert cuts[0][1] == logging.INFO


def test_a_reader_that_keeps_up_is_never_cut() -> None:
    with running_server(
        kv_tokens=8192, decode_rate=20_000.0, tick_seconds=0.005, send_timeout=0.05
    ) as server:
        with socket.create_connection((server.host, server.port)) as sock:
            body = {"prompt": "x", "max_tokens": 2000, "stream": True}
            sock.sendall(request_bytes("/v1/completions", body, close=True))
            data = read_all(sock)
        assert data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the last chunk, then the end
        assert server.metrics()["kv_send_timeouts_total"] == 0
        wait_for(lambda: at_zero(server))


# --- a client that half-closes or closes is gone ---------------------------------------------

FAST: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 2048,
    "decode_rate": 2000.0,
    "mean_output_tokens": 10_000.0,
    "tick_seconds": 0.005,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(**FAST) as running:
        yield running


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_is_gone_and_releases_at_once(
    server: RunningServer, stream: bool
) -> None:
    """A read EOF ends the request, as nginx, Go and uvicorn take it: the reservation comes back
    long before the 1.5 s the answer would take."""
    body = {"prompt": "hello", "max_tokens": 1500, "stream": stream}
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(request_bytes("/v1/completions", body))
        wait_for(lambda: server.metrics()["kv_inflight_requests"] == 1)
        started = time.monotonic()
        sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: at_zero(server), timeout=1.0)
        assert time.monotonic() - started < 1.0
    assert server.engine.stats().running == 0  # the engine stopped generating for nobody


def test_an_end_of_file_inside_the_body_still_closes_at_once(server: RunningServer) -> None:
    with socket.create_connection((server.host, server.port)) as sock:
        whole = request_bytes("/v1/completions", {"prompt": "hello", "max_tokens": 5})
        sock.sendall(whole[:-5])  # the body is incomplete
        sock.shutdown(socket.SHUT_WR)
        data = read_all(sock)
    assert b"200 OK" not in data  # no answer to a request that never arrived
    wait_for(lambda: at_zero(server))
    assert server.metrics()["kv_inflight_requests"] == 0


def test_a_client_that_closes_while_generating_is_released_at_once(
    server: RunningServer,
) -> None:
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(request_bytes("/v1/completions", {"prompt": "hello", "max_tokens": 1500}))
    wait_for(lambda: server.metrics()["kv_inflight_requests"] == 1)
    sock.close()
    wait_for(lambda: at_zero(server), timeout=1.0)
