"""``kvclient bench URL``: load-test any OpenAI-compatible server without becoming a storm.

Before the run, a preflight (reachable, authorised, model served, context window known) and the
outputs' needs are checked, each failure one line and exit status 2. After it, the exit status is
1 when more than ``--max-failure-rate`` of the offered requests did not complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from .._exceptions import KVClientError
from .._tiktoken import TiktokenCounter
from .._tokens import TokenCounter
from ..cli_options import (
    HelpFormatter,
    add_api_key,
    add_context_window,
    add_json,
    add_log_level,
    add_model,
    add_tokenizer,
    add_url,
    hidden_alias,
    load_tokenizer,
    no_url_message,
    resolve_client,
    setup_logging,
    to_stdout,
    write_json,
)
from ._bench import (
    DEFAULT_CONCURRENCY,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_PROBE_CONCURRENCY,
    DEFAULT_SWEEP_POINTS,
    DEFAULT_SWEEP_SECONDS,
    MAX_DEFAULT_CONCURRENCY,
    BenchConfig,
    NothingToSweep,
    default_concurrency,
    find_budget,
    run_one,
    run_sweep,
)
from ._html import render_html
from ._metrics import SLO
from ._plots import plot_run, plot_sweep
from ._preflight import PreflightError, preflight
from ._report import SWEEP_HEADERS, print_result, print_table, sweep_rows
from ._results import BenchResult, SweepResult
from ._sweep import DEFAULT_ATTAINMENT

DEFAULT_MAX_FAILURE_RATE = 0.01
EXIT_FAILURES = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Arguments that cannot work together, or an output that cannot be written: one line."""


