"""Every module of kvclient imports on its own, first, in a fresh interpreter.

A module that works only when another was imported before it (two modules importing each other,
each needing the other's names at import time) fails here, whichever of the two is the first.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvclient

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> list[str]:
    found = [info.name for info in pkgutil.walk_packages(kvclient.__path__, "kvclient.")]
    # ``__main__`` runs a command when imported: ``python -m kvclient`` is its only use.
    return ["kvclient", *sorted(name for name in found if not name.endswith(".__main__"))]


MODULES = _modules()


def test_the_openai_adapter_is_among_the_modules() -> None:
    assert {
        "kvclient.openai._async_clients",
        "kvclient.openai._sync_clients",
        "kvclient.openai._async_transport",
        "kvclient.openai._sync_transport",
    } <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    # From the repository's root: ``python -c`` puts the working directory first on the path.
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
