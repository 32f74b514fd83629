"""Fair shares of the KV budget through ``kvclient gateway --tenants``, against hostile clients
and measured by what tenants get: a light tenant beside a flood that forges its name, picks
priority -1000 and opens 60 connections (FIFO against fair), and two saturating tenants weighted
3:1 under the peak rule.

The gateway is set up as its guide recommends: each tenant known by the API key the tenants
file lists for it (``keys``), an unlisted key refused, no ``--tenant-header``, every tenant
granted class 0 alone. One reference server (``kvclient serve``, 16,128 KV tokens, admitting by
the prompt as vLLM does, outputs that stop by themselves after 200 tokens on average, at
``--decode-rate`` tokens/s per sequence) in its own process, and a gateway in front in its own,
on its default rule, the peak rule (``/health`` says which ran; two gateways sharing a ledger
run it too, over every gateway's holders).

Flood: tenant A (key ``sk-a``) keeps ``--flood`` requests with 1,000-token caps in flight, each
on a connection of its own and each sent with ``X-Tenant: b`` (B's name, in a header a careless
gateway would read) and ``X-Priority: -1000``: more than fit, so the rest wait in the gateway.
Tenant B (key ``sk-b``) sends one short request (``max_tokens`` 10) a second for ``--seconds``
seconds, without waiting for the one before. B's latencies alone (before the flood), beside the
flood through the FIFO gateway and through the fair one: p50, p99, and B's wait for the next
release of one of A's holdings (from its send to the first of A's answers received more than a
round trip later). Goal: fair p99 <= max(2 x B's p99 alone, B's p99 alone + 1.5 s); under FIFO
it waits behind A's whole queue.

Shares: tenants A (weight 3) and B (weight 1), each keeping 48 streamed requests with
1,000-token caps in flight: more than fit, so both are backlogged (the share of once-a-second
samples in which one had nothing waiting is reported: a tenant not backlogged takes no share).
What each tenant got over ``--seconds`` seconds once both are backlogged, from the engine's own
counts relayed in every chunk (``stream_options`` ``continuous_usage_stats``): the KV
token-seconds its requests held in the engine (prompt plus the tokens generated so far,
integrated over the time between chunks) and the tokens it received; beside them, the
gateway's own counter (``kv_tenant_token_seconds_total``). Goal: A/B within 10 % of 3 in both.

    python bench/tenant_fairness.py [--quick] [--seconds 60] [--flood 60] [--decode-rate 300]
                                    [--ledger]

``--ledger``: the fair flood and the shares once more across two gateways sharing a local
``redis-server`` (one order across them), A through one and B through the other.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
from _common import (
    gateway_process,
    print_table,
    redis_server,
    reference_server_process,
    write_json,
)

from kvclient._prometheus import parse_samples

#: Sixteen of A's requests fit by their caps (1,008 tokens each: a 1-token prompt and its cap,
#: in blocks of 16); the peak rule admits more, as their outputs stop sooner.
KV_TOKENS = 16 * 1008
FLOOD_CAP = 1000
SHARE_CAP = 1000
SHARE_CLIENTS = 48
MEAN_OUTPUT = 200
LIGHT_CAP = 10
MAX_RUNNING = 256
#: What the flood sends besides its own key: another tenant's name and the most urgent class.
FORGED = {"X-Tenant": "b", "X-Priority": "-1000"}


def _tenants(path: Path, weights: dict[str, float]) -> str:
    text = "".join(
        f'[tenants.{name}]\nweight = {w}\nkeys = ["sk-{name}"]\n\n' for name, w in weights.items()
    )
    path.write_text(text)
    return str(path)


def _headers(tenant: str) -> dict[str, str]:
    """A's key and the forgery; B's key and its own name (as a header that names the tenant
    would carry it: the forgery then lands in B's own queue where such a header is read)."""
    headers = {"Authorization": f"Bearer sk-{tenant}"}
    return {**headers, **FORGED} if tenant == "a" else {**headers, "X-Tenant": tenant}


async def _post(http: httpx.AsyncClient, tenant: str, cap: int) -> float:
    began = time.monotonic()
    answer = await http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": cap}, headers=_headers(tenant)
    )
    if answer.status_code != 200:
        raise RuntimeError(f"{tenant}: {answer.status_code} {answer.text[:200]}")
    return time.monotonic() - began


async def _keep(
    base: str,
    tenant: str,
    cap: int,
    clients: int,
    until: float,
    ends: list[float] | None = None,
) -> int:
    """``clients`` requests of ``tenant`` in flight until ``until``, each on a connection of
    its own (each client sends its next when its last is answered); the answers counted, the
    time each was received added to ``ends``."""
    answered = 0
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:

        async def one() -> None:
            nonlocal answered
            while time.monotonic() < until:
                await _post(http, tenant, cap)
                answered += 1
                if ends is not None:
                    ends.append(time.monotonic())

        async with anyio.create_task_group() as group:
            for _ in range(clients):
                group.start_soon(one)
    return answered


