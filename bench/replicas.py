"""Three replicas, one slow: kvclient's routing against round-robin, then one replica killed.

Three reference-server processes with the same KV pool; one decodes at a quarter of the others'
rate. One seeded open-loop trace (``kvclient.loadgen``: a synthetic mix, Poisson arrivals) is
sent twice over the same replicas, one run after the other:

- ``kvclient``: one ``AsyncClient(base_url=[3 urls])``: each request goes where its reservation
  (prompt + output cap) fits with the most room left, from the room each replica advertises
  (RateLimit headers); a refused connection or 503 goes to another replica at once;
- ``round-robin``: one ``AsyncClient`` per replica (each paced by its own server's hints), the
  requests assigned in turn.

Measured per run: each replica's share of the admitted requests (the servers' own counters),
p50/p99 latency, completions, errors. Goal: kvclient sends the slow replica
proportionally less than round-robin does, with a better p99.

Then the trace goes once more through the kvclient, one request in four streamed, and one fast
replica is killed (SIGKILL) halfway through: every request must complete or fail with a clear
error within its deadline; none lost (no record) or hung (past its deadline).

    python bench/replicas.py [--quick]

``--quick`` (the smoke test in tests/bench/test_bench_scripts.py) runs a short trace against servers
in this process, ten times as fast, and stops the "killed" one gracefully instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
from _common import _wait_for, free_port, pin_to_cpu, print_table, write_json

from kvclient import AsyncClient, RetryPolicy, TiktokenCounter
from kvclient.loadgen import (
    RecordTimer,
    RequestRecord,
    Shape,
    SyntheticWorkload,
    WorkItem,
    arrival_offsets,
    percentile,
    run_load,
)
from kvclient.loadgen._kvsender import KVClientSender
from kvclient.loadgen._report import parse_prometheus_text

KV_TOKENS = 8192
CONTEXT = 4096
FAST_RATE = 400.0  # tokens per second per sequence
SLOW_FACTOR = 4  # the slow replica decodes at FAST_RATE / 4
MEAN_OUTPUT = 250.0
MODEL = "kvclient-sim"
SEED = 15
SHAPES = (
    Shape(prompt_tokens=(50, 400), max_tokens=(100, 500), weight=0.7),
    Shape(prompt_tokens=(800, 1600), max_tokens=(50, 200), weight=0.3),
)


class Replicas:
    """Three servers (fast, fast, slow): ``urls``, and :meth:`kill` for one of them.

    Separate processes (killed with SIGKILL: a crash), or with ``in_process`` threads of this
    one (``--quick``: no start-up cost; stopped as ``reference_server`` stops, cutting what
    still runs after 1 s).
    """

    def __init__(
        self, stack: contextlib.ExitStack, *, cpu: int | None, speed: float, in_process: bool
    ) -> None:
        fast = FAST_RATE * speed
        rates = [fast, fast, fast / SLOW_FACTOR]
        self.urls: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stacks: list[contextlib.ExitStack] = []
        if in_process:
            from reference_server import running_server

            for rate in rates:
                inner = stack.enter_context(contextlib.ExitStack())
                server = inner.enter_context(
                    running_server(
                        kv_tokens=KV_TOKENS,
                        context_window=CONTEXT,
                        decode_rate=rate,
                        mean_output_tokens=MEAN_OUTPUT,
                        seed=SEED,
                    )
                )
                self.urls.append(server.base_url)
                self._stacks.append(inner)
        else:
            pin = None
            if cpu is not None and hasattr(os, "sched_setaffinity"):

                def pin() -> None:
                    os.sched_setaffinity(0, {cpu})

            stack.callback(self._stop)
            for rate in rates:
                port = free_port()
                cmd = [sys.executable, "-m", "reference_server", "--port", str(port)]
                cmd += ["--log-level", "error", "--kv-tokens", str(KV_TOKENS)]
                cmd += ["--context-window", str(CONTEXT), "--decode-rate", str(rate)]
                cmd += ["--mean-output-tokens", str(MEAN_OUTPUT), "--seed", str(SEED)]
                self._procs.append(subprocess.Popen(cmd, preexec_fn=pin, stderr=subprocess.DEVNULL))
                self.urls.append(f"http://127.0.0.1:{port}")
            for proc, url in zip(self._procs, self.urls, strict=True):
                _wait_for(url + "/health", proc, "a reference server")
        for url in self.urls:
            # Warm up (the server's tokenizer loads at its first prompt): no run pays for it.
            body = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
            _HTTP.post(url + "/v1/completions", json=body).raise_for_status()

    async def kill(self, index: int) -> None:
        if self._procs:
            self._procs[index].send_signal(signal.SIGKILL)
        else:
            await anyio.to_thread.run_sync(self._stacks[index].close)

    def _stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


# One client for every scrape: building one costs more than the scrape.
_HTTP = httpx.Client(timeout=30)


def counters(urls: Sequence[str]) -> list[dict[str, float]]:
    """Each server's /metrics now (empty for one that does not answer)."""
    found = []
    for url in urls:
        try:
            found.append(parse_prometheus_text(_HTTP.get(url + "/metrics").text))
        except httpx.HTTPError:
            found.append({})
    return found


