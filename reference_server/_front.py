"""The gateway's HTTP/1.1 front: a lean ASGI server for one app, on asyncio or uvloop.

uvicorn costs the gateway about 0.1 ms of CPU per request on this machine (its protocol, its
scope and cycle objects, a head and a body written apart), a sixth of the whole request; this
front costs about half of that. It serves exactly what the gateway needs:

- HTTP/1.1 keep-alive (and HTTP/1.0), requests parsed by httptools (llhttp) and answered in
  order (a pipelined request waits its turn);
- bodies read whole, up to ``max_body_bytes``: beyond, a 413 in our error shape once the body
  is drained (up to :data:`DRAIN_LIMIT_BYTES`, so the client sees the answer), then the
  connection closes; ``Expect: 100-continue`` answered;
- answers by ``Content-Length`` (the head and the body in one write) or chunked, ``HEAD``
  without a body, writes held back while the client's socket is full (and the connection cut
  after ``send_timeout`` of that: a stalled reader must not pin a reservation);
- a client that half-closes after its request still gets its answer (see ``_protocol``);
- ``http.disconnect`` from ``receive`` once the client is gone or the answer is complete;
- an idle keep-alive connection closed after ``keep_alive_timeout``; a request whose head
  (request line and headers) is not complete ``head_timeout`` after it began, or whose body
  has not moved for ``body_timeout`` (nginx's ``client_body_timeout``), answered 408 and closed
  (a client trickling its headers or its body holds no connection for long);
- the ASGI lifespan (startup, shutdown), and a graceful stop that lets running requests end.

Not served: HTTP/2, WebSockets, TLS (the gateway listens on loopback, or behind a terminator).
An unexpected exception in the app is logged by type only (a message could quote a prompt) and
answered with a generic 500, or cuts the connection once the answer has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

import httptools

from .app import _DRAIN_LIMIT_BYTES, _internal_error, _too_large

__all__ = ["DIRECT_EXTENSION", "DRAIN_LIMIT_BYTES", "FrontServer"]

logger = logging.getLogger("kvclient.gateway.front")

#: How much of an oversized body is read and thrown away before the 413 (then the connection
#: closes); a declared Content-Length above this is answered at once. The reference server's.
DRAIN_LIMIT_BYTES = _DRAIN_LIMIT_BYTES
#: The scope's ``extensions`` key of the request's :class:`_Cycle`, for an app that writes a
#: streamed body straight from another protocol's callback (the gateway relaying a stream):
#: :meth:`_Cycle.write_chunk`, :meth:`_Cycle.write_paused`.
DIRECT_EXTENSION = "kvclient.direct"
#: The request line and headers together (llhttp has no limit of its own).
MAX_HEAD_BYTES = 64 * 1024
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
DEFAULT_HEAD_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
#: SO_LINGER on, zero seconds: close() resets the connection (struct linger of two ints).
_LINGER_ZERO = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

_REASONS = {
    100: b"Continue", 200: b"OK", 201: b"Created", 204: b"No Content", 304: b"Not Modified",
    400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
    405: b"Method Not Allowed", 408: b"Request Timeout", 413: b"Content Too Large",
    415: b"Unsupported Media Type", 422: b"Unprocessable Content", 429: b"Too Many Requests",
    431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
    502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}  # fmt: skip
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 11\r\nconnection: close\r\n\r\nBad Request"
)
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
    b"connection: close\r\n\r\n"
)


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class _Request:
    __slots__ = ("body", "expect_continue", "headers", "http_version", "keep_alive", "method",
                 "over_limit", "size", "url")  # fmt: skip

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.over_limit = False
        self.expect_continue = False
        self.method = ""
        self.http_version = "1.1"
        self.keep_alive = True


class _Cycle:
    """One request's ASGI ``receive`` and ``send``."""

    __slots__ = ("_body_sent", "_conn", "_flush", "_gone", "_head", "_request", "chunked",
                 "complete", "on_gone", "started")  # fmt: skip

    def __init__(self, conn: HttpFront, request: _Request) -> None:
        self._conn = conn
        self._request = request
        self._body_sent = False
        self._head: bytes | None = None
        self._flush: asyncio.Handle | None = None
        self._gone: asyncio.Future[None] | None = None
        self.chunked = False
        self.started = False
        self.complete = False
        #: Called (soon) when the client goes away: a watcher without a task on ``receive``.
        self.on_gone: Callable[[], object] | None = None

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            body = self._request.body
            data = body[0] if len(body) == 1 else b"".join(body)
            return {"type": "http.request", "body": data, "more_body": False}
        conn = self._conn
        if not conn.gone and not self.complete:
            gone = self._gone = conn.loop.create_future()
            conn.waiting.add(gone)
            try:
                await gone
            finally:
                conn.waiting.discard(gone)
                self._gone = None
        return {"type": "http.disconnect"}

    def _ended(self) -> None:
        self.complete = True
        gone = self._gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    async def send(self, message: MutableMapping[str, Any]) -> None:
        conn = self._conn
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("the answer has started already")
            self._head = self._build_head(message["status"], message.get("headers") or ())
            self.started = True
            # Held back so that a body sent next goes in the same write; flushed on the next
            # turn of the loop if none comes.
            self._flush = conn.loop.call_soon(self._flush_head)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.complete:
            raise RuntimeError("a body outside an answer")
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self._request.method == "HEAD":
            body = b""
        elif self.chunked:
            if body:
                body = b"%x\r\n%s\r\n" % (len(body), body)
            if not more:
                body += b"0\r\n\r\n"
        head = self._head
        if head is not None:
            self._head = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
            body = head + body
        if not more:
            self._ended()
        if conn.gone:
            return
        if body:
            conn.transport.write(body)
        if conn.write_paused is not None:
            await conn.drain()

    def write_chunk(self, data: bytes) -> None:
        """More of a started chunked answer, written now (not a coroutine: for a protocol's
        callback). The caller watches :meth:`write_paused` for a client that stops reading."""
        conn = self._conn
        if not self.chunked or self._head is not None or self.complete:
            raise RuntimeError("write_chunk needs a chunked answer whose head was sent")
        if data and not conn.gone:
            conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def watch_disconnect(self, callback: Callable[[], object] | None) -> None:
        """``callback`` is called soon after the client goes away (at once if it has); None
        stops watching. Without a task waiting on ``receive`` for it."""
        if callback is not None and self._conn.gone:
            self._conn.loop.call_soon(callback)
            return
        self.on_gone = callback

    def write_paused(self) -> asyncio.Future[None] | None:
        """While the client's socket is full: a future done once it takes data again."""
        return self._conn.write_paused

    def _flush_head(self) -> None:
        self._flush = None
        head, self._head = self._head, None
        if head is not None and not self._conn.gone:
            self._conn.transport.write(head)

    def _build_head(self, status: int, headers: Any) -> bytes:
        request = self._request
        parts = [_status_line(status)]
        length = dated = False
        keep_alive = request.keep_alive
        for name, value in headers:
            if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
                raise RuntimeError("a header with a line break")
            low = name.lower()
            if low == b"content-length":
                length = True
            elif low == b"connection" and b"close" in value.lower():
                keep_alive = False
            elif low == b"transfer-encoding":
                continue  # ours to decide
            elif low == b"date":
                dated = True
            parts += (low, b": ", value, b"\r\n")
        if not length and request.method != "HEAD" and status not in (204, 304):
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if not keep_alive:
            request.keep_alive = False
            parts.append(b"connection: close\r\n")
        if not dated:
            parts.append(self._conn.server.date_line())
        parts.append(b"\r\n")
        return b"".join(parts)


