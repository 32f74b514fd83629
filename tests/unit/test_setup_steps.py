"""``scripts/test_setup.py`` (the README's test command runs it) installs every program a test
looks for, headless Chromium included; checked with its steps replaced, nothing installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str) -> ModuleType:
    """A script of scripts/ (on sys.path: tests/conftest.py puts it there), loaded afresh."""
    spec = importlib.util.spec_from_file_location(f"setup_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_setup_installs_chromium_with_redis_and_the_engines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = _load("test_setup")
    ensured: list[tuple[str, str]] = []

    def debian(command: str, package: str, **_: Any) -> str:
        ensured.append((command, package))
        return f"/usr/bin/{command}"

    monkeypatch.setattr(setup.debian_packages, "ensure", debian)
    monkeypatch.setattr(setup.redis_server, "ensure", lambda: debian("redis-server", "redis"))
    monkeypatch.setattr(setup.llama_engine, "ensure", lambda: {"llama": "built"})
    monkeypatch.setattr(setup.vllm_engine, "ensure", lambda: {"vllm": "installed"})
    monkeypatch.setattr(setup.fetch_tokenizers, "_complete", lambda directory: True)
    monkeypatch.setattr(setup.fetch_tokenizers, "fetch", lambda name: Path("/t") / name)
    assert setup.main() == 0
    assert ("chromium", "chromium") in ensured
    assert '"chromium": "/usr/bin/chromium"' in capsys.readouterr().out
    # What the screenshot tests look for is what was installed.
    from tests.helpers import chromium

    monkeypatch.setattr(chromium.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert chromium.chromium() == "/usr/bin/chromium"


def test_a_missing_debian_program_is_installed_with_apt_get(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packages = _load("debian_packages")
    installed: set[str] = set()
    ran: list[list[str]] = []

    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in installed or name == "apt-get" else None

    def run(args: list[str], **_: Any) -> None:
        ran.append(args)
        if "install" in args:
            installed.add(args[-1])

    monkeypatch.setattr(packages.shutil, "which", which)
    monkeypatch.setattr(packages.subprocess, "run", run)
    monkeypatch.setattr(packages.os, "geteuid", lambda: 0)
    assert packages.ensure("chromium", "chromium") == "/usr/bin/chromium"
    assert [a[:2] for a in ran] == [["apt-get", "update"], ["apt-get", "install"]]
    ran.clear()
    assert packages.ensure("chromium", "chromium") == "/usr/bin/chromium"  # found: nothing runs
    assert ran == []
