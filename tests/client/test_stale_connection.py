"""The one transport failure re-sent at once, as httpx really raises it: a peer that hangs up
on a request, or resets the connection with the request unread in its socket (uvicorn closing a
kept-alive connection as a request arrives). The callers ask only before any answer (once the
headers are read, a failure is the answer's)."""

from __future__ import annotations

import socket
import struct
import threading

import anyio
import httpx
import pytest

from kvclient._http import stale_connection


def _serve_once(listener: socket.socket, how: str) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.recv(65536)  # the request has arrived
        if how == "reset":  # a reset: the peer's socket closed with a linger of 0
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _failure(how: str, *, asynchronous: bool) -> httpx.HTTPError:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    thread = threading.Thread(target=_serve_once, args=(listener, how), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"

    async def post_async() -> None:
        async with httpx.AsyncClient() as client:
            await client.post(url, json={})

    def post() -> None:
        with httpx.Client() as client:
            client.post(url, json={})

    try:
        with pytest.raises(httpx.HTTPError) as caught:
            anyio.run(post_async) if asynchronous else post()
    finally:
        thread.join(timeout=10)
        listener.close()
    return caught.value


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("how", ["hung up", "reset"])
def test_a_connection_closed_before_any_answer_is_stale(how: str, asynchronous: bool) -> None:
    assert stale_connection(_failure(how, asynchronous=asynchronous))


def test_other_failures_are_not_stale() -> None:
    for failure in (
        httpx.ReadError("not a reset"),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message"),
    ):
        assert not stale_connection(failure)
