"""What the send path needs from httpx: request and response bodies, and transport failures.

- :class:`Body`: a request body with nothing to leave unfinished when a call is cancelled.
- :class:`Bounded`: a response body read against its call's deadline, which gives back the
  call's send-window room when it is closed.
- :func:`stale_connection`: the one transport failure that is re-sent at once.
- :func:`transport_error`: any other transport failure as kvclient's exception.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from ._exceptions import APIConnectionError, APITimeoutError
from ._shims import finish_generators

__all__ = ["MIN_ATTEMPT_TIMEOUT", "Body", "Bounded", "redact_url", "stale_connection"]

#: A request always gets a little time, even when the deadline is all but spent.
MIN_ATTEMPT_TIMEOUT = 0.001


class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A request body that iterates without a generator.

    httpx's own body for ``content=bytes`` is an async generator; a call cancelled while
    httpcore writes it leaves that generator suspended, and trio warns when it collects it.
    This one has nothing to leave unfinished. (Content-Length stays as httpx computed it.)
    """

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __iter__(self) -> Iterator[bytes]:
        return iter((self._data,))

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _OneChunk(self._data)


class _OneChunk:
    __slots__ = ("_data",)

    def __init__(self, data: bytes | None) -> None:
        self._data = data

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data


def stale_connection(exc: httpx.HTTPError) -> bool:
    """The peer closed the (pooled, idle) connection before any byte of the answer.

    llama.cpp advertises keep-alive but closes the connection after each streamed answer, and
    uvicorn closes one idle for 5 s; a request sent on it in that instant fails this way: the
    peer hung up without an answer, or, the request already in its socket unread, the peer's
    kernel reset the connection (Linux answers data on a closed socket with a reset). The
    callers ask only before any answer. Nothing reached the engine and nothing says it is in
    trouble, so the request goes again at once on a fresh connection (httpcore drops the closed
    one), as Go's net/http does for a reused connection. Anything else a transport raises
    (refused, reset mid-answer, timed out) takes the retry policy's path.
    """
    if isinstance(exc, httpx.RemoteProtocolError):
        return "without sending a response" in str(exc)
    return isinstance(exc, httpx.ReadError) and _reset_by_peer(exc)


def _reset_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` came of a connection reset by the peer (httpcore wraps the OS error, and
    anyio's backend once more)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, ConnectionResetError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def redact_url(url: str) -> str:
    """``url`` with any password in its userinfo replaced by ``[secure]`` (as httpx's repr)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _password = userinfo.partition(":")
    return f"{scheme}://{user}{':[secure]' if colon else ''}@{host}{slash}{path}"


def transport_error(
    exc: httpx.HTTPError, request: httpx.Request | None, *, answered: bool
) -> APIConnectionError:
    """A transport failure; retryable only when no answer had started to arrive."""
    target = (
        f"{request.method} {redact_url(str(request.url))}" if request is not None else "request"
    )
    when = "while reading the answer" if answered else "before any answer"
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # A wrong URL scheme is not a network accident: no retry can fix it.
    retryable = not answered and not isinstance(exc, httpx.UnsupportedProtocol)
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(
            f"{target} timed out {when} ({detail})", request=request, retryable=retryable
        )
    return APIConnectionError(
        f"{target} failed {when} ({detail})", request=request, retryable=retryable
    )


class Bounded(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body read against a deadline (``deadline``, on ``clock``; None: unbounded),
    which calls ``on_close`` (once) when it is closed.

    httpx's read timeout bounds each wait for a chunk, so a body trickled a byte at a time never
    trips it. This checks the deadline as each chunk arrives, and before the body's first read
    lowers the read timeout to the time left (httpcore takes it once per body), so one read can
    overrun the deadline by at most that. A stream moves ``deadline`` after each event.
    ``on_close`` gives back the send-window room of an answer handed on unread (a stream).
    """

    __slots__ = ("_clock", "_closed", "_on_close", "_request", "_stream", "deadline", "why")

    def __init__(
        self,
        stream: Any,
        request: httpx.Request,
        clock: Callable[[], float],
        deadline: float | None,
        why: str,
    ) -> None:
        self._stream = stream
        self._request = request
        self._clock = clock
        self.deadline = deadline
        self.why = why
        self._on_close: Callable[[], None] | None = None
        self._closed = False

    def on_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the body is closed (at once if it already is)."""
        self._on_close = release
        if self._closed:
            self.release()

    def release(self) -> None:
        """Run the ``on_close`` callback now, if it has not run (a stream dropped unclosed)."""
        release, self._on_close = self._on_close, None
        if release is not None:
            release()

    def check(self) -> None:
        if self.deadline is not None and self._clock() >= self.deadline:
            raise httpx.ReadTimeout(self.why, request=self._request)

    def _tighten(self) -> None:
        timeout = self._request.extensions.get("timeout")
        if self.deadline is None or not isinstance(timeout, dict):
            return
        left = max(self.deadline - self._clock(), MIN_ATTEMPT_TIMEOUT)
        read = timeout.get("read")
        timeout["read"] = left if read is None else min(read, left)

    def __iter__(self) -> Iterator[bytes]:
        if not isinstance(self._stream, httpx.SyncByteStream):
            raise RuntimeError("Attempted to call a sync iterator on an async stream.")
        self.check()
        self._tighten()
        for chunk in self._stream:
            self.check()
            yield chunk

    def __aiter__(self) -> AsyncIterator[bytes]:
        if not isinstance(self._stream, httpx.AsyncByteStream):
            raise RuntimeError("Attempted to call an async iterator on a sync stream.")
        self.check()
        self._tighten()
        return _AsyncBounded(self, self._stream.__aiter__())

    def close(self) -> None:
        self._closed = True
        try:
            if isinstance(self._stream, httpx.SyncByteStream):
                self._stream.close()
        finally:
            self.release()

    async def aclose(self) -> None:
        self._closed = True
        try:
            if isinstance(self._stream, httpx.AsyncByteStream):
                await self._stream.aclose()
        finally:
            self.release()


class _AsyncBounded:
    """The async iteration of :class:`Bounded`: a plain iterator, nothing left suspended."""

    __slots__ = ("_chunks", "_owner")

    def __init__(self, owner: Bounded, chunks: AsyncIterator[bytes]) -> None:
        self._owner = owner
        self._chunks = chunks

    def __aiter__(self) -> _AsyncBounded:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._chunks.__anext__()
        try:
            self._owner.check()
        except httpx.ReadTimeout:
            # Close the connection, then run httpx's generators under us to their end rather
            # than leave them suspended (trio warns when it collects them).
            await self._owner.aclose()
            await finish_generators(self._chunks)
            raise
        return chunk
