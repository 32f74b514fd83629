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
    # The client's pair alone: how the check works, not every pair's imports in another root.
    pairs = [pair for pair in unasync.PAIRS if pair[1] == "kvclient/_sync_client.py"]
    monkeypatch.setattr(unasync, "PAIRS", pairs)
    for source, target, _doc in pairs:
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


def test_async_tests_become_plain_sync_tests() -> None:
    unasync = _load()
    source = (
        "pytestmark = pytest.mark.anyio\n"
        "async def test_x() -> None:\n"
        "    async with make_async_client(server) as client:\n"
        "        [c async for c in await client.chat_stream()]\n"
    )
    assert unasync.unasync(source) == (
        "def test_x() -> None:\n"
        "    with make_client(server) as client:\n"
        "        [c for c in client.chat_stream()]\n"
    )


def test_the_client_tests_are_generated_pairs() -> None:
    targets = {target for _source, target, _doc in _load().PAIRS}
    assert {"tests/client/_sync/test_client.py", "tests/client/_sync/test_replicas.py"} <= targets
