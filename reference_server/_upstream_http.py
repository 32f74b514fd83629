"""The gateway's HTTP/1.1 client to its upstream engines: asyncio protocols, httptools parsing.

Why not httpx: a generic client costs more than the gateway's own work. Profiled on the
gateway's hot path, httpx and httpcore (URL parsing, header models, the pool's bookkeeping, anyio
streams with a cancel scope per read) took about 45 % of its CPU per request; this client does
one thing, which is to forward a request that is already built and relay what comes back as it
comes. It runs on asyncio only (the gateway is served by uvicorn).

- A keep-alive pool per upstream (:class:`UpstreamPool`), at most ``max_idle`` idle connections
  kept; a connection is reused only once its previous answer was read to its end.
- A reused connection that turns out to be closed (the engine dropped it while idle) before any
  byte of the answer arrived is re-sent once on a new connection; a failure after a byte of the
  answer never is (the engine may have started the work).
- Content-Length, chunked and close-delimited bodies; :meth:`UpstreamResponse.piece` returns
  what has arrived each time it wakes (several SSE events in one piece when they came together),
  never waiting to fill a buffer; reading from the socket pauses while ``max_buffer`` bytes wait
  for a slow consumer.
- Timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` between two arrivals of
  data, ``write_timeout`` for a request the socket would not take.
- :meth:`UpstreamResponse.close` before the end aborts the connection at once, so the engine sees
  the disconnect and stops generating.

Errors (all :class:`UpstreamError`, named after httpx's): :class:`ConnectError` (and
:class:`ConnectTimeout`), :class:`ReadTimeout`, :class:`WriteTimeout`, :class:`RemoteProtocolError`
(the connection closed or the answer was malformed); ``answered`` on each says whether a byte of
the answer had arrived.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Iterable
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "WriteTimeout",
]

DEFAULT_MAX_IDLE = 64
#: Body bytes received and not yet consumed before reading from the socket pauses.
DEFAULT_MAX_BUFFER = 256 * 1024


class UpstreamError(Exception):
    """The upstream could not be reached or its answer could not be read."""

    #: Whether any byte of the answer had arrived (then it is never re-sent anywhere).
    answered: bool = False


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(ConnectError):
    pass


class ReadTimeout(UpstreamError):
    pass


class WriteTimeout(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    pass


def _fail(future: asyncio.Future[None], error: UpstreamError) -> None:
    if not future.done():
        future.set_exception(error)


class _Connection(asyncio.Protocol):
    """One TCP connection and the answer being read from it (HTTP/1.1, one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffer: int) -> None:
        self.loop = loop
        self.max_buffer = max_buffer
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.requests = 0
        self._waiter: asyncio.Future[None] | None = None
        self._wait_timeout = 0.0
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._begin()

    def _begin(self) -> None:
        """Ready for the next answer."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.received = False
        self.framed = False  # Content-Length or chunked: the end is not the connection's
        self.keep_alive = True
        self.error: UpstreamError | None = None
        self.body: list[bytes] = []
        self.buffered = 0
        #: While a body is spliced (UpstreamResponse.splice): where its bytes go as they arrive.
        self.sink: Callable[[bytes], None] | None = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses; they have its methods.)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(RemoteProtocolError(f"malformed answer: {exc}"))
            assert self.transport is not None
            self.transport.abort()
            return
        if self.sink is not None:
            # Spliced: the bytes went on already; wake the reader only at the end, and count
            # this arrival against the read timeout.
            self._deadline = self.loop.time() + self._wait_timeout
            if self.complete or self.error is not None:
                self._wake()
            return
        if self.buffered > self.max_buffer and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None and self._waiter is None:
            self._timer.cancel()
            self._timer = None
        if self.headers_done and not self.complete and not self.framed:
            self.complete = True  # a close-delimited body ends here
            self.keep_alive = False
        elif not self.complete:
            what = f": {exc}" if exc else ""
            self._broken(RemoteProtocolError(f"the upstream closed the connection{what}"))
        self._wake()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer (we never ask for one): skip it
            self.headers = []
            self.framed = False
            return
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if not body:
            return
        sink = self.sink
        if sink is not None:
            sink(body)
            return
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # --- waiting --------------------------------------------------------------------------

    def _broken(self, error: UpstreamError) -> None:
        if self.error is None:
            error.answered = self.received
            self.error = error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until something arrives (or the connection ends); ReadTimeout after ``timeout``.

        One timer per connection, re-armed only when it fires early, instead of one per wait
        (a stream waits once per event)."""
        waiter = self._waiter = self.loop.create_future()
        self._wait_timeout = timeout
        self._deadline = deadline = self.loop.time() + timeout
        if self._timer is None:
            self._timer = self.loop.call_at(deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nothing waits: the next wait re-arms
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        error = ReadTimeout(f"nothing arrived from the upstream in {self._wait_timeout:g} s")
        error.answered = self.received
        waiter.set_exception(error)

    def take(self) -> bytes:
        """The body bytes that arrived and were not yet taken."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.buffered = 0
        if self._reading_paused and not self.lost:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    async def send(self, data: bytes, timeout: float) -> None:
        assert self.transport is not None
        self.requests += 1
        self.transport.write(data)
        drain = self._drain
        if drain is not None:
            timer = self.loop.call_later(
                timeout, _fail, drain, WriteTimeout(f"the upstream took no data in {timeout:g} s")
            )
            try:
                await drain
            finally:
                timer.cancel()

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
        self.lost = True


class UpstreamResponse:
    """An answer's status and headers; its body read whole (:meth:`read`) or as it arrives
    (:meth:`piece`). :meth:`close` it: the connection goes back to the pool when the answer was
    read to its end, and is aborted (the engine sees a disconnect) when it was not."""

    __slots__ = ("_conn", "_pool", "_timeout", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Connection, timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        self._timeout = timeout
        self.status = conn.status
        #: (lower-cased name, value) as the upstream sent them.
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def piece(self) -> bytes:
        """Body bytes as they arrive: everything that came since the last piece; ``b""`` at the
        end of the body."""
        conn = self._conn
        while True:
            if conn.body:
                return conn.take()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            # conn.wait(), inlined: a stream comes through here once per event.
            waiter = conn._waiter = conn.loop.create_future()
            conn._wait_timeout = self._timeout
            conn._deadline = conn.loop.time() + self._timeout
            if conn._timer is None:
                conn._timer = conn.loop.call_at(conn._deadline, conn._check_deadline)
            try:
                await waiter
            finally:
                conn._waiter = None

    async def splice(self, sink: Callable[[bytes], None]) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, from the connection's own
        callback (no task wakes up per piece, as with :meth:`piece`), until the body ends.
        Raises what :meth:`piece` raises; :meth:`pause` and :meth:`resume` hold the flow back."""
        conn = self._conn
        if conn.body:
            sink(conn.take())
        conn.sink = sink
        try:
            while not conn.complete:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._timeout)
        finally:
            conn.sink = None

    def pause(self) -> None:
        """Stop reading from the upstream (its engine's socket fills, and it waits)."""
        conn = self._conn
        if not conn.lost and conn.transport is not None and not conn._reading_paused:
            conn._reading_paused = True
            conn.transport.pause_reading()

    def resume(self) -> None:
        conn = self._conn
        if not conn.lost and conn.transport is not None and conn._reading_paused:
            conn._reading_paused = False
            conn.transport.resume_reading()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while piece := await self.piece():
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.body and conn.usable():
            self._pool._release(conn)
        else:
            conn.abort()


