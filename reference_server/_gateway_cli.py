"""``kvclient gateway``: the reservation ledger in front of real engines (vLLM, llama.cpp, TGI,
SGLang), on one port."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvclient import HuggingFaceCounter, KVClientError, TokenCounter

from .config import DEFAULT_SEND_TIMEOUT
from .gateway import DEFAULT_DECODE_RATE, GatewayConfig
from .ledger import DEFAULT_SAFETY_FRACTION

__all__ = ["build_parser", "config_from_args", "main"]

DEFAULT_PORT = 8080

_DESCRIPTION = """\
An OpenAI-compatible front (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/health, /metrics) that admits each request against a KV reservation ledger (prompt + output
cap) and forwards it to an upstream engine with its max_tokens made explicit, so the engine can
never run past what was reserved. Out of budget: 429 with Retry-After.

Each upstream's context window and KV budget are discovered from its own endpoints (vLLM
/metrics cache_config_info, llama.cpp /props, TGI /metrics, SGLang /get_server_info), or given
with --kv-tokens, once per --upstream, in the same order.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvclient gateway",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--upstream", action="append", required=True, metavar="URL",
        help="an engine's base URL, e.g. http://127.0.0.1:8000 (repeat for several)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-tokens", action="append", type=int, default=[], metavar="N",
        help="the KV budget of the upstream at the same position, instead of discovering it",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--context-window", type=int, help="default: discovered per upstream")
    parser.add_argument("--safety-fraction", type=float, default=DEFAULT_SAFETY_FRACTION)
    parser.add_argument(
        "--max-queue-wait", type=float, default=0.0, metavar="S",
        help="wait up to S seconds in FIFO order for budget before answering 429",
    )  # fmt: skip
    parser.add_argument(
        "--decode-rate", type=float, default=DEFAULT_DECODE_RATE, metavar="TOKENS_PER_S",
        help="per-sequence decode rate assumed for Retry-After estimates",
    )  # fmt: skip
    parser.add_argument(
        "--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT, metavar="S",
        help="end a request whose client has not read for S seconds (releases its reservation)",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", type=Path, metavar="PATH",
        help="count with this local model directory (tokenizer.json, tokenizer_config.json, "
        "its chat template) instead of the upstream's /tokenize",
    )  # fmt: skip
    parser.add_argument(
        "--count-first", action="store_true",
        help="counting by the upstream's /tokenize, wait for each count before forwarding "
        "(by default a request with an explicit max_tokens goes while its count is on the way, "
        "the whole context window reserved until it lands, when that fits)",
    )  # fmt: skip
    parser.add_argument("--api-key", help="require this bearer token from clients")
    parser.add_argument(
        "--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
        help="the event loop: auto is uvloop when it is installed (pip install "
        "'kvclient[gateway]'), else asyncio",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info")
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    counter: TokenCounter | None = None
    if args.tokenizer is not None:
        try:
            counter = HuggingFaceCounter.from_pretrained(args.tokenizer)
        except KVClientError as exc:
            raise ValueError(f"--tokenizer: {exc}") from None
    return GatewayConfig(
        upstreams=tuple(args.upstream),
        kv_tokens=tuple(args.kv_tokens),
        context_window=args.context_window,
        safety_fraction=args.safety_fraction,
        max_queue_wait=args.max_queue_wait,
        decode_rate=args.decode_rate,
        send_timeout=args.send_timeout,
        counter=counter,
        overlap_count=not args.count_first,
        api_key=args.api_key,
    )


def serve(
    app: Any, *, host: str, port: int, loop: str, max_body_bytes: int, send_timeout: float
) -> None:
    """Serve ``app`` with the gateway's front (:mod:`reference_server._front`) until SIGINT or
    SIGTERM; on uvloop when ``loop`` says so, or is ``auto`` and uvloop is installed."""
    import asyncio
    import importlib.util
    import signal

    from ._front import FrontServer
    from ._runner import bind_loopback

    if loop == "uvloop" or (loop == "auto" and importlib.util.find_spec("uvloop")):
        import uvloop

        runner: Any = uvloop.run
    else:
        runner = asyncio.run
    sock = bind_loopback(host, port)
    front = FrontServer(app, max_body_bytes=max_body_bytes, send_timeout=send_timeout)

    async def main() -> None:
        running = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            running.add_signal_handler(sig, front.stop)
        await front.serve([sock])

    try:
        runner(main())
    finally:
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    import logging

    from ._runner import http_url
    from .gateway import create_gateway_app

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    app = create_gateway_app(config)
    print(
        f"kvclient gateway on {http_url(args.host, args.port)} in front of "
        f"{', '.join(config.upstreams)} (discovered on the first request)",
        file=sys.stderr,
    )
    serve(
        app,
        host=args.host,
        port=args.port,
        loop=args.loop,
        max_body_bytes=config.max_body_bytes,
        send_timeout=config.send_timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
