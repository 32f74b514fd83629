"""What the gateway costs a paced client: ``kvclient bench`` through it against the same bench
direct to the reference server, same budget, same trace.

Two reference servers with the same budget (``kvclient serve``, reserve mode, 32,768 KV tokens,
1,000 tokens/s per sequence), each in its own process: one benched directly, one behind
``kvclient gateway`` (its defaults, its own process). The same seeded trace (``--rate`` 20/s,
``--requests`` 100, the seed's mix) is sent to each, ``--repeat`` times in turn (direct,
gateway, direct, ...), so both see the same machine.
Reported: the bench's wall time and its ratio (goal: the gateway within 1.2x of direct), attempts
per completed request, the client's time holding requests (backoff), and the gateway's
``RateLimit`` room sampled every 0.25 s meanwhile: how often it advertised the whole usable
budget free while the client was still holding requests.

    python bench/gateway_pacing.py [--repeat 3] [--rate 20] [--requests 100] [--no-queue]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _common import gateway_process, machine, print_table, reference_server_process, write_json

from kvclient.headers import parse_ratelimit

GOAL_RATIO = 1.2
SERVER = ("--kv-tokens", "32768", "--context-window", "8192", "--decode-rate", "1000")


def bench(url: str, rate: float, requests: int, seed: int) -> dict[str, Any]:
    """One ``kvclient bench`` run (its own process, as a user runs it); its JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        argv = [sys.executable, "-m", "kvclient", "bench", url, "--rate", str(rate)]
        argv += ["--requests", str(requests), "--seed", str(seed), "--no-progress"]
        argv += ["--json", str(out)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if not out.exists():
            raise RuntimeError(f"kvclient bench failed: {done.stderr[-2000:]}")
        summary: dict[str, Any] = json.loads(out.read_text())["summary"]
        return summary


class RoomSampler(threading.Thread):
    """Reads the gateway's RateLimit room every ``interval`` seconds (a 1-token probe)."""

    def __init__(self, url: str, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, int, int | None]] = []  # (time, free, usable)
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": "kvclient-sim", "prompt": "x", "max_tokens": 1}
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.wait(self.interval):
                answer = http.post("/v1/completions", json=body, headers={"Prefer": "wait=0"})
                hint = parse_ratelimit(answer.headers)
                if hint is not None:
                    self.samples.append((time.monotonic(), hint.remaining, hint.quota))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, in turn")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=100, help="requests per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--no-queue",
        action="store_true",
        help="the gateway with --max-queue-wait 0: a 429 at once, the client pacing itself",
    )
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    full_while_holding = samples_total = 0
    with (
        reference_server_process(*SERVER) as direct,
        reference_server_process(*SERVER) as engine,
        gateway_process(engine, *(["--max-queue-wait", "0"] if args.no_queue else [])) as gateway,
    ):
        for i in range(args.repeat):
            print(f"… run {i + 1}: direct", flush=True)
            runs["direct"].append(bench(direct, args.rate, args.requests, args.seed))
            print(f"… run {i + 1}: through the gateway", flush=True)
            sampler = RoomSampler(gateway)
            sampler.start()
            summary = bench(gateway, args.rate, args.requests, args.seed)
            sampler.stop.set()
            sampler.join()
            runs["gateway"].append(summary)
            held = summary["backoff_seconds"] > 0
            samples_total += len(sampler.samples)
            full_while_holding += sum(
                1 for _, free, usable in sampler.samples if held and free == usable
            )
    rows = []
    medians: dict[str, float] = {}
    for name, results in runs.items():
        walls = [r["duration"] for r in results]
        medians[name] = statistics.median(walls)
        rows.append(
            [
                name,
                f"{medians[name]:.2f} s ({min(walls):.2f}-{max(walls):.2f})",
                f"{statistics.median(r['attempts_per_completed'] for r in results):.3f}",
                f"{statistics.median(r['http_429'] for r in results):.0f}",
                f"{statistics.median(r['backoff_seconds'] / r['offered'] for r in results):.3f} s",
                f"{statistics.median(r['completed'] for r in results):.0f}/{args.requests}",
            ]
        )
    ratio = medians["gateway"] / medians["direct"]
    print_table(
        f"kvclient bench --rate {args.rate:g} --requests {args.requests}, the seed's mix, "
        f"{args.repeat} runs each in turn; reference servers of 32,768 KV tokens"
        + (", the gateway with --max-queue-wait 0" if args.no_queue else ""),
        ["target", "wall (median, range)", "attempts/completed", "429s", "mean backoff", "done"],
        rows,
    )
    print(
        f"\nthrough the gateway / direct: {ratio:.2f}x (goal <= {GOAL_RATIO}: "
        f"{'met' if ratio <= GOAL_RATIO else 'NOT met'}); the gateway advertised the whole budget "
        f"free in {full_while_holding} of {samples_total} samples taken while the client held "
        "requests"
    )
    write_json(
        "gateway_pacing_no_queue" if args.no_queue else "gateway_pacing",
        {"machine": machine(), "args": vars(args), "runs": runs, "ratio": ratio,
         "full_while_holding": full_while_holding, "samples": samples_total},
    )  # fmt: skip


if __name__ == "__main__":
    main()
