"""A real engine's server process for the tests: a free loopback port, a log, a clean stop.

``llama_engine.LlamaServer`` and ``vllm_engine.VllmServer`` are this with their own command and
their own idea of ready.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineProcess:
    """One server process on ``127.0.0.1:port``; its output in a temporary log, removed on exit.

    The process leads a session of its own, so that stopping it stops its children too (vLLM's
    engine core).
    """

    #: For log file names and messages.
    name = "engine"
    #: How long a stop waits after SIGTERM before SIGKILL, in seconds.
    stop_grace = 10.0
    #: How much of the log's end a failure shows, in characters.
    log_tail = 4000
    #: Added to the process's nice value: a heavy engine yields the CPU to the timing-sensitive
    #: tests beside it.
    niceness = 0

    def __init__(self) -> None:
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, command: list[str], **popen: Any) -> None:
        """Start ``command`` with its output in a new log (the port is already chosen)."""
        fd, name = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self.log_path = Path(name)
        if self.niceness:
            command = ["nice", "-n", str(self.niceness), *command]  # nice execs: same pid
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **popen,
            )

    def log(self) -> str:
        if self.log_path is None:
            return ""
        return self.log_path.read_text(errors="replace")[-self.log_tail :]

    def get_status(self, path: str, *, timeout: float = 2.0) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its session: any children go too
            process.wait()

    def start(self) -> EngineProcess:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
