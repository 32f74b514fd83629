"""The gateway's HTTP/1.1 front (uvicorn, with the head deadline and head size limit of
:mod:`reference_server.http.serving`) and its upstream client (httpx) against peers that bend
or break the protocol: upgrades, framing errors, endless or trickled heads, endless or oversized
upstream answers, answers nobody asked for, clients that leave while queued.

Everything goes over real loopback sockets; raw sockets where a well-behaved client library
would not send the bytes. Every socket has a timeout, so a server that hangs fails a test by
the time it takes, never by hanging the run.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvclient import TiktokenCounter
from reference_server import RunningServer, running_server, serve_in_thread
from reference_server.gateway import GatewayConfig
from reference_server.http.serving import GuardedH11Protocol
from reference_server.testing import running_gateway
from tests.helpers.hostile import accept_each
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import discoverable

FAST: dict[str, Any] = {
    "decode_rate": 4000.0,
    "tick_seconds": 0.005,
    "kv_tokens": 4096,
    "context_window": 1024,
}
MB = 1024 * 1024
SOCKET_TIMEOUT = 5.0
COMPLETION = b'{"prompt": "hi", "max_tokens": 3}'


# --- raw HTTP on the client side ---------------------------------------------------------------


def connect(server: RunningServer, timeout: float = SOCKET_TIMEOUT) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=timeout)


def post_head(path: str, body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    """A POST's head with a JSON body of ``len(body)`` bytes (``extra``: header lines)."""
    lines = [
        b"POST " + path.encode() + b" HTTP/" + version,
        b"Host: t",
        b"Content-Type: application/json",
        b"Content-Length: " + str(len(body)).encode(),
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def read_until_closed(sock: socket.socket, timeout: float = SOCKET_TIMEOUT) -> tuple[bytes, str]:
    """Everything the peer sends until it closes: ``(bytes, how)``, ``how`` being ``"eof"``,
    ``"reset"`` or ``"timeout"`` (the connection is still open after ``timeout`` seconds)."""
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, "timeout"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, "timeout"
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk


@dataclass
class Answer:
    status: int
    version: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        values = [v for k, v in self.headers if k.lower() == name]
        return values[-1] if values else None


class Reader:
    """Reads HTTP/1.x answers one after another from one connection."""

    def __init__(self, sock: socket.socket, timeout: float = SOCKET_TIMEOUT) -> None:
        self.sock = sock
        self.buffer = b""
        self.closed = False
        sock.settimeout(timeout)

    def _fill(self) -> None:
        if self.closed:
            raise EOFError("the connection is closed")
        chunk = self.sock.recv(65536)
        if not chunk:
            self.closed = True
            raise EOFError("the connection is closed")
        self.buffer += chunk

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def answer(self, *, head_only: bool = False) -> Answer:
        status_line = self._line()
        version, status, *_ = status_line.split(b" ", 2)
        assert version.startswith(b"HTTP/"), status_line
        headers = []
        while line := self._line():
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        found = Answer(int(status), version, headers, b"")
        if head_only:
            return found
        if (found.header(b"transfer-encoding") or b"").lower() == b"chunked":
            while size := int(self._line().split(b";")[0], 16):
                found.body += self._take(size)
                assert self._take(2) == b"\r\n"
            while self._line():  # trailers
                pass
        elif (length := found.header(b"content-length")) is not None:
            found.body = self._take(int(length))
        else:  # ended by the close
            try:
                while True:
                    self._fill()
            except EOFError:
                found.body, self.buffer = self.buffer, b""
        return found

    def at_eof(self) -> bool:
        """True when the peer has closed (nothing more is to come), False when it is still open."""
        if self.buffer:
            return False
        try:
            self._fill()
        except (EOFError, ConnectionResetError):
            return True
        except TimeoutError:
            return False
        return False


def exchange(server: RunningServer, request: bytes, timeout: float = SOCKET_TIMEOUT) -> Answer:
    """One request on a new connection, its answer."""
    with connect(server, timeout) as sock:
        sock.sendall(request)
        return Reader(sock, timeout).answer()


def still_serving(server: RunningServer) -> None:
    """A new connection is answered at once: the server is not stuck or dead."""
    started = time.monotonic()
    answer = exchange(server, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n", timeout=3.0)
    assert answer.status == 200, answer
    assert json.loads(answer.body)["status"] == "ok"
    assert time.monotonic() - started < 3.0


def rss_bytes() -> int:
    """This process's resident set (the gateway and upstreams are threads of it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0) rather than a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# --- upstreams ---------------------------------------------------------------------------------


def raw_answer(body: bytes, *extra: bytes, status: bytes = b"200 OK") -> bytes:
    lines = [b"HTTP/1.1 " + status, b"Content-Type: application/json", *extra]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# What a raw upstream's completion script gets: its socket, and a way to wait that ends early
# when the upstream stops. It returns whether the connection may serve another request.
CompletionScript = Callable[[socket.socket, Callable[[float], bool]], bool]


@dataclass
class RawUpstream:
    """A keep-alive HTTP/1.1 upstream written on raw sockets, for answers no framework would
    send: discovery is answered normally (a vLLM-like window, 404 elsewhere) and each
    ``POST /v1/completions`` is handed to ``script``, which writes what it likes."""

    script: CompletionScript
    completions: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self._threads: list[threading.Thread] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> RawUpstream:
        acceptor = threading.Thread(target=self._accept, daemon=True)
        acceptor.start()
        self._threads.append(acceptor)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        accept_each(self._listener, self.stopping, self._serve, self._threads)

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            conn.settimeout(0.1)
            try:
                while not self.stopping.is_set():
                    while b"\r\n\r\n" not in buffer:
                        try:
                            chunk = conn.recv(65536)
                        except TimeoutError:
                            if self.stopping.is_set():
                                return
                            continue
                        if not chunk:
                            return
                        buffer += chunk
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    lines = head.split(b"\r\n")
                    method, path, _ = lines[0].split(b" ", 2)
                    length = 0
                    for line in lines[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    conn.settimeout(SOCKET_TIMEOUT)
                    while len(buffer) < length:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buffer += chunk
                    buffer = buffer[length:]
                    conn.settimeout(0.1)
                    if path == b"/v1/models":
                        conn.sendall(raw_answer(b'{"data": [{"id": "m", "max_model_len": 1024}]}'))
                    elif method == b"POST" and path == b"/v1/completions":
                        self.completions += 1
                        if not self.script(conn, self.stopping.wait):
                            return
                    else:
                        conn.sendall(raw_answer(b"{}", status=b"404 Not Found"))
            except OSError:
                return  # the gateway closed its end: what several scripts provoke


def raw_gateway_config(upstream: RawUpstream) -> GatewayConfig:
    """Window and budget given, a local counter: discovery needs only ``/v1/models``."""
    return GatewayConfig(
        upstreams=(upstream.base_url,),
        kv_tokens=(4096,),
        context_window=1024,
        counter=TiktokenCounter(),
    )


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[RunningServer]:
    with running_server(**FAST) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream: RunningServer) -> Iterator[RunningServer]:
    with running_gateway(GatewayConfig(upstreams=(upstream.base_url,))) as server:
        still_serving(server)  # discovered
        yield server


# --- 1. upgrades ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_an_h2c_upgrade_is_ignored_and_answered_over_http_1_1(
    gateway: RunningServer, method: str
) -> None:
    """``Upgrade: h2c`` is not taken up: the request (its body included) gets an HTTP/1.1 200,
    and the connection then serves the next request or is closed, never left hanging."""
    upgrade = (
        b"Connection: Upgrade, HTTP2-Settings",
        b"Upgrade: h2c",
        b"HTTP2-Settings: AAMAAABkAAQAAP__",
    )
    if method == "GET":
        request = b"\r\n".join([b"GET /v1/models HTTP/1.1", b"Host: t", *upgrade]) + b"\r\n\r\n"
    else:
        request = post_head("/v1/completions", COMPLETION, *upgrade) + COMPLETION
    with connect(gateway) as sock:
        sock.sendall(request + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        reader = Reader(sock, timeout=2.0)  # under the keep-alive timeout: a hang fails
        answer = reader.answer()
        assert (answer.version, answer.status) == (b"HTTP/1.1", 200), answer
        payload = json.loads(answer.body)
        if method == "GET":
            assert payload["data"][0]["max_model_len"] == 1024
        else:
            assert payload["choices"][0]["finish_reason"] == "length"
            assert payload["usage"]["completion_tokens"] == 3
        try:
            following = reader.answer()
        except (EOFError, ConnectionResetError):
            pass  # cleanly closed
        else:
            assert following.status == 200
            assert json.loads(following.body)["status"] == "ok"
    still_serving(gateway)


def test_curl_http2_falls_back_to_http_1_1(gateway: RunningServer) -> None:
    """``curl --http2`` (an h2c upgrade on a GET) prints the models' JSON."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    done = subprocess.run(
        [curl, "--http2", "-sS", "--max-time", "10", gateway.base_url + "/v1/models"],
        capture_output=True,
        timeout=15,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["data"][0]["max_model_len"] == 1024


# --- 2, 3. what an app writes is framed and validated ---------------------------------------------

SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled"


async def _misbehaving_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A raw ASGI app: ``/over-once`` and ``/over-after`` write past their Content-Length (in the
    same message, in a later one); ``/header/<hex>`` puts those bytes in a header value."""
    if scope["type"] != "http":
        return
    path: str = scope["path"]
    if path.startswith("/header/"):
        value = b"a" + bytes.fromhex(path.removeprefix("/header/")) + b"b"
        headers = [(b"content-length", b"2"), (b"x-bad", value)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
    if path == "/over-once":
        await send(start)
        await send({"type": "http.response.body", "body": b"hello" + SMUGGLED})
    elif path == "/over-after":
        await send(start)
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        await send({"type": "http.response.body", "body": SMUGGLED})
    else:
        await send(start)
        await send({"type": "http.response.body", "body": b"fine!"})


@pytest.mark.parametrize("path", ["/over-once", "/over-after"])
def test_an_answer_longer_than_its_content_length_cannot_desync_the_connection(path: str) -> None:
    """The bytes past the Content-Length are never written: the connection closes, and the
    pipelined request after it is never answered with the app's smuggled answer."""
    with serve_in_thread(_misbehaving_app, lifespan="off") as server, connect(server) as sock:  # type: ignore[arg-type]
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\nGET /ok HTTP/1.1\r\nHost: t\r\n\r\n".encode()
        )
        data, how = read_until_closed(sock)
        assert how in ("eof", "reset"), (how, data)
        assert b"smuggled" not in data
        assert data.count(b"HTTP/1.1 ") == 1  # the first answer's head, nothing after it
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"content-length: 5" in head
        assert body in (b"", b"hello")  # then closed: a client sees a short or whole body
        assert exchange(server, b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n").body == b"fine!"


@pytest.mark.parametrize(
    "bad",
    [b"\x00", b"\r", b"\n", b"\r\nset-cookie: x=1"],
    ids=["nul", "cr", "lf", "crlf-injection"],
)
def test_a_control_character_in_an_app_header_value_never_reaches_the_wire(bad: bytes) -> None:
    """uvicorn refuses the header before writing any of the head: the connection is closed
    without a byte (the answer had started, so no 500 can follow), and the server serves on."""
    with serve_in_thread(_misbehaving_app, lifespan="off") as server, connect(server) as sock:  # type: ignore[arg-type]
        sock.sendall(b"GET /header/" + bad.hex().encode() + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        data, how = read_until_closed(sock)
        assert (data, how) == (b"", "eof")
        assert exchange(server, b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n").body == b"fine!"


def test_a_nul_in_an_upstream_header_is_never_relayed() -> None:
    """An upstream answer with a NUL in a header value is a broken upstream: a JSON 5xx."""

    def script(conn: socket.socket, wait: Callable[[float], bool]) -> bool:
        conn.sendall(raw_answer(b'{"choices": []}', b"X-Bad: a\x00b"))
        return True

    with RawUpstream(script) as up, running_gateway(raw_gateway_config(up)) as gw:
        with connect(gw) as sock:
            sock.sendall(post_head("/v1/completions", COMPLETION) + COMPLETION)
            answer = Reader(sock).answer()
        assert answer.status >= 500
        assert json.loads(answer.body)["error"]["message"]
        assert answer.header(b"x-bad") is None
        assert all(b"\x00" not in value for _, value in answer.headers)
        still_serving(gw)


# --- 4. request targets ---------------------------------------------------------------------------


def test_an_absolute_form_target_is_served(gateway: RunningServer) -> None:
    """``GET http://host:port/v1/models`` (as a proxy client sends it) is the models list."""
    target = f"http://127.0.0.1:{gateway.port}/v1/models".encode()
    answer = exchange(gateway, b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert answer.status == 200
    assert json.loads(answer.body)["data"][0]["max_model_len"] == 1024


# --- 5, 6, 7. heads that never end ----------------------------------------------------------------


def test_an_endless_header_line_is_cut_at_the_head_limit(gateway: RunningServer) -> None:
    """2 MB of one header value without a CRLF: a 431 (or a reset) past 64 KiB, memory flat,
    and /health answers at once meanwhile."""
    still_serving(gateway)
    before = rss_bytes()
    chunk = b"a" * 16384
    sent = 0
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Long: ")
        try:
            while sent < 2 * MB:
                sock.sendall(chunk)
                sent += len(chunk)
                if sent % (512 * 1024) == 0:
                    still_serving(gateway)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the gateway while we were still sending
        data, how = read_until_closed(sock, timeout=3.0)
    assert how in ("eof", "reset"), f"still open after {sent} bytes of head"
    if data:
        assert data.startswith(b"HTTP/1.1 431 "), data[:200]
    still_serving(gateway)
    assert rss_bytes() - before < 20 * MB


def test_thirty_thousand_empty_headers_are_refused_before_the_upstream() -> None:
    """``X: `` 30,000 times (a 150 kB head) is refused as too large (431), whether it arrives in one
    read or several; nothing is forwarded."""
    forwarded: list[int] = []

    async def completions(request: Request) -> Response:
        forwarded.append(len(request.headers))
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    app = discoverable([Route("/v1/completions", completions, methods=["POST"])])
    with serve_in_thread(app) as up, running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw:
        still_serving(gw)
        with connect(gw) as sock:
            with suppress(BrokenPipeError, ConnectionResetError):  # closed while we send
                sock.sendall(
                    post_head("/v1/completions", COMPLETION, *[b"X: "] * 30000) + COMPLETION
                )
            data, how = read_until_closed(sock, timeout=3.0)
        assert how in ("eof", "reset"), data[:200]
        if data:
            assert data.startswith(b"HTTP/1.1 431 "), data[:200]
        assert forwarded == []
        answer = exchange(gw, post_head("/v1/completions", COMPLETION) + COMPLETION)
        assert answer.status == 200
        assert len(forwarded) == 1  # the upstream does count what reaches it


@pytest.mark.parametrize("how", ["bare-crlf", "header-bytes", "idle"])
def test_a_head_that_never_completes_is_closed_at_the_deadline(
    gateway: RunningServer, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Bytes arriving (a CRLF every 0.25 s, a header byte every 0.1 s) do not put off the head
    deadline: the connection is closed at it, as an idle one is."""
    monkeypatch.setattr(GuardedH11Protocol, "head_timeout", 1.0)
    with connect(gateway) as sock:
        started = time.monotonic()
        if how == "header-bytes":
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        pause, piece = {"bare-crlf": (0.25, b"\r\n"), "header-bytes": (0.1, b"z")}.get(
            how, (0.1, b"")
        )
        closed_at = None
        while time.monotonic() - started < 5.0:
            try:
                if piece:
                    sock.sendall(piece)
                sock.settimeout(pause)
                if sock.recv(4096) == b"":
                    closed_at = time.monotonic() - started
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - started
                break
    assert closed_at is not None, "still open after 5 s"
    # At the deadline at the latest (h11 refuses a stray CRLF before any request at once).
    assert closed_at < 3.0, closed_at
    if how != "bare-crlf":
        assert closed_at >= 0.9, closed_at
    still_serving(gateway)


# --- 8, 9, 10. upstreams that answer too much -----------------------------------------------------


def test_endless_upstream_headers_end_in_a_json_error() -> None:
    """An upstream whose answer head never ends: the client gets a JSON 5xx within seconds,
    and the gateway holds only a bounded part of the head."""

    def script(conn: socket.socket, wait: Callable[[float], bool]) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Pad: " + b"p" * 1000 + b"\r\n"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not wait(0):
            conn.sendall(line * 64)
        return False

    with RawUpstream(script) as up, running_gateway(raw_gateway_config(up)) as gw:
        still_serving(gw)
        before = rss_bytes()
        started = time.monotonic()
        answer = httpx.post(
            gw.base_url + "/v1/completions",
            content=COMPLETION,
            headers={"content-type": "application/json"},
            timeout=10,
        )
        assert time.monotonic() - started < 5.0
        assert answer.status_code >= 500
        assert answer.json()["error"]["message"]
        assert rss_bytes() - before < 50 * MB
        assert up.completions == 1  # not retried against the same upstream
        still_serving(gw)


def test_a_100_mb_upstream_answer_is_refused_not_buffered() -> None:
    """A non-streamed answer past ``max_answer_bytes`` (16 MiB) is a 502
    ``upstream_answer_too_large``; the rest is never read into memory."""
    piece = b" " * 65536

    async def completions(request: Request) -> Response:
        async def body() -> Any:
            for _ in range(100 * MB // len(piece)):
                yield piece

        return StreamingResponse(
            body(), media_type="application/json", headers={"content-length": str(100 * MB)}
        )

    app = discoverable([Route("/v1/completions", completions, methods=["POST"])])
    with serve_in_thread(app) as up, running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw:
        still_serving(gw)
        before = rss_bytes()
        answer = httpx.post(
            gw.base_url + "/v1/completions",
            content=COMPLETION,
            headers={"content-type": "application/json"},
            timeout=20,
        )
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "upstream_answer_too_large"
        assert rss_bytes() - before < 50 * MB
        still_serving(gw)


def test_a_second_upstream_answer_on_one_connection_reaches_no_client() -> None:
    """An upstream that writes an unrequested second answer (with a Set-Cookie) right after the
    first: each client gets its own request's answer, and never the second one's headers."""
    first = b'{"choices": [{"index": 0, "text": "first"}], "usage": {"completion_tokens": 1}}'
    second = b'{"choices": [{"index": 0, "text": "SMUGGLED"}]}'

    def script(conn: socket.socket, wait: Callable[[float], bool]) -> bool:
        conn.sendall(
            raw_answer(first, b"X-First: 1")
            + raw_answer(second, b"Set-Cookie: stolen=1", b"X-Second: 1")
        )
        return True

    with RawUpstream(script) as up, running_gateway(raw_gateway_config(up)) as gw:
        with httpx.Client(base_url=gw.base_url, timeout=10) as http:
            for _ in range(3):
                answer = http.post(
                    "/v1/completions",
                    content=COMPLETION,
                    headers={"content-type": "application/json"},
                )
                assert answer.status_code == 200
                assert answer.content == first
                assert answer.headers.get("x-first") == "1"
                assert "set-cookie" not in answer.headers
                assert "x-second" not in answer.headers
        assert up.completions == 3


# --- 11. odd requests -----------------------------------------------------------------------------


def test_a_request_without_host_is_refused(gateway: RunningServer) -> None:
    """An HTTP/1.1 request without Host is a 400 (RFC 9112 3.2)."""
    answer = exchange(gateway, b"GET /v1/models HTTP/1.1\r\n\r\n")
    assert answer.status == 400
    still_serving(gateway)


def test_a_request_with_two_hosts_is_refused(gateway: RunningServer) -> None:
    """Two Host headers are a 400 (RFC 9112 3.2)."""
    answer = exchange(gateway, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    assert answer.status == 400
    still_serving(gateway)


def test_a_connect_request_is_refused(gateway: RunningServer) -> None:
    """CONNECT gets one 4xx JSON answer and no tunnel, and nothing in the log but a line."""
    answer = exchange(gateway, b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n")
    assert 400 <= answer.status < 500
    assert "error" in json.loads(answer.body)
    still_serving(gateway)


def test_a_chunked_trailer_cannot_authenticate(upstream: RunningServer) -> None:
    """An ``Authorization`` sent as a trailer of a chunked body is not a request header: 401."""
    with running_gateway(GatewayConfig(upstreams=(upstream.base_url,), api_key="KEY")) as gw:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nTrailer: Authorization\r\n\r\n"
        )
        body = b"%x\r\n%s\r\n0\r\nAuthorization: Bearer KEY\r\n\r\n" % (len(COMPLETION), COMPLETION)
        answer = exchange(gw, head + body)
        assert answer.status == 401, answer
        keyed = post_head("/v1/completions", COMPLETION, b"Authorization: Bearer KEY") + COMPLETION
        assert exchange(gw, keyed).status == 200  # the key in the head does work


def test_an_http_1_0_client_gets_a_stream_without_chunked_coding(gateway: RunningServer) -> None:
    """HTTP/1.0 has no chunked coding: a streamed answer is ended by the close instead."""
    body = b'{"prompt": "hi", "max_tokens": 3, "stream": true}'
    with connect(gateway) as sock:
        sock.sendall(post_head("/v1/completions", body, version=b"1.0") + body)
        data, how = read_until_closed(sock)
    assert how == "eof"
    head, _, content = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"transfer-encoding" not in head.lower()
    assert b"content-length" not in head.lower()
    events = [e for e in content.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), content[:300]
    assert events[-1] == b"data: [DONE]"
    still_serving(gateway)


def test_a_pipelined_request_before_garbage_is_answered_first(gateway: RunningServer) -> None:
    """A valid request, then garbage on the same connection: the valid one's answer comes
    first, then the refusal (or the close)."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n\x00\x01 garbage\r\n\r\n")
        reader = Reader(sock)
        answer = reader.answer()
        assert answer.status == 200, answer
        assert json.loads(answer.body)["data"][0]["max_model_len"] == 1024
        if not reader.at_eof():
            assert reader.answer().status == 400
            assert reader.at_eof()
    still_serving(gateway)


# --- 12. clients that leave while queued ----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", ["gateway", "server"])
def test_a_queued_client_that_closes_or_resets_leaves_the_queue_at_once(front: str) -> None:
    """A request waiting in the FIFO queue whose client sends a FIN, or a reset, is out of the
    queue within a second, on the gateway and on the reference server alike (one endpoint)."""
    slow = {
        "decode_rate": 50.0,
        "tick_seconds": 0.005,
        "kv_tokens": 1024,
        "context_window": 1024,
        "mean_output_tokens": 1e6,
    }
    with running_server(**slow, max_queue_wait=30.0 if front == "server" else 0.0) as up:
        if front == "server":
            context: Any = _as_is(up)
        else:
            context = running_gateway(GatewayConfig(upstreams=(up.base_url,), max_queue_wait=30.0))
        with context as target:
            if front == "server":
                queue = up.state.queue
            else:
                still_serving(target)
                known = target.app.state.gateway.upstreams[0].known
                assert known is not None
                queue = known.queue
            hold = b'{"prompt": "a", "max_tokens": 600, "stream": true}'
            holder = connect(target)
            try:
                holder.sendall(post_head("/v1/completions", hold) + hold)
                head = Reader(holder).answer(head_only=True)  # streaming: 12 s of decoding
                assert head.status == 200
                wait = b'{"prompt": "b", "max_tokens": 600}'
                for close in (socket.socket.close, reset):
                    leaver = connect(target)
                    leaver.sendall(post_head("/v1/completions", wait) + wait)
                    wait_for(lambda: queue.waiting == 1)
                    left = time.monotonic()
                    close(leaver)
                    wait_for(lambda: queue.waiting == 0, timeout=1.0)
                    assert time.monotonic() - left < 1.0
            finally:
                reset(holder)
            ledger = up.ledger
            wait_for(lambda: ledger.stats().inflight == 0, timeout=5.0)
            assert ledger.stats().admitted_total == 1  # the leavers never reached the engine
            still_serving(target)


@contextmanager
def _as_is(server: RunningServer) -> Iterator[RunningServer]:
    yield server


# --- 13. framing, heads and headers the front refuses ---------------------------------------------

HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def refused_then_closed(server: RunningServer, request: bytes) -> Answer:
    """Sends ``request`` with a valid request pipelined after it: the one answer, which must be
    followed by the close (the pipelined request is never served)."""
    with connect(server) as sock:
        with suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request + HEALTH)
        reader = Reader(sock, timeout=3.0)  # under the keep-alive timeout: a hang fails
        answer = reader.answer()
        assert reader.at_eof(), "the connection was kept open after the refusal"
    return answer


def test_content_length_with_transfer_encoding_is_refused_and_closed(
    gateway: RunningServer,
) -> None:
    """Both framings at once (the request smuggling pattern): a 400, then the close, as RFC 9112
    6.1 requires of a server that answers such a request at all."""
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    head = post_head("/v1/completions", body, b"Transfer-Encoding: chunked")
    answer = refused_then_closed(gateway, head + body)
    assert answer.status == 400, answer
    assert "Transfer-Encoding" in json.loads(answer.body)["error"]["message"]
    still_serving(gateway)


def test_connections_that_send_one_crlf_are_all_closed_by_the_deadline(
    gateway: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fifty connections that each send one CRLF and nothing more: none is open past the head
    deadline (a byte that is not a whole head never puts the deadline off)."""
    monkeypatch.setattr(GuardedH11Protocol, "head_timeout", 1.0)
    socks = [connect(gateway) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"\r\n")
        time.sleep(1.5)
        still_open = []
        for sock in socks:
            _, how = read_until_closed(sock, timeout=0.05)
            if how == "timeout":
                still_open.append(sock)
        assert still_open == []
    finally:
        for sock in socks:
            sock.close()
    still_serving(gateway)


def _recording_upstream(seen: list[list[tuple[bytes, bytes]]]) -> Any:
    async def completions(request: Request) -> Response:
        seen.append(list(request.headers.raw))
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    return discoverable([Route("/v1/completions", completions, methods=["POST"])])


def test_only_the_stated_headers_go_upstream() -> None:
    """Content type, accept, and tracing (traceparent, tracestate, x-request-id) go upstream as
    the client sent them; cookies, the client's own and unknown headers, Prefer (the gateway's
    to honour) and a data-parallel rank (it would steer KV the gateway did not reserve) do not."""
    seen: list[list[tuple[bytes, bytes]]] = []
    kept = [
        (b"accept", b"application/json"),
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        (b"tracestate", b"congo=t61rcWkgMzE"),
        (b"x-request-id", b"req-42"),
    ]
    dropped = [
        (b"cookie", b"session=alice"),
        (b"x-custom", b"1"),
        (b"prefer", b"wait=5"),
        (b"x-data-parallel-rank", b"3"),
        (b"openai-organization", b"org-1"),
        (b"forwarded", b"for=10.0.0.1"),
    ]
    extra = [name + b": " + value for name, value in kept + dropped]
    app = _recording_upstream(seen)
    with serve_in_thread(app) as up, running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw:
        answer = exchange(gw, post_head("/v1/completions", COMPLETION, *extra) + COMPLETION)
    assert answer.status == 200, answer
    [headers] = seen
    names = {name for name, _ in headers}
    for name, value in [(b"content-type", b"application/json"), *kept]:
        assert (name, value) in headers
    assert names.isdisjoint(name for name, _ in dropped), headers


def test_a_head_with_too_many_fields_is_431_and_closed(gateway: RunningServer) -> None:
    """150 header fields (a small head that arrives in one read): a 431, then the close."""
    head = post_head("/v1/completions", COMPLETION, *[b"X: %d" % i for i in range(150)])
    answer = refused_then_closed(gateway, head + COMPLETION)
    assert answer.status == 431, answer
    assert json.loads(answer.body)["error"]["message"]
    still_serving(gateway)


def test_a_head_past_64_kib_that_arrives_in_one_read_is_431_and_closed() -> None:
    """20 fields of 4 kB (an 80 kB head, sent at once: h11 bounds only a head it buffers
    incomplete): a 431, then the close, and nothing reaches the upstream."""
    seen: list[list[tuple[bytes, bytes]]] = []
    pads = [b"X-Pad-%d: " % i + b"p" * 4000 for i in range(20)]
    with (
        serve_in_thread(_recording_upstream(seen)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = refused_then_closed(
            gw, post_head("/v1/completions", COMPLETION, *pads) + COMPLETION
        )
        assert answer.status == 431, answer
        still_serving(gw)
    assert seen == []


def test_a_forwarded_header_repeated_past_the_bound_is_431() -> None:
    """A stated header repeated 40 times is not relayed 40 times: the request is refused, and
    nothing reaches the upstream."""
    seen: list[list[tuple[bytes, bytes]]] = []
    extra = [b"tracestate: k%d=v" % i for i in range(40)]
    with (
        serve_in_thread(_recording_upstream(seen)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = exchange(gw, post_head("/v1/completions", COMPLETION, *extra) + COMPLETION)
    assert answer.status == 431, answer
    assert json.loads(answer.body)["error"]["param"] == "tracestate"
    assert seen == []


@pytest.mark.parametrize("bad", [b"\x7f", b"\x01", b"\x1b"], ids=["del", "soh", "esc"])
def test_a_control_character_in_a_request_header_value_is_a_400_naming_it(
    gateway: RunningServer, bad: bytes
) -> None:
    """DEL and the other control characters h11 lets through (it refuses NUL, CR and LF): a 400
    that names the header, then the close."""
    head = post_head("/v1/completions", COMPLETION, b"X-Odd: a" + bad + b"b")
    answer = refused_then_closed(gateway, head + COMPLETION)
    assert answer.status == 400, answer
    error = json.loads(answer.body)["error"]
    assert "x-odd" in error["message"].lower()
    still_serving(gateway)


def test_a_413_for_a_huge_content_length_closes_the_connection(gateway: RunningServer) -> None:
    """A body declared far past the limit is refused at once; the connection is then closed
    rather than read on to the declared end."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    with connect(gateway) as sock:
        sock.sendall(head + b"Content-Length: 999999999999\r\n\r\n{")
        reader = Reader(sock, timeout=3.0)
        answer = reader.answer()
        assert answer.status == 413, answer
        assert reader.at_eof(), "the connection was kept open, reading a body nobody will take"
    still_serving(gateway)


def test_a_chunk_size_past_64_bits_is_a_400_and_closed(gateway: RunningServer) -> None:
    """A chunk size of 17 hex digits (h11 takes up to 20): a 400 at once, then the close."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    with connect(gateway) as sock:
        sock.sendall(head + b"1" * 17 + b"\r\n" + COMPLETION)
        reader = Reader(sock, timeout=3.0)
        answer = reader.answer()
        assert answer.status == 400, answer
        assert "chunk" in json.loads(answer.body)["error"]["message"]
        assert reader.at_eof()
    still_serving(gateway)


def test_an_upstream_that_switches_protocols_is_a_502_naming_it() -> None:
    """A 101 Switching Protocols from the upstream (to a request that asked for no upgrade) is a
    broken upstream: the client gets a JSON 502 that names it, its connection kept."""

    def script(conn: socket.socket, wait: Callable[[float], bool]) -> bool:
        conn.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        wait(10)
        return False

    with RawUpstream(script) as up, running_gateway(raw_gateway_config(up)) as gw:
        with connect(gw) as sock:
            sock.sendall(post_head("/v1/completions", COMPLETION) + COMPLETION)
            reader = Reader(sock, timeout=5.0)
            answer = reader.answer()
            assert answer.status == 502, answer
            error = json.loads(answer.body)["error"]
            assert up.base_url in error["message"]
            assert "101" in error["message"]
            sock.sendall(HEALTH)
            assert reader.answer().status == 200
        still_serving(gw)
