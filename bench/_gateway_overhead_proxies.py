"""The proxies ``gateway_overhead.py`` measures, each in its own process: ``kvclient gateway``,
nginx as a plain reverse proxy and LiteLLM's proxy, started pinned to a core and stopped; and the
CPU time a proxy's processes spent, from ``/proc``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import _pinner, _wait_for, free_port

CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

NGINX_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _serving(
    cmd: list[str],
    port: int,
    ready: str,
    what: str,
    *,
    cpu: int | None,
    timeout: float = 20.0,
    **popen: Any,
) -> Iterator[tuple[str, int]]:
    """``cmd`` started (pinned to ``cpu``, stderr silenced) and stopped; yields (URL, pid) once
    ``ready`` (a path) answers on ``port``."""
    popen.setdefault("stderr", subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, preexec_fn=_pinner(cpu), **popen)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url + ready, proc, what, timeout=timeout)
        yield url, proc.pid
    finally:
        _stop(proc)


@contextlib.contextmanager
def gateway_process(*args: str, cpu: int | None) -> Iterator[tuple[str, int]]:
    """``python -m kvclient.cli gateway ARGS`` on a free port; yields (URL, pid) once
    ``/health`` says its upstreams are discovered."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--port", str(port)]
    cmd += ["--log-level", "warning", *args]
    with _serving(cmd, port, "/health", "the gateway", cpu=cpu) as served:
        yield served


@contextlib.contextmanager
def nginx_process(nginx: str, upstream: str, *, cpu: int | None) -> Iterator[tuple[str, int]]:
    """nginx as a plain reverse proxy to ``upstream``, configured in a temporary prefix."""
    port = free_port()
    upstream_port = int(upstream.rsplit(":", 1)[1])
    with tempfile.TemporaryDirectory(prefix="kvclient-nginx-") as prefix:
        os.chmod(prefix, 0o755)  # the worker may run as another user
        conf = Path(prefix) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(prefix=prefix, port=port, upstream_port=upstream_port))
        cmd = [nginx, "-c", str(conf), "-p", prefix, "-e", f"{prefix}/error.log"]
        cmd += ["-g", "daemon off;"]
        with _serving(cmd, port, "/v1/models", "nginx", cpu=cpu) as served:
            yield served


LITELLM_CONF = """\
model_list:
  - model_name: instant
    litellm_params:
      model: openai/instant
      api_base: {upstream}/v1
      api_key: none
litellm_settings:
  set_verbose: false
"""


@contextlib.contextmanager
def litellm_process(litellm: str, upstream: str, *, cpu: int | None) -> Iterator[tuple[str, int]]:
    """LiteLLM's proxy in front of ``upstream``, with its defaults (one worker, no database).

    Offline and on loopback only: its model cost map is the one it ships
    (``LITELLM_LOCAL_MODEL_COST_MAP``), and it is allowed to start without a master key."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvclient-litellm-") as prefix:
        conf = Path(prefix) / "config.yaml"
        conf.write_text(LITELLM_CONF.format(upstream=upstream))
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
            "LITELLM_LOG": "ERROR",
        }
        cmd = [litellm, "--config", str(conf), "--host", "127.0.0.1", "--port", str(port)]
        with _serving(
            cmd, port, "/v1/models", "LiteLLM's proxy", cpu=cpu, timeout=120,
            cwd=prefix, env=env, stdout=subprocess.DEVNULL,
        ) as served:  # fmt: skip
            yield served


def litellm_version(litellm: str) -> str:
    """The version of LiteLLM behind the ``litellm`` command (the Python of its shebang)."""
    try:
        first = Path(litellm).read_text(errors="replace").splitlines()[0]
        python = first[2:].strip() if first.startswith("#!") else sys.executable
        found = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return found.stdout.strip() or "unknown"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its children now (nginx: master and worker)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICK
