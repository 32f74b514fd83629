"""The gateway's upstream client (reference_server/_upstream_http.py) against real loopback
servers scripted byte by byte: bodies by length, chunked and to the close; keep-alive reuse and
its bound; a stale keep-alive connection re-sent once, and only when nothing was answered; the
timeouts; the connection aborted when an answer is abandoned.

The client is asyncio only (the gateway runs on uvicorn), so these run under ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

from reference_server._upstream_http import (
    ConnectError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamPool,
    WriteTimeout,
    header_block,
)

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[[Reader, Writer, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free loopback port; ``handler(reader, writer, n)`` runs for the n-th
    connection (from 1). Yields its URL and the list of connection numbers seen."""
    seen: list[int] = []
    tasks: set[asyncio.Task[Any]] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen) + 1)
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer, seen[-1])
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.sleep(0)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request (head, body by Content-Length), or None at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def pool(url: str, **overrides: Any) -> UpstreamPool:
    options: dict[str, Any] = {"connect_timeout": 2.0, "read_timeout": 5.0, "write_timeout": 5.0}
    options.update(overrides)
    return UpstreamPool(url, **options)


def test_a_body_by_length_and_the_connection_reused_for_the_next_request() -> None:
    requests: list[tuple[bytes, bytes]] = []

    async def answer(reader: Reader, writer: Writer, n: int) -> None:
        while (request := await read_request(reader)) is not None:
            requests.append(request)
            body = b'{"n": %d}' % len(requests)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Up: a\r\n\r\n" % len(body))
            writer.write(body)

    async def scenario() -> None:
        async with serving(answer) as (url, connections):
            upstream = pool(url)
            headers = header_block([(b"content-type", b"application/json"), ("x-caller", "me")])
            for i in (1, 2, 3):
                response = await upstream.request(
                    "POST", "/v1/completions", headers=headers, body=b'{"prompt": "hi"}'
                )
                assert response.status == 200
                assert response.header(b"x-up") == b"a"
                assert await response.read() == b'{"n": %d}' % i
                response.close()
            assert connections == [1]  # one connection, kept alive
            assert (upstream.opened, upstream.idle) == (1, 1)
            upstream.close()
        head, body = requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert f"Host: {url.removeprefix('http://')}\r\n".encode() in head
        assert b"content-type: application/json\r\nx-caller: me\r\n" in head
        assert b"Content-Length: 16\r\n" in head
        assert body == b'{"prompt": "hi"}'

    run(scenario())


