"""``kvclient contract URL``: check a live server against the admission contract.

Prints one row per check (check, result, evidence) and exits 0 only when no required check
failed; ``unsupported`` rows (a server that has no ``/v1/models``, never refuses, or sends no
Retry-After when that is allowed) are reported but never fail the run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from ..cli_options import (
    HelpFormatter,
    add_api_key,
    add_context_window,
    add_json,
    add_log_level,
    add_model,
    add_url,
    no_url_message,
    resolve_client,
    setup_logging,
    to_stdout,
    write_json,
)
from . import run_contract
from ._results import (
    CHECK_NAMES,
    DEFAULT_BURST,
    DEFAULT_CAPACITY_WAIT,
    DEFAULT_RETRY_TRIES,
    DEFAULT_TIMEOUT,
    CheckStatus,
    ContractOptions,
    ContractReport,
)

__all__ = ["main", "render_table"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_STYLES = {
    CheckStatus.PASS: "green",
    CheckStatus.FAIL: "bold red",
    CheckStatus.UNSUPPORTED: "yellow",
    CheckStatus.SKIPPED: "dim",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="kvclient contract",
        description=(
            "Check a live OpenAI-compatible server against the KV admission contract: context "
            "window advertised, overlong prompts refused with 413, max_tokens respected, 429 with "
            "an honest Retry-After under saturation (never 5xx), no capacity leaked by dropped "
            "streams, bad input answered with 4xx JSON errors."
        ),
    )
    add_url(parser)
    add_model(parser, "the model to send (default: the first one /v1/models lists)")
    add_api_key(parser)
    add_context_window(
        parser,
        "the model's context window, when /v1/models does not report max_model_len "
        "(default: discovered)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=DEFAULT_BURST,
        metavar="N",
        help=f"requests in a saturating burst (default {DEFAULT_BURST})",
    )
    parser.add_argument(
        "--burst-max-tokens",
        type=int,
        metavar="TOKENS",
        help="max_tokens of burst requests, each run to its cap (default: the burst asks for "
        "4x the server's KV pool, or the whole context when the pool is unknown)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"time budget of each check (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--retry-tries",
        type=int,
        default=DEFAULT_RETRY_TRIES,
        metavar="N",
        help=f"retries after the advised wait before Retry-After is judged dishonest "
        f"(default {DEFAULT_RETRY_TRIES})",
    )
    parser.add_argument(
        "--capacity-wait",
        type=float,
        default=DEFAULT_CAPACITY_WAIT,
        metavar="SECONDS",
        help=f"how long capacity may take to come back after dropped streams "
        f"(default {DEFAULT_CAPACITY_WAIT:g})",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send /v1/chat/completions requests (default: /v1/completions)",
    )
    parser.add_argument(
        "--allow-missing-retry-after",
        action="store_true",
        help="report 429s without Retry-After as unsupported instead of failed",
    )
    parser.add_argument(
        "--only",
        metavar="CHECK[,CHECK]",
        help=f"run only these checks: {', '.join(CHECK_NAMES)} (default: all)",
    )
    add_json(parser, "the report")
    parser.add_argument(
        "--plain", action="store_true", help="plain text table even if rich is there"
    )
    add_log_level(parser)
    return parser


def render_table(report: ContractReport) -> str:
    """The report as a plain-text table (what ``--plain`` prints)."""
    rows = [("CHECK", "RESULT", "EVIDENCE")]
    rows += [(r.name, r.status.value.upper(), r.evidence) for r in report.results]
    width_name = max(len(row[0]) for row in rows)
    width_status = max(len(row[1]) for row in rows)
    lines = [f"{a:<{width_name}}  {b:<{width_status}}  {c}" for a, b, c in rows]
    return "\n".join([*lines, _summary(report)])


def _summary(report: ContractReport) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    verdict = "PASSED" if report.ok else "FAILED"
    context = report.context_window if report.context_window is not None else "unknown"
    return (
        f"{verdict}: {counts} in {report.duration:.1f} s against {report.base_url} "
        f"(model {report.model or 'unknown'}, context {context})"
    )


def _print_rich(report: ContractReport, out: TextIO) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(title=f"KV admission contract: {report.base_url}", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("evidence", overflow="fold")
    for result in report.results:
        style = _STYLES[result.status]
        table.add_row(result.name, f"[{style}]{result.status.value}[/]", result.evidence)
    console = Console(file=out, soft_wrap=False)
    console.print(table)
    console.print(_summary(report), markup=False, highlight=False, soft_wrap=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_level)
    resolve_client(args)
    only = None
    if args.only:
        only = tuple(name.strip() for name in args.only.split(",") if name.strip())
    try:
        options = ContractOptions(
            model=args.model,
            api_key=args.api_key,
            context_window=args.context_window,
            burst=args.burst,
            burst_max_tokens=args.burst_max_tokens,
            timeout=args.timeout,
            retry_tries=args.retry_tries,
            capacity_wait=args.capacity_wait,
            require_retry_after=not args.allow_missing_retry_after,
            api="chat" if args.chat else "completions",
            only=only,
        )
    except ValueError as exc:
        print(f"kvclient contract: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.url:
        print(f"kvclient contract: {no_url_message()}", file=sys.stderr)
        return EXIT_USAGE
    report = run_contract(args.url, options=options)
    if args.json_path is not None:
        write_json(args.json_path, report.to_dict())
    if not to_stdout(args.json_path) and (args.plain or not _print_rich(report, sys.stdout)):
        print(render_table(report))
    return EXIT_OK if report.ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
