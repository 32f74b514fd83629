"""Headless Chromium for the tests that look at a rendered page: find it, screenshot a page,
count the screenshot's colours. In CI (``CI=true``) a missing Chromium fails the test
(``scripts/test_setup.py`` installs it); elsewhere it skips, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        reason = "headless Chromium is not installed (python scripts/test_setup.py installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def screenshot(page: Path, png: Path, *, width: int, height: int) -> Path:
    """``page`` as Chromium renders it in a ``width`` x ``height`` window, into ``png``."""
    subprocess.run(
        [
            chromium(),
            *FLAGS,
            f"--user-data-dir={png.parent / 'chromium-profile'}",
            f"--screenshot={png}",
            f"--window-size={width},{height}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=90,
    )
    return png


def pixels(png: Path) -> Counter[str]:
    """How many pixels of each colour (``#rrggbb``) the image has."""
    from PIL import Image

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        counts: Counter[str] = Counter()
        for n, (r, g, b) in rgb.getcolors(maxcolors=1 << 24) or []:
            counts[f"#{r:02x}{g:02x}{b:02x}"] += n
    return counts