def test_a_chunked_stream_is_relayed_as_it_arrives_not_buffered() -> None:
    got_first = asyncio.Event()
    events = [b'data: {"i": %d}\n\n' % i for i in range(4)]

    async def stream(reader: Reader, writer: Writer, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
        await got_first.wait()  # the next chunk only once the first was received
        both = events[1] + events[2]  # two events in one chunk, then one in a split chunk
        writer.write(b"%x\r\n%s\r\n" % (len(both), both))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"%x\r\n%s" % (len(events[3]), events[3][:5]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(events[3][5:] + b"\r\n0\r\n\r\n")
        await read_request(reader)  # keep the connection open

    async def scenario() -> None:
        async with serving(stream) as (url, _):
            upstream = pool(url)
            response = await upstream.request("POST", "/s", body=b"{}")
            assert response.header(b"transfer-encoding") == b"chunked"
            assert await response.piece() == events[0]
            got_first.set()
            pieces = []
            while piece := await response.piece():
                pieces.append(piece)
            assert b"".join(pieces) == b"".join(events[1:])
            assert pieces[0] == events[1] + events[2]
            assert len(pieces) >= 2  # the split event arrived as what came
            response.close()
            assert upstream.idle == 1  # read to its end: back to the pool
            upstream.close()

    run(scenario())


def test_a_body_delimited_by_the_close_is_read_and_its_connection_not_kept() -> None:
    async def old_style(reader: Reader, writer: Writer, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def scenario() -> None:
        async with serving(old_style) as (url, connections):
            upstream = pool(url)
            for _ in range(2):
                response = await upstream.request("GET", "/v1/models")
                assert await response.read() == b"all of it"
                response.close()
            assert connections == [1, 2]
            assert upstream.idle == 0
            upstream.close()

    run(scenario())


def test_a_stale_keep_alive_connection_is_re_sent_once_on_a_new_one() -> None:
    received: list[int] = []

    async def drops_first(reader: Reader, writer: Writer, n: int) -> None:
        first = True
        while await read_request(reader) is not None:
            received.append(n)
            if n == 1 and not first:
                # The race an idle connection loses: the engine closed it as the request went.
                writer.transport.abort()
                return
            first = False
            writer.write(OK)

    async def scenario() -> None:
        async with serving(drops_first) as (url, connections):
            upstream = pool(url)
            response = await upstream.request("POST", "/a", body=b"{}")
            await response.read()
            response.close()
            response = await upstream.request("POST", "/a", body=b"{}")
            assert response.status == 200
            assert await response.read() == b"{}"
            response.close()
            assert upstream.resent == 1
            assert connections == [1, 2]
            upstream.close()
        assert received == [1, 1, 2]  # sent twice in all: once more, on the new connection

    run(scenario())


def test_a_connection_that_breaks_after_a_byte_of_the_answer_is_never_re_sent() -> None:
    received: list[int] = []

    async def half_answer(reader: Reader, writer: Writer, n: int) -> None:
        while await read_request(reader) is not None:
            received.append(n)
            if len(received) == 1:
                writer.write(OK)
                continue
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")  # then gone
            await writer.drain()
            writer.transport.abort()
            return

    async def scenario() -> None:
        async with serving(half_answer) as (url, _):
            upstream = pool(url)
            response = await upstream.request("POST", "/a", body=b"{}")
            await response.read()
            response.close()
            with pytest.raises(RemoteProtocolError) as caught:
                await upstream.request("POST", "/a", body=b"{}")
            assert caught.value.answered
            assert upstream.resent == 0
            upstream.close()
        assert received == [1, 1]

    run(scenario())


def test_a_body_cut_mid_way_is_an_error_not_a_short_answer() -> None:
    async def short(reader: Reader, writer: Writer, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.transport.abort()

    async def scenario() -> None:
        async with serving(short) as (url, _):
            upstream = pool(url)
            response = await upstream.request("POST", "/a", body=b"{}")
            assert await response.piece() == b"only this"
            with pytest.raises(RemoteProtocolError) as caught:
                await response.piece()
            assert caught.value.answered
            response.close()
            upstream.close()

    run(scenario())


def test_connect_error_read_timeouts_and_write_timeout() -> None:
    async def silent(reader: Reader, writer: Writer, n: int) -> None:
        if n == 2:  # headers and a first piece, then nothing
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(30)  # reads nothing more, answers nothing more

    async def scenario() -> None:
        async with serving(silent) as (url, _):
            refused = pool(url.rsplit(":", 1)[0] + ":1")
            with pytest.raises(ConnectError):
                await refused.request("GET", "/health")

            upstream = pool(url, read_timeout=0.2, write_timeout=0.2)
            started = time.monotonic()
            with pytest.raises(ReadTimeout) as caught:
                await upstream.request("POST", "/a", body=b"{}")  # connection 1: no answer
            assert not caught.value.answered
            assert 0.15 < time.monotonic() - started < 3

            response = await upstream.request("POST", "/a", body=b"{}")  # connection 2
            assert await response.piece() == b"abc"
            with pytest.raises(ReadTimeout) as caught:
                await response.piece()
            assert caught.value.answered
            response.close()

            with pytest.raises(WriteTimeout):  # connection 3 never reads its request
                await upstream.request("POST", "/a", body=b"x" * (64 << 20))
            upstream.close()

    run(scenario())


def test_an_abandoned_answer_aborts_its_connection_at_once() -> None:
    upstream_saw_close = asyncio.Event()

    async def endless(reader: Reader, writer: Writer, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(2000):
                writer.write(b"6\r\ndata: \r\n")
                await writer.drain()
                await asyncio.sleep(0.005)
        except ConnectionError:
            upstream_saw_close.set()
            return
        if await reader.read() == b"":  # (an EOF is a close too)
            upstream_saw_close.set()

    async def scenario() -> None:
        async with serving(endless) as (url, _):
            upstream = pool(url)
            response = await upstream.request("POST", "/s", body=b"{}")
            assert await response.piece()
            response.close()  # the client went away
            await asyncio.wait_for(upstream_saw_close.wait(), 5)
            assert upstream.idle == 0
            upstream.close()

    run(scenario())


def test_the_pool_keeps_at_most_max_idle_connections() -> None:
    async def slow(reader: Reader, writer: Writer, n: int) -> None:
        while await read_request(reader) is not None:
            await asyncio.sleep(0.05)
            writer.write(OK)

    async def scenario() -> None:
        async with serving(slow) as (url, connections):
            upstream = pool(url, max_idle=2)

            async def one() -> None:
                response = await upstream.request("POST", "/a", body=b"{}")
                assert await response.read() == b"{}"
                response.close()

            await asyncio.gather(*(one() for _ in range(4)))
            assert len(connections) == 4
            assert upstream.idle == 2
            await asyncio.gather(*(one() for _ in range(2)))
            assert len(connections) == 4  # the two kept were reused
            upstream.close()
            assert upstream.idle == 0

    run(scenario())


def test_a_malformed_answer_is_a_protocol_error() -> None:
    async def garbage(reader: Reader, writer: Writer, n: int) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await asyncio.sleep(5)

    async def scenario() -> None:
        async with serving(garbage) as (url, _):
            upstream = pool(url)
            with pytest.raises(RemoteProtocolError):
                await upstream.request("GET", "/v1/models")
            upstream.close()

    run(scenario())