def _range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {text!r}") from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in 0..1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in 0..1, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="kvclient bench",
        description="Load-test an OpenAI-compatible server. Arrivals are planned before the run "
        "(open loop) so a slow server cannot slow them; retries follow the server's Retry-After; "
        "every 429, 503 and failure is counted, and latencies include backoff. Exit status: 0, "
        "1 when more than --max-failure-rate of the requests did not complete (or a sweep "
        "found no rate within the SLOs), 2 when the server or the arguments cannot work.",
    )
    add_url(p)
    add_model(p, "the model to send (default: the first one /v1/models lists)")
    add_api_key(p)
    add_context_window(
        p, "the model's context window (default: discovered from the server, /v1/models)"
    )
    loop = p.add_argument_group(
        "arrivals (at most one of --rate, --concurrency or --sweep)",
        "Without any: a closed loop at the concurrency the server's KV pool holds at worst "
        "case (its whole context windows, or llama.cpp's slots; at most "
        f"{MAX_DEFAULT_CONCURRENCY}, {DEFAULT_CONCURRENCY} when the pool is not discovered). "
        "A closed loop cannot outrun the server, and every request it keeps in flight fits, so "
        "the run measures serving rather than refusals; the line it prints says what it chose.",
    )
    loop.add_argument(
        "--rate",
        type=float,
        help="open loop: requests per second (default: a closed loop, see above)",
    )
    loop.add_argument(
        "--arrival",
        choices=["poisson", "constant", "gamma"],
        default="poisson",
        help="how --rate's arrivals are spaced",
    )
    loop.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    loop.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="closed loop: requests in flight (default: matched to the server's KV pool)",
    )
    loop.add_argument(
        "--requests",
        type=int,
        dest="num_requests",
        metavar="N",
        help=f"requests to send (default {DEFAULT_NUM_REQUESTS}; with --duration, until it ends)",
    )
    hidden_alias(loop, "--num-requests", dest="num_requests", type=int)
    loop.add_argument(
        "--duration",
        type=float,
        help=f"seconds; no new sends after it (a sweep's seconds per rate, default "
        f"{DEFAULT_SWEEP_SECONDS:g})",
    )
    loop.add_argument("--grace", type=float, default=30.0, help="seconds allowed after --duration")
    sweep = p.add_argument_group(
        "sweep: the highest arrival rate whose goodput meets the --slo-* targets"
    )
    sweep.add_argument(
        "--sweep",
        action="store_true",
        help="measure the flat-out throughput (closed loop), then open loops at rates around "
        "it, bisecting towards the knee",
    )
    sweep.add_argument(
        "--sweep-points",
        type=int,
        default=DEFAULT_SWEEP_POINTS,
        help="rates to try (default %(default)s)",
    )
    sweep.add_argument(
        "--sweep-attainment",
        type=_share,
        default=DEFAULT_ATTAINMENT,
        help="share of the offered requests that must complete within the SLOs for a rate to "
        "pass (default %(default)s)",
    )
    sweep.add_argument(
        "--probe-concurrency",
        type=int,
        default=DEFAULT_PROBE_CONCURRENCY,
        help="closed-loop concurrency of the throughput probe (default %(default)s)",
    )
    sweep.add_argument(
        "--probe-requests", type=int, help="requests of the probe (default 4 x its concurrency)"
    )
    work = p.add_argument_group(
        "workload (default: the seed post's adversarial mix: 60% short prompts with large or "
        "unset caps, 40% long prompts with small caps)"
    )
    work.add_argument(
        "--dataset",
        type=Path,
        metavar="FILE",
        help="our JSONL (prompt or messages, max_tokens) or ShareGPT JSON (first human turn "
        "as prompt, the reply's length as max_tokens; default: a synthetic workload)",
    )
    hidden_alias(work, "--workload-file", dest="dataset", type=Path)
    work.add_argument(
        "--prompt-tokens",
        type=_range,
        metavar="MIN:MAX",
        help="synthetic prompts' length in tokens, drawn from MIN:MAX, or N "
        "(default: the seed's mix)",
    )
    work.add_argument(
        "--max-tokens-range",
        type=_range,
        metavar="MIN:MAX",
        help="synthetic requests' max_tokens, drawn from MIN:MAX, or N (default: the seed's mix)",
    )
    hidden_alias(work, "--max-tokens", dest="max_tokens_range", type=_range)
    work.add_argument("--unset-cap-share", type=float, default=0.0, help="share sent with no cap")
    work.add_argument("--chat", action="store_true", help="send prompts as chat")
    add_tokenizer(
        work,
        "counts tokens and makes synthetic prompts of exact lengths for it",
        "tiktoken cl100k_base",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the workload and the arrivals: the same seed replays the same run",
    )
    p.add_argument("--no-stream", action="store_true", help="no SSE: no TTFT or TPOT")
    p.add_argument("--naive", action="store_true", help="baseline: retry at once, no Retry-After")
    p.add_argument("--request-deadline", type=float, default=60.0, help="seconds per request")
    p.add_argument("--max-attempts", type=int, default=6, help="attempts per request at most")
    p.add_argument(
        "--max-failure-rate",
        type=_share,
        default=DEFAULT_MAX_FAILURE_RATE,
        help="exit 1 when a larger share of the offered requests did not complete "
        "(default %(default)s)",
    )
    p.add_argument("--slo-ttft", type=float, help="goodput: TTFT goal in seconds (default: none)")
    p.add_argument(
        "--slo-tpot",
        type=float,
        help="goodput: time-per-output-token goal, seconds (default: none)",
    )
    p.add_argument(
        "--slo-latency", type=float, help="goodput: end-to-end goal in seconds (default: none)"
    )
    add_json(p, "the summary")
    p.add_argument("--records", action="store_true", help="with --json: per-request records too")
    p.add_argument(
        "--plot",
        metavar="FILE",
        type=Path,
        help="PNG of latency and rejections, or the sweep curve (default: none)",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        type=Path,
        help="one self-contained page: summary, latency distributions, timeline of in-flight "
        "KV and refusals, sweep curve (default: none)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_log_level(p)
    return p


# --- checks before anything runs --------------------------------------------------------------


def _writable(path: Path, flag: str) -> None:
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: cannot write there")


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be known wrong before the run, so no run is wasted on it."""
    resolve_client(args)
    if args.url is None:
        raise UsageError(no_url_message())
    kinds = sum(x is not None for x in (args.rate, args.concurrency)) + bool(args.sweep)
    if kinds > 1:
        raise UsageError("give at most one of --rate, --concurrency and --sweep")
    if args.sweep and not (args.slo_ttft or args.slo_tpot or args.slo_latency):
        raise UsageError("--sweep needs a target: --slo-latency, --slo-ttft or --slo-tpot")
    if args.sweep and args.sweep_points < 1:
        raise UsageError("--sweep-points must be at least 1")
    if args.dataset is not None and not args.dataset.is_file():
        raise UsageError(f"--dataset {args.dataset}: no such file")
    for flag, path in (("--json", args.json_path), ("--plot", args.plot), ("--html", args.html)):
        if path is not None and not (flag == "--json" and to_stdout(path)):
            _writable(path, flag)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'kvclient[plot]'") from None


def make_counter(tokenizer: Path | None) -> TokenCounter:
    """The run's token counter: the model's own tokenizer when given (a file or a directory)."""
    if tokenizer is None:
        return TiktokenCounter()
    try:
        return load_tokenizer(tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _slo(args: argparse.Namespace) -> SLO | None:
    if args.slo_ttft or args.slo_tpot or args.slo_latency:
        return SLO(ttft=args.slo_ttft, tpot=args.slo_tpot, latency=args.slo_latency)
    return None


def _api_key(args: argparse.Namespace) -> str | None:
    from .._client import API_KEY_ENV, from_env

    key: str | None = args.api_key or from_env(API_KEY_ENV)
    return key


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The runs' config from the checked options (``args.counter`` made, the arrival mode
    chosen)."""
    return BenchConfig(
        url=args.url,
        counter=args.counter,
        api_key=_api_key(args),
        dataset=args.dataset,
        chat=args.chat,
        prompt_tokens=args.prompt_tokens,
        max_tokens_range=args.max_tokens_range,
        unset_cap_share=args.unset_cap_share,
        seed=args.seed,
        naive=args.naive,
        stream=not args.no_stream,
        max_attempts=args.max_attempts,
        request_deadline=args.request_deadline,
        rate=args.rate,
        concurrency=args.concurrency,
        arrival=args.arrival,
        burstiness=args.burstiness,
        num_requests=args.num_requests,
        duration=args.duration,
        grace=args.grace,
        sweep_points=args.sweep_points,
        sweep_attainment=args.sweep_attainment,
        probe_concurrency=args.probe_concurrency,
        probe_requests=args.probe_requests,
        slo=_slo(args),
        sample=args.html is not None,
        progress=not args.no_progress,
    )


def _fail(message: str) -> int:
    print(f"kvclient bench: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        check_args(args)
        args.counter = make_counter(args.tokenizer)
        served = anyio.run(
            lambda: preflight(
                url=args.url,
                model=args.model,
                api_key=_api_key(args),
                context_window=args.context_window,
            )
        )
        if args.rate is None and args.concurrency is None and not args.sweep:
            budget = anyio.run(find_budget, args.url, _api_key(args))
            args.concurrency, why = default_concurrency(budget, served.context_window)
            print(
                f"kvclient bench: no arrival mode given: closed loop at --concurrency "
                f"{args.concurrency} ({why})",
                file=sys.stderr,
            )
    except (UsageError, PreflightError, KVClientError, ValueError, OSError) as exc:
        return _fail(str(exc))
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)  # noqa: E731
    config = config_from(args)
    try:
        if args.sweep:
            sweep = anyio.run(run_sweep, config, served, say)
            return _report_sweep(args, sweep)
        result = anyio.run(run_one, config, served)
    except (NothingToSweep, KVClientError, ValueError, OSError) as exc:
        return _fail(str(exc))
    return _report_one(args, result)


def _report_one(args: argparse.Namespace, result: BenchResult) -> int:
    if not to_stdout(args.json_path):
        print_result(result)
    if args.json_path is not None:
        write_json(args.json_path, result.to_json(with_records=args.records))
    if args.plot is not None:
        plot_run(result.records, args.plot)
    if args.html is not None:
        page = render_html(
            title=f"kvclient bench {args.url}",
            summary=result.summary,
            records=result.records,
            samples=result.samples,
        )
        args.html.write_text(page, encoding="utf-8")
    s = result.summary
    if s.failure_rate > args.max_failure_rate:
        print(
            f"kvclient bench: {s.offered - s.completed} of {s.offered} requests "
            f"({s.failure_rate:.1%}) did not complete, more than --max-failure-rate "
            f"{args.max_failure_rate:g}; the most common: "
            + "; ".join(f"{g.cause} ×{g.count}: {g.message}" for g in s.failures[:2]),
            file=sys.stderr,
        )
        return EXIT_FAILURES
    return 0


def _report_sweep(args: argparse.Namespace, sweep: SweepResult) -> int:
    slo = ", ".join(
        f"{name} <= {value:g} s"
        for name, value in (
            ("TTFT", args.slo_ttft),
            ("TPOT", args.slo_tpot),
            ("latency", args.slo_latency),
        )
        if value
    )
    title = (
        f"kvclient bench --sweep: {sweep.capacity:.2f} req/s flat out; a rate passes when "
        f"{args.sweep_attainment:.0%} of its requests complete within {slo}"
    )
    at_knee = sweep.at_knee()
    if not to_stdout(args.json_path):
        print_table(title, SWEEP_HEADERS, sweep_rows(sweep))
        if sweep.knee is None:
            print("no rate met the SLOs")
        else:
            print(f"knee: {sweep.knee:.2f} req/s ({sweep.knee / sweep.capacity:.0%} of flat out)")
    if args.json_path is not None:
        write_json(args.json_path, sweep.to_json(with_records=args.records))
    if args.plot is not None:
        plot_sweep(sweep, args.plot)
    if args.html is not None:
        shown = at_knee or sweep.runs[0]
        curve = [
            (p.rate, r.summary.request_throughput, r.summary.goodput or 0.0)
            for p, r in sorted(
                zip(sweep.points, sweep.runs, strict=True), key=lambda pr: pr[0].rate
            )
        ]
        page = render_html(
            title=f"kvclient bench --sweep {args.url}",
            summary=shown.summary,
            records=shown.records,
            samples=shown.samples,
            sweep=curve,
            sweep_rows=sweep_rows(sweep),
            sweep_headers=SWEEP_HEADERS,
            knee_rate=sweep.knee,
        )
        args.html.write_text(page, encoding="utf-8")
    return 0 if sweep.knee is not None else EXIT_FAILURES


__all__ = ["config_from", "main"]
