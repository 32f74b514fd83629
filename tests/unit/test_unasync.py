"""The sync shells are generated from the async ones (scripts/unasync.py): they must agree."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "unasync.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync_script", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_sync_shells_are_what_unasync_writes() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_fails_on_a_hand_edited_sync_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unasync = _load()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for source, target, _doc in unasync.PAIRS:
        for name in (source, target):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(unasync, "ROOT", tmp_path)
    assert unasync.main(["--check"]) == 0
    target = tmp_path / "kvclient" / "_sync_client.py"
    target.write_text(target.read_text().replace("call.begin_attempt()", "pass"))
    assert unasync.main(["--check"]) == 1
    diff = capsys.readouterr().out
    assert any(line.startswith("+") and "call.begin_attempt()" in line for line in diff.split("\n"))
    assert unasync.main([]) == 0  # rewrite
    assert unasync.main(["--check"]) == 0


def test_rewrite_rules() -> None:
    unasync = _load()
    source = (
        "async def f(x: AsyncIterator[int]) -> Awaitable[None]:\n"
        "    async with AsyncLock() as lock:\n"
        "        async for y in x.__aiter__():\n"
        "            await self.retry.async_sleep(1)\n"
        "    await response.aclose()\n"
        "    raise StopAsyncIteration\n"
    )
    assert unasync.unasync(source) == (
        "def f(x: Iterator[int]) -> None:\n"
        "    with Lock() as lock:\n"
        "        for y in x.__iter__():\n"
        "            self.retry.sleep(1)\n"
        "    response.close()\n"
        "    raise StopIteration\n"
    )
