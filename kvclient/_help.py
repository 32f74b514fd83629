"""One help format for every ``kvclient`` command: each option shows its default."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and ``(default: X)`` after an option's help unless the help
    already says what the default is (a flag's default is off, and goes unsaid)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unsaid = action.default is None or action.default is argparse.SUPPRESS
        if "default" in text or unsaid or action.default is False or action.default == []:
            return text
        return f"{text} (default: %(default)s)".lstrip()
