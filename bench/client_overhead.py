"""Client overhead per call against an instant-answer local server: raw httpx, openai, kvclient.

The server (bench/instant_server.py) runs in its own process, pinned to CPU 1; the benchmark runs
pinned to CPU 0 (when two cores exist). Each variant makes the same non-streamed
``/v1/completions`` call with ``max_tokens=16``, with a tiny prompt and with a 1,000-token prompt:

- raw ``httpx.Client.post`` + ``response.json()`` (the floor);
- ``openai.OpenAI(...).completions.create`` (defaults);
- ``kvclient.Client.complete`` with ``model`` and ``context_window`` given (no discovery): it
  counts the prompt locally and clamps ``max_tokens`` before sending.

Async likewise (httpx.AsyncClient / AsyncOpenAI / AsyncClient, sequential awaits in one task).
Variants run in interleaved rounds; the figure is the best round's mean time per call (wall
clock, which the goals use), and beside it the benchmark process's CPU time per call, a steadier
figure of the client's own work.

Goals: with a tiny prompt (count cost ~0), kvclient within 1.10x of raw httpx; with the
1,000-token prompt (count included), kvclient faster than the openai SDK. The count's share is
``TiktokenCounter().count(prompt)`` time / kvclient call time.

    python bench/client_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
from _common import instant_server_process, pin_to_cpu, print_table, write_json

from kvclient import AsyncClient, Client, TiktokenCounter
from kvclient.loadgen import make_prompt

GOAL_VS_HTTPX = 1.10
MODEL = "instant"
CONTEXT = 8192
MAX_TOKENS = 16


def prompts() -> dict[str, str]:
    return {"tiny": "Say hi", "1k": make_prompt(1000, random.Random(0))}


def sync_variants(url: str, prompt: str) -> tuple[dict[str, Callable[[], Any]], list[Any]]:
    import openai

    http = httpx.Client()
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x")
    kv = Client(base_url=url, model=MODEL, context_window=CONTEXT)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
    endpoint = url + "/v1/completions"
    variants = {
        "raw httpx": lambda: http.post(endpoint, json=body).json(),
        "openai SDK": lambda: sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS
        ),
        "kvclient": lambda: kv.complete(prompt, max_tokens=MAX_TOKENS),
    }
    return variants, [http, sdk, kv]


def async_variants(
    url: str, prompt: str
) -> tuple[dict[str, Callable[[], Awaitable[Any]]], list[Any]]:
    import openai

    http = httpx.AsyncClient()
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
    kv = AsyncClient(base_url=url, model=MODEL, context_window=CONTEXT)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
    endpoint = url + "/v1/completions"

    async def raw() -> Any:
        return (await http.post(endpoint, json=body)).json()

    async def sdk_call() -> Any:
        return await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)

    async def kv_call() -> Any:
        return await kv.complete(prompt, max_tokens=MAX_TOKENS)

    return {"raw httpx": raw, "openai SDK": sdk_call, "kvclient": kv_call}, [http, sdk, kv]


Timings = dict[str, dict[str, list[float]]]


def keep_best(best: list[float], start: float, cpu: float, calls: int) -> None:
    """Keep the best round's [wall, client CPU] seconds per call."""
    best[0] = min(best[0], (time.perf_counter() - start) / calls)
    best[1] = min(best[1], (time.process_time() - cpu) / calls)


