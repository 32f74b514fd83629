"""How far one stream's counts lag another's, read from a real vLLM: what ``--relay-lag`` covers.

The peak rule (``docs/peak.md``) needs no margin for counts that are all equally late; what it
covers is the lag of one stream's counts behind another's. In lockstep every running sequence
makes one token a step, so between two streams running together the difference of their token
counts is constant in the engine; read at the client, it wobbles by what one stream's chunks
lag the other's. This bench measures that wobble.

``--streams`` (default 8, vLLM's ``--max-num-seqs`` in the tests) streamed completions sent at
once, caps that fit vLLM's KV cache together (no preemption, no waiting: lockstep), each chunk's
``usage.completion_tokens`` (``stream_options.continuous_usage_stats``) stamped on arrival.
For each pair of streams, over the steps both run (the first and last 10 % left out: prefill and
ends), the median of the difference of their latest counts is the engine's offset; the
deviation from it at each arrival is how many tokens one stream's view lags the other's. Given
in tokens and in seconds (over the streams' own speed), with the margin the gateway takes for it
(twice the speed times ``--relay-lag``, default 0.25 s) beside it.

    python bench/relay_lag.py [--streams 8] [--tokens 300] [--rounds 3] [--through-gateway]

Direct to vLLM by default (what a gateway reads); ``--through-gateway`` reads through
``kvclient gateway`` (one more hop: an upper bound). About 3 minutes with vLLM's start-up.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from bisect import bisect_right
from pathlib import Path

import anyio
import httpx
from _common import gateway_process, machine, pin_to_cpu, print_table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import vllm_engine

from kvclient.sse import aiter_events
from reference_server.admission.holders import DEFAULT_RELAY_LAG, LAG_RATE_FACTOR

Trace = list[tuple[float, int]]  # (arrival, completion tokens so far)


async def one_stream(http: httpx.AsyncClient, url: str, model: str, tokens: int) -> Trace:
    """A streamed completion that cannot stop early; each count with its arrival time."""
    body = {
        "model": model,
        "prompt": "Tell a long story.",
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    trace: Trace = []
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for event in aiter_events(response.aiter_lines()):
            if event is None:
                break
            usage = event.get("usage") or {}
            count = usage.get("completion_tokens")
            if count:
                trace.append((time.monotonic(), int(count)))
    return trace


async def burst(url: str, model: str, streams: int, tokens: int) -> list[Trace]:
    traces: list[Trace] = []
    async with httpx.AsyncClient(timeout=600) as http:

        async def run() -> None:
            traces.append(await one_stream(http, url, model, tokens))

        async with anyio.create_task_group() as group:
            for _ in range(streams):
                group.start_soon(run)
    return traces


def count_at(trace: Trace, times: list[float], t: float) -> int:
    """The latest count of ``trace`` read by ``t`` (0 before its first)."""
    i = bisect_right(times, t)
    return trace[i - 1][1] if i else 0


def pair_lags(a: Trace, b: Trace) -> tuple[list[int], float]:
    """Deviations (tokens) of the two streams' count difference from its median, at every
    arrival of either over their common middle, and their mean speed there (tokens/s)."""
    start, end = max(a[0][0], b[0][0]), min(a[-1][0], b[-1][0])
    if end <= start:
        return [], 0.0
    span = end - start
    lo, hi = start + 0.1 * span, end - 0.1 * span
    ta, tb = [t for t, _ in a], [t for t, _ in b]
    moments = sorted(t for t in ta + tb if lo <= t <= hi)
    if len(moments) < 10:
        return [], 0.0
    diffs = [count_at(a, ta, t) - count_at(b, tb, t) for t in moments]
    offset = statistics.median(diffs)
    made = count_at(a, ta, hi) - count_at(a, ta, lo)
    return [round(abs(d - offset)) for d in diffs], made / (hi - lo)


def summarize(traces: list[Trace]) -> dict[str, float]:
    lags: list[int] = []
    speeds: list[float] = []
    for a, b in itertools.combinations([t for t in traces if len(t) > 20], 2):
        found, speed = pair_lags(a, b)
        if found:
            lags.extend(found)
            speeds.append(speed)
    lags.sort()
    speed = statistics.mean(speeds) if speeds else 0.0

    def q(p: float) -> float:
        return float(lags[min(len(lags) - 1, int(p * len(lags)))]) if lags else 0.0

    return {
        "samples": len(lags),
        "speed": speed,
        "p50": q(0.5),
        "p99": q(0.99),
        "max": float(lags[-1]) if lags else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8, help="streams at once")
    parser.add_argument("--tokens", type=int, default=300, help="tokens each (min = max)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts, one after another")
    parser.add_argument(
        "--through-gateway", action="store_true",
        help="read through kvclient gateway --max-running STREAMS (one more hop)",
    )  # fmt: skip
    parser.add_argument(
        "--no-pin", action="store_true", help="leave vLLM on every core (default: on CPU 1)"
    )
    args = parser.parse_args()
    pinned = not args.no_pin and pin_to_cpu(0)
    print("… starting vLLM (a minute or two)", flush=True)
    rounds: list[dict[str, float]] = []
    with vllm_engine.VllmServer(cpus={1} if pinned else None) as engine:
        model = str(engine.model)
        for round_ in range(args.rounds):
            if args.through_gateway:
                with gateway_process(
                    engine.url, "--max-running", str(args.streams), cpu=0 if pinned else None
                ) as url:
                    traces = anyio.run(burst, url, model, args.streams, args.tokens)
            else:
                traces = anyio.run(burst, engine.url, model, args.streams, args.tokens)
            rounds.append(summarize(traces))
            print(f"  round {round_ + 1}: {rounds[-1]}", flush=True)
    rows = []
    for i, r in enumerate(rounds, 1):
        per_token = 1000 / r["speed"] if r["speed"] else 0.0
        rows.append(
            [
                str(i),
                f"{r['speed']:.0f}",
                f"{r['p50']:.0f} ({r['p50'] * per_token:.0f} ms)",
                f"{r['p99']:.0f} ({r['p99'] * per_token:.0f} ms)",
                f"{r['max']:.0f} ({r['max'] * per_token:.0f} ms)",
                f"{LAG_RATE_FACTOR * r['speed'] * DEFAULT_RELAY_LAG:.0f}",
            ]
        )
    where = "through kvclient gateway" if args.through_gateway else "direct"
    print_table(
        f"How far one stream's counts lag another's, {args.streams} streams of {args.tokens} "
        f"tokens at once, {where}, real vLLM {vllm_engine.VLLM_VERSION} on CPU"
        f"{' (vLLM on CPU 1)' if pinned else ''}",
        [
            "round",
            "tokens/s a stream",
            "lag p50, tokens",
            "p99",
            "most",
            f"the gateway's margin (2 x speed x {DEFAULT_RELAY_LAG} s)",
        ],
        rows,
    )
    write_json(
        "relay_lag_gateway" if args.through_gateway else "relay_lag",
        {"machine": machine(), "streams": args.streams, "tokens": args.tokens,
         "pinned": pinned, "rounds": rounds},
    )  # fmt: skip


if __name__ == "__main__":
    main()
