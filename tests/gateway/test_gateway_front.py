"""The gateway's own HTTP/1.1 front (``reference_server._front``), on raw sockets: what an ASGI
server owes its clients and its app."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from reference_server._front import DRAIN_LIMIT_BYTES
from reference_server._runner import RunningServer, serve_front_in_thread

LIMIT = 1000


class Recorder:
    """An ASGI app: echoes the request, streams when asked, fails when asked."""

    def __init__(self) -> None:
        self.lifespan: list[str] = []
        self.disconnects = threading.Event()
        self.paths: list[str] = []  # every request the app was given

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        self.paths.append(scope["path"])
        message = await receive()
        body = message["body"]
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("a secret prompt")
        if path == "/boom-late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
            raise RuntimeError("a secret prompt")
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            for i in range(3):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                            "more_body": True})  # fmt: skip
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if path == "/big":  # more than any socket holds, in one answer
            size = 64 * 1024 * 1024
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(size).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"z" * size})
            self.disconnects.set()  # the write returned: taken, or cut
            return
        if path == "/wait":  # until the client goes away
            assert (await receive())["type"] == "http.disconnect"
            self.disconnects.set()
            return
        echo = json.dumps(
            {
                "method": scope["method"],
                "path": path,
                "query": scope["query_string"].decode(),
                "size": len(body),
                "client": list(scope["client"]),
            }
        ).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(echo)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": echo})


@contextmanager
def front(
    app: Any = None, idle: float = 5.0, send_timeout: float | None = None
) -> Iterator[tuple[RunningServer, Recorder]]:
    recorder = app or Recorder()
    try:
        with serve_front_in_thread(
            recorder, max_body_bytes=LIMIT, keep_alive_timeout=idle, send_timeout=send_timeout
        ) as server:
            yield server, recorder
    finally:
        while _OPEN:
            _OPEN.pop().close()


_OPEN: list[socket.socket] = []


def _raw(server: RunningServer) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=5)
    _OPEN.append(sock)  # closed by front() on the way out
    return sock


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """``count`` answers from ``sock``: (status, headers, body), Content-Length or chunked."""
    buffer = b""
    answers = []

    def need(n: int) -> None:
        nonlocal buffer
        while len(buffer) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buffer += chunk

    def line() -> bytes:
        nonlocal buffer
        while b"\r\n" not in buffer:
            need(len(buffer) + 1)
        head, _, buffer = buffer.partition(b"\r\n")
        return head

    while len(answers) < count:
        status = int(line().split()[1])
        headers: dict[bytes, bytes] = {}
        while header := line():
            name, _, value = header.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            continue
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while size := int(line(), 16):
                need(size + 2)
                body, buffer = body + buffer[:size], buffer[size + 2 :]
            line()
        else:
            size = int(headers.get(b"content-length", b"0"))
            need(size)
            body, buffer = buffer[:size], buffer[size:]
        answers.append((status, headers, body))
    return answers


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    with front() as (server, _):
        sock = _raw(server)
        sock.sendall(
            b"GET /a?x=1 HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
            b"GET /c%20d HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        answers = _read_answers(sock, 3)
        echoed = [json.loads(body) for _, _, body in answers]
        assert [e["path"] for e in echoed] == ["/a", "/b", "/c d"]
        assert echoed[0]["query"] == "x=1"
        assert echoed[1]["size"] == 5
        assert all(status == 200 and b"date" in headers for status, headers, _ in answers)
        sock.sendall(b"GET /again HTTP/1.1\r\nHost: t\r\n\r\n")  # still open
        assert json.loads(_read_answers(sock, 1)[0][2])["path"] == "/again"
        sock.close()


def test_chunked_bodies_streams_and_head() -> None:
    with front() as (server, _):
        sock = _raw(server)
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
            b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        (s1, _, b1), (s2, h2, b2) = _read_answers(sock, 2)
        assert s1 == s2 == 200
        assert json.loads(b1)["size"] == 7
        assert h2[b"transfer-encoding"] == b"chunked"
        assert b2 == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        sock.close()
        sock = _raw(server)
        sock.sendall(b"HEAD /y HTTP/1.1\r\nHost: t\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200")
        assert head.endswith(b"\r\n\r\n")  # a HEAD answer has no body
        sock.close()


def test_expect_100_continue_and_the_body_limit() -> None:
    with front() as (server, _):
        sock = _raw(server)
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"
        )
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"abc")
        assert json.loads(_read_answers(sock, 1)[0][2])["size"] == 3
        # Over the limit, with 100-continue: refused at once, no 100.
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {LIMIT + 1}\r\n\r\n".encode()
        )
        status, headers, body = _read_answers(sock, 1)[0]
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert headers[b"connection"] == b"close"
        assert _closed(sock)
        # Over the limit, sent whole: drained, then refused.
        with httpx.Client(base_url=server.base_url) as http:
            answer = http.post("/x", content=b"x" * (LIMIT * 3))
            assert answer.status_code == 413
            assert http.post("/x", content=b"x" * LIMIT).json()["size"] == LIMIT
        # Declared beyond what is ever drained: answered before the body.
        sock = _raw(server)
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: t\r\n"
            + f"Content-Length: {DRAIN_LIMIT_BYTES + 1}\r\n\r\n".encode()
        )
        assert _read_answers(sock, 1)[0][0] == 413
        assert _closed(sock)


def test_malformed_requests_and_oversized_heads_are_refused() -> None:
    with front() as (server, _):
        sock = _raw(server)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert _read_answers(sock, 1)[0][0] == 400
        assert _closed(sock)
        sock = _raw(server)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert _read_answers(sock, 1)[0][0] == 431
        assert _closed(sock)


def test_an_unexpected_error_is_a_generic_500_or_a_cut_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with front() as (server, _), httpx.Client(base_url=server.base_url) as http:
        answer = http.get("/boom")
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "internal_error"
        with pytest.raises(httpx.HTTPError):
            http.get("/boom-late").read()
        assert http.get("/fine").status_code == 200
    assert "a secret prompt" not in caplog.text
    assert "unexpected RuntimeError" in caplog.text


def test_receive_says_disconnect_when_the_client_goes_away() -> None:
    with front() as (server, recorder):
        sock = _raw(server)
        sock.sendall(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        time.sleep(0.1)
        # A reset: a plain close looks like a half-close until a write fails (see _protocol).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
        assert recorder.disconnects.wait(5)


def _read_to_the_end(sock: socket.socket) -> None:
    while sock.recv(1 << 16):
        pass


def test_a_write_the_client_does_not_take_is_cut_after_the_send_timeout() -> None:
    with front(send_timeout=0.3) as (server, recorder):
        sock = _raw(server)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
        started = time.monotonic()
        assert recorder.disconnects.wait(10)  # not one byte read, the socket kept open
        assert time.monotonic() - started < 5
        # Cut with a reset: what the kernel had queued is dropped, and the client is told the
        # answer was cut, not that it ended (a plain close would trickle it out, then EOF).
        time.sleep(0.1)
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            _read_to_the_end(sock)


def test_a_half_closed_client_gets_its_answer() -> None:
    with front() as (server, _):
        sock = _raw(server)
        sock.sendall(b"GET /half HTTP/1.1\r\nHost: t\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        assert json.loads(_read_answers(sock, 1)[0][2])["path"] == "/half"
        assert _closed(sock)


def test_a_head_that_trickles_in_is_answered_408_and_closed() -> None:
    recorder = Recorder()
    with serve_front_in_thread(recorder, max_body_bytes=LIMIT, head_timeout=0.3) as server:
        sock = _raw(server)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
        started = time.monotonic()
        assert _read_answers(sock, 1)[0][0] == 408
        assert _closed(sock)
        assert time.monotonic() - started < 3
        with httpx.Client(base_url=server.base_url) as http:  # everyone else still served
            assert http.get("/fine").status_code == 200
    while _OPEN:
        _OPEN.pop().close()


def test_a_body_that_stops_moving_is_answered_408_and_closed() -> None:
    """A body that keeps moving is waited for, however slowly; one that stops for
    ``body_timeout`` is answered 408 and its connection closed, before the app ever saw it."""
    recorder = Recorder()
    with serve_front_in_thread(recorder, max_body_bytes=LIMIT, body_timeout=1.0) as server:
        sock = _raw(server)
        sock.sendall(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\nab")
        for piece in (b"cd", b"ef"):  # each gap well under the timeout
            time.sleep(0.3)
            sock.sendall(piece)
        status, _, body = _read_answers(sock, 1)[0]
        assert status == 200
        assert json.loads(body)["size"] == 6
        sock.sendall(b"POST /stuck HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\nab")
        started = time.monotonic()
        assert _read_answers(sock, 1)[0][0] == 408
        assert _closed(sock)
        assert 0.9 <= time.monotonic() - started < 5
        assert all(path != "/stuck" for path in recorder.paths)
        with httpx.Client(base_url=server.base_url) as http:  # everyone else still served
            assert http.get("/fine").status_code == 200
    while _OPEN:
        _OPEN.pop().close()


def test_lifespan_runs_and_idle_connections_close() -> None:
    recorder = Recorder()
    with front(recorder, idle=0.2) as (server, _):
        assert recorder.lifespan == ["lifespan.startup"]
        sock = _raw(server)
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
        _read_answers(sock, 1)
        started = time.monotonic()
        assert _closed(sock)
        assert time.monotonic() - started < 3
    assert recorder.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def test_a_header_with_a_line_break_is_never_written(caplog: pytest.LogCaptureFixture) -> None:
    async def injecting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-evil", b"a\r\nset-cookie: b")]})  # fmt: skip

    with front(injecting) as (server, _), httpx.Client(base_url=server.base_url) as http:
        answer = http.get("/")
        assert answer.status_code == 500
        assert "set-cookie" not in answer.headers
    assert "unexpected RuntimeError" in caplog.text


def _request_bytes(i: int, size: int, chunked: bool) -> bytes:
    body = bytes([97 + i % 26]) * size
    if chunked:
        middle = size // 2
        framed = b""
        for part in (body[:middle], body[middle:]):
            if part:
                framed += b"%x\r\n%s\r\n" % (len(part), part)
        return f"POST /r{i} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + (
            framed + b"0\r\n\r\n"
        )
    return f"POST /r{i} HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n\r\n".encode() + body


def test_pipelined_requests_cut_anywhere_are_all_answered_in_order() -> None:
    """However the bytes of several requests are cut into writes, each is answered once, in
    order, with its own body (httptools' callbacks and the front's queue across reads)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    with front() as (server, _):

        @settings(max_examples=40, deadline=None)
        @given(
            shapes=st.lists(
                st.tuples(st.integers(0, LIMIT), st.booleans()), min_size=1, max_size=6
            ),
            cuts=st.lists(st.integers(1, 400), max_size=12),
        )
        def check(shapes: list[tuple[int, bool]], cuts: list[int]) -> None:
            data = b"".join(_request_bytes(i, n, c) for i, (n, c) in enumerate(shapes))
            sock = _raw(server)
            at = 0
            for cut in cuts:
                if at >= len(data):
                    break
                sock.sendall(data[at : at + cut])
                at += cut
                time.sleep(0.001)
            sock.sendall(data[at:])
            answers = _read_answers(sock, len(shapes))
            echoed = [json.loads(body) for _, _, body in answers]
            assert [e["path"] for e in echoed] == [f"/r{i}" for i in range(len(shapes))]
            assert [e["size"] for e in echoed] == [n for n, _ in shapes]
            sock.close()

        check()


def test_garbage_never_takes_the_front_down() -> None:
    """Whatever a client sends, the front answers it (400, 431, 413, or an echo) or closes, and
    goes on serving everyone else."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    valid = b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n"
    with front(idle=0.5) as (server, _), httpx.Client(base_url=server.base_url) as http:

        @settings(max_examples=60, deadline=None)
        @given(
            junk=st.one_of(
                st.binary(max_size=300),
                st.builds(
                    lambda a, b: valid[:a] + b, st.integers(0, len(valid)), st.binary(max_size=50)
                ),
            )
        )
        def check(junk: bytes) -> None:
            sock = _raw(server)
            sock.settimeout(2)
            try:
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass  # a reset is an answer too (a timeout is not: it fails)
            finally:
                sock.close()
            assert http.get("/after").status_code == 200

        check()
