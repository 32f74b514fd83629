"""The docs site: ``mkdocs build --strict`` passes, the API reference lists every public name (and
no other), and a real browser renders its pages.

The build runs as ``.ci/run`` runs it (strict: a broken link, anchor or image fails it). The
screenshot test runs Debian's headless Chromium; locally, without it, the test skips and says
why; in CI (``CI=true``) a missing Chromium fails the test: ``scripts/test_setup.py``
installs it. So does a missing mkdocs, which the ``dev`` extra installs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.chromium import pixels, screenshot

ROOT = Path(__file__).resolve().parents[2]
# Material's header and navigation bar in the site's palette (indigo), as Chromium paints it.
HEADER_COLOR = "#4051b5"
# The header is 48 px tall across the 1280 px window: about 61,000 pixels.
MIN_HEADER_PIXELS = 30_000
# Rendered text is antialiased into many shades; a blank or unstyled page has a handful.
MIN_DISTINCT_COLORS = 200
# The modules whose ``__all__`` the API reference renders, and the page of each.
API_PAGES = {
    "kvclient": "api/kvclient",
    "kvclient.openai": "api/openai",
    "kvclient.contract": "api/contract",
    "kvclient.engines.behaviour": "api/engines",
    "kvclient.engines.budget": "api/engines",
    "kvclient.engines.discovery": "api/engines",
    "kvclient.engines.errors": "api/engines",
    "kvclient.engines.metrics": "api/engines",
    "kvclient.engines.spend": "api/engines",
    "kvclient.engines.tokenize": "api/engines",
    "kvclient.cli_options": "api/cli-options",
    "kvclient.headers": "api/headers",
    "kvclient.routing": "api/routing",
    "kvclient.sse": "api/sse",
    "kvclient.testing": "api/testing",
    "reference_server.testing": "api/reference-server-testing",
}


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it, into a temporary directory."""
    if importlib.util.find_spec("mkdocs") is None:
        _missing("mkdocs is not installed (python -m pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_the_api_reference_lists_every_public_name(site: Path, module: str) -> None:
    page = (site / API_PAGES[module] / "index.html").read_text()
    anchors = set(re.findall(r'id="([\w.]+)"', page))
    public = importlib.import_module(module).__all__
    missing = [name for name in public if f"{module}.{name}" not in anchors]
    assert not missing, f"{module}: not in the API reference: {missing}"
    # And nothing else at the module's level: a name it only imports is not its API.
    shown = {a.removeprefix(f"{module}.") for a in anchors if a.startswith(f"{module}.")}
    extra = sorted(name for name in shown if "." not in name and name not in public)
    assert not extra, f"{module}: in the API reference but not in __all__: {extra}"


@pytest.mark.parametrize(
    ("page", "heading"),
    [
        ("index.html", "kvclient"),
        ("guides/gateway/index.html", "The gateway in front of an engine"),
    ],
)
def test_chromium_renders_the_page(site: Path, tmp_path: Path, page: str, heading: str) -> None:
    html = site / page
    assert f">{heading}<" in html.read_text()  # the Markdown became the page
    png = screenshot(html, tmp_path / "shot.png", width=1280, height=1600)
    colors = pixels(png)
    # Material's stylesheet applied (its header), and text drawn (many antialiased shades).
    assert colors[HEADER_COLOR] >= MIN_HEADER_PIXELS, colors.most_common(5)
    assert len(colors) >= MIN_DISTINCT_COLORS, len(colors)


def test_every_doc_the_source_names_exists() -> None:
    """A docstring or comment that sends the reader to ``docs/NAME.md`` names a page that is
    there (pages move; their references in the code are not checked by the build)."""
    named = re.compile(r"docs/[\w/.-]+\.md")
    missing = []
    for package in ("kvclient", "reference_server", "scripts", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for found in named.findall(path.read_text(encoding="utf-8")):
                if not (ROOT / found).is_file():
                    missing.append(f"{path.relative_to(ROOT)}: {found}")
    assert missing == []
