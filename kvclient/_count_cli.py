"""``kvclient count``: count tokens offline, as the client will before sending."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._accounting import effective_output_cap
from ._client import BASE_URL_ENV, from_env
from ._exceptions import KVClientError
from ._tiktoken import TiktokenCounter
from ._tokens import DEFAULT_NON_TEXT_PART_TOKENS, TokenCounter, count_chat_request
from .cli_options import (
    HelpFormatter,
    add_api_key,
    add_context_window,
    add_log_level,
    add_model,
    add_tokenizer,
    env_names,
    hidden_alias,
    load_tokenizer,
    no_url_message,
    resolve_client,
    setup_logging,
)
from .engines.tokenize import TOKENIZE_ENGINES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="kvclient count",
        description="Count the tokens of a prompt (text) or a chat request (JSON: a list of "
        'messages, or {"messages": [...], "tools": [...]}), offline, and show the max_tokens '
        "kvclient would send.",
    )
    parser.add_argument(
        "text",
        nargs="?",
        metavar="INPUT",
        help="the prompt; with --chat, the chat request's JSON or a file holding it ('-': "
        "standard input) (default: standard input)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the input is a chat request in JSON (default: the input is a prompt)",
    )
    counters = parser.add_mutually_exclusive_group()
    add_tokenizer(counters, "count with it", "tiktoken")
    hidden_alias(counters, "--hf-tokenizer", dest="tokenizer", type=Path)
    counters.add_argument(
        "--server",
        metavar="URL",
        nargs="?",
        const="",
        help="ask this server's /tokenize instead, with --api-key and --model; without a URL, "
        f"the server at {env_names(BASE_URL_ENV)}, as the client finds it (a value that is "
        "not an http(s) URL is the INPUT) (default: count here)",
    )
    add_api_key(parser)
    add_model(parser, "with --server: the model whose tokenizer counts (default: the server's)")
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
    add_context_window(parser, "the model's context window: show the effective max_tokens too "
                       "(default: no)")  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, metavar="TOKENS", help="the requested cap (default: unset)"
    )
    add_log_level(parser)
    return parser


def _compat(argv: Sequence[str]) -> list[str]:
    """``--chat=FILE`` (``--chat`` took a value before it became a flag) as ``--chat FILE``."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith("--chat="):
            out += ["--chat", arg.removeprefix("--chat=")]
        else:
            out.append(arg)
    return out


def _read_chat(args: argparse.Namespace) -> str:
    source: str | None = args.text
    if source is None or source == "-":
        return sys.stdin.read()
    # A value that is not JSON is the name of a file holding it.
    if not source.lstrip().startswith(("[", "{")):
        return Path(source).read_text(encoding="utf-8")
    return source


def _resolve_server(args: argparse.Namespace) -> None:
    """``--server`` without a URL: the one the environment names, as the client reads it
    (``--server "some prompt"``: that is the input, not a URL). Raises ValueError when there
    is none."""
    if args.server is None:
        return
    if args.server and not args.server.startswith(("http://", "https://")) and args.text is None:
        args.text, args.server = args.server, ""
    if not args.server:
        found = from_env(BASE_URL_ENV)
        if found is None:
            raise ValueError(f"--server: {no_url_message()}")
        args.server = found


def _counter(args: argparse.Namespace) -> TokenCounter:
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer, non_text_part_tokens=args.media_tokens)
    if args.server:
        from ._server_counter import ServerTokenizeCounter

        return ServerTokenizeCounter(
            args.server,
            engine=args.engine,
            model=args.model,
            api_key=args.api_key,
            non_text_part_tokens=args.media_tokens,
        )
    return TiktokenCounter(
        args.encoding, path=args.tiktoken_file, non_text_part_tokens=args.media_tokens
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(_compat(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_level)
    resolve_client(args)
    counter: TokenCounter | None = None
    try:
        _resolve_server(args)
        counter = _counter(args)
        if args.chat:
            try:
                text = _read_chat(args)
            except OSError as exc:
                print(f"kvclient count: cannot read the chat file: {exc}", file=sys.stderr)
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
    finally:
        close = getattr(counter, "close", None)  # a server's counter holds connections
        if callable(close):
            close()
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
