"""What ``kvclient gateway`` adds to a request, against direct calls and against nginx.

One run, one upstream: bench/instant_server.py (answers at once; ``/tokenize`` in vLLM's shape,
``kv_physical_capacity_tokens`` in ``/metrics``, streams of ``max_tokens`` events) in its own
process on CPU 1. Four paths to it:

- direct;
- nginx as a plain reverse proxy (Debian's package; one worker, ``proxy_buffering off``, HTTP/1.1
  keep-alive both ways, ``keepalive_requests`` raised from its 1,000), skipped with a note when
  ``nginx`` is not installed;
- ``kvclient gateway`` counting each prompt with the upstream's ``/tokenize`` (its default);
- ``kvclient gateway --tokenizer DIR`` counting locally (the Llama-3 model directory that
  ``scripts/test_setup.py`` caches, or ``--tokenizer``), skipped when there is none.

Each proxy runs in its own process on CPU 0, beside the load generator (this process: a minimal
raw HTTP/1.1 client, asyncio protocols and httptools, keep-alive connections in a closed loop,
each next request written from the callback that completed the answer before it; httpx, or
even asyncio streams at 0.12 ms a request, would measure itself). Two cores cannot give three
processes a core each; the upstream keeps its own.

Measured, in interleaved rounds (figures pooled over rounds):

1. non-streamed completions (a 60-word prompt, ``max_tokens`` 16) at 1 and at 16 connections:
   p50 and p99 latency, the added latency against direct (same percentile), and the proxy's CPU
   seconds per request (``utime + stime`` of the proxy's processes from ``/proc/PID/stat``,
   nginx's master and worker summed, before and after);
2. streams of ``--events`` events (``--event-gap`` apart, so they arrive as a real engine sends
   them, not coalesced), 8 at a time: the proxy's CPU per relayed event (the whole stream's CPU,
   its request included, over its events: an upper bound);
3. two correctness probes through a gateway with the upstream given twice (so a retry would show
   as a second attempt at the same server): an upstream 500 is answered 500 after exactly one
   attempt, and an upstream 429 reaches the client with its ``Retry-After``.

Goals (issue 14, a tenth of LiteLLM's cost): added p50 <= 1 ms, CPU <= 0.75 ms per request,
<= 50 µs per relayed event, tokens counted included; never a retry into an engine failure;
Retry-After reaching the client as Retry-After.

    python bench/gateway_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    _pinner,
    _wait_for,
    free_port,
    instant_server_process,
    pin_to_cpu,
    print_table,
    write_json,
)

GOAL_ADDED_P50_MS = 1.0
GOAL_CPU_MS_PER_REQUEST = 0.75
GOAL_CPU_US_PER_EVENT = 50.0
CONNECTIONS = (1, 16)
STREAM_CONCURRENCY = 8
PROMPT = " ".join(f"word{i % 17}" for i in range(60))
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


# --- processes ---------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def gateway_process(*args: str, cpu: int | None) -> Iterator[tuple[str, int]]:
    """``python -m kvclient.cli gateway ARGS`` on a free port; yields (URL, pid) once
    ``/health`` says its upstreams are discovered."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--port", str(port)]
    cmd += ["--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, preexec_fn=_pinner(cpu), stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url + "/health", proc, "the gateway")
        yield url, proc.pid
    finally:
        _stop(proc)


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
        proc = subprocess.Popen(cmd, preexec_fn=_pinner(cpu), stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for(url + "/v1/models", proc, "nginx")
            yield url, proc.pid
        finally:
            _stop(proc)


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


# --- the load generator ------------------------------------------------------------------------


def _request(port: int, body: bytes) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _LoadConnection(asyncio.Protocol):
    """One keep-alive connection of the closed loop: the next request is written from the
    callback that completes the answer before it (no task, no stream reader), parsed by
    httptools. The load generator shares its core with the proxy, so what it costs is taken
    from the proxy's share: this costs about a third of an asyncio-streams client (whose 0.12 ms
    a request was more than nginx's whole work)."""

    def __init__(
        self,
        request: bytes,
        remaining: list[int],
        latencies: list[float],
        statuses: list[int],
        done: asyncio.Future[int],
    ) -> None:
        import httptools

        self.request = request
        self.remaining = remaining
        self.latencies = latencies
        self.statuses = statuses
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.events = 0
        self.started = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._next()

    def _next(self) -> None:
        assert self.transport is not None
        if self.remaining[0] <= 0:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(self.events)
            return
        self.remaining[0] -= 1
        self.started = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.latencies.append(time.perf_counter() - self.started)
        self.statuses.append(self.parser.get_status_code())
        if self.body:
            self.events += b"".join(self.body).count(b"data:")
            self.body = []
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"the connection was lost: {exc}"))


