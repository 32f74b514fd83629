"""Every command explains itself: each option of every sub-command is documented, with its
default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvclient.cli import COMMANDS


def _parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(COMMANDS[command][0])
    build = getattr(module, "build_parser", None) or getattr(module, "_parser", None)
    assert build is not None, f"{command}: no build_parser()"
    parser: argparse.ArgumentParser = build()
    return parser


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_documented_with_its_default(command: str) -> None:
    parser = _parser(command)
    text = parser.format_help()
    undocumented, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if action.help == argparse.SUPPRESS:  # a former spelling, hidden (test_cli_options.py)
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not action.help:
            undocumented.append(name)
            continue
        flag = action.nargs == 0 or action.required  # a flag is off unless given
        if not flag and "default" not in parser._get_formatter()._get_help_string(action):
            no_default.append(name)
    assert undocumented == [], f"{command}: options without help: {undocumented}"
    assert no_default == [], f"{command}: options whose help says no default: {no_default}"
    assert "%(default)" not in text
