"""``kvclient serve`` (``python -m reference_server``): the reference server, served by uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvclient import ModelProfile
from kvclient.cli_options import (
    HelpFormatter,
    add_context_window,
    add_log_level,
    add_model,
    add_tokenizer,
    setup_logging,
)

from ..admission.ledger import DEFAULT_SAFETY_FRACTION, STRATEGIES
from ..http.serving import configure, load_tokenizer, serve
from .config import (
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_DECODE_RATE,
    DEFAULT_KV_TOKENS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MEAN_OUTPUT_TOKENS,
    DEFAULT_MODEL_ID,
    DEFAULT_PROFILE,
    DEFAULT_RETRY_AFTER_QUANTILE,
    DEFAULT_SEND_TIMEOUT,
    ServerConfig,
)
from .scheduler import OVERFLOWS

__all__ = ["build_parser", "config_from_args", "main"]

DEFAULT_PORT = 8000

_DESCRIPTION = f"""\
Run the kvclient reference server: an OpenAI-compatible API (/v1/completions,
/v1/chat/completions, /v1/models, /tokenize, /generate, /health, /metrics) in front of a KV
reservation ledger and a simulated engine that generates real tokens and can really run out of
KV cache.

Single process by design: one ledger guards one engine's KV pool, so the server runs one uvicorn
worker and binds 127.0.0.1 only. Several workers would each believe they own the whole pool.

