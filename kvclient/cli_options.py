"""The options every ``kvclient`` command shares (``serve`` and ``gateway`` included), defined
once, and their one help format.

One spelling, one metavar, one meaning and the same environment variables in every command that
takes them (``tests/cli/test_cli_options.py`` walks every parser to keep it so). Also the logging
set-up of the command-line entry points: library code never configures logging; a command does,
once, from ``--log-level``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from ._client import API_KEY_ENV, BASE_URL_ENV, from_env
from ._hf_tokenizer import HuggingFaceCounter
from ._tokens import DEFAULT_NON_TEXT_PART_TOKENS, TokenCounter

__all__ = [
    "LOG_LEVELS",
    "TOKENIZER_HELP",
    "HelpFormatter",
    "add_api_key",
    "add_context_window",
    "add_json",
    "add_log_level",
    "add_model",
    "add_tokenizer",
    "add_url",
    "env_names",
    "hidden_alias",
    "load_tokenizer",
    "no_url_message",
    "resolve_client",
    "setup_logging",
    "to_stdout",
    "write_json",
]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: Third-party loggers whose INFO lines are one per HTTP request: shown only at ``debug``.
CHATTY_LOGGERS = ("httpx", "httpcore")


def env_names(names: tuple[str, ...]) -> str:
    """``$A, else $B``: how help texts name the environment variables read."""
    return ", else ".join(f"${name}" for name in names)


def add_url(parser: argparse.ArgumentParser) -> None:
    """The server's base URL, positional and optional (``resolve_client`` reads the env)."""
    parser.add_argument(
        "url",
        metavar="URL",
        nargs="?",
        help="the server's base URL, e.g. http://127.0.0.1:8000, with or without /v1 "
        f"(default: {env_names(BASE_URL_ENV)})",
    )


def add_api_key(parser: argparse.ArgumentParser | Any) -> None:
    """The key a client sends (``resolve_client`` reads the env)."""
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"sent as 'Authorization: Bearer KEY' (default: {env_names(API_KEY_ENV)})",
    )


def add_model(parser: argparse.ArgumentParser | Any, help: str) -> None:
    parser.add_argument("--model", metavar="MODEL", help=help)


def add_context_window(parser: argparse.ArgumentParser | Any, help: str, **kw: Any) -> None:
    parser.add_argument("--context-window", type=int, metavar="TOKENS", help=help, **kw)


TOKENIZER_HELP = (
    "the model's tokenizer: a local Hugging Face model directory (tokenizer.json and "
    "tokenizer_config.json with its chat template: exact counts, chats rendered as the server "
    "renders them), or a bare tokenizer.json file (chats estimated with OpenAI's per-message "
    "formula)"
)


def add_tokenizer(parser: argparse.ArgumentParser | Any, purpose: str, default: str) -> Any:
    """``--tokenizer PATH``: a model directory or a tokenizer.json, in every command."""
    return parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help=f"{TOKENIZER_HELP}; {purpose} (default: {default})",
    )


def load_tokenizer(
    path: str | Path, *, non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS
) -> TokenCounter:
    """The counter ``--tokenizer PATH`` names: a model directory (``from_pretrained``, as
    ``AutoTokenizer.from_pretrained`` takes one) or a bare ``tokenizer.json``. A path that is
    neither raises ValueError saying so."""
    path = Path(path)
    if path.is_dir():
        return HuggingFaceCounter.from_pretrained(path, non_text_part_tokens=non_text_part_tokens)
    if path.is_file():
        return HuggingFaceCounter(path, non_text_part_tokens=non_text_part_tokens)
    raise ValueError(f"--tokenizer: no model directory or tokenizer.json at {str(path)!r}")


def add_json(parser: argparse.ArgumentParser | Any, what: str) -> None:
    """``--json FILE``: write a JSON report; ``-`` is standard output (instead of the table)."""
    parser.add_argument(
        "--json",
        type=Path,
        dest="json_path",
        metavar="FILE",
        help=f"also write {what} as JSON to FILE ('-': standard output, instead of the table; "
        "default: none)",
    )


def to_stdout(path: Path | None) -> bool:
    return path is not None and str(path) == "-"


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2)
    if to_stdout(path):
        print(text)
    else:
        path.write_text(text + "\n", encoding="utf-8")


def add_log_level(parser: argparse.ArgumentParser | Any, default: str = "warning") -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help="the least severe log records shown (kvclient's retries are 'info'); httpx's "
        "line per HTTP request only at 'debug' (default: %(default)s)",
    )


def setup_logging(level: str) -> None:
    """What a command does with ``--log-level``: a handler on the root logger, and httpx's and
    httpcore's one-line-per-request INFO records hidden unless ``debug`` was asked for."""
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(name)s: %(message)s")
    logging.getLogger().setLevel(numeric)
    chatty = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(chatty)


def hidden_alias(parser: argparse.ArgumentParser | Any, old: str, *, dest: str, **kw: Any) -> None:
    """A former spelling that keeps working, left out of ``--help`` (deprecated)."""
    parser.add_argument(old, dest=dest, help=argparse.SUPPRESS, **kw)


def resolve_client(args: argparse.Namespace) -> None:
    """Fill what a client command was not given from the environment, as ``kvclient.Client``
    reads it: the base URL from ``BASE_URL_ENV``, the key from ``API_KEY_ENV``."""
    if getattr(args, "url", None) is None and hasattr(args, "url"):
        args.url = from_env(BASE_URL_ENV)
    if getattr(args, "api_key", None) is None and hasattr(args, "api_key"):
        args.api_key = from_env(API_KEY_ENV)


def no_url_message() -> str:
    return f"give the server's URL, or set {' or '.join(BASE_URL_ENV)}"


def say(prog: str, message: str) -> None:
    """One line on standard error, named after the command."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One help format for every ``kvclient`` command: descriptions as written, and ``(default:
    X)`` after an option's help unless the help already says what the default is (a flag's
    default is off, and goes unsaid)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unsaid = action.default is None or action.default is argparse.SUPPRESS
        if "default" in text or unsaid or action.default is False or action.default == []:
            return text
        return f"{text} (default: %(default)s)".lstrip()