def wait_idle(urls: Sequence[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(m.get("kv_inflight_requests", 0) == 0 for m in counters(urls)):
            return
        time.sleep(0.05)


class Mixed:
    """Every ``every``-th request streamed (the killed run: cut streams must end clearly)."""

    def __init__(self, client: AsyncClient, every: int = 4) -> None:
        self._plain = KVClientSender(client, stream=False)
        self._streamed = KVClientSender(client, stream=True)
        self._every = every
        self._next = 0

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        self._next += 1
        sender = self._streamed if self._next % self._every == 0 else self._plain
        await sender.send(item, timer)


class RoundRobin:
    """One kvclient per replica; the requests assigned in turn, in the order they are sent."""

    def __init__(self, clients: Sequence[AsyncClient]) -> None:
        self._senders = [KVClientSender(c, stream=False) for c in clients]
        self._next = 0

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        sender = self._senders[self._next % len(self._senders)]
        self._next += 1
        await sender.send(item, timer)


def policy(deadline: float) -> RetryPolicy:
    return RetryPolicy(deadline=deadline)


async def run_mode(
    mode: str,
    urls: list[str],
    items: list[WorkItem],
    offsets: list[float],
    deadline: float,
    replicas: Replicas | None = None,
    kill: int | None = None,
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    options: dict[str, Any] = {"model": MODEL, "context_window": CONTEXT}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    clients: list[AsyncClient]
    if mode == "round-robin":
        clients = [
            AsyncClient(
                base_url=url,
                retry=policy(deadline),
                http_client=httpx.AsyncClient(limits=limits, timeout=deadline),
                **options,
            )
            for url in urls
        ]
        sender: Any = RoundRobin(clients)
    else:
        clients = [
            AsyncClient(
                base_url=urls,
                retry=policy(deadline),
                http_client=httpx.AsyncClient(limits=limits, timeout=deadline),
                **options,
            )
        ]
        sender = Mixed(clients[0]) if kill is not None else KVClientSender(clients[0], stream=False)
    killed: dict[str, Any] = {}

    async def killer() -> None:
        assert kill is not None
        assert replicas is not None
        await anyio.sleep(offsets[len(offsets) // 2])
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(urls[kill] + "/metrics")).text
        killed["at"] = offsets[len(offsets) // 2]
        killed["index"] = kill
        killed["metrics"] = parse_prometheus_text(text)  # its counters when it was killed
        await replicas.kill(kill)

    async with anyio.create_task_group() as tg:
        if kill is not None:
            tg.start_soon(killer)
        records, wall = await run_load(items, sender, offsets=offsets, grace=deadline + 5)
    for client in clients:
        await client._http.aclose()
    return records, wall, killed


def summarize(
    mode: str,
    records: list[RequestRecord],
    wall: float,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    deadline: float,
    killed: dict[str, Any],
) -> dict[str, Any]:
    if killed:
        after = list(after)
        after[killed["index"]] = killed["metrics"]
    completed = [r for r in records if r.ok]
    latencies = [r.latency for r in completed if r.latency is not None]
    admitted = [
        a.get("kv_admitted_total", 0) - b.get("kv_admitted_total", 0)
        for a, b in zip(after, before, strict=True)
    ]
    rejected = [
        a.get("kv_rejected_total", 0) - b.get("kv_rejected_total", 0)
        for a, b in zip(after, before, strict=True)
    ]
    total = sum(admitted) or 1
    causes: dict[str, int] = {}
    for r in records:
        if not r.ok:
            causes[r.error or "unknown"] = causes.get(r.error or "unknown", 0) + 1
    # Lost: no outcome recorded; hung: ended (or not) past the deadline (+1 s of slack for the
    # load generator's own bookkeeping on a loaded machine).
    lost = [r for r in records if r.end is None]
    hung = [
        r
        for r in records
        if r.end is not None and r.sent is not None and r.end - r.sent > deadline + 1.0
    ]
    unclear = [r for r in records if not r.ok and not r.message]
    return {
        "mode": mode,
        "requests": len(records),
        "completed": len(completed),
        "failed_by_cause": causes,
        "failed_without_message": len(unclear),
        "failure_messages": sorted({(r.message or "")[:300] for r in records if not r.ok})[:5],
        "lost": len(lost),
        "hung": len(hung),
        "admitted_by_replica": admitted,
        "share_by_replica": [a / total for a in admitted],
        "http_429_by_replica": rejected,
        "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "wall_seconds": wall,
    }


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: a short trace")
    parser.add_argument("--rate", type=float, help="arrivals per second (default 24, quick 30)")
    parser.add_argument("--requests", type=int, help="trace length (default 480, quick 30)")
    parser.add_argument("--deadline", type=float, help="per request (default 30 s, quick 10 s)")
    args = parser.parse_args()
    rate = args.rate or (40.0 if args.quick else 24.0)
    n = args.requests or (16 if args.quick else 480)
    deadline = args.deadline or (10.0 if args.quick else 30.0)
    speed = 10.0 if args.quick else 1.0  # quick: every replica ten times as fast
    pinned = pin_to_cpu(0)
    cpu = 1 if pinned else None
    counter = TiktokenCounter()
    items = SyntheticWorkload(shapes=SHAPES, seed=SEED).items(n, counter)
    offsets = arrival_offsets(rate=rate, num_requests=n, seed=SEED)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(
        f"{n} requests at {rate:g}/s, deadline {deadline:g} s; replicas: 2 at "
        f"{FAST_RATE * speed:g} tok/s, 1 at {FAST_RATE * speed / SLOW_FACTOR:g}; load average "
        f"{fmt(load, '.2f')}",
        flush=True,
    )
    results = []
    with contextlib.ExitStack() as stack:
        replicas = Replicas(stack, cpu=cpu, speed=speed, in_process=args.quick)
        urls = replicas.urls
        for mode in ("kvclient", "round-robin", "kvclient, replica 2 killed, 1 in 4 streamed"):
            wait_idle(urls)
            print(f"… {mode}", flush=True)
            before = counters(urls)
            kill = 1 if "killed" in mode else None
            records, wall, killed = anyio.run(
                run_mode, mode, urls, items, offsets, deadline, replicas, kill
            )
            summary = summarize(mode, records, wall, before, counters(urls), deadline, killed)
            summary["killed_at"] = killed.get("at")
            results.append(summary)

    rows = []
    for r in results:
        failed = sum(r["failed_by_cause"].values())
        rows.append(
            [
                r["mode"],
                " / ".join(f"{s:.0%}" for s in r["share_by_replica"]),
                fmt(r["latency_p50"], ".2f", " s"),
                fmt(r["latency_p99"], ".2f", " s"),
                f"{r['completed']}/{r['requests']}",
                f"{failed}" + (f" ({', '.join(sorted(r['failed_by_cause']))})" if failed else ""),
                f"{r['lost']} / {r['hung']}",
                " / ".join(f"{x:.0f}" for x in r["http_429_by_replica"]),
            ]
        )
    print_table(
        f"Three replicas (KV pool {KV_TOKENS} tokens each; replica 3 decodes at 1/{SLOW_FACTOR} "
        f"the rate): {n} requests at {rate:g}/s, deadline {deadline:g} s",
        [
            "client",
            "share of requests (1 / 2 / 3 slow)",
            "p50",
            "p99",
            "completed",
            "failed",
            "lost / hung",
            "429s (1 / 2 / 3)",
        ],
        rows,
    )
    kv, rr, killed_run = results
    goals = {
        "slow_share_below_round_robin": kv["share_by_replica"][2] < rr["share_by_replica"][2],
        "p99_better_than_round_robin": (kv["latency_p99"] or 1e9) < (rr["latency_p99"] or 0),
        "killed_none_lost_or_hung": killed_run["lost"] == 0 and killed_run["hung"] == 0,
        "killed_failures_explained": killed_run["failed_without_message"] == 0,
    }
    for r in results:
        for message in r["failure_messages"]:
            print(f"{r['mode']}: failed: {message}")
    print(
        "\ngoals: "
        + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in goals.items())
    )
    write_json(
        "replicas",
        {
            "settings": {
                "requests": n,
                "rate": rate,
                "deadline": deadline,
                "kv_tokens": KV_TOKENS,
                "fast_rate": FAST_RATE * speed,
                "slow_factor": SLOW_FACTOR,
                "mean_output_tokens": MEAN_OUTPUT,
                "load_average": load,
            },
            "results": results,
            "goals": goals,
        },
    )


if __name__ == "__main__":
    main()