async def _light(base: str, seconds: float) -> list[tuple[float, float]]:
    """One short request of B a second for ``seconds``, each sent on time; when each was sent
    and its latency."""
    latencies: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:

        async def one() -> None:
            sent = time.monotonic()
            latencies.append((sent, await _post(http, "b", LIGHT_CAP)))

        async with anyio.create_task_group() as group:
            start = time.monotonic()
            for i in range(max(1, round(seconds))):
                await anyio.sleep(max(0.0, start + i - time.monotonic()))
                group.start_soon(one)
    return latencies


def _next_after(times: list[float], t: float) -> float:
    """The first of the sorted ``times`` after ``t`` (infinity when none is)."""
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else math.inf


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _rule(base: str) -> str:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        health = (await http.get("/health")).json()
    return str(health["upstreams"][0]["admission"])


async def _flood(
    base: str,
    flood: int,
    seconds: float,
    warmup: float,
    rate: float,
    flood_base: str | None = None,
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        alone = [await _post(http, "b", LIGHT_CAP) for _ in range(10)]
    sends: list[tuple[float, float]] = []
    ends: list[float] = []
    until = time.monotonic() + warmup + seconds

    async def light() -> None:
        await anyio.sleep(warmup)  # A holds the budget and its queue is deep
        sends.extend(await _light(base, seconds))

    async with anyio.create_task_group() as group:
        group.start_soon(_keep, flood_base or base, "a", FLOOD_CAP, flood, until, ends)
        group.start_soon(light)
    beside = [latency for _, latency in sends]
    # Each of B's requests waits at least for a release of one of A's holdings (A fills the
    # budget): the first of A's answers received more than a round trip after B's was sent.
    lag = max(0.0, statistics.median(alone) - LIGHT_CAP / rate)
    ends.sort()
    waits = [_next_after(ends, sent + lag) - sent for sent, _ in sends]
    alone_p99 = _p(alone, 0.99)
    return {
        "rule": await _rule(base),
        "alone_p50": statistics.median(alone),
        "alone_p99": alone_p99,
        "p50": statistics.median(beside),
        "p99": _p(beside, 0.99),
        "bound": max(2 * alone_p99, alone_p99 + 1.5),
        "requests": len(beside),
        "latencies": beside,
        "release_wait_p50": statistics.median(waits),
        "release_wait_p99": _p(waits, 0.99),
        "release_waits": waits,
        "a_answers": len(ends),
    }


class _Got:
    """What one tenant's streamed requests got within a window: KV token-seconds held in the
    engine (prompt + tokens so far, between chunks) and tokens received."""

    def __init__(self) -> None:
        self.token_seconds = 0.0
        self.tokens = 0
        self.cut = 0  # streams that broke (counted as far as they came)


async def _stream(
    http: httpx.AsyncClient, tenant: str, window: tuple[float, float], got: _Got
) -> None:
    """One streamed request of ``tenant``, what it got within ``window`` added to ``got``."""
    body = {
        "prompt": "hi",
        "max_tokens": SHARE_CAP,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    start, end = window
    prompt = made = 0
    since: float | None = None
    async with http.stream("POST", "/v1/completions", json=body, headers=_headers(tenant)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{tenant}: {r.status_code} {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            usage = json.loads(line[6:]).get("usage")
            if not usage:
                continue
            now = time.monotonic()
            if since is not None:  # what it held since the last count, within the window
                overlap = max(0.0, min(now, end) - max(since, start))
                got.token_seconds += (prompt + made) * overlap
            tokens = int(usage["completion_tokens"])
            if start <= now <= end:
                got.tokens += tokens - made
            prompt, made, since = int(usage["prompt_tokens"]), tokens, now


async def _tenant_figures(base: str, name: str) -> dict[str, float]:
    """The gateway's ``/metrics`` figure ``name`` by tenant."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        text = (await http.get("/metrics")).text
    return {s.labels["tenant"]: s.value for s in parse_samples(text) if s.name == name}


async def _shares(
    base: str, seconds: float, warmup: float, b_base: str | None = None
) -> dict[str, Any]:
    start = time.monotonic() + warmup
    window = (start, start + seconds)
    got = {"a": _Got(), "b": _Got()}
    marks: list[dict[str, float]] = []
    none_waiting = {"a": 0, "b": 0}  # samples, a second apart, with nothing of its waiting
    samples = 0

    async def keep(url: str, tenant: str) -> None:
        limits = httpx.Limits(max_connections=SHARE_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

            async def one() -> None:
                while time.monotonic() < window[1]:
                    try:
                        await _stream(http, tenant, window, got[tenant])
                    except httpx.TransportError:
                        got[tenant].cut += 1

            async with anyio.create_task_group() as group:
                for _ in range(SHARE_CLIENTS):
                    group.start_soon(one)

    async def mark() -> None:
        nonlocal samples
        counter = "kv_tenant_token_seconds_total"
        await anyio.sleep(max(0.0, window[0] - time.monotonic()))
        marks.append(await _tenant_figures(base, counter))
        while time.monotonic() < window[1] - 1.0:  # is each tenant backlogged?
            await anyio.sleep(1.0)
            waiting = await _tenant_figures(base, "kv_tenant_waiting_requests")
            samples += 1
            for tenant in none_waiting:
                none_waiting[tenant] += waiting.get(tenant, 0.0) == 0
        await anyio.sleep(max(0.0, window[1] - time.monotonic()))
        marks.append(await _tenant_figures(base, counter))

    async with anyio.create_task_group() as group:
        group.start_soon(keep, base, "a")
        group.start_soon(keep, b_base or base, "b")
        group.start_soon(mark)
    a, b = got["a"], got["b"]
    counted = {t: marks[1].get(t, 0.0) - marks[0].get(t, 0.0) for t in ("a", "b")}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        text = (await http.get("/metrics")).text
    breaks = sum(s.value for s in parse_samples(text) if s.name.startswith("kv_upstream_lockstep"))
    return {
        "rule": await _rule(base),
        "lockstep_breaks": breaks,  # spells on whole caps, the engine seen out of lockstep
        "a_token_seconds": a.token_seconds,
        "b_token_seconds": b.token_seconds,
        "token_seconds_ratio": a.token_seconds / b.token_seconds if b.token_seconds else math.inf,
        "a_tokens": a.tokens,
        "b_tokens": b.tokens,
        "tokens_ratio": a.tokens / b.tokens if b.tokens else math.inf,
        "counter_ratio": counted["a"] / counted["b"] if counted["b"] else math.inf,
        "cut_streams": a.cut + b.cut,
        "a_none_waiting": none_waiting["a"] / max(1, samples),
        "b_none_waiting": none_waiting["b"] / max(1, samples),
    }


@contextlib.contextmanager
def _gateway(upstream: str, *args: str) -> Iterator[str]:
    """A gateway in its own process on core 0, started again (up to twice) when it did not
    come up in time: on a machine shared with other work, starting may take that long."""
    with contextlib.ExitStack() as stack:
        for attempt in range(3):
            try:
                url = stack.enter_context(gateway_process(upstream, *args, cpu=0))
                break
            except (RuntimeError, subprocess.TimeoutExpired):
                if attempt == 2:
                    raise
        yield url


def _within(ratio: float) -> bool:
    return abs(ratio / 3 - 1) <= 0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 s windows, a smaller flood")
    parser.add_argument("--seconds", type=float, help="each window (default 60, --quick 8)")
    parser.add_argument("--flood", type=int, help="A's connections (default 60)")
    parser.add_argument(
        "--decode-rate", type=float, help="tokens/s per sequence (default 300, --quick 1000)"
    )
    parser.add_argument(
        "--ledger",
        action="store_true",
        help="also across two gateways sharing a local redis-server (--ledger): A through one, "
        "B through the other",
    )
    args = parser.parse_args()
    seconds = args.seconds or (8.0 if args.quick else 60.0)
    flood = args.flood or (30 if args.quick else 60)
    rate = args.decode_rate or (1000.0 if args.quick else 300.0)
    warmup = 2 * FLOOD_CAP / rate  # two of A's longest holdings: its queue is deep by then
    share_warmup = 4 * SHARE_CAP / rate  # both tenants backlogged, their first holders gone
    server = ("--kv-tokens", str(KV_TOKENS), "--context-window", "4096", "--safety-fraction", "1")
    # The server admits by the prompt alone, as vLLM does (the gateway in front keeps it within
    # its KV), and runs every sequence it is sent at each step (up to 256, more than ever fit):
    # told so, the gateway runs the peak rule.
    server += ("--decode-rate", str(rate), "--max-running", str(MAX_RUNNING))
    server += ("--admission", "prompt", "--mean-output-tokens", str(MEAN_OUTPUT))
    gateway = ("--safety-fraction", "1", "--decode-rate", str(rate))
    gateway += ("--max-running", str(MAX_RUNNING))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": seconds, "flood": flood, "decode_rate": rate, "mean_output": MEAN_OUTPUT,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        even = ("--tenants", _tenants(tmp / "even.toml", {"a": 1.0, "b": 1.0}))
        weighted = ("--tenants", _tenants(tmp / "weighted.toml", {"a": 3.0, "b": 1.0}))
        up = stack.enter_context(reference_server_process(*server, cpu=1))
        with _gateway(up, *gateway) as url:
            results["fifo"] = anyio.run(_flood, url, flood, seconds, warmup, rate)
        write_json("tenant_fairness", results)  # each part kept as it is measured
        with _gateway(up, *gateway, *even) as url:
            results["fair"] = anyio.run(_flood, url, flood, seconds, warmup, rate)
        write_json("tenant_fairness", results)
        with _gateway(up, *gateway, *weighted) as url:
            results["shares"] = anyio.run(_shares, url, seconds, share_warmup)
        write_json("tenant_fairness", results)
        if args.ledger:
            # Each run its own Redis: the two tenants files differ, and Redis keeps each
            # upstream's terms (and its tenants' counters) for as long as a gateway has it.
            ledger = ("--ledger", stack.enter_context(redis_server()))
            with contextlib.ExitStack() as two:
                one, other = (
                    two.enter_context(_gateway(up, *gateway, *even, *ledger)) for _ in "12"
                )
                results["shared"] = anyio.run(_flood, other, flood, seconds, warmup, rate, one)
            write_json("tenant_fairness", results)
            ledger = ("--ledger", stack.enter_context(redis_server()))
            with contextlib.ExitStack() as two:
                one, other = (
                    two.enter_context(_gateway(up, *gateway, *weighted, *ledger)) for _ in "12"
                )
                results["shared_shares"] = anyio.run(_shares, one, seconds, share_warmup, other)
    _report(results, flood, rate, seconds)
    write_json("tenant_fairness", results)


def _report(results: dict[str, Any], flood: int, rate: float, seconds: float) -> None:
    floods = [("FIFO", results["fifo"]), ("fair", results["fair"])]
    if "shared" in results:
        floods.append(("fair, 2 gateways on Redis", results["shared"]))
    keys = ("alone_p50", "alone_p99", "p50", "p99", "bound", "release_wait_p99")
    print_table(
        f"B's latency (s) beside A's flood ({flood} connections x {FLOOD_CAP}-token caps at "
        f"{rate:g}/s, forging B's name, X-Priority -1000)",
        ["gateway", "rule", "alone p50", "alone p99", "beside p50", "beside p99", "bound",
         "wait for A's release p99"],
        [[name, r["rule"], *(f"{r[k]:.3f}" for k in keys)] for name, r in floods],
    )  # fmt: skip
    shares = [("one gateway", results["shares"])]
    if "shared_shares" in results:
        shares.append(("2 gateways on Redis", results["shared_shares"]))
    print_table(
        f"what tenants weighted 3:1 got over {seconds:g} s",
        ["gateway", "rule", "KV token-s A", "KV token-s B", "A/B", "tokens A", "tokens B",
         "A/B", "gateway's counter A/B", "none of A / B waiting"],
        [[name, r["rule"], f"{r['a_token_seconds']:.0f}", f"{r['b_token_seconds']:.0f}",
          f"{r['token_seconds_ratio']:.3f}", str(r["a_tokens"]), str(r["b_tokens"]),
          f"{r['tokens_ratio']:.3f}", f"{r['counter_ratio']:.3f}",
          f"{r['a_none_waiting']:.0%} / {r['b_none_waiting']:.0%}"] for name, r in shares],
    )  # fmt: skip
    fair, fifo = results["fair"], results["fifo"]
    goals: dict[str, Any] = {
        "fair_p99_within_bound": fair["p99"] <= fair["bound"],
        "fifo_over_fair_p99": fifo["p99"] / fair["p99"],
    }
    for name, r in shares:
        key = "shares" if name == "one gateway" else "shared_shares"
        goals[f"{key}_token_seconds_within_10_percent"] = _within(r["token_seconds_ratio"])
        goals[f"{key}_tokens_within_10_percent"] = _within(r["tokens_ratio"])
    if "shared" in results:
        goals["shared_p99_within_bound"] = results["shared"]["p99"] <= results["shared"]["bound"]
    results["goals"] = goals
    print(
        f"\ngoals: fair p99 {fair['p99']:.3f} s <= max(2 x alone p99, alone p99 + 1.5 s) = "
        f"{fair['bound']:.3f} s: {goals['fair_p99_within_bound']} (FIFO p99 / fair p99 = "
        f"{goals['fifo_over_fair_p99']:.1f}); weights 3:1, A/B within 10 % of 3: "
        + ", ".join(f"{k}: {v}" for k, v in goals.items() if k.endswith("10_percent"))
    )
    if "shared" in results:
        shared = results["shared"]
        print(
            f"across 2 gateways on Redis: fair p99 {shared['p99']:.3f} s <= "
            f"{shared['bound']:.3f} s: {goals['shared_p99_within_bound']}"
        )


if __name__ == "__main__":
    main()