class HttpFront(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.parsing: _Request | None = None
        self.head_bytes = 0
        self.ready: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.cycle: _Cycle | None = None
        self.gone = False
        self.half_closed = False
        self.closing = False
        #: The parser was stopped on purpose (an answer is on its way): no 400 for it.
        self.stopped = False
        self.write_paused: asyncio.Future[None] | None = None
        self.waiting: set[asyncio.Future[None]] = set()
        #: Since when the connection waits for a request (None: busy); the server's sweep
        #: closes it after keep_alive_timeout (one timer for all, not one per request).
        self.idle_since: float | None = None
        #: Since when a request's head is arriving (None: not in a head); the sweep answers 408
        #: to one still incomplete after head_timeout (a client trickling its headers).
        self.head_since: float | None = None
        #: When a request's body last moved (None: not in a body); while no answer runs on the
        #: connection, the sweep answers 408 to one that has not moved for body_timeout.
        self.body_since: float | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(local[0]), int(local[1])) if isinstance(local, tuple) else None
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        if self.stopped:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # an upgrade included: not served here
            if not self.stopped:
                self._refuse(_BAD_REQUEST)

    def eof_received(self) -> bool | None:
        if self.parsing is None and (self.task is not None or self.ready):
            self.half_closed = True  # answer what was asked, then close
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        cycle = self.cycle
        if cycle is not None and cycle.on_gone is not None:
            callback, cycle.on_gone = cycle.on_gone, None
            self.loop.call_soon(callback)
        server = self.server
        server.connections.discard(self)
        if server._drained is not None and not server.connections:
            server._drained.set()
        self.idle_since = None
        for future in (*self.waiting, self.write_paused):
            if future is not None and not future.done():
                future.set_result(None)
        self.ready.clear()

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        paused, self.write_paused = self.write_paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    async def drain(self) -> None:
        """Until the client takes data again; past the server's ``send_timeout`` the
        connection is cut (its answer's app sees the disconnect)."""
        paused = self.write_paused
        if paused is None or self.gone:
            return
        timeout = self.server.send_timeout
        try:
            await asyncio.wait_for(asyncio.shield(paused), timeout)
        except asyncio.TimeoutError:
            logger.warning("an answer was cut: not read within the send timeout")
            self.reset()

    def reset(self) -> None:
        """Cut the connection with a reset: what the kernel still holds for a client that does
        not read is dropped, not trickled out to it after the app is done, and the client is
        told the answer was cut, not that it ended."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
        self.transport.abort()

    # --- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.parsing = _Request()
        self.head_bytes = 0
        self.head_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        request = self.parsing
        assert request is not None
        request.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.parsing
        assert request is not None
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            request.expect_continue = True
        request.headers.append((name, value))
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse(_HEAD_TOO_LARGE)
            self.stopped = True
            raise httptools.HttpParserError("head too large")

    def on_headers_complete(self) -> None:
        self.head_since = None
        self.body_since = self.loop.time()
        request = self.parsing
        assert request is not None
        parser = self.parser
        request.method = parser.get_method().decode("ascii")
        request.http_version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        declared = None
        for name, value in request.headers:
            if name == b"content-length":
                with contextlib.suppress(ValueError):
                    declared = int(value)
        if (
            declared is not None
            and declared > self.server.max_body_bytes
            and (request.expect_continue or declared > DRAIN_LIMIT_BYTES)
        ):
            # Waiting for a 100 that will not come, or too much to drain: answered at once,
            # and nothing more is read.
            self._answer_now(request)
        if request.expect_continue and request.http_version == "1.1":
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        assert request is not None
        self.body_since = self.loop.time()
        request.size += len(body)
        if request.size > self.server.max_body_bytes:
            request.over_limit = True
            request.body = []
            if request.size > DRAIN_LIMIT_BYTES:
                self._answer_now(request)
        elif not request.over_limit:
            request.body.append(body)

    def _answer_now(self, request: _Request) -> None:
        """The 413 for ``request`` before its body is read; the connection then closes."""
        request.over_limit = True
        request.keep_alive = False
        self.parsing = None
        self.body_since = None
        self.ready.append(request)
        self.stopped = True
        self.transport.pause_reading()
        self._next()
        raise httptools.HttpParserError("the body is not read")

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        self.parsing = None
        self.body_since = None
        self.ready.append(request)
        if len(self.ready) > 8:
            self.transport.pause_reading()  # a client pipelining without reading: wait
        self._next()

    # --- serving --------------------------------------------------------------------------

    def _refuse(self, answer: bytes) -> None:
        if not self.gone and not self.closing:
            self.closing = True
            if self.task is None:
                self.transport.write(answer)
            self.transport.close()

    def _arm_idle(self) -> None:
        self.idle_since = self.loop.time()

    def close_if_idle(self, now: float, timeout: float) -> None:
        since = self.idle_since
        idle = self.task is None and self.parsing is None and not self.ready
        if since is not None and now - since >= timeout and idle and not self.closing:
            self.closing = True
            self.transport.close()
        head = self.head_since
        if head is not None and now - head >= self.server.head_timeout and not self.closing:
            self.stopped = True
            self._refuse(_REQUEST_TIMEOUT)
        body = self.body_since
        if (
            body is not None
            and self.task is None
            and now - body >= self.server.body_timeout
            and not self.closing
        ):
            self.stopped = True
            self._refuse(_REQUEST_TIMEOUT)

    def _next(self) -> None:
        if self.task is not None or self.gone or self.closing:
            return
        if not self.ready:
            if self.half_closed:
                self.closing = True
                self.transport.close()
            elif not self.server.stopping:
                self._arm_idle()
            return
        request = self.ready.popleft()
        if len(self.ready) <= 8:
            with contextlib.suppress(RuntimeError, AttributeError):
                self.transport.resume_reading()
        self.task = self.loop.create_task(self._serve(request))

    def _scope(self, request: _Request, cycle: _Cycle) -> dict[str, Any]:
        url = request.url
        path, _, query = url.partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "method": request.method,
            "scheme": "http",
            "path": _unquote(path),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": self.client,
            "server": self.local,
            "state": dict(self.server.state),
            "extensions": {DIRECT_EXTENSION: cycle},
        }

    async def _serve(self, request: _Request) -> None:
        cycle = self.cycle = _Cycle(self, request)
        scope = self._scope(request, cycle)
        app: Any = self.server.app if not request.over_limit else self.server.too_large
        try:
            await app(scope, cycle.receive, cycle.send)
        except Exception as exc:
            logger.error("unexpected %s while serving %s", type(exc).__name__, scope["path"])
            if not cycle.started and not self.gone:
                request.keep_alive = False
                with contextlib.suppress(Exception):
                    await _internal_error()(scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            cycle._ended()
            raise
        finally:
            self.task = None
            self.cycle = None
            if self.body_since is not None:  # a pipelined body's clock starts now
                self.body_since = self.loop.time()
            if not cycle.complete or not request.keep_alive or self.server.stopping:
                # An answer cut short, or one that ends the connection.
                self.closing = True
                cycle._ended()
                if not self.gone:
                    if cycle._head is not None:
                        cycle._flush_head()
                    self.transport.close()
        self._next()

    def shutdown(self) -> None:
        """The server stops: close now if idle, else once the running answer is done."""
        if self.task is None and not self.gone:
            self.closing = True
            self.transport.close()


def _unquote(path: bytes) -> str:
    text = path.decode("latin-1")
    return unquote(text) if "%" in text else text


class FrontServer:
    """Serves ``app`` on listening sockets: :meth:`serve` until :meth:`stop`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
        graceful_timeout: float = 5.0,
        lifespan: bool = True,
        send_timeout: float | None = None,
        head_timeout: float = DEFAULT_HEAD_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
    ) -> None:
        self.app = app
        #: A request line and headers not complete this long after they began: 408, closed.
        self.head_timeout = head_timeout
        #: A request body that has not moved for this long (no answer running): 408, closed.
        self.body_timeout = body_timeout
        #: A write the client has not taken within this many seconds cuts the connection.
        self.send_timeout = send_timeout
        self.max_body_bytes = max_body_bytes
        self.keep_alive_timeout = keep_alive_timeout
        self.graceful_timeout = graceful_timeout
        self.lifespan = lifespan
        self.connections: set[HttpFront] = set()
        self.state: dict[str, Any] = {}
        self.stopping = False
        self.started = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._stop: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._date_second = 0
        self._date = b""
        self.too_large = _too_large(max_body_bytes).response()

    def _sweep(self) -> None:
        """Close the connections idle for ``keep_alive_timeout``; again in a fraction of it."""
        timeout = self.keep_alive_timeout
        if timeout <= 0:
            return
        now = self.loop.time()
        for conn in list(self.connections):
            conn.close_if_idle(now, timeout)
        self._sweeper = self.loop.call_later(min(1.0, timeout / 4), self._sweep)

    def date_line(self) -> bytes:
        """``date: ...`` for an answer (RFC 9110 6.6.1), formatted once a second."""
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date = b"date: %s\r\n" % email.utils.formatdate(now, usegmt=True).encode()
        return self._date

    def stop(self) -> None:
        """Ask :meth:`serve` to stop (from the serving loop's thread)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()

    async def serve(self, sockets: list[socket.socket]) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.stopping:
            self._stop.set()
        lifespan = _Lifespan(self.app, self.state) if self.lifespan else None
        if lifespan is not None:
            await lifespan.startup()
        servers = [
            await self.loop.create_server(lambda: HttpFront(self), sock=sock, backlog=1024)
            for sock in sockets
        ]
        self.started = True
        self._sweep()
        try:
            await self._stop.wait()
        finally:
            if self._sweeper is not None:
                self._sweeper.cancel()
            for server in servers:
                server.close()
            for conn in list(self.connections):
                conn.shutdown()
            if self.connections:
                self._drained = asyncio.Event()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), self.graceful_timeout)
            for conn in list(self.connections):
                if conn.task is not None:
                    conn.task.cancel()
                conn.transport.abort()
            if lifespan is not None:
                await lifespan.shutdown()


class _Lifespan:
    """The ASGI lifespan protocol, for an app that may not speak it (then it is skipped)."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self.task: asyncio.Task[None] | None = None
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self.state}  # fmt: skip
        try:
            await self.app(scope, self.messages.get, self.answers.put)
        except Exception:
            logger.debug("the app does not take the lifespan protocol")
        finally:
            # An app that returns (or raises) without answering does not speak it.
            await self.answers.put({"type": "lifespan.unsupported"})

    async def startup(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        await self.messages.put({"type": "lifespan.startup"})
        answer = await self.answers.get()
        if answer["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app failed to start: {answer.get('message', '')}")
        if answer["type"] == "lifespan.unsupported":
            self.task = None

    async def shutdown(self) -> None:
        if self.task is None:
            return
        await self.messages.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.answers.get(), 10)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 1)
