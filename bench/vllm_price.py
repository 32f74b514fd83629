"""The gateway's price in throughput, on a real vLLM: the same load direct and through it.

The real vLLM the tests use (``scripts/vllm_engine.py``: a tiny random-weight Llama on CPU, a
2,048 window) over 3,072 KV tokens and 8 sequences at most (``--engine small``, the tests'), or
over 16,384 KV tokens and 64 sequences (``--engine large``: the pool binds), through
``kvclient.AsyncClient``, with the process that runs vLLM's model on CPU 1 and everything else
(vLLM's API server and scheduler, the client, the gateway) on CPU 0, as on a GPU host, where
the model's steps are the GPU's and no CPU work per streamed token is taken from them:

- **direct**: vLLM admits everything its scheduler can fit and preempts sequences when their KV
  outgrows the pool (recomputing them later); ``direct@N``: the client sends at most N at once;
- **gateway**: ``kvclient gateway --max-running N`` in front of the same vLLM, its defaults: the
  pool vLLM really has (less its null block), the peak rule with a newcomer's clock, and holders
  counted by a forecast of their outputs within a preemption budget (20 per 1,000 requests); what
  does not fit waits in its FIFO queue;
- **exact**: the same with ``--preemption-budget 0`` (no forecast: every holder to its cap);
- **caps**: ``--admission-rule caps``, every holder its whole reservation;
- **no-queue** (429 + Retry-After at once), ``lag@S`` (``--relay-lag S``), ``budget@N``
  (``--preemption-budget N``), ``start@Q`` (``--forecast-quantile Q``);
- ``shared@N``: N gateway processes sharing one Redis ledger (``--ledger``, a local
  ``redis-server``), the requests dealt to them in turn as a load balancer would (our tester
  only); ``workers@N``: one gateway of ``--workers N`` processes on a Redis ledger.

Mixes (``--mix``):

- ``caps``: a burst of ``--requests`` (32) sent at once, caps 400-800, every one run to its cap;
- ``prefix``: a burst of prompts of two shared 512-token prefixes, 64-token suffixes, 300 out;
- ``realistic``: Poisson arrivals at ``--rate`` a second, prompts of 100-300 tokens, caps
  400-800, outputs that stop before their caps (median about a third of the cap, a long tail;
  see ``_vllm_price_load.py``), streamed: TTFT, TPOT and goodput (TTFT <= 5 s, TPOT <= 60 ms),
  measured by our client and, with ``--tester vllm``, by vLLM's own ``vllm bench serve``.

Reported side by side: output tokens/s, vs direct, preemptions (``vllm:num_preemptions_total``),
attempts per completed request, 429s, sequences running at once and KV used (vLLM's own
gauges), and for the bursts each rule played exactly on the same mix (``ideal_running``).

    python bench/vllm_price.py [--mix caps|prefix|realistic] [--rate R] [--engine small|large]
        [--runs direct,gateway,exact,caps] [--rounds N] [--tester ours|vllm|both]

10-30 minutes on 2 cores (vLLM's start-up included). Needs vLLM installed by
``python scripts/test_setup.py`` (or ``python scripts/vllm_engine.py ensure``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import httpx
from _common import gateway_process, machine, pin_to_cpu, print_table, redis_server, write_json
from _vllm_price_load import (
    PREFIX_CAP,
    PREFIX_TOKENS,
    PREFIXES,
    SEED,
    Item,
    burst,
    caps_workload,
    drawn_lengths,
    poisson,
    prefix_workload,
    realistic_workload,
    vllm_tester,
)
from _vllm_price_play import PLAYED_RULES, Played, play

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import vllm_engine

from kvclient import HuggingFaceCounter
from kvclient.engines.budget import VLLM_KEPT_BLOCKS, budget_from_vllm_metrics
from kvclient.engines.metrics import preemptions_from_vllm_metrics, prometheus_samples
from reference_server.admission.holders import START_SLACK_STEPS
from reference_server.admission.ledger import DEFAULT_SAFETY_FRACTION
from reference_server.admission.peak import Holder, peak, prefix_blocks

LABELS = {
    "direct": "direct to vLLM",
    "gateway": "through kvclient gateway (its defaults)",
    "exact": "through kvclient gateway --preemption-budget 0 (no forecast)",
    "caps": "through kvclient gateway --admission-rule caps",
    "no-queue": "through kvclient gateway --max-queue-wait 0 (429 at once)",
}
#: The engines: (KV cache bytes of the tiny model at 2 KiB a token, sequences at once).
ENGINES = {"small": ("6M", 8), "large": ("32M", 64)}
#: What each engine reports it has (``vllm:cache_config_info``), in tokens, and its block: for
#: ``--play``, which starts no vLLM (a run reads them from the engine).
POOLS = {"small": (3072, 128), "large": (16384, 128)}
#: vLLM's time a step on the realistic mix, ``a + b x running`` seconds, and a prompt token's
#: prefill, for the play. The small engine's fitted to the runs at 3/s on 2026-12-06 (direct
#: 445 tokens/s at 5.6 at once, the gateway 361 at 4.3: these short contexts cost a step
#: little more a sequence); the large one's to its direct runs at 3/s and 6/s (466-546 tokens/s
#: at 24-28 at once).
STEPS = {"small": (9.6e-3, 0.54e-3, 0.02e-3), "large": (10e-3, 1.6e-3, 0.02e-3)}


def preemptions(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return preemptions_from_vllm_metrics(text) or 0.0


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
    if "+" in name:
        parts = name.split("+")
        head = next((p for p in parts if p.startswith(("shared@", "workers@"))), None)
        rest = [label(p).removeprefix("through kvclient gateway ") for p in parts if p != head]
        return " ".join([label(head) if head else "through kvclient gateway", *rest])
    kind, _, value = name.partition("@")
    if kind == "direct" and value:
        return f"direct to vLLM, at most {value} at once (the client waits)"
    option = {"lag": "--relay-lag", "budget": "--preemption-budget", "start": "--forecast-quantile"}
    if kind in option:
        return f"through kvclient gateway {option[kind]} {value}"
    if kind == "shared":
        return f"through {value} kvclient gateways on one Redis ledger (requests dealt in turn)"
    if kind == "workers":
        return f"through kvclient gateway --workers {value} on a Redis ledger"
    return LABELS[name]


def gateway_args(name: str, engine: vllm_engine.VllmServer) -> list[str]:
    """The ``kvclient gateway`` options of run ``name`` (several joined by ``+``)."""
    args = ["--max-running", str(engine.max_num_seqs)]
    for part in name.split("+"):
        kind, _, value = part.partition("@")
        args += {
            "caps": ["--admission-rule", "caps"],
            "exact": ["--preemption-budget", "0"],
            "no-queue": ["--max-queue-wait", "0"],
            "lag": ["--relay-lag", value],
            "budget": ["--preemption-budget", value],
            "start": ["--forecast-quantile", value],
            "workers": ["--workers", value],
        }.get(kind, [])
    return args


def gateways(name: str) -> int:
    """How many gateway processes run ``name`` sharing one Redis ledger (``shared@N``; 0: none
    shared, ``workers@N`` is one gateway of N processes)."""
    for part in name.split("+"):
        kind, _, value = part.partition("@")
        if kind == "shared":
            return int(value)
    return 0


@contextlib.contextmanager
def gateway_urls(name: str, engine: vllm_engine.VllmServer, cpu: int | None) -> Iterator[list[str]]:
    """The gateways of run ``name``, each in a process of its own (on the client's core when
    pinned: the CPU they spend is not taken from the engine's): one, or ``shared@N`` of them
    (and ``workers@N``) on a Redis ledger of their own."""
    args = gateway_args(name, engine)
    with contextlib.ExitStack() as stack:
        if gateways(name) or "--workers" in args:
            args += ["--ledger", stack.enter_context(redis_server())]
        urls = [
            stack.enter_context(gateway_process(engine.url, *args, cpu=cpu))
            for _ in range(max(1, gateways(name)))
        ]
        yield urls


def run(
    name: str,
    engine: vllm_engine.VllmServer,
    items: list[Item],
    cpu: int | None,
    tester: str,
    warmup: list[Item] | None = None,
) -> dict[str, Any]:
    """One run of ``name``: the load played by our client (``tester`` "ours") or vLLM's own
    (``tester`` "vllm"), vLLM's gauges watched meanwhile, its preemptions counted. ``warmup``
    is played first by our client, through the same gateway, and not measured: a gateway that
    has been serving has learnt what outputs do."""
    counter = HuggingFaceCounter.from_pretrained(str(engine.model))
    realistic = any(item.at for item in items)

    def play(url: str | list[str]) -> dict[str, Any]:
        if tester == "vllm":
            if not isinstance(url, str):
                raise SystemExit("vLLM's tester sends to one URL: use workers@N, not shared@N")
            rate = (len(items) - 1) / items[-1].at
            saved = vllm_tester(engine.python, engine.model, url, requests=len(items), rate=rate)
            return {
                "requests": len(items), "completed": saved["completed"],
                "tokens_per_second": saved["output_throughput"],
                "goodput": saved.get("request_goodput"),
                "ttft_mean": saved["mean_ttft_ms"] / 1000, "ttft_p99": saved["p99_ttft_ms"] / 1000,
                "tpot_p99": saved["p99_tpot_ms"] / 1000,
                "latency_p99": saved["p99_e2el_ms"] / 1000, "attempts_per_completed": None,
                "http_429": 0,
            }  # fmt: skip
        if realistic:
            return anyio.run(poisson, url, items, counter)
        limit = int(name.partition("@")[2]) if name.startswith("direct@") else None
        return anyio.run(burst, url, items, counter, limit)

    def measured(url: str | list[str]) -> tuple[dict[str, Any], EngineWatch, float]:
        if warmup:
            anyio.run(poisson, url, warmup, counter)
        before = preemptions(engine.url)
        with EngineWatch(engine.url) as watch:
            return play(url), watch, before

    if name.startswith("direct"):
        result, watch, before = measured(engine.url)
    else:
        with gateway_urls(name, engine, cpu) as urls:
            result, watch, before = measured(urls if gateways(name) else urls[0])
            healths = [httpx.get(u + "/health", timeout=30).json()["upstreams"][0] for u in urls]
            breaks = [
                value
                for u in urls
                for _, value in prometheus_samples(
                    httpx.get(u + "/metrics", timeout=30).text, "kv_upstream_lockstep_breaks"
                )
            ]
            health = healths[0]
            result["lockstep_breaks"] = sum(breaks)
            result["forecast"] = health.get("forecast")
            result["late_starts"] = health.get("late_starts")
            result["usable_tokens"] = health.get("usable_tokens")
            # Which rule each gateway's upstream was on at the end, and why not the peak.
            result["rules"] = [(h.get("admission"), h.get("caps_reason")) for h in healths]
    result.update(watch.summary())
    result["preemptions"] = preemptions(engine.url) - before
    result["run"] = name
    result["tester"] = tester
    return result


#: The rules :func:`ideal_running` plays: whole caps; the peak rule as built before, a newcomer
#: whole until its first token, into 90 % of the pool; the peak rule as built now, the pool less
#: vLLM's null block and a newcomer counted from admission with ``START_SLACK_STEPS`` steps of
#: slack; and the best schedule that never preempts (the whole pool, starts known exactly).
IDEAL_RULES = {
    "caps": "whole caps, 90 % of the pool",
    "peak, before": "peak rule as built before (a newcomer whole until its first token, 90 %)",
    "peak, now": "peak rule as built now (the pool less its null block, the newcomer's clock)",
    "best": "best schedule that never preempts (the whole pool, every start known)",
}


def ideal_running(
    prompts: list[list[int]],
    caps: list[int],
    *,
    pool: int,
    block_size: int,
    max_running: int,
    rule: str,
) -> float:
    """The mean number of sequences at once if the gateway saw every holder's progress exactly
    and at once (no relay lag, a newcomer's first token on the step after its admission), the
    engine stepping all of them together: the FIFO queue admitting by ``rule`` (see
    :data:`IDEAL_RULES`) as the ledger counts, every request running to its cap as it does in
    the bursts. What each rule allows on this mix, against which the measured runs' means say
    what the relay's view costs."""
    if rule in ("caps", "peak, before"):
        usable = int(pool * DEFAULT_SAFETY_FRACTION)
    elif rule == "peak, now":
        usable = pool - VLLM_KEPT_BLOCKS * block_size
    else:
        usable = pool - VLLM_KEPT_BLOCKS * block_size
    slack = START_SLACK_STEPS if rule == "peak, now" else 0
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
            new = Holder(admitted.held, admitted.most, cap + 1 + slack, keys, admitted.borrowed)
            if rule in ("caps", "peak, before"):
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
    parser.add_argument("--requests", type=int, default=None, help="requests (default: 32 in a "
                        "burst, 150 realistic)")  # fmt: skip
    parser.add_argument("--low", type=int, default=400, help="smallest max_tokens")
    parser.add_argument("--high", type=int, default=800, help="largest max_tokens")
    parser.add_argument(
        "--runs", default="direct,direct@4,gateway,exact,caps",
        help="comma-separated: direct, direct@N (at most N at once), gateway, exact, caps, "
        "no-queue, lag@S, budget@N, start@Q, shared@N (N gateways on one Redis ledger, the "
        "requests dealt in turn), workers@N (--workers N); options joined by + "
        "(start@0.5+lag@0.05, shared@2+exact)",
    )  # fmt: skip
    parser.add_argument(
        "--mix", choices=("caps", "prefix", "realistic"), default="caps",
        help="caps: a burst run to caps of --low to --high; prefix: a burst of two shared "
        "512-token prefixes; realistic: Poisson arrivals at --rate, outputs that stop early",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=1.5, help="realistic: requests a second")
    parser.add_argument(
        "--warmup", type=int, default=48,
        help="realistic: requests of the same mix played before each measured run, unmeasured, "
        "through the same gateway (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=sorted(ENGINES), default="small",
        help="small: 3,072 KV tokens, 8 sequences (the tests'); large: 16,384 KV tokens, 64",
    )  # fmt: skip
    parser.add_argument(
        "--tester", choices=("ours", "vllm", "both"), default="ours",
        help="realistic: who plays the load: kvclient's AsyncClient, vLLM's own "
        "`vllm bench serve`, or both (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run the runs this many times, interleaved (a busy machine's drift falls on all "
        "alike); each row is the round of median throughput (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-pin", action="store_true",
        help="leave vLLM on every core (default: the process running vLLM's model on CPU 1, "
        "everything else on CPU 0, so that no CPU work per token is taken from the model's "
        "steps, as on a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--play", action="store_true",
        help="realistic: only play each rule on the mix in the engine model (no vLLM; seconds)",
    )  # fmt: skip
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if args.mix == "prefix":
        items = prefix_workload(args.requests or 32)
    elif args.mix == "realistic":
        items = realistic_workload(args.requests or 150, args.rate, args.low, args.high)
    else:
        items = caps_workload(args.requests or 32, args.low, args.high)
    warmup = None
    if args.mix == "realistic" and args.warmup:
        # The same mix, other draws, at the same rate: what the gateway has learnt before.
        warmup = realistic_workload(args.warmup, args.rate, args.low, args.high, seed=SEED + 1)
    if args.play:
        if args.mix != "realistic":
            parser.error("--play plays the realistic mix")
        pool, block_size = POOLS[args.engine]
        report_plays(plays(items, warmup, pool, block_size, args.engine), None)
        return
    testers = ["ours", "vllm"] if args.tester == "both" else [args.tester]
    if args.mix != "realistic":
        testers = ["ours"]
    pinned = not args.no_pin and pin_to_cpu(0)
    kv_bytes, seqs = ENGINES[args.engine]
    print("… starting vLLM (a minute or two)", flush=True)
    keys = [(name, tester) for tester in testers for name in names]
    rounds: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in keys}
    with vllm_engine.VllmServer(
        cpus={0} if pinned else None,
        compute_cpus={1} if pinned else None,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=seqs,
    ) as engine:
        for round_ in range(args.rounds):
            for name, tester in keys:
                print(f"… round {round_ + 1}: {label(name)} ({tester})", flush=True)
                result = run(name, engine, items, 0 if pinned else None, tester, warmup)
                rounds[name, tester].append(result)
                print(f"  {result}", flush=True)
        counter = HuggingFaceCounter.from_pretrained(str(engine.model))
        ideal = ideals(items, counter, engine) if args.mix != "realistic" else {}
        played: dict[str, Played] = {}
        if args.mix == "realistic":
            found = budget_from_vllm_metrics(httpx.get(engine.url + "/metrics", timeout=30).text)
            assert found is not None, "vLLM's /metrics has no vllm:cache_config_info"
            played = plays(items, warmup, *found, args.engine)
    results = [median_round(rounds[key]) for key in keys]
    for r in results:
        direct = next(
            (d for d in results if d["run"] == "direct" and d["tester"] == r["tester"]), None
        )
        for what in ("tokens_per_second", "goodput"):
            mine, theirs = r.get(what), direct.get(what) if direct else None
            r[f"{what}_vs_direct"] = mine / theirs if mine is not None and theirs else None
    report(args, results, ideal, pinned, seqs)
    if played:
        direct = next((r for r in results if r["run"] == "direct" and r["tester"] == "ours"), None)
        report_plays(played, direct)
    name = f"vllm_price_{args.mix}_{args.engine}"
    write_json(
        name + (f"_{args.rate:g}" if args.mix == "realistic" else ""),
        {"machine": machine(), "requests": len(items), "caps": [args.low, args.high],
         "mix": args.mix, "rate": args.rate, "engine": args.engine, "rounds": args.rounds,
         "pinned": pinned, "results": results, "ideal_running": ideal,
         "played": {rule: vars(p) for rule, p in played.items()},
         "step_model": step_model(results),
         "all_rounds": {f"{n} ({t})": v for (n, t), v in rounds.items()}},
    )  # fmt: skip


def report(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    ideal: dict[str, float],
    pinned: bool,
    seqs: int,
) -> None:
    """The table of the runs, and for the bursts each rule played exactly."""
    realistic = args.mix == "realistic"
    headers = ["run", "tester", "completed", "output tokens/s", "vs direct"]
    if realistic:
        headers += ["goodput/s", "vs direct", "TTFT mean", "TTFT p99", "TPOT p99"]
    else:
        headers += ["p50", "p99"]
    headers += ["preemptions", "attempts / completed", "running at once, mean (most)",
                "KV used, mean", "forecast quantile"]  # fmt: skip
    rows = []
    for r in results:
        row = [
            label(r["run"]),
            r["tester"],
            f"{r['completed']}/{r['requests']}",
            f"{r['tokens_per_second']:.1f}",
            fmt(r["tokens_per_second_vs_direct"], ".2f", "x"),
        ]
        if realistic:
            row += [fmt(r.get("goodput"), ".2f"), fmt(r.get("goodput_vs_direct"), ".2f", "x"),
                    fmt(r.get("ttft_mean"), ".1f", " s"), fmt(r.get("ttft_p99"), ".1f", " s"),
                    fmt(r.get("tpot_p99") and 1000 * r["tpot_p99"], ".0f", " ms")]  # fmt: skip
        else:
            row += [fmt(r.get("latency_p50"), ".0f", " s"), fmt(r.get("latency_p99"), ".0f", " s")]
        forecast = r.get("forecast") or {}
        row += [f"{r['preemptions']:.0f}", fmt(r.get("attempts_per_completed"), ".2f"),
                f"{fmt(r['running_mean'], '.1f')} ({fmt(r['running_max'], '.0f')})",
                fmt(r["kv_usage_mean"] and 100 * r["kv_usage_mean"], ".0f", " %"),
                fmt(forecast.get("quantile"), "g")]  # fmt: skip
        rows.append(row)
    if args.mix == "prefix":
        what = f"{PREFIXES} shared {PREFIX_TOKENS}-token prefixes, max_tokens {PREFIX_CAP}"
        what += ", at once"
    elif realistic:
        what = f"Poisson arrivals at {args.rate:g}/s, caps {args.low}-{args.high}"
        what += ", outputs that stop early"
    else:
        what = f"max_tokens {args.low}-{args.high} sent at once, run to their caps"
    kv = "16,384 KV tokens, 64" if args.engine == "large" else "3,072 KV tokens, 8"
    print_table(
        f"{what}, real vLLM {vllm_engine.VLLM_VERSION} on CPU ({kv} sequences at most"
        f"{'; vLLM model on CPU 1, the rest on CPU 0' if pinned else ''})",
        headers,
        rows,
    )
    model = step_model(results)
    direct = next((r for r in results if r["run"] == "direct"), None)
    for rule, mean in ideal.items():
        line = f"{IDEAL_RULES[rule]}, played exactly: {mean:.2f} at once"
        if model is not None and direct is not None:
            a, b = model
            rate = mean / (a + b * mean)
            ratio = rate / direct["tokens_per_second"]
            line += f", {rate:.0f} tokens/s by the step time measured: {ratio:.2f}x direct"
        print(line)


def ideals(
    items: list[Item], counter: HuggingFaceCounter, engine: vllm_engine.VllmServer
) -> dict[str, float]:
    """:func:`ideal_running` by each rule against this engine."""
    found = budget_from_vllm_metrics(httpx.get(engine.url + "/metrics", timeout=30).text)
    assert found is not None, "vLLM's /metrics has no vllm:cache_config_info"
    total, block_size = found
    return {
        rule: ideal_running(
            [counter.encode(item.prompt) for item in items],
            [item.cap for item in items],
            pool=total,
            block_size=block_size,
            max_running=engine.max_num_seqs,
            rule=rule,
        )
        for rule in IDEAL_RULES
    }


def plays(
    items: list[Item], warmup: list[Item] | None, pool: int, block_size: int, engine: str
) -> dict[str, Played]:
    """Each rule of :data:`PLAYED_RULES` played on the realistic mix (prompts of one token a
    word and the BOS, output lengths drawn from each request's stop chance) against an engine
    of ``pool`` KV tokens (less vLLM's null block), ``engine``'s sequences and step time; the
    forecast learns the warm-up's outputs first, as the gateway does."""
    learnt = []
    if warmup:
        learnt = list(zip(drawn_lengths(warmup, SEED + 1), (w.cap for w in warmup), strict=True))
    lengths = drawn_lengths(items)
    return {
        rule: play(
            [item.at for item in items],
            [len(item.prompt.split()) + 1 for item in items],
            [item.cap for item in items],
            lengths,
            pool=pool - VLLM_KEPT_BLOCKS * block_size,
            block_size=block_size,
            max_running=ENGINES[engine][1],
            rule=rule,
            step=STEPS[engine],
            learnt=learnt,
        )
        for rule in PLAYED_RULES
    }


def report_plays(played: dict[str, Played], direct: dict[str, Any] | None) -> None:
    """Each rule played, against direct played (and the best schedule that never preempts),
    and what the gateway measured against direct, the goal's ratio, beside it."""
    base = played["direct"].tokens_per_second
    best = played["best"].tokens_per_second
    for rule, p in played.items():
        rate = p.tokens_per_second
        print(
            f"{PLAYED_RULES[rule]}, played: {p.running_mean:.2f} at once, {rate:.0f} tokens/s, "
            f"{rate / base:.2f}x direct, {rate / best:.2f}x the best, {p.preemptions} "
            f"preemptions, TTFT mean {p.ttft_mean:.1f} s, p99 {p.ttft_p99:.1f} s"
        )
    if direct is not None:
        print(f"(measured direct: {direct['tokens_per_second']:.0f} tokens/s)")


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
