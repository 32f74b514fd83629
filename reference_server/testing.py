"""Run the servers (uvicorn) in a background thread on a free loopback port.

For tests, benchmarks, the demo and the contract suite: everything goes over a real socket and
real HTTP, yet the caller keeps direct access to the ledger and the engine.

>>> with running_server(kv_tokens=4096) as server:          # doctest: +SKIP
...     httpx.get(server.base_url + "/health").json()["status"]
'ok'
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from starlette.applications import Starlette

from .http.serving import bind_socket, http_url, uvicorn_config
from .simulated.app import ServerState, create_app
from .simulated.config import ServerConfig

if TYPE_CHECKING:
    from .admission.ledger import KVAdmissionController
    from .gateway.config import GatewayConfig
    from .gateway.state import GatewayState
    from .simulated.engine import SimulatedEngine

__all__ = ["RunningServer", "running_gateway", "running_server", "serve_in_thread"]

_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 10.0


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
    def gateway(self) -> GatewayState:
        gateway: GatewayState = self.app.state.gateway
        return gateway

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
        return f"RunningServer({self.base_url!r})"


@contextmanager
def serve_in_thread(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    lifespan: Literal["on", "off"] = "on",
    send_buffer: int | None = None,
) -> Iterator[RunningServer]:
    """Serve ``app`` with uvicorn (as the command lines do, on asyncio) in a daemon thread until
    the block exits. ``send_buffer``: SO_SNDBUF of accepted sockets (small: a client that stops
    reading blocks the server's writes sooner)."""
    state = getattr(getattr(app, "state", None), "server", None)
    if send_buffer is None and isinstance(state, ServerState):
        send_buffer = state.config.socket_send_buffer
    sock = bind_socket(host, port, send_buffer=send_buffer)
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(
            app, loop="asyncio", log_level=log_level, lifespan=lifespan, graceful_timeout=1
        )
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # SystemExit on start-up failure included
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"server-{bound_port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while not server.started:
            if failure or not thread.is_alive():
                raise RuntimeError(f"the server failed to start: {failure!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.01)
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
def running_gateway(
    config: GatewayConfig, *, host: str = "127.0.0.1", send_buffer: int | None = None
) -> Iterator[RunningServer]:
    """Start ``kvclient gateway`` on a free loopback port; ``server.gateway`` is its
    :class:`~reference_server.gateway.state.GatewayState`."""
    from .gateway.app import create_gateway_app

    with serve_in_thread(create_gateway_app(config), host=host, send_buffer=send_buffer) as server:
        yield server
