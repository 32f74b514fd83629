"""Serving an app with uvicorn: the socket, the protocol, the loop, one way for both apps.

uvicorn speaks HTTP/1.1 through h11, a maintained and strict HTTP/1.1 implementation: it bounds a
request head (64 KiB here, as nginx's large header buffers), refuses what it cannot frame, reads
a request's body before anything pipelined after it, ignores an ``Upgrade`` it does not take up
(``curl --http2``), never merges trailer fields into the headers, frames HTTP/1.0 answers by
closing, and refuses to send a header value with control characters or more body than declared.
uvicorn's faster httptools protocol does four of those wrong, and mending them meant writing
HTTP ourselves; the difference is a fraction of a millisecond on requests that last from 100 ms
to minutes (``bench/gateway_overhead.py``).

One limit is added, because without it one client can hold a connection forever: a request head
must arrive whole within ``head_timeout`` seconds of the connection (or of the previous answer,
plus the keep-alive timeout). Unlike uvicorn's keep-alive timer, a byte does not reset it, so a
client that trickles one byte at a time is closed all the same. A body that stalls is the app's
to time out (:func:`~reference_server.http.requests.read_body`).

And the checks h11 leaves to the server, made on each request h11 has parsed (no HTTP is parsed
here): a head of more than 64 KiB or 100 fields however it arrived (h11 bounds only what it
buffers while a head is incomplete: 431), Content-Length with Transfer-Encoding (RFC 9112 6.1), a
control character in a field value (h11 refuses only NUL, CR and LF), a chunk size past 2**63
(h11 reads up to 20 hex digits). Each refusal, and each of h11's own, is a JSON error with the
status h11 advises (400, 431, 501), and then the close. On an untrusted network, put
nginx or Envoy in front all the same, as vLLM advises: they are built to absorb slow and
hostile clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import errno
import importlib.util
import logging
import re
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import h11
import uvicorn
from uvicorn.config import STARTUP_FAILURE, Config
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState
from uvicorn.supervisors import Multiprocess

from .errors import APIError

__all__ = [
    "DEFAULT_HEAD_LIMIT",
    "DEFAULT_HEAD_TIMEOUT",
    "DEFAULT_MAX_FIELDS",
    "LOG_LEVELS",
    "GuardedH11Protocol",
    "PortInUseError",
    "answer_cut",
    "bind_socket",
    "configure",
    "http_url",
    "load_tokenizer",
    "serve",
    "uvicorn_config",
]

C = TypeVar("C")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_HEAD_LIMIT = 64 * 1024
DEFAULT_HEAD_TIMEOUT = 10.0
#: The most header fields a request head may carry (Apache's LimitRequestFields).
DEFAULT_MAX_FIELDS = 100
#: uvicorn's own default: an idle keep-alive connection is closed after this many seconds.
KEEP_ALIVE_TIMEOUT = 5.0


class PortInUseError(OSError):
    """The address is taken by another process."""


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int, *, send_buffer: int | None = None) -> socket.socket:
    """A listening TCP socket; accepted connections inherit ``send_buffer`` (SO_SNDBUF).

    Bound here rather than by uvicorn so that a port in use is one clear error
    (:class:`PortInUseError`) and the port is known before serving starts (``port=0``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # With the protocol named (not 0) asyncio turns Nagle's algorithm off on accepted sockets;
    # the listener says so too (Linux passes it on). With Nagle on, an answer written as head
    # then body waits for the client's delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(exc.errno, f"{http_url(host, port)} is already in use") from None
        raise
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


#: The largest chunk size taken: one past it does not fit a signed 64-bit length (nginx's rule).
_MAX_CHUNK = 2**63 - 1
#: What RFC 9110 5.5 does not allow in a field value: control characters but HTAB.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class _Refusal:
    """Why a request is answered by the protocol and the connection closed."""

    status: int
    message: str
    param: str | None = None

    def answer(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The headers and JSON body of the answer, in the apps' error shape."""
        code = "request_header_fields_too_large" if self.status == 431 else "invalid_request"
        body = bytes(
            APIError(self.status, self.message, code=code, param=self.param).response().body
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        return headers, body


def _head_refusal(request: h11.Request, *, limit: int, max_fields: int) -> _Refusal | None:
    """What refuses a request head h11 has parsed, if anything: its size or number of fields
    (however it arrived), a control character in a field value, or two framings at once."""
    fields = request.headers
    if len(fields) > max_fields:
        return _Refusal(431, f"the request head has more than {max_fields} header fields")
    size = len(request.method) + len(request.target) + 13  # " HTTP/1.1\r\n" and the blank line
    size += sum(len(name) + len(value) + 4 for name, value in fields)
    if size > limit:
        return _Refusal(431, f"the request head is larger than {limit} bytes")
    for name, value in fields:
        if _CONTROL.search(value):
            header = name.decode("latin-1")
            return _Refusal(
                400, f"the {header!r} header has a control character in its value", param=header
            )
    names = {name for name, _ in fields}
    if b"content-length" in names and b"transfer-encoding" in names:
        return _Refusal(
            400,
            "a request with both Content-Length and Transfer-Encoding has no one length "
            "(RFC 9112 6.1); send one of them",
        )
    return None


def _chunk_left(conn: h11.Connection) -> int:
    """What is left to read of the chunk being read. h11 has no public count of it and keeps
    it in its chunked reader; 0 for a body that is not chunked (and, should h11 ever keep it
    elsewhere, 0 always: the check is then off, and its test fails)."""
    left = getattr(getattr(conn, "_reader", None), "_bytes_in_chunk", 0)
    return left if isinstance(left, int) else 0


class _CheckedConnection(h11.Connection):
    """h11's server connection, each request it parses checked (:func:`_head_refusal`), each
    chunk size bounded; the refusal (or h11's own) kept for the answer."""

    def __init__(self, limit: int, max_fields: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limit)
        self.limit = limit
        self.max_fields = max_fields
        self.refusal: _Refusal | None = None

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            message = (
                f"the request head is larger than {self.limit} bytes"
                if status == 431
                else f"invalid HTTP/1.1 request: {str(exc)[:200]}"
            )
            self.refusal = _Refusal(status, message)
            raise
        refusal = None
        if isinstance(event, h11.Request):
            refusal = _head_refusal(event, limit=self.limit, max_fields=self.max_fields)
        elif self.their_state is h11.SEND_BODY and _chunk_left(self) > _MAX_CHUNK:
            refusal = _Refusal(400, f"a chunk size past {_MAX_CHUNK} bytes")
        if refusal is not None:
            self.refusal = refusal
            raise h11.RemoteProtocolError(refusal.message, error_status_hint=refusal.status)
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline that bytes cannot reset, and the
    checks h11 leaves to the server (:class:`_CheckedConnection`)."""

    head_timeout = DEFAULT_HEAD_TIMEOUT
    max_fields = DEFAULT_MAX_FIELDS

    _head_timer: asyncio.TimerHandle | None = None

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limit = config.h11_max_incomplete_event_size or DEFAULT_HEAD_LIMIT
        self.conn = _CheckedConnection(limit, self.max_fields)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived whole
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            # Armed first: a pipelined head already in disarms it again.
            self._arm(self.timeout_keep_alive + self.head_timeout)
        super().on_response_complete()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(seconds, self._head_expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """The answer to a request h11 or its checks refused (uvicorn sends a plain 400 for all),
        then the close. The app reading that request, if any, sees its client gone."""
        conn = self.conn
        refusal = conn.refusal if isinstance(conn, _CheckedConnection) else None
        if refusal is None:
            refusal = _Refusal(400, msg)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # else an answer has begun
            headers, body = refusal.answer()
            reason = STATUS_PHRASES.get(refusal.status, b"")
            for event in (
                h11.Response(status_code=refusal.status, headers=headers, reason=reason),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(conn.send(event))
        self.transport.close()


class _QuietUpgrades(logging.Filter):
    """uvicorn logs two warnings for every request with an Upgrade it does not take up (any
    client can send them): they say nothing an operator can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Unsupported upgrade request", "No supported WebSocket"))


#: Whether the app cut this request's answer on purpose (in the task uvicorn runs it in).
_cut: contextvars.ContextVar[bool] = contextvars.ContextVar("answer_cut", default=False)


def answer_cut() -> None:
    """The app cut this request's answer on purpose (the send timeout: a client that stopped
    reading) and has said so in its own log; call it in the task that serves the request.
    uvicorn then does not log the unfinished answer as an ERROR."""
    _cut.set(True)


class _QuietCuts(logging.Filter):
    """uvicorn logs "returned without completing response" at ERROR for an answer the app cut
    on purpose; for those (and only those) the app's own line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_cut.get() and record.getMessage().startswith("ASGI callable returned"))


logging.getLogger("uvicorn.error").addFilter(_QuietUpgrades())
logging.getLogger("uvicorn.error").addFilter(_QuietCuts())


def _loop(loop: Literal["auto", "asyncio", "uvloop"]) -> str:
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return loop


def uvicorn_config(
    app: Any,
    *,
    loop: Literal["auto", "asyncio", "uvloop"] = "auto",
    log_level: str = "warning",
    lifespan: Literal["on", "off", "auto"] = "on",
    access_log: bool = False,
    graceful_timeout: float = 5.0,
) -> uvicorn.Config:
    """The uvicorn settings both apps are served with."""
    return uvicorn.Config(
        app,
        http=GuardedH11Protocol,
        h11_max_incomplete_event_size=DEFAULT_HEAD_LIMIT,
        ws="none",
        loop=_loop(loop),
        log_level=log_level,
        lifespan=lifespan,
        access_log=access_log,
        timeout_keep_alive=int(KEEP_ALIVE_TIMEOUT),
        timeout_graceful_shutdown=int(graceful_timeout),
        workers=1,
    )


def _listen(
    host: str, port: int, what: str, *, send_buffer: int | None = None, note: str = ""
) -> socket.socket | None:
    """The listening socket, its URL printed; None, with one line on stderr, when the address
    cannot be bound."""
    try:
        sock = bind_socket(host, port, send_buffer=send_buffer)
    except PortInUseError as exc:
        print(f"{what}: {exc.strerror}", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"{what}: cannot listen on {http_url(host, port)}: {exc.strerror}", file=sys.stderr)
        return None
    bound = sock.getsockname()[1]
    print(f"{what} listening on {http_url(host, bound)}{note}", file=sys.stderr, flush=True)
    return sock


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    what: str,
    loop: Literal["auto", "asyncio", "uvloop"] = "auto",
    log_level: str = "warning",
    send_buffer: int | None = None,
) -> int:
    """Serve ``app`` until SIGINT or SIGTERM; print its URL first. Returns the exit status: 2,
    with one line on stderr, when the address cannot be bound."""
    sock = _listen(host, port, what, send_buffer=send_buffer)
    if sock is None:
        return 2
    server = uvicorn.Server(uvicorn_config(app, loop=loop, log_level=log_level))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def serve_workers(
    make_app: Callable[[], Any],
    *,
    workers: int,
    host: str,
    port: int,
    what: str,
    loop: Literal["auto", "asyncio", "uvloop"] = "auto",
    log_level: str = "warning",
) -> int:
    """Serve ``workers`` processes on one listening socket (bound here; the kernel hands each
    connection to one of them), supervised by uvicorn's own supervisor: a worker that dies or
    stops answering its health check is replaced, SIGHUP replaces them all one by one, SIGINT
    and SIGTERM stop them. Each worker is a fresh interpreter that builds its own app with
    ``make_app``, so it must be picklable (a module-level class holding the settings). Returns
    0, 1 when a worker could not start (the supervisor then stops), 2 when the address cannot
    be bound."""
    sock = _listen(host, port, what, note=f" ({workers} worker processes)")
    if sock is None:
        return 2
    config = uvicorn_config(make_app, loop=loop, log_level=log_level)
    config.factory = True
    config.workers = workers
    supervisor = Multiprocess(config, sockets=[sock])
    try:
        supervisor.run()
    finally:
        sock.close()
    return 1 if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0


def load_tokenizer(path: Any) -> Any:
    """A counter from ``--tokenizer PATH``, a local model directory or a bare tokenizer.json,
    as every ``kvclient`` command takes it; a ValueError that says why when it cannot be read."""
    from kvclient import KVClientError
    from kvclient.cli_options import load_tokenizer as load

    try:
        return load(path)
    except KVClientError as exc:
        raise ValueError(f"--tokenizer: {exc}") from None


def configure(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    build: Callable[[argparse.Namespace], C],
) -> tuple[argparse.Namespace, C]:
    """Parse ``argv`` (default: the process's) and build the config; a setting that cannot work
    is a usage error (one line, exit 2)."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return args, build(args)
    except ValueError as exc:
        parser.error(str(exc))