def run_sync(url: str, calls: int, rounds: int) -> Timings:
    """Best round's [wall, client CPU] seconds per call, by prompt, by variant."""
    out: Timings = {}
    per_round = max(1, calls // rounds)
    for size, prompt in prompts().items():
        variants, closers = sync_variants(url, prompt)
        for fn in variants.values():  # warm-up: connections, imports, the encoding
            for _ in range(20):
                fn()
        best = {name: [float("inf"), float("inf")] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(per_round):
                    fn()
                keep_best(best[name], start, cpu, per_round)
        for c in closers:
            c.close()
        out[size] = best
    return out


async def run_async(url: str, calls: int, rounds: int) -> Timings:
    out: Timings = {}
    per_round = max(1, calls // rounds)
    for size, prompt in prompts().items():
        variants, closers = async_variants(url, prompt)
        for fn in variants.values():
            for _ in range(20):
                await fn()
        best = {name: [float("inf"), float("inf")] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(per_round):
                    await fn()
                keep_best(best[name], start, cpu, per_round)
        for c in closers:
            await (c.aclose() if hasattr(c, "aclose") else c.close())
        out[size] = best
    return out


def count_seconds(prompt: str, repeat: int) -> float:
    counter = TiktokenCounter().load()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(100):
            counter.count(prompt)
        best = min(best, (time.perf_counter() - start) / 100)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, help="calls per variant (default 2000, --quick 300)")
    args = parser.parse_args()
    calls = args.calls or (300 if args.quick else 2000)
    rounds = 5 if args.quick else 20
    pinned = pin_to_cpu(0)
    count_1k = count_seconds(prompts()["1k"], 5 if args.quick else 20)
    with instant_server_process(cpu=1 if pinned else None) as url:
        sync = run_sync(url, calls, rounds)
        async_ = anyio.run(run_async, url, calls, rounds)

    rows = []
    results: dict[str, Any] = {"count_1k_seconds": count_1k}
    goals: dict[str, bool] = {}
    for mode, data in (("sync", sync), ("async", async_)):
        for size in ("tiny", "1k"):
            raw_wall, raw_cpu = data[size]["raw httpx"]
            for name, (wall, cpu) in data[size].items():
                ratio = wall / raw_wall
                note = ""
                if name == "kvclient" and size == "tiny":
                    ok = ratio <= GOAL_VS_HTTPX
                    goals[f"{mode}_tiny_within_{GOAL_VS_HTTPX}x_httpx"] = ok
                    note = f"goal <= {GOAL_VS_HTTPX}x httpx: {'met' if ok else 'NOT met'}"
                if name == "kvclient" and size == "1k":
                    ok = wall < data[size]["openai SDK"][0]
                    goals[f"{mode}_1k_faster_than_openai"] = ok
                    note = (
                        f"count {count_1k * 1e6:.0f} µs = {count_1k / wall:.0%} of the call; "
                        f"goal < openai SDK: {'met' if ok else 'NOT met'}"
                    )
                rows.append(
                    [
                        mode,
                        "1,000 tokens" if size == "1k" else "tiny",
                        name,
                        f"{wall * 1e6:,.0f}",
                        f"{ratio:.2f}x",
                        f"{cpu * 1e6:,.0f}",
                        f"{cpu / raw_cpu:.2f}x",
                        note,
                    ]
                )
        results[mode] = {
            size: {
                name: {
                    "seconds": wall,
                    "ratio_to_httpx": wall / data[size]["raw httpx"][0],
                    "client_cpu_seconds": cpu,
                    "cpu_ratio_to_httpx": cpu / data[size]["raw httpx"][1],
                }
                for name, (wall, cpu) in data[size].items()
            }
            for size in data
        }
    placement = "pinned: client CPU 0, server CPU 1" if pinned else "NOT pinned"
    print_table(
        f"Client overhead per call against an instant local server ({placement}), best of "
        f"{rounds} rounds of {calls // rounds} calls, non-streamed, max_tokens={MAX_TOKENS}",
        [
            "mode",
            "prompt",
            "client",
            "µs per call",
            "vs raw httpx",
            "client CPU µs",
            "CPU vs httpx",
            "notes",
        ],
        rows,
    )
    print(
        "\nkvclient goals: "
        + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items())
    )
    write_json(
        "client_overhead",
        {"pinned": pinned, "calls": calls, "rounds": rounds, "goals_met": goals, **results},
    )


if __name__ == "__main__":
    main()