class UpstreamPool:
    """Keep-alive connections to one upstream (``http://host:port`` or ``https://``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        write_timeout: float,
        max_idle: int = DEFAULT_MAX_IDLE,
        max_buffer: int = DEFAULT_MAX_BUFFER,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an upstream must be an http(s) URL, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        authority = parts.netloc.rsplit("@", 1)[-1]
        self._host_line = b"Host: " + authority.encode("idna") + b"\r\n"
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_idle = max_idle
        self.max_buffer = max_buffer
        self._idle: collections.deque[_Connection] = collections.deque()
        self._closed = False
        #: Connections opened and requests re-sent after a stale keep-alive, for tests and bench.
        self.opened = 0
        self.resent = 0

    def head(
        self, method: str, path: str, headers: bytes, content_length: int | None = None
    ) -> bytes:
        """A request head: ``headers`` is the block of ``Name: value\\r\\n`` lines to pass."""
        length = b"" if content_length is None else b"Content-Length: %d\r\n" % content_length
        target = (self.prefix + path).encode("ascii")
        return b"%s %s HTTP/1.1\r\n%s%s%s\r\n" % (
            method.encode("ascii"),
            target,
            self._host_line,
            headers,
            length,
        )

    async def request(
        self, method: str, path: str, *, headers: bytes = b"", body: bytes | None = None
    ) -> UpstreamResponse:
        """Send one request; returns once the answer's status and headers have arrived."""
        data = self.head(method, path, headers, None if body is None else len(body)) + (body or b"")
        loop = asyncio.get_running_loop()
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except RemoteProtocolError as exc:
                if exc.answered:
                    raise
                self.resent += 1  # a stale keep-alive connection: once more, on a new one
        conn = await self._connect(loop)
        return await self._exchange(conn, data)

    async def _exchange(self, conn: _Connection, data: bytes) -> UpstreamResponse:
        try:
            await conn.send(data, self.write_timeout)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                if conn.lost:
                    raise RemoteProtocolError("the upstream closed the connection")
                await conn.wait(self.read_timeout)
        except BaseException:
            conn.abort()
            raise
        return UpstreamResponse(self, conn, self.read_timeout)

    def _take_idle(self) -> _Connection | None:
        idle = self._idle
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.usable():
                conn._begin()
                return conn
        return None

    def _release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.abort()
            return
        self._idle.append(conn)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        def factory() -> _Connection:
            return _Connection(loop, self.max_buffer)

        opening = loop.create_connection(
            factory, self.host, self.port, ssl=self.ssl, server_hostname=None if self.ssl is None
            else self.host,
        )  # fmt: skip
        try:
            _, conn = await asyncio.wait_for(opening, self.connect_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise ConnectTimeout(
                f"no connection to {self.host}:{self.port} in {self.connect_timeout:g} s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"{self.host}:{self.port}: {exc}") from exc
        self.opened += 1
        return conn

    @property
    def idle(self) -> int:
        return sum(1 for conn in self._idle if conn.usable())

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().abort()


def header_block(pairs: Iterable[tuple[Any, Any]]) -> bytes:
    """``Name: value\\r\\n`` lines from (name, value) pairs of bytes or str."""
    lines = []
    for name, value in pairs:
        n = name if isinstance(name, bytes) else name.encode("latin-1")
        v = value if isinstance(value, bytes) else value.encode("latin-1")
        lines.append(b"%s: %s\r\n" % (n, v))
    return b"".join(lines)