Default KV budget: {DEFAULT_KV_TOKENS} tokens; usable = total x --safety-fraction.
"""


def _quantile(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in (0, 1] or 'none', got {text!r}"
        ) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"the quantile must be in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvclient serve",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--port", type=int, default=DEFAULT_PORT, help="port on 127.0.0.1 (0: any free port)")
    add_model(parser, "the model id served (default: %(default)s)")
    parser.set_defaults(model=DEFAULT_MODEL_ID)
    add_context_window(
        parser,
        "the model's context window, reported as max_model_len",
        default=DEFAULT_CONTEXT_WINDOW,
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-tokens",
        type=int,
        metavar="TOKENS",
        help=f"physical KV pool size in tokens (default: {DEFAULT_KV_TOKENS})",
    )
    budget.add_argument(
        "--kv-bytes",
        type=int,
        metavar="BYTES",
        help="physical KV pool size in bytes, with --model-preset (default: --kv-tokens's)",
    )
    add(
        "--model-preset",
        choices=sorted(ModelProfile.PRESETS),
        default=DEFAULT_PROFILE.name,
        help="per-token KV bytes of this model (for --kv-bytes and the byte metrics)",
    )
    add(
        "--safety-fraction",
        type=float,
        default=DEFAULT_SAFETY_FRACTION,
        metavar="F",
        help="share of the KV pool that is admitted (usable)",
    )
    add("--block-size", type=int, default=16, help="KV block size in tokens")
    add(
        "--decode-rate",
        type=float,
        default=DEFAULT_DECODE_RATE,
        metavar="TOKENS_PER_S",
        help="simulated tokens per second per sequence (default: %(default)s)",
    )
    add(
        "--throughput",
        type=float,
        metavar="TOKENS_PER_S",
        help="engine tokens/s with a large batch: each other running sequence adds "
        "1/throughput to a decode step (default: none, a step takes 1/decode-rate)",
    )
    add(
        "--max-running",
        type=int,
        metavar="N",
        help="sequences decoded at once (vLLM's max_num_seqs); the rest wait holding no KV "
        "(default: no cap)",
    )
    # Two flags of their own (each option of every command has one spelling and one meaning):
    # the first says the default out loud, the second turns sharing off.
    sharing = parser.add_mutually_exclusive_group()
    sharing.add_argument(
        "--prefix-caching",
        action="store_true",
        help="share full prompt blocks between running sequences, as vLLM's prefix caching "
        "(the default)",
    )
    sharing.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="every sequence holds its whole prompt, as with vLLM's --no-enable-prefix-caching",
    )
    add(
        "--on-overflow",
        choices=OVERFLOWS,
        default="fail",
        help="what an overflow of the KV pool does: fail every request in the engine (a crash, "
        "as llama.cpp's unified cache does), or preempt the newest sequence and recompute it "
        "once its blocks fit again, as vLLM does (default: %(default)s)",
    )
    add(
        "--recompute-cost",
        type=float,
        default=0.0,
        metavar="S",
        help="with --on-overflow preempt: seconds each recomputed token (a preempted sequence's "
        "prompt and output) adds to the step it rejoins in (default: %(default)s)",
    )
    add(
        "--mean-output-tokens",
        type=float,
        default=DEFAULT_MEAN_OUTPUT_TOKENS,
        help="mean natural output length before a sequence stops by itself",
    )
    add("--admission", choices=STRATEGIES, default="reserve", help="admission strategy")
    add(
        "--max-concurrency",
        type=int,
        metavar="N",
        help="request cap, the whole rule in concurrency mode (default: none; "
        "16 in concurrency mode)",
    )
    add(
        "--max-queue-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds a request may wait in FIFO order for budget before the 429 (0: at once)",
    )
    add(
        "--stagger-retry-after",
        action="store_true",
        help="tell clients turned away together staggered Retry-After times that each fit",
    )
    add(
        "--retry-after-quantile",
        type=_quantile,
        metavar="Q",
        default=DEFAULT_RETRY_AFTER_QUANTILE,
        help="estimate Retry-After from the Q quantile of recent output lengths (a bet: some "
        "clients are told less than the wait); 'none' (the default): from every holder's cap, "
        "never shorter than the wait",
    )
    add(
        "--api-key",
        default=os.environ.get("KVCLIENT_SERVE_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY', except on /health and /metrics "
        "(default: $KVCLIENT_SERVE_API_KEY, else no key)",
    )
    add("--seed", type=int, default=0, help="seed of output lengths, words and faults")
    add(
        "--fault-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="fail this share of requests on purpose at a random token, as 500 injected_fault "
        "(chaos testing; default: %(default)s)",
    )
    add("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body limit")
    add_tokenizer(
        parser,
        "counts for admission, /tokenize and usage, like a real model",
        "tiktoken cl100k_base and OpenAI's chat formula",
    )
    add(
        "--send-timeout",
        type=float,
        default=DEFAULT_SEND_TIMEOUT,
        metavar="S",
        help="end a request when a write of its answer waits S seconds for the client to read "
        "(a client that stopped reading), releasing its reservation (default: %(default)s)",
    )
    add(
        "--socket-send-buffer",
        type=int,
        metavar="BYTES",
        help="SO_SNDBUF of every connection (default: the kernel's, megabytes on loopback); "
        "smaller makes a client that stops reading block the server's writes sooner",
    )
    add(
        "--admission-log",
        metavar="PATH",
        help="append every admission, release and 429 (with its advice) to PATH as JSON lines, "
        "for bench/soak.py's Retry-After check (default: none)",
    )
    add_log_level(parser, default="info")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    extra: dict[str, Any] = {}
    if getattr(args, "tokenizer", None):
        extra["tokenizer"] = load_tokenizer(args.tokenizer)
    return ServerConfig(
        **extra,
        model=args.model,
        context_window=args.context_window,
        kv_tokens=args.kv_tokens,
        kv_bytes=args.kv_bytes,
        model_profile=ModelProfile.preset(args.model_preset),
        safety_fraction=args.safety_fraction,
        block_size=args.block_size,
        decode_rate=args.decode_rate,
        throughput=args.throughput,
        max_running=args.max_running,
        prefix_caching=not args.no_prefix_caching,
        on_overflow=args.on_overflow,
        recompute_seconds=args.recompute_cost,
        mean_output_tokens=args.mean_output_tokens,
        admission=args.admission,
        max_concurrency=args.max_concurrency,
        max_queue_wait=args.max_queue_wait,
        stagger_retry_after=args.stagger_retry_after,
        retry_after_quantile=args.retry_after_quantile,
        api_key=args.api_key,
        seed=args.seed,
        fault_rate=args.fault_rate,
        max_body_bytes=args.max_body_bytes,
        send_timeout=args.send_timeout,
        admission_log=args.admission_log,
        socket_send_buffer=args.socket_send_buffer,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, config = configure(build_parser(), argv, config_from_args)
    setup_logging(args.log_level)
    from .app import create_app

    app = create_app(config)
    # Load the tokenizer now (about 0.3 s for tiktoken's), not on the first request: the first
    # burst would wait for it, and its 429s (and their RateLimit room) would come that late.
    config.tokenizer.count("warm up")
    usable = app.state.server.ledger.usable_tokens
    print(
        f"reference server: model {config.model}, context {config.context_window}, "
        f"KV pool {config.total_kv_tokens} tokens ({usable} usable), "
        f"admission {config.admission}",
        file=sys.stderr,
    )
    return serve(
        app,
        host="127.0.0.1",
        port=args.port,
        what="kvclient serve",
        # asyncio: the simulated engine's timing was measured on it.
        loop="asyncio",
        log_level=args.log_level,
        send_buffer=config.socket_send_buffer,
    )


if __name__ == "__main__":
    sys.exit(main())
