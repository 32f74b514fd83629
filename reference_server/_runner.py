"""Run the real server (uvicorn) in a background thread on a free loopback port.

For tests, the demo and the contract suite: everything goes over a real socket and real HTTP,
yet the caller keeps direct access to the ledger and the engine.

>>> with running_server(kv_tokens=4096) as server:          # doctest: +SKIP
...     httpx.get(server.base_url + "/health").json()["status"]
'ok'
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette

from ._protocol import HalfCloseH11Protocol
from .app import ServerState, create_app
from .config import ServerConfig
from .engine import SimulatedEngine
from .gateway import GatewayConfig
from .ledger import KVAdmissionController

__all__ = ["RunningServer", "running_gateway", "running_server"]

_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 10.0


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RunningServer:
    """A live server: ``base_url`` to reach it, the app and its parts to look inside."""

    def __init__(self, *, app: Starlette, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.base_url = http_url(host, port)

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.server
        return state

    @property
    def config(self) -> ServerConfig:
        return self.state.config

    @property
    def ledger(self) -> KVAdmissionController:
        return self.state.ledger

    @property
    def engine(self) -> SimulatedEngine:
        return self.state.engine

    def metrics(self) -> dict[str, float]:
        """Every metric by its Prometheus name, read directly (no scrape)."""
        return self.state.snapshot()

    def __repr__(self) -> str:
        return f"RunningServer({self.base_url!r}, admission={self.config.admission!r})"


def bind_loopback(host: str, port: int, *, send_buffer: int | None = None) -> socket.socket:
    """A listening socket; accepted connections inherit ``send_buffer`` (SO_SNDBUF).

    The protocol is named (``IPPROTO_TCP``, not 0): asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on accepted sockets whose ``proto`` says TCP, and with Nagle on, an
    answer written as head then body waited for the client's delayed ACK: 44 ms for every
    request after the first on a keep-alive connection. The listener sets it too (Linux passes
    it on to accepted sockets).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # "::1", "::"
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _wait_started(
    started: Callable[[], bool], thread: threading.Thread, failure: list[BaseException], what: str
) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while not started():
        if failure or not thread.is_alive():
            raise RuntimeError(f"{what} failed to start: {failure!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in time")
        time.sleep(0.01)


@contextmanager
def serve_in_thread(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    lifespan: Literal["on", "off"] = "off",
    http: type[asyncio.Protocol] = HalfCloseH11Protocol,
) -> Iterator[RunningServer]:
    """Serve ``app`` with uvicorn in a daemon thread until the block exits."""
    state = getattr(getattr(app, "state", None), "server", None)
    send_buffer = state.config.socket_send_buffer if isinstance(state, ServerState) else None
    sock = bind_loopback(host, port, send_buffer=send_buffer)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        http=http,
        # asyncio whether or not uvloop is installed (uvicorn's "auto" would pick it): the
        # tests' servers run in threads of the test process.
        loop="asyncio",
        log_level=log_level,
        lifespan=lifespan,
        access_log=False,
        timeout_graceful_shutdown=1,
        workers=1,
    )
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # SystemExit on start-up failure included
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"reference-server-{bound_port}", daemon=True)
    thread.start()
    try:
        _wait_started(lambda: server.started, thread, failure, "the reference server")
        yield RunningServer(app=app, host=host, port=bound_port)
    finally:
        server.should_exit = True
        thread.join(_STOP_TIMEOUT)
        sock.close()


@contextmanager
def running_server(config: ServerConfig | None = None, **overrides: Any) -> Iterator[RunningServer]:
    """Start the reference server on a free loopback port; stop it on exit.

    ``overrides`` replace fields of ``config`` (or of the defaults):
    ``running_server(kv_tokens=4096, admission="prompt")``.
    """
    base = config if config is not None else ServerConfig()
    if overrides:
        base = dataclasses.replace(base, **overrides)
    with serve_in_thread(create_app(base)) as server:
        yield server


@contextmanager
def serve_front_in_thread(
    app: Any,
    *,
    max_body_bytes: int,
    host: str = "127.0.0.1",
    port: int = 0,
    keep_alive_timeout: float = 5.0,
    send_buffer: int | None = None,
    send_timeout: float | None = None,
    head_timeout: float = 10.0,
    body_timeout: float = 30.0,
) -> Iterator[RunningServer]:
    """Serve ``app`` with the gateway's own front (:mod:`reference_server._front`, lifespan
    on) on asyncio in a daemon thread until the block exits; ``send_buffer`` as in
    :func:`bind_loopback`."""
    from ._front import FrontServer

    sock = bind_loopback(host, port, send_buffer=send_buffer)
    bound_port = sock.getsockname()[1]
    front = FrontServer(
        app,
        max_body_bytes=max_body_bytes,
        keep_alive_timeout=keep_alive_timeout,
        graceful_timeout=1.0,
        send_timeout=send_timeout,
        head_timeout=head_timeout,
        body_timeout=body_timeout,
    )
    loop = asyncio.new_event_loop()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(front.serve([sock]))
        except BaseException as exc:
            failure.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=f"gateway-{bound_port}", daemon=True)
    thread.start()
    try:
        _wait_started(lambda: front.started, thread, failure, "the gateway")
        yield RunningServer(app=app, host=host, port=bound_port)
    finally:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(front.stop)
        thread.join(_STOP_TIMEOUT)
        sock.close()


@contextmanager
def running_gateway(
    config: GatewayConfig, *, send_buffer: int | None = None
) -> Iterator[RunningServer]:
    """Start ``kvclient gateway`` on a free loopback port; ``server.app.state.gateway`` is its
    :class:`~reference_server.gateway.GatewayState`. ``send_buffer``: its clients' sockets'
    SO_SNDBUF (a small one makes a slow reader's writes back up soon)."""
    from .gateway import create_gateway_app

    app = create_gateway_app(config)
    # The front the CLI serves it with (see _gateway_cli.main).
    with serve_front_in_thread(
        app,
        max_body_bytes=config.max_body_bytes,
        send_buffer=send_buffer,
        send_timeout=config.send_timeout,
    ) as server:
        yield server
