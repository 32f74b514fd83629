"""The gateway's price in throughput, on a real vLLM: the same overload direct and through it.

A burst of long generations (``--requests`` 32, caps drawn from 400-800, sent at once) to the
real vLLM the tests use (``scripts/vllm_engine.py``: a tiny random-weight Llama on CPU, a 2,048
window over 3,072 KV tokens, 8 sequences at most), through ``kvclient.AsyncClient``:

- **direct**: vLLM admits everything its scheduler can fit and preempts sequences when their KV
  outgrows the pool (recomputing them later);
- **gateway**: ``kvclient gateway --max-running 8`` in front of the same vLLM, its defaults:
  the peak rule (admit by the most the holders can hold at once, from each one's progress as
  its stream shows it), and what does not fit waits in its FIFO queue (``--max-queue-wait``
  300 s), admitted the moment there is room; kvclient says how long it will wait (``Prefer:
  wait``);
- **caps**: the same with ``--admission-rule caps``: every holder counts its whole reservation;
- **gateway, no queue**: the peak rule with ``--max-queue-wait 0``: a 429 + Retry-After at
  once, the client pacing itself from the RateLimit room;
- **tight** (not run by default): the peak rule admitting to 95 % of vLLM's pool instead of
  90 % (vLLM keeps one of its blocks for itself: 95 % of 24 blocks stays under the 23 it
  allocates from).

``--mix prefix``: the prefix-heavy mix instead: two shared prefixes of 512 tokens, a 64-token
suffix each, ``max_tokens`` 300 (vLLM shares the prefixes' KV blocks; the gateway counts them
once where a holder past its prefill has them).

Reported side by side: completed requests, output tokens per second (completion tokens over the
burst's wall time), p50/p99 latency, attempts per completed request (every POST the client's
transport sent), 429s, and vLLM's preemptions during the run (``vllm:num_preemptions_total``).

    python bench/vllm_price.py [--requests 32] [--runs direct,gateway,caps,no-queue] [--mix prefix]

About 10 minutes on 2 cores (vLLM's start-up included). Needs vLLM installed by
``python scripts/test_setup.py`` (or ``python scripts/vllm_engine.py ensure``).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import anyio
import httpx
from _common import gateway_process, machine, pin_to_cpu, print_table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import vllm_engine

from kvclient import AsyncClient, HuggingFaceCounter, RetryPolicy
from kvclient.engines.budget import budget_from_vllm_metrics
from kvclient.engines.metrics import preemptions_from_vllm_metrics, prometheus_samples
from kvclient.loadgen import percentile
from reference_server.admission.ledger import DEFAULT_SAFETY_FRACTION
from reference_server.admission.peak import Holder, peak, prefix_blocks

SEED = 7
DEADLINE = 900.0
LABELS = {
    "direct": "direct to vLLM",
    "gateway": "through kvclient gateway (defaults: peak rule, a FIFO queue)",
    "caps": "through kvclient gateway --admission-rule caps",
    "no-queue": "through kvclient gateway --max-queue-wait 0 (429 at once)",
    "tight": "through kvclient gateway --safety-fraction 0.95",
}
#: The prefix-heavy mix: shared prefixes, each request's own suffix, one output cap.
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, PREFIX_CAP = 2, 512, 64, 300


def workload(requests: int, low: int, high: int) -> list[tuple[str, int]]:
    """Seeded prompts (a few words each) and caps drawn uniformly from ``low``-``high``."""
    rng = random.Random(SEED)
    words = "story river mountain lamp garden engine winter market letter harbor".split()
    return [
        (f"Tell a long story about {' and '.join(rng.sample(words, 3))}.", rng.randint(low, high))
        for _ in range(requests)
    ]


def prefix_workload(requests: int) -> list[tuple[str, int]]:
    """Seeded prompts of one of two 512-word prefixes (one token a word for Llama 3's
    tokenizer) and a 64-word suffix of their own, each with ``max_tokens`` 300."""
    rng = random.Random(SEED)
    words = "story river mountain lamp garden engine winter market letter harbor".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(PREFIX_TOKENS)) for _ in range(PREFIXES)]
    return [
        (
            prefixes[i % PREFIXES]
            + " "
            + " ".join(rng.choice(words) for _ in range(SUFFIX_TOKENS)),
            PREFIX_CAP,
        )
        for i in range(requests)
    ]


def preemptions(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return preemptions_from_vllm_metrics(text) or 0.0


async def burst(
    url: str, items: list[tuple[str, int]], counter: HuggingFaceCounter, limit: int | None = None
) -> dict[str, Any]:
    """Send every item at once through one AsyncClient (at most ``limit`` in flight: None, no
    limit); what came back, and how."""
    posts = 0
    rejected = 0

    async def on_response(response: httpx.Response) -> None:
        nonlocal posts, rejected
        if response.request.method == "POST":
            posts += 1
            rejected += response.status_code == 429

    http = httpx.AsyncClient(
        timeout=DEADLINE,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        event_hooks={"response": [on_response]},
    )
    latencies: list[float] = []
    tokens = 0
    failures: dict[str, int] = {}
    async with (
        http,
        AsyncClient(
            base_url=url,
            counter=counter,
            http_client=http,
            retry=RetryPolicy(deadline=DEADLINE, max_attempts=50),
        ) as client,
    ):
        slots = anyio.Semaphore(limit or len(items))

        async def one(prompt: str, cap: int) -> None:
            nonlocal tokens
            started = time.monotonic()
            try:
                async with slots:
                    result = await client.complete(prompt, max_tokens=cap)
            except Exception as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                return
            latencies.append(time.monotonic() - started)
            tokens += result.usage.completion_tokens if result.usage else 0

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for prompt, cap in items:
                group.start_soon(one, prompt, cap)
        wall = time.monotonic() - started
    completed = len(latencies)
    return {
        "requests": len(items),
        "completed": completed,
        "failures": failures,
        "wall_seconds": wall,
        "completion_tokens": tokens,
        "tokens_per_second": tokens / wall if wall else 0.0,
        "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "attempts": posts,
        "attempts_per_completed": posts / completed if completed else None,
        "http_429": rejected,
    }


class EngineWatch:
    """vLLM's own gauges, read every half second while a run lasts: how full its KV cache
    really was (``vllm:kv_cache_usage_perc``) and how many sequences it ran at once
    (``vllm:num_requests_running``): the mean over the samples taken while any ran, and the
    most."""

    GAUGES: ClassVar[dict[str, str]] = {
        "kv_usage": "vllm:kv_cache_usage_perc",
        "running": "vllm:num_requests_running",
    }

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: dict[str, list[float]] = {name: [] for name in self.GAUGES}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.5):
                try:
                    text = http.get(self.url + "/metrics").text
                except httpx.HTTPError:
                    continue
                for name, metric in self.GAUGES.items():
                    found = prometheus_samples(text, metric)
                    if found:
                        self.samples[name].append(sum(value for _, value in found))

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, samples in self.samples.items():
            busy = [s for s in samples if s > 0]
            out[f"{name}_mean"] = sum(busy) / len(busy) if busy else None
            out[f"{name}_max"] = max(busy) if busy else None
        return out


def label(name: str) -> str:
    if name.startswith("direct@"):
        return f"direct to vLLM, at most {name.partition('@')[2]} at once (the client waits)"
    if name.startswith("lag@"):
        return f"through kvclient gateway --relay-lag {name.partition('@')[2]}"
    return LABELS[name]


def run(
    name: str, engine: vllm_engine.VllmServer, items: list[tuple[str, int]], cpu: int | None
) -> dict[str, Any]:
    with EngineWatch(engine.url) as watch:
        result = _run(name, engine, items, cpu)
    result.update(watch.summary())
    return result


def gateway_args(name: str, engine: vllm_engine.VllmServer) -> list[str]:
    """The ``kvclient gateway`` options of run ``name``."""
    args = ["--max-running", str(engine.max_num_seqs)]
    if name == "caps":
        args += ["--admission-rule", "caps"]
    if name == "no-queue":
        args += ["--max-queue-wait", "0"]
    if name == "tight":
        args += ["--safety-fraction", "0.95"]
    if name.startswith("lag@"):
        args += ["--relay-lag", name.partition("@")[2]]
    return args


def _run(
    name: str, engine: vllm_engine.VllmServer, items: list[tuple[str, int]], cpu: int | None
) -> dict[str, Any]:
    counter = HuggingFaceCounter.from_pretrained(str(engine.model))
    before = preemptions(engine.url)
    if name.startswith("direct"):
        limit = int(name.partition("@")[2]) if "@" in name else None
        result = anyio.run(burst, engine.url, items, counter, limit)
    else:
        # The gateway in a process of its own, as it is deployed (on the client's core when
        # pinned: the CPU it spends is not taken from the engine's).
        with gateway_process(engine.url, *gateway_args(name, engine), cpu=cpu) as url:
            result = anyio.run(burst, url, items, counter)
            metrics = httpx.get(url + "/metrics", timeout=30).text
            breaks = prometheus_samples(metrics, "kv_upstream_lockstep_breaks")
            result["lockstep_breaks"] = sum(value for _, value in breaks)
    result["preemptions"] = preemptions(engine.url) - before
    result["run"] = name
    return result


#: The rules :func:`ideal_running` plays: whole caps; the peak rule as built (a newcomer counts
#: whole until its first token); the peak rule if a newcomer's start were known (its trajectory
#: from admission on).
IDEAL_RULES = {
    "caps": "whole caps",
    "peak": "peak rule (a newcomer whole until its first token)",
    "peak, start known": "peak rule, if a newcomer's start were known",
}


def ideal_running(
    prompts: list[list[int]],
    caps: list[int],
    *,
    usable: int,
    block_size: int,
    max_running: int,
    rule: str,
) -> float:
    """The mean number of sequences at once if the gateway saw every holder's progress exactly
    and at once (no relay lag, a newcomer's first token on the step after its admission), the
    engine stepping all of them together: the FIFO queue admitting by ``rule`` (see
    :data:`IDEAL_RULES`) as the ledger counts, every request running to its cap as they do here.
    What the rule itself allows on this mix, against which the measured runs' means say what
    the relay's view costs."""
    queue = list(zip(prompts, caps, strict=True))
    running: list[tuple[Holder, int]] = []  # (its holder at admission, steps it has run)
    steps = produced = 0
    while queue or running:
        while queue and len(running) < max_running:
            ids, cap = queue[0]
            keys = prefix_blocks(ids, block_size)
            shared = any(h.prefix == keys for h, _ in running)
            admitted = Holder(len(ids), len(ids) + cap, cap + 1, keys, len(keys) if shared else 0)
            now = [
                Holder(h.held + s, h.most, h.steps_left - s, h.prefix, h.borrowed)  # type: ignore[operator]
                for h, s in running
            ]
            new = admitted
            if rule != "peak, start known":
                new = Holder.flat(new.most, new.prefix, new.borrowed)
            if rule == "caps":  # every reservation whole, shared blocks or not
                now = [Holder.flat(h.most) for h in now]
                new = Holder.flat(new.most)
            if peak([*now, new], block_size=block_size) > usable:
                break
            queue.pop(0)
            running.append((admitted, 0))
        produced += len(running)
        running = [(h, s + 1) for h, s in running if s + 1 < h.most - h.held]
        steps += 1
    return produced / steps


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput among a run's rounds (the lower middle of an even count),
    with every round's throughput beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_second"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["rounds_tokens_per_second"] = [r["tokens_per_second"] for r in runs]
    return chosen


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests in the burst")
    parser.add_argument("--low", type=int, default=400, help="smallest max_tokens")
    parser.add_argument("--high", type=int, default=800, help="largest max_tokens")
    parser.add_argument(
        "--runs",
        default="direct,direct@4,gateway,caps",
        help="comma-separated: direct, direct@N (at most N at once), gateway, caps, no-queue, "
        "tight",
    )
    parser.add_argument(
        "--mix", choices=("caps", "prefix"), default="caps",
        help="caps: short prompts, caps from --low to --high; prefix: two shared 512-token "
        "prefixes, 64-token suffixes, max_tokens 300",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run the runs this many times, interleaved (a busy machine's drift falls on all "
        "alike); each row is the round of median throughput (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-pin", action="store_true",
        help="leave vLLM on every core (default: vLLM on CPU 1, the client and the gateway on "
        "CPU 0, so that what the gateway spends is not taken from the engine, as on a GPU)",
    )  # fmt: skip
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if args.mix == "prefix":
        items = prefix_workload(args.requests)
    else:
        items = workload(args.requests, args.low, args.high)
    pinned = not args.no_pin and pin_to_cpu(0)
    print("… starting vLLM (a minute or two)", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with vllm_engine.VllmServer(cpus={1} if pinned else None) as engine:
        for round_ in range(args.rounds):
            for name in names:
                print(f"… round {round_ + 1}: {label(name)}", flush=True)
                rounds[name].append(run(name, engine, items, 0 if pinned else None))
                print(f"  {rounds[name][-1]}", flush=True)
        counter = HuggingFaceCounter.from_pretrained(str(engine.model))
        ideal = ideals(items, counter, engine)
    results = [median_round(rounds[name]) for name in names]
    direct = next((r for r in results if r["run"] == "direct"), None)
    for r in results:
        r["vs_direct"] = r["tokens_per_second"] / direct["tokens_per_second"] if direct else None
    rows = [
        [
            label(r["run"]),
            f"{r['completed']}/{r['requests']}",
            f"{r['tokens_per_second']:.1f}",
            fmt(r["latency_p50"], ".0f", " s"),
            fmt(r["latency_p99"], ".0f", " s"),
            fmt(r["attempts_per_completed"], ".2f"),
            str(r["http_429"]),
            f"{r['preemptions']:.0f}",
            f"{fmt(r['running_mean'], '.1f')} ({fmt(r['running_max'], '.0f')})",
            fmt(r["kv_usage_mean"] and 100 * r["kv_usage_mean"], ".0f", " %"),
            fmt(r["kv_usage_max"] and 100 * r["kv_usage_max"], ".0f", " %"),
            fmt(r["vs_direct"], ".2f", "x"),
        ]
        for r in results
    ]
    what = (
        f"{args.requests} requests of {PREFIXES} shared {PREFIX_TOKENS}-token prefixes, "
        f"max_tokens {PREFIX_CAP}"
        if args.mix == "prefix"
        else f"{args.requests} requests with max_tokens {args.low}-{args.high}"
    )
    print_table(
        f"{what} sent at once, real vLLM "
        f"{vllm_engine.VLLM_VERSION} on CPU (3,072 KV tokens, window 2,048, 8 sequences at most"
        f"{'; vLLM on CPU 1, the rest on CPU 0' if pinned else ''})",
        [
            "run",
            "completed",
            "output tokens/s",
            "p50",
            "p99",
            "attempts / completed",
            "429s",
            "preemptions",
            "running at once, mean (most)",
            "KV used, mean",
            "KV used, most",
            "vs direct",
        ],
        rows,
    )
    model = step_model(results)
    for rule, mean in ideal.items():
        line = f"{IDEAL_RULES[rule]}, ideal (exact progress, no lag): {mean:.2f} at once"
        if model is not None and direct is not None:
            a, b = model
            line += (
                f", {mean / (a + b * mean):.0f} tokens/s by the step time measured "
                f"({1000 * a:.1f} + {1000 * b:.2f} ms a sequence): "
                f"{mean / (a + b * mean) / direct['tokens_per_second']:.2f}x direct"
            )
        print(line)
    write_json(
        "vllm_price" if args.mix == "caps" else "vllm_price_prefix",
        {"machine": machine(), "requests": args.requests, "caps": [args.low, args.high],
         "mix": args.mix, "rounds": args.rounds, "pinned": pinned, "results": results,
         "ideal_running": ideal, "step_model": model, "all_rounds": rounds},
    )  # fmt: skip


def ideals(
    items: list[tuple[str, int]], counter: HuggingFaceCounter, engine: vllm_engine.VllmServer
) -> dict[str, float]:
    """:func:`ideal_running` by each rule, at the gateway's defaults against this engine."""
    found = budget_from_vllm_metrics(httpx.get(engine.url + "/metrics", timeout=30).text)
    assert found is not None, "vLLM's /metrics has no vllm:cache_config_info"
    total, block_size = found
    return {
        rule: ideal_running(
            [counter.encode(prompt) for prompt, _ in items],
            [cap for _, cap in items],
            usable=int(total * DEFAULT_SAFETY_FRACTION),
            block_size=block_size,
            max_running=engine.max_num_seqs,
            rule=rule,
        )
        for rule in IDEAL_RULES
    }


def step_model(results: list[dict[str, Any]]) -> tuple[float, float] | None:
    """vLLM's time a step as ``a + b x sequences``, in seconds, from two direct runs at different
    numbers at once (``direct`` and ``direct@N``: tokens/s over the mean running); None
    without both."""
    points = [
        (r["running_mean"], r["running_mean"] / r["tokens_per_second"])
        for r in results
        if r["run"].startswith("direct") and r["running_mean"] and r["tokens_per_second"]
    ]
    if len(points) < 2 or points[0][0] == points[1][0]:
        return None
    (n1, t1), (n2, t2) = points[:2]
    b = (t2 - t1) / (n2 - n1)
    return t1 - b * n1, b


if __name__ == "__main__":
    main()
