"""A chat call with kvclient's sync Client: clamped max_tokens, Retry-After honoured.

    python -m reference_server &            # or any OpenAI-compatible server
    python examples/sync_chat.py            # KVCLIENT_BASE_URL=http://host:port to change

The context window is discovered from GET /v1/models; every retry is logged.
"""

from __future__ import annotations

import logging
import os

from kvclient import Client, KVClientError, RetryPolicy

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
# kvclient logs each retry at INFO: shown. httpx logs each HTTP request at INFO: hidden.
logging.getLogger("httpx").setLevel(logging.WARNING)
BASE_URL = os.environ.get("KVCLIENT_BASE_URL", "http://127.0.0.1:8000")


def main() -> int:
    question = "In one sentence: why reserve KV cache for the output?"
    messages = [{"role": "user", "content": question}]
    with Client(base_url=BASE_URL, retry=RetryPolicy(max_attempts=5, deadline=60)) as client:
        try:
            answer = client.chat(messages, max_tokens=128)
        except KVClientError as exc:
            print(f"failed: {type(exc).__name__}: {exc}")
            return 1
        print(answer.text)
        print(
            f"model={answer.model} context={client.context_window} max_tokens sent="
            f"{answer.max_tokens} usage={answer.usage} attempts={answer.attempts} "
            f"waited={answer.retry_wait:.2f}s"
        )
        print("streamed: ", end="", flush=True)
        with client.chat_stream(messages, max_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
        print(f"\nfinish_reason={stream.completion.finish_reason} usage={stream.completion.usage}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