async def _closed_loop(
    port: int, body: bytes, requests: int, concurrency: int
) -> tuple[list[float], list[int], int]:
    loop = asyncio.get_running_loop()
    remaining = [requests]
    latencies: list[float] = []
    statuses: list[int] = []
    request = _request(port, body)
    done = [loop.create_future() for _ in range(concurrency)]
    for future in done:
        await loop.create_connection(
            lambda f=future: _LoadConnection(request, remaining, latencies, statuses, f),  # type: ignore[misc]
            "127.0.0.1",
            port,
        )
    events = await asyncio.gather(*done)
    return latencies, statuses, sum(events)


def _run(coroutine: Any) -> Any:
    """On uvloop when it is installed (the gateway extra): the load generator's loop costs less
    of the core it shares with the proxy, whichever proxy it is."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def load(url: str, body: bytes, requests: int, concurrency: int) -> tuple[list[float], int, int]:
    """(latencies, non-200 answers, SSE events received) of a closed loop."""
    port = int(url.rsplit(":", 1)[1])
    latencies, statuses, events = _run(_closed_loop(port, body, requests, concurrency))
    return latencies, sum(1 for s in statuses if s != 200), events


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- probes ------------------------------------------------------------------------------------


def _metric(upstream: str, name: str) -> float:
    import httpx

    text = httpx.get(upstream + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _answers(upstream: str, status: int) -> int:
    return int(_metric(upstream, f'instant_answers_total{{status="{status}"}}'))


def _cpu_of(pid: int | None, upstream: str) -> float:
    """The proxy's CPU seconds; without a proxy, the upstream's own."""
    return cpu_seconds(pid) if pid else _metric(upstream, "process_cpu_seconds_total")


def front_stack(loops: list[str]) -> str:
    """The gateway's front (its own, reference_server/_front.py, on httptools), and the
    loop(s) it ran on (``auto``: uvloop when it is installed)."""
    import importlib.util

    found = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return "its own front (httptools) on " + " / ".join(
        found if loop == "auto" else loop for loop in loops
    )


def probes(upstream: str, cpu: int | None) -> dict[str, Any]:
    """An upstream 500 is never retried; an upstream 429's Retry-After reaches the client."""
    import httpx

    result: dict[str, Any] = {}
    twice = ("--upstream", upstream, "--upstream", upstream)
    with (
        gateway_process(*twice, cpu=cpu) as (url, _),
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        before = _answers(upstream, 500)
        answer = http.post("/v1/completions", json={"prompt": "instant:500", "max_tokens": 4})
        attempts = _answers(upstream, 500) - before
        result["500"] = {
            "status": answer.status_code,
            "upstream_attempts": attempts,
            "ok": answer.status_code == 500 and attempts == 1,
        }
        answer = http.post("/v1/completions", json={"prompt": "instant:429", "max_tokens": 4})
        seen = answer.headers.get("retry-after")
        result["429"] = {
            "status": answer.status_code,
            "retry_after": seen,
            "ok": answer.status_code == 429 and seen == "7",
        }
    return result


# --- the run -----------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def default_tokenizer() -> Path | None:
    """The Llama-3 model directory (``tokenizer.json`` and its config) that
    scripts/fetch_tokenizers.py caches (``scripts/test_setup.py`` runs it), when it is there."""
    cache = os.environ.get("KVCLIENT_TOKENIZER_CACHE")
    if cache:
        root = Path(cache)
    else:
        base = os.environ.get("KVCLIENT_CACHE")
        root = (Path(base) if base else Path.home() / ".cache" / "kvclient") / "tokenizers"
    found = sorted(
        d for d in root.glob("@lenml+tokenizer-llama3@*") if (d / "tokenizer.json").is_file()
    )
    return found[-1] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, help="per path, connection count and round")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 1)")
    parser.add_argument("--streams", type=int, help="streams per path (default 64, --quick 8)")
    parser.add_argument("--events", type=int, help="events per stream (default 200, --quick 50)")
    parser.add_argument("--event-gap", type=float, default=0.001, metavar="S")
    parser.add_argument("--tokenizer", type=Path, help="model directory for the local-count row")
    parser.add_argument("--no-nginx", action="store_true")
    parser.add_argument(
        "--loops",
        default="auto",
        help="event loops for the gateways, comma-separated (auto, asyncio, uvloop); with more "
        "than one, the local-count gateway gets a row per loop (an A/B in one run)",
    )
    args = parser.parse_args()
    requests = args.requests or (300 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    streams = args.streams or (8 if args.quick else 64)
    events = args.events or (50 if args.quick else 200)
    pinned = pin_to_cpu(0)
    proxy_cpu = 0 if pinned else None
    nginx = None if args.no_nginx else shutil.which("nginx")
    tokenizer = args.tokenizer or default_tokenizer()
    notes = []
    if args.no_nginx:
        notes.append("nginx row skipped: --no-nginx")
    elif nginx is None:
        notes.append("nginx row skipped: not installed (apt-get install nginx)")
    if tokenizer is None:
        notes.append(
            "local-count row skipped: no tokenizer directory (scripts/fetch_tokenizers.py)"
        )
    load_before = os.getloadavg()

    body = json.dumps({"model": "instant", "prompt": PROMPT, "max_tokens": 16}).encode()
    stream_body = json.dumps(
        {"model": "instant", "prompt": PROMPT, "max_tokens": events, "stream": True}
    ).encode()
    instant_args = ("--token-streams", "--event-gap", str(args.event_gap))
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(
            instant_server_process(*instant_args, cpu=1 if pinned else None)
        )
        paths: dict[str, tuple[str, int | None]] = {"direct": (upstream, None)}
        if nginx is not None:
            paths["nginx"] = stack.enter_context(nginx_process(nginx, upstream, cpu=proxy_cpu))
        loops = [loop.strip() for loop in args.loops.split(",") if loop.strip()]
        paths["gateway (upstream /tokenize)"] = stack.enter_context(
            gateway_process("--upstream", upstream, "--loop", loops[0], cpu=proxy_cpu)
        )
        if tokenizer is not None:
            for loop in loops:
                name = "gateway (local tokenizer)"
                if len(loops) > 1:
                    name = f"gateway (local, {loop})"
                paths[name] = stack.enter_context(
                    gateway_process(
                        "--upstream", upstream, "--tokenizer", str(tokenizer), "--loop", loop,
                        cpu=proxy_cpu,
                    )
                )  # fmt: skip
        for url, _ in paths.values():  # warm-up: imports, connections, discovery, the counter
            load(url, body, max(50, requests // 10), 4)
            load(url, stream_body, 2, 2)

        latencies: dict[tuple[str, int], list[float]] = {}
        cpu: dict[tuple[str, int], float] = {}
        failed: dict[str, int] = {}
        for _ in range(rounds):
            for name, (url, pid) in paths.items():
                for connections in CONNECTIONS:
                    # The direct row's CPU is the upstream's own (as it reports it).
                    before = _cpu_of(pid, upstream)
                    lat, bad, _ = load(url, body, requests, connections)
                    spent = _cpu_of(pid, upstream) - before
                    cpu[(name, connections)] = cpu.get((name, connections), 0.0) + spent
                    latencies.setdefault((name, connections), []).extend(lat)
                    failed[name] = failed.get(name, 0) + bad

        stream_results: dict[str, dict[str, Any]] = {}
        for name, (url, pid) in paths.items():
            before = cpu_seconds(pid) if pid else 0.0
            _, bad, received = load(url, stream_body, streams, STREAM_CONCURRENCY)
            spent = cpu_seconds(pid) - before if pid else None
            expected = streams * (events + 2)  # token events, the final event, [DONE]
            stream_results[name] = {
                "streams": streams,
                "events_per_stream": events,
                "events_received": received,
                "events_expected": expected,
                "non_200": bad,
                "cpu_seconds": spent,
                "cpu_us_per_event": spent / received * 1e6
                if spent is not None and received
                else None,
            }
        probe = probes(upstream, proxy_cpu)
    load_after = os.getloadavg()

    rows, results = [], []
    for name in paths:
        for connections in CONNECTIONS:
            lat = latencies[(name, connections)]
            direct = latencies[("direct", connections)]
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            added50 = p50 - percentile(direct, 0.5)
            added99 = p99 - percentile(direct, 0.99)
            n = len(lat)
            spent = cpu.get((name, connections))
            per_request = spent / n if spent is not None else None
            results.append(
                {
                    "path": name,
                    "connections": connections,
                    "requests": n,
                    "p50_ms": p50 * 1e3,
                    "p99_ms": p99 * 1e3,
                    "mean_ms": statistics.fmean(lat) * 1e3,
                    "added_p50_ms": added50 * 1e3 if name != "direct" else None,
                    "added_p99_ms": added99 * 1e3 if name != "direct" else None,
                    "cpu_ms_per_request": per_request * 1e3 if per_request is not None else None,
                }
            )
            rows.append(
                [
                    name,
                    str(connections),
                    f"{p50 * 1e3:.3f}",
                    f"{p99 * 1e3:.3f}",
                    "-" if name == "direct" else f"{added50 * 1e3:+.3f}",
                    "-" if name == "direct" else f"{added99 * 1e3:+.3f}",
                    "-" if per_request is None else f"{per_request * 1e3:.3f}",
                ]
            )
    where = "proxies and load on CPU 0, upstream on CPU 1" if pinned else "not pinned"
    stack = front_stack(loops)
    print_table(
        f"Non-streamed completions ({requests:,} per path, connection count and round, "
        f"{rounds} interleaved round(s); {where}; the gateway on {stack}; CPU of the direct "
        "rows: the upstream's own)",
        ["path", "conns", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "CPU ms/request"],
        rows,
    )
    print_table(
        f"Streams: {streams} of {events} events, {args.event_gap * 1e3:g} ms apart, "
        f"{STREAM_CONCURRENCY} at a time",
        ["path", "events received", "CPU µs/event"],
        [
            [
                name,
                f"{r['events_received']:,} of {r['events_expected']:,}",
                "-" if r["cpu_us_per_event"] is None else f"{r['cpu_us_per_event']:.1f}",
            ]
            for name, r in stream_results.items()
        ],
    )
    print(
        f"\nprobes through the gateway: upstream 500 -> {probe['500']['status']} after "
        f"{probe['500']['upstream_attempts']} upstream attempt(s); upstream 429 -> "
        f"{probe['429']['status']} with Retry-After {probe['429']['retry_after']!r}"
    )
    goals: dict[str, dict[str, Any]] = {}
    for name in (n for n in paths if n.startswith("gateway")):
        by_conn = {r["connections"]: r for r in results if r["path"] == name}
        cpu_ms = max(r["cpu_ms_per_request"] for r in by_conn.values())
        per_event = stream_results[name]["cpu_us_per_event"]
        goals[name] = {
            **{
                f"added_p50_at_{c}": by_conn[c]["added_p50_ms"] <= GOAL_ADDED_P50_MS
                for c in CONNECTIONS
            },
            "cpu_per_request": cpu_ms <= GOAL_CPU_MS_PER_REQUEST,
            "cpu_per_event": per_event is not None and per_event <= GOAL_CPU_US_PER_EVENT,
        }
        print(f"\n{name} goals:")
        for c in CONNECTIONS:
            added = by_conn[c]["added_p50_ms"]
            print(
                f"  added p50 <= {GOAL_ADDED_P50_MS} ms at {c} connection(s): "
                f"{_met(added <= GOAL_ADDED_P50_MS)} ({added:.3f} ms)"
            )
        print(
            f"  CPU <= {GOAL_CPU_MS_PER_REQUEST} ms per request: "
            f"{_met(goals[name]['cpu_per_request'])} ({cpu_ms:.3f} ms, worst of 1 and 16)"
        )
        print(
            f"  CPU <= {GOAL_CPU_US_PER_EVENT:g} µs per event: "
            f"{_met(goals[name]['cpu_per_event'])} ({per_event or 0:.1f} µs)"
        )
    print(f"\nnever a retry into an engine failure: {_met(probe['500']['ok'])}")
    print(f"Retry-After reaches the client as Retry-After: {_met(probe['429']['ok'])}")
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    for name, bad in failed.items():
        if bad:
            print(f"non-200 answers through {name}: {bad}")
    for note in notes:
        print(note)
    write_json(
        "gateway_overhead",
        {
            "command": " ".join(["python", "bench/gateway_overhead.py", *sys.argv[1:]]),
            "pinned": pinned,
            "front": stack,
            "load_average": {"before": load_before[0], "after": load_after[0]},
            "requests": requests,
            "rounds": rounds,
            "tokenizer": str(tokenizer) if tokenizer else None,
            "results": results,
            "streams": stream_results,
            "probes": probe,
            "non_200": failed,
            "goals": goals,
            "notes": notes,
        },
    )


if __name__ == "__main__":
    main()
