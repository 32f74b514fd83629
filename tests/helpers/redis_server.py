"""A real Redis server (Debian's ``redis-server``) on a free loopback port, for the tests of the
shared ledger, in plain TCP or over TLS (certificates made with ``openssl``: :func:`make_tls`), a
replica of another, or a Sentinel watching one (:class:`RedisSentinel`).
``scripts/test_setup.py`` installs it when it is missing."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["RedisSentinel", "RedisServer", "TLSFiles", "make_tls", "redis_server_path"]


@dataclass(frozen=True)
class TLSFiles:
    """A self-signed CA, and a certificate it signed for the server (127.0.0.1) and a client."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(directory: Path) -> TLSFiles:
    """A fresh CA and the certificates it signs, by the ``openssl`` command (EC P-256, one day)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvclient test CA")  # fmt: skip
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
        extensions = directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
            "-extfile", extensions.name)  # fmt: skip
    return TLSFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


def redis_server_path() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pong(sock: socket.socket) -> bool:
    sock.sendall(b"PING\r\n")
    return sock.recv(16).startswith(b"+PONG")


class RedisServer:
    """``redis-server`` on 127.0.0.1, in memory only; :meth:`stop` and :meth:`start` again
    (same port) to take it away and bring it back."""

    def __init__(
        self,
        directory: Path,
        *,
        tls: TLSFiles | None = None,
        client_certs: bool = False,
        replica_of: int | None = None,
    ) -> None:
        path = redis_server_path()
        if path is None:
            raise RuntimeError("redis-server is not installed: run scripts/test_setup.py")
        self.path = path
        self.directory = directory
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        #: Over TLS only (``--port 0 --tls-port``), asking clients for a certificate when
        #: ``client_certs``.
        self.tls = tls
        self.client_certs = client_certs
        #: The port of the master this one replicates, if any.
        self.replica_of = replica_of

    @property
    def url(self) -> str:
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if self.replica_of is not None:
            return ["--port", str(self.port), "--replicaof", "127.0.0.1", str(self.replica_of)]
        if self.tls is None:
            return ["--port", str(self.port)]
        return ["--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "yes" if self.client_certs else "no"]  # fmt: skip

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
            if self.tls is None:
                return _pong(sock)
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            if self.client_certs:
                context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
            with context.wrap_socket(sock, server_hostname="127.0.0.1") as secure:
                return _pong(secure)

    def _command(self) -> list[str]:
        return [
            self.path, "--bind", "127.0.0.1", *self._listen_args(), "--save", "",
            "--appendonly", "no", "--dir", str(self.directory), "--protected-mode", "no",
        ]  # fmt: skip

    def start(self) -> None:
        self.process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self._ping():
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class RedisSentinel(RedisServer):
    """A Sentinel (``redis-server --sentinel``) watching the master on ``master_port`` as
    ``service``, alone (quorum 1), quick to fail over: down after 300 ms."""

    def __init__(self, directory: Path, *, master_port: int, service: str = "ledger") -> None:
        super().__init__(directory)
        self.master_port = master_port
        self.service = service

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}"

    def _command(self) -> list[str]:
        conf = self.directory / f"sentinel-{self.port}.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.directory}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 300\n"
            f"sentinel failover-timeout {self.service} 3000\n"
        )
        return [self.path, str(conf), "--sentinel"]
