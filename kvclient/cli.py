"""The ``kvclient`` command: one entry point, one sub-command per capability.

Each sub-command lives in its own module with its own argument parser and a ``main(argv)``;
this module only dispatches, so ``kvclient serve --help`` shows the server's own options and
importing the CLI never imports the server, the load generator or their optional dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._version import __version__

# name -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "kvclient.demo",
        "run the reference server embedded and drive one workload through a naive client and "
        "through kvclient; print the comparison",
    ),
    "serve": (
        "reference_server.simulated.cli",
        "run the reference server (OpenAI-compatible, KV reservation ledger, simulated engine)",
    ),
    "gateway": (
        "reference_server.gateway.cli",
        "put the KV reservation ledger in front of real engines (vLLM, llama.cpp, TGI, SGLang)",
    ),
    "bench": (
        "kvclient.loadgen.cli",
        "load-test any OpenAI-compatible server, pacing retries by its Retry-After",
    ),
    "contract": (
        "kvclient.contract.cli",
        "check a live server against the admission contract",
    ),
    "count": ("kvclient._count_cli", "count the tokens of a text or a chat JSON file"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvclient",
        description="Call self-hosted LLM servers without OOM crashes or retry storms.",
    )
    parser.add_argument("--version", action="version", version=f"kvclient {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] not in COMMANDS:
        parser.parse_args(args)  # prints help/version or a usage error and exits
        parser.print_help()
        return 2
    module_name, _ = COMMANDS[args[0]]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(
            f"kvclient {args[0]}: cannot import {module_name} ({exc}). "
            "Install the extras it needs: pip install 'kvclient[server,bench]'",
            file=sys.stderr,
        )
        return 2
    result: int = module.main(args[1:])
    return result


if __name__ == "__main__":
    sys.exit(main())
