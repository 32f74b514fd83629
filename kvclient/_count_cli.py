"""``kvclient count``: count tokens offline, as the client will before sending."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._accounting import effective_output_cap
from ._exceptions import KVClientError
from ._tokens import HuggingFaceCounter, TiktokenCounter, TokenCounter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvclient count",
        description="Count the tokens of a prompt (text) or a chat request (JSON list of "
        "messages), offline, and show the max_tokens kvclient would send.",
    )
    parser.add_argument("text", nargs="?", help="the prompt; omit to read standard input")
    parser.add_argument("--chat", action="store_true", help="the input is a JSON list of messages")
    parser.add_argument("--encoding", default="cl100k_base", help="tiktoken encoding name")
    parser.add_argument("--tiktoken-file", help="explicit path to a .tiktoken encoding file")
    parser.add_argument("--hf-tokenizer", help="path to a Hugging Face tokenizer.json instead")
    parser.add_argument("--context-window", type=int, help="show the effective max_tokens too")
    parser.add_argument("--max-tokens", type=int, help="the requested cap (default: unset)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    text = args.text if args.text is not None else sys.stdin.read()
    counter: TokenCounter
    try:
        if args.hf_tokenizer:
            counter = HuggingFaceCounter(args.hf_tokenizer)
        else:
            counter = TiktokenCounter(args.encoding, path=args.tiktoken_file)
        if args.chat:
            try:
                messages = json.loads(text)
            except json.JSONDecodeError as exc:
                print(f"kvclient count: --chat input is not JSON: {exc}", file=sys.stderr)
                return 2
            tokens = counter.count_messages(messages)
        else:
            tokens = counter.count(text)
    except (KVClientError, TypeError) as exc:
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
