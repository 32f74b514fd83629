"""Real loopback HTTP servers that misbehave on purpose, for client tests that need sockets.

A :class:`HostileServer` listens on 127.0.0.1 (port 0) in a thread and hands each connection's
first request to a script, which writes whatever raw bytes it likes: a body trickled a byte at a
time, a stream of ``: ping`` comments that never reaches an event, an answer held open after a
few events. One request per connection (every answer says ``Connection: close``). Scripts wait
on :attr:`HostileServer.stopping` rather than sleeping blindly, so stopping the server ends them
at once; every script is also bounded in time on its own.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = [
    "HostileServer",
    "Request",
    "accept_each",
    "chat_events",
    "hold_open",
    "json_answer",
    "ping_forever",
    "sse_answer",
    "trickle_json",
]

# No script runs longer than this, whatever it was asked to do.
MAX_SCRIPT_SECONDS = 15.0


def accept_each(
    listener: socket.socket,
    stopping: threading.Event,
    serve: Callable[[socket.socket], None],
    threads: list[threading.Thread],
) -> None:
    """Accept connections on ``listener`` (which has a short timeout) until ``stopping``, each
    served by ``serve`` in a thread of its own, appended to ``threads``."""
    while not stopping.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        thread = threading.Thread(target=serve, args=(conn,), daemon=True)
        threads.append(thread)
        thread.start()


@dataclass
class Request:
    """The request line, headers and JSON body (None if not JSON) of one request."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


Script = Callable[["HostileServer", socket.socket, Request], None]


@dataclass
class HostileServer:
    """Answers each request with the next script of ``scripts``, then with ``default``."""

    scripts: list[Script] = field(default_factory=list)
    default: Script | None = None
    seen: list[Request] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.02)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HostileServer:
        self._acceptor.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stopping.set()
        self._acceptor.join(timeout=5)
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def wait(self, seconds: float) -> bool:
        """Pause a script; True when the server is stopping (the script should end)."""
        return self.stopping.wait(seconds)

    def _accept(self) -> None:
        accept_each(self._listener, self.stopping, self._serve, self._threads)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(MAX_SCRIPT_SECONDS)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                request = _read_request(conn)
                if request is None:
                    return
                with self._lock:
                    self.seen.append(request)
                    script = self.scripts.pop(0) if self.scripts else self.default
                if script is None:
                    script = json_answer(404, {"error": {"message": "no script"}})
                script(self, conn, request)
            except OSError:
                pass  # the client went away: that is what many of these tests do


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    try:
        body = json.loads(rest) if rest else None
    except ValueError:
        body = None
    return Request(method, path, headers, body)


def _head(status: int, content_type: str, extra: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_answer(status: int, payload: Any, headers: dict[str, str] | None = None) -> Script:
    """A plain JSON answer."""
    body = json.dumps(payload).encode()

    def script(server: HostileServer, conn: socket.socket, request: Request) -> None:
        extra = {"Content-Length": str(len(body)), **(headers or {})}
        conn.sendall(_head(status, "application/json", extra) + body)

    return script


def trickle_json(payload: Any, *, interval: float, seconds: float) -> Script:
    """A 200 whose JSON body comes one byte per ``interval``; gives up after ``seconds``."""
    body = json.dumps(payload).encode()

    def script(server: HostileServer, conn: socket.socket, request: Request) -> None:
        conn.sendall(_head(200, "application/json", {"Content-Length": str(len(body))}))
        for i in range(min(len(body), int(seconds / interval))):
            if server.wait(interval):
                return
            conn.sendall(body[i : i + 1])

    return script


def ping_forever(*, interval: float, seconds: float) -> Script:
    """An event stream whose headers come at once, then only ``: ping`` comments."""

    def script(server: HostileServer, conn: socket.socket, request: Request) -> None:
        conn.sendall(_head(200, "text/event-stream"))
        for _ in range(int(seconds / interval)):
            conn.sendall(b": ping\n\n")
            if server.wait(interval):
                return

    return script


def sse_answer(pieces: Iterable[bytes], *, pause: float = 0.0) -> Script:
    """An event stream sent as ``pieces`` (each its own write, ``pause`` apart), then closed."""
    parts = list(pieces)

    def script(server: HostileServer, conn: socket.socket, request: Request) -> None:
        conn.sendall(_head(200, "text/event-stream"))
        for part in parts:
            conn.sendall(part)
            if pause and server.wait(pause):
                return

    return script


def hold_open(pieces: Iterable[bytes], *, seconds: float) -> Script:
    """An event stream that sends ``pieces``, then holds the connection open, silent, until the
    client closes it, the server stops or ``seconds`` pass."""
    parts = list(pieces)

    def script(server: HostileServer, conn: socket.socket, request: Request) -> None:
        conn.sendall(_head(200, "text/event-stream") + b"".join(parts))
        conn.settimeout(0.05)
        for _ in range(int(seconds / 0.05)):
            if server.stopping.is_set():
                return
            try:
                if not conn.recv(1):
                    return  # the client closed its end
            except TimeoutError:
                continue

    return script


def chat_events(*deltas: dict[str, Any], finish: str = "stop") -> list[bytes]:
    """``data:`` events of a chat stream, one per delta (the last finishing), then [DONE]."""
    events = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        choice = {"index": 0, "delta": delta, "finish_reason": finish if last else None}
        event = {"id": "h-1", "model": "test-model", "choices": [choice]}
        events.append(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events
