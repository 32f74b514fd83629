"""Every ```python block of README.md, and of the docs pages marked runnable, runs as pasted.

Each block runs on its own in a fresh interpreter, against a real reference server (the one
`kvclient serve` runs, serving ``kvclient-sim``) on a loopback port chosen at run time. The
pages tell readers to export the server's URL; the test does the same: ``KVCLIENT_BASE_URL``
for kvclient's clients, ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` for the openai SDK's.

A docs page is runnable when it carries the line ``<!-- snippets: run -->``; its other pages'
Python blocks are illustrations (a model directory's path, a URL of your own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_server.testing import RunningServer, running_server

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE_MARK = "<!-- snippets: run -->"
# A fence opens with ```python (any indentation, as inside a list) and closes with ``` alone.
_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
SNIPPET_TIMEOUT = 90


def _pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    docs = ROOT / "docs"
    pages += sorted(p for p in docs.rglob("*.md") if RUNNABLE_MARK in p.read_text())
    return pages


def _snippets() -> list[tuple[str, str]]:
    found = []
    for page in _pages():
        text = page.read_text()
        for n, match in enumerate(_BLOCK.finditer(text), 1):
            indent = len(match.group("indent"))
            lines = match.group("code").splitlines()
            code = "\n".join(line[indent:] for line in lines) + "\n"
            line_no = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line_no} (block {n})", code))
    return found


SNIPPETS = _snippets()


def test_the_readme_has_python_snippets() -> None:
    """The extraction itself works: the README's examples are found (a changed fence would
    otherwise make every case below vanish silently)."""
    readme = [name for name, _ in SNIPPETS if name.startswith("README.md:")]
    assert len(readme) >= 3, readme


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # `kvclient serve`'s defaults: the model kvclient-sim, a window of 8,192 tokens.
    with running_server() as s:
        yield s


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_snippet_runs_as_pasted(
    server: RunningServer, tmp_path: Path, where: str, code: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCLIENT_", "OPENAI_"))}
    env.update(
        KVCLIENT_BASE_URL=server.base_url,
        OPENAI_BASE_URL=f"{server.base_url}/v1",
        OPENAI_API_KEY="unused",
        # The package under test, wherever the interpreter's own install points.
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT,
    )
    assert done.returncode == 0, f"{where} failed:\n{code}\n--- stderr:\n{done.stderr[-4000:]}"
