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
                body = json.dumps({"ok": True}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                served += 1
                answered.append(connections)


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
