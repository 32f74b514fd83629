"""The gateway's pooled connection to an upstream that closes a kept-alive connection as the
next request goes out on it (uvicorn does after 5 s idle): the request goes again on a new
connection, and the client sees one answer, not a 503."""

from __future__ import annotations

import json
import socket
import threading

import anyio

from reference_server.gateway import GatewayConfig
from reference_server.gateway.upstream import UpstreamHTTP


def _serve(listener: socket.socket, answered: list[int]) -> None:
    """A plain HTTP/1.1 server: the first connection answers its first request and is closed by
    the server when the second arrives on it, unread; later connections answer everything."""
    connections = 0
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        connections += 1
        first_connection = connections == 1
        with conn:
            served = 0
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                if first_connection and served == 1:
                    break  # closed under the second request: the keep-alive race
                answered.append(connections)  # before the answer: the client sees it once read
                body = json.dumps({"ok": True}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                served += 1


def test_a_kept_alive_connection_closed_under_a_request_is_replaced() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    answered: list[int] = []
    threading.Thread(target=_serve, args=(listener, answered), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    http = UpstreamHTTP(url, GatewayConfig(upstreams=(url,)))

    async def twice() -> list[int]:
        statuses = []
        for _ in range(2):
            response = await http.request("POST", "/v1/completions", content=b"{}")
            statuses.append(response.status)
            await response.read()
            response.release()
        await http.aclose()
        return statuses

    try:
        assert anyio.run(twice) == [200, 200]
    finally:
        listener.close()
    assert answered == [1, 2]  # the second answer came on a new connection


def _serve_each(listener: socket.socket, stale: int, answered: list[int]) -> None:
    """A threaded HTTP/1.1 server: each of the first ``stale`` connections answers its first
    request and is closed when a second arrives on it (as uvicorn closes every connection that
    went idle together after a burst); later connections answer everything."""
    count = 0

    def handle(conn: socket.socket, number: int) -> None:
        with conn:
            served = 0
            while conn.recv(65536):
                if number <= stale and served == 1:
                    return
                answered.append(number)  # before the answer: the client sees it once read
                body = b'{"ok": true}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                served += 1

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        count += 1
        threading.Thread(target=handle, args=(conn, count), daemon=True).start()


def test_a_request_sent_again_never_takes_another_stale_connection_from_the_pool() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    answered: list[int] = []
    threading.Thread(target=_serve_each, args=(listener, 4, answered), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    http = UpstreamHTTP(url, GatewayConfig(upstreams=(url,)))

    async def burst_then_one() -> int:
        async def one() -> None:
            response = await http.request("POST", "/v1/completions", content=b"{}")
            await response.read()
            response.release()

        async with anyio.create_task_group() as group:
            for _ in range(4):  # four connections in the pool, all closed by the server next
                group.start_soon(one)
        response = await http.request("POST", "/v1/completions", content=b"{}")
        await response.read()
        response.release()
        await http.aclose()
        return response.status

    try:
        assert anyio.run(burst_then_one) == 200
    finally:
        listener.close()
    assert sorted(answered[:4]) == [1, 2, 3, 4]
    assert answered[4] == 5  # a new connection, not another of the four
