"""``kvclient count``: count tokens offline, as the client will before sending."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._accounting import effective_output_cap
from ._dialects import TOKENIZE_ENGINES
from ._exceptions import KVClientError
from ._help import HelpFormatter
from ._tokens import (
    DEFAULT_NON_TEXT_PART_TOKENS,
    HuggingFaceCounter,
    TiktokenCounter,
    TokenCounter,
    count_chat_request,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="kvclient count",
        description="Count the tokens of a prompt (text) or a chat request (JSON: a list of "
        'messages, or {"messages": [...], "tools": [...]}), offline, and show the max_tokens '
        "kvclient would send.",
    )
    parser.add_argument("text", nargs="?", help="the prompt (default: standard input)")
    parser.add_argument(
        "--chat",
        nargs="?",
        const="",
        metavar="FILE",
        help="the input is a chat request in JSON: from FILE ('-': standard input), else from "
        "the text argument or standard input (default: the input is a prompt)",
    )
    counters = parser.add_mutually_exclusive_group()
    counters.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local model directory (tokenizer.json, tokenizer_config.json, chat template): "
        "exact counts, the chat template rendered as the server renders it (default: tiktoken)",
    )
    counters.add_argument(
        "--hf-tokenizer", help="path to a bare Hugging Face tokenizer.json (default: tiktoken)"
    )
    counters.add_argument(
        "--server", metavar="URL", help="ask the server's /tokenize instead (default: count here)"
    )
    parser.add_argument(
        "--engine",
        choices=sorted(TOKENIZE_ENGINES),
        default="vllm",
        help="the --server's dialect (ours: vllm)",
    )
    parser.add_argument("--encoding", default="cl100k_base", help="tiktoken encoding name")
    parser.add_argument(
        "--tiktoken-file",
        help="explicit path to a .tiktoken encoding file (default: the one shipped)",
    )
    parser.add_argument(
        "--media-tokens",
        type=int,
        default=DEFAULT_NON_TEXT_PART_TOKENS,
        help="tokens counted per image or audio part (default: %(default)s)",
    )
    parser.add_argument(
        "--context-window", type=int, help="show the effective max_tokens too (default: no)"
    )
    parser.add_argument("--max-tokens", type=int, help="the requested cap (default: unset)")
    return parser


def _read_chat(args: argparse.Namespace) -> str:
    source: str = args.chat
    if source == "-":
        return sys.stdin.read()
    # A value that is not a file is the JSON itself (``--chat '[...]'``, as before FILE existed).
    if source and not source.lstrip().startswith(("[", "{")):
        return Path(source).read_text(encoding="utf-8")
    if source:
        return source
    return args.text if args.text is not None else sys.stdin.read()


def _counter(args: argparse.Namespace) -> TokenCounter:
    if args.tokenizer:
        return HuggingFaceCounter.from_pretrained(
            args.tokenizer, non_text_part_tokens=args.media_tokens
        )
    if args.hf_tokenizer:
        return HuggingFaceCounter(args.hf_tokenizer, non_text_part_tokens=args.media_tokens)
    if args.server:
        from ._server_counter import ServerTokenizeCounter

        return ServerTokenizeCounter(
            args.server, engine=args.engine, non_text_part_tokens=args.media_tokens
        )
    return TiktokenCounter(
        args.encoding, path=args.tiktoken_file, non_text_part_tokens=args.media_tokens
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        counter = _counter(args)
        if args.chat is not None:
            try:
                text = _read_chat(args)
            except OSError as exc:
                print(f"kvclient count: cannot read --chat file: {exc}", file=sys.stderr)
                return 2
            try:
                request: Any = json.loads(text)
            except json.JSONDecodeError as exc:
                print(f"kvclient count: --chat input is not JSON: {exc}", file=sys.stderr)
                return 2
            tools = None
            if isinstance(request, dict):
                tools = request.get("tools")
                request = request.get("messages")
            tokens = count_chat_request(counter, request, tools)
        else:
            text = args.text if args.text is not None else sys.stdin.read()
            tokens = counter.count(text)
    except (KVClientError, TypeError, ValueError) as exc:
        print(f"kvclient count: {exc}", file=sys.stderr)
        return 2
    print(f"prompt_tokens: {tokens}")
    if args.context_window is not None:
        try:
            cap = effective_output_cap(args.max_tokens, tokens, args.context_window)
        except ValueError as exc:
            print(f"kvclient count: {exc}", file=sys.stderr)
            return 2
        print(f"max_tokens:    {cap if cap is not None else 'none: the prompt fills the context'}")
        return 0 if cap is not None else 1
    return 0
