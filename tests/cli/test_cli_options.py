"""One spelling, one metavar, one meaning per option across every ``kvclient`` command, and the
same environment variables wherever a command takes a URL or a key.

The parsers are built in-process, as ``kvclient COMMAND`` builds them; nothing is shelled out.
"""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict
from typing import Any

import pytest

from kvclient._client import API_KEY_ENV, BASE_URL_ENV
from kvclient.cli import COMMANDS, _parser
from kvclient.cli_options import LOG_LEVELS, resolve_client
from reference_server.http.serving import LOG_LEVELS as SERVER_LOG_LEVELS

#: Commands that are clients of a server: they read the client's environment variables.
CLIENT_COMMANDS = ("bench", "contract", "count")
#: Former spellings, kept working and hidden (CHANGELOG.md): command -> old -> new.
ALIASES = {
    "bench": {
        "--num-requests": "--requests",
        "--workload-file": "--dataset",
        "--max-tokens": "--max-tokens-range",
    },
    "count": {"--hf-tokenizer": "--tokenizer"},
}


def _build(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(COMMANDS[command][0])
    build = getattr(module, "build_parser", None) or module._parser
    parser: argparse.ArgumentParser = build()
    return parser


PARSERS = {command: _build(command) for command in COMMANDS}


def _skipped(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction | argparse._VersionAction)


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not _skipped(a) and a.help != argparse.SUPPRESS]


def _hidden(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not _skipped(a) and a.help == argparse.SUPPRESS]


def _shape(action: argparse.Action) -> tuple[Any, ...]:
    """What must agree between two options of one spelling: how a value is written and read."""
    kind = "flag" if action.nargs == 0 else "value"
    choices = tuple(action.choices) if action.choices is not None else None
    return (kind, action.metavar, action.type, choices, action.nargs)


def test_the_top_level_help_lists_every_command() -> None:
    text = _parser().format_help()
    for command, (_, help_text) in COMMANDS.items():
        assert command in text
        assert help_text.split()[0] in text


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_text(command: str) -> None:
    parser = PARSERS[command]
    undocumented = [
        (a.option_strings or [a.dest])[0] for a in _visible(parser) if not (a.help or "").strip()
    ]
    assert undocumented == []
    # A hidden option is only ever a former spelling of a documented one.
    documented = {a.dest for a in _visible(parser)}
    for action in _hidden(parser):
        assert action.dest in documented, f"{command} {action.option_strings}: not an alias"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_option_has_one_spelling(command: str) -> None:
    for action in _visible(PARSERS[command]):
        long = [s for s in action.option_strings if s.startswith("--")]
        assert len(long) <= 1, f"{command}: {long} are two spellings of one option"


def test_shared_options_agree_across_commands() -> None:
    """Every option that several commands take has the same metavar, type and choices."""
    shapes: dict[str, dict[tuple[Any, ...], list[str]]] = defaultdict(lambda: defaultdict(list))
    for command, parser in PARSERS.items():
        for action in _visible(parser):
            for spelling in action.option_strings:
                shapes[spelling][_shape(action)].append(command)
    disagree = {name: dict(by) for name, by in shapes.items() if len(by) > 1}
    assert disagree == {}


def test_one_thing_has_one_spelling_across_commands() -> None:
    """An option's value (its dest) has one spelling in every command that takes it."""
    spellings: dict[str, set[str]] = defaultdict(set)
    for parser in PARSERS.values():
        for action in _visible(parser):
            if action.option_strings:
                spellings[action.dest].add(action.option_strings[-1])
    assert {dest: names for dest, names in spellings.items() if len(names) > 1} == {}


def test_value_options_name_their_value() -> None:
    """An option that takes a value names it in --help (``--json FILE``, not ``--json
    JSON_PATH``): a metavar or a list of choices."""
    for command, parser in PARSERS.items():
        for action in _visible(parser):
            if action.option_strings and action.nargs != 0:
                assert (
                    action.metavar is not None
                    or action.choices is not None
                    or (
                        action.dest.upper()
                        == action.option_strings[-1][2:].upper().replace("-", "_")
                    )
                ), f"{command} {action.option_strings}: metavar {action.dest.upper()}"


def test_log_levels_are_one_list() -> None:
    assert SERVER_LOG_LEVELS == LOG_LEVELS
    for command, parser in PARSERS.items():
        levels = [a for a in parser._actions if "--log-level" in a.option_strings]
        assert len(levels) == 1, f"{command} has no --log-level"
        assert tuple(levels[0].choices or ()) == LOG_LEVELS


@pytest.mark.parametrize(("command", "aliases"), sorted(ALIASES.items()))
def test_former_spellings_still_work(command: str, aliases: dict[str, str]) -> None:
    parser = PARSERS[command]
    for old, new in aliases.items():
        value = "7:9" if old == "--max-tokens" else "7"
        assert parser.parse_args([old, value]) == parser.parse_args([new, value])
        assert all(old not in a.option_strings for a in _visible(parser))


def test_tokenizer_means_a_directory_or_a_file_everywhere() -> None:
    options = {
        command: action
        for command, parser in PARSERS.items()
        for action in _visible(parser)
        if "--tokenizer" in action.option_strings
    }
    assert set(options) == {"bench", "count", "gateway", "serve"}
    for action in options.values():
        assert "model directory" in (action.help or "")
        assert "tokenizer.json" in (action.help or "")


# --- the environment ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_client_commands_name_the_client_environment(command: str) -> None:
    parser = PARSERS[command]
    by_dest = {a.dest: a for a in parser._actions}
    assert "api_key" in by_dest
    for name in API_KEY_ENV:
        assert f"${name}" in (by_dest["api_key"].help or "")
    if "url" in by_dest:
        for name in BASE_URL_ENV:
            assert f"${name}" in (by_dest["url"].help or "")


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_client_commands_read_the_client_environment(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = PARSERS[command]
    monkeypatch.setenv("KVCLIENT_BASE_URL", " ")  # blank: the next one counts
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("KVCLIENT_API_KEY", "first")
    monkeypatch.setenv("OPENAI_API_KEY", "second")
    args = parser.parse_args([])
    resolve_client(args)
    assert args.api_key == "first"
    if hasattr(args, "url"):
        assert args.url == "http://127.0.0.1:9/v1"
    given = parser.parse_args(["--api-key", "given"])
    resolve_client(given)
    assert given.api_key == "given"
