#!/usr/bin/env python3
"""Capture real llama.cpp answers, each request asked plain and as a stream, for the tests of
the gateway's assembly of plain answers from streams (``tests/unit/test_assemble.py``).

    python scripts/capture_llama_streams.py     # writes tests/unit/llama_cpp_streams.json

Runs the llama-server and tiny model of ``scripts/llama_engine.py`` (build them first) on
loopback. Every request has temperature 0 and a seed, so its plain answer and its stream
generate the same tokens. The model's path in the answers is cut to its file name. The last
case is an error mid-decode: four requests overrun a unified KV pool of 512 tokens
("Context size has been exceeded"), plain and streamed, until one of each fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_engine

OUT = Path(__file__).resolve().parent.parent / "tests" / "unit" / "llama_cpp_streams.json"
NO_EOS = {"128009": -100, "128001": -100}  # the tiny model's end tokens: run to the cap
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
FIXED = {"temperature": 0, "seed": 7}

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", CHAT, {"messages": HI, "max_tokens": 12}),
    ("chat_stop", CHAT, {"messages": HI, "max_tokens": 12, "stop": ["/show"]}),
    ("chat_n2", CHAT, {"messages": HI, "max_tokens": 6, "n": 2}),
    ("chat_logprobs", CHAT, {"messages": HI, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}),
    ("completion", COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 12}),
    ("completion_n_cmpl3", COMPLETIONS, {"prompt": "Once", "max_tokens": 5, "n_cmpl": 3}),
    ("completion_logprobs", COMPLETIONS, {"prompt": "Once", "max_tokens": 5, "logprobs": 2}),
    ("completion_stop", COMPLETIONS, {"prompt": "Once", "max_tokens": 12, "stop": ["_>"]}),
    # The end token at once: nothing generated, finish_reason "stop".
    ("chat_eos", CHAT, {"messages": HI, "max_tokens": 12, "logit_bias": {"128009": 100}}),
]


def _clean(text: str, model: str) -> str:
    return text.replace(model, Path(model).name)


def _one(http: httpx.Client, path: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    plain = http.post(path, json=body)
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=streamed) as answer:
        stream = b"".join(answer.iter_raw()).decode()
        status = answer.status_code
    return {
        "path": path,
        "request": body,
        "plain": {"status": plain.status_code, "body": json.loads(_clean(plain.text, model))},
        "stream": {"status": status, "body": _clean(stream, model)},
    }


def _overrun(url: str, path: str, model: str) -> dict[str, Any]:
    """A plain request and a stream, each failed mid-decode by a unified KV pool overrun."""
    import concurrent.futures

    body = {"prompt": "Story", "max_tokens": 200, "logit_bias": NO_EOS, **FIXED}
    found: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(10):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda _: _one(http, path, body, model), range(4)))
            for result in results:
                if "plain" not in found and result["plain"]["status"] >= 400:
                    found["plain"] = result["plain"]
                if "stream" not in found and '"error"' in result["stream"]["body"]:
                    found["stream"] = result["stream"]
            if len(found) == 2:
                return {"path": path, "request": body, **found}
    raise SystemExit("no mid-decode error in 10 bursts")


def main() -> int:
    cases: dict[str, Any] = {}
    with (
        llama_engine.LlamaServer(ctx=2048, parallel=4) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        model = http.get("/v1/models").json()["data"][0]["id"]
        for name, path, body in CASES:
            cases[name] = _one(http, path, {**body, **FIXED}, model)
    with llama_engine.LlamaServer(ctx=512, parallel=4, unified=True) as server:
        cases["completion_overrun"] = _overrun(server.url, COMPLETIONS, model)
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
