from __future__ import annotations

import socket

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs on asyncio and on trio."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never reach outside the machine: a connection to a non-loopback host fails loudly."""
    real_connect = socket.socket.connect
    real_create_connection = socket.create_connection

    def _is_local(address: object) -> bool:
        host = address[0] if isinstance(address, tuple) else address
        return isinstance(host, str) and (
            host.startswith("127.") or host in ("localhost", "::1") or host.startswith("/")
        )

    def guarded_connect(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address):
            raise OSError(f"tests may not reach the network: connect to {address!r}")
        real_connect(self, address)  # type: ignore[arg-type]

    def guarded_create_connection(address: tuple[str, int], *args: object, **kw: object) -> object:
        if not _is_local(address):
            raise OSError(f"tests may not reach the network: connect to {address!r}")
        return real_create_connection(address, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "create_connection", guarded_create_connection)
