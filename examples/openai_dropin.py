"""The official openai SDK with kvclient underneath: the one-line change.

    python -m reference_server &            # or any OpenAI-compatible server
    python examples/openai_dropin.py        # KVCLIENT_BASE_URL=http://host:port to change

``from kvclient.openai import OpenAI`` instead of ``from openai import OpenAI``: the calls stay
the SDK's, while every completion is counted, sent with a clamped ``max_tokens``, refused locally
when it cannot fit, and retried by kvclient's policy. The last part shows the same transport
under a plain ``openai.OpenAI``, as frameworks that take ``http_client=`` use it.
"""

from __future__ import annotations

import logging
import os

import httpx
import openai

from kvclient import RetryPolicy
from kvclient.openai import OpenAI, Transport

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
# kvclient logs each retry at INFO: shown. httpx logs each HTTP request at INFO: hidden.
logging.getLogger("httpx").setLevel(logging.WARNING)
BASE_URL = os.environ.get("KVCLIENT_BASE_URL", "http://127.0.0.1:8000") + "/v1"


def main() -> int:
    messages = [{"role": "user", "content": "In one sentence: why reserve KV cache?"}]
    with OpenAI(base_url=BASE_URL, api_key="unused", retry=RetryPolicy(deadline=60)) as client:
        model = client.models.list().data[0].id
        try:
            answer = client.chat.completions.create(model=model, messages=messages)
        except openai.RateLimitError as exc:  # kvclient gave up: attempts or deadline ran out
            print(f"server busy: {exc.message}")
            return 1
        print((answer.choices[0].message.content or "")[:200])
        print(f"usage={answer.usage} (no max_tokens given: kvclient sent context - prompt)")

        print("streamed: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, stream=True
        )
        with stream:
            for chunk in stream:
                if chunk.choices:
                    print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()

        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "word " * 100_000}]
            )
        except openai.BadRequestError as exc:  # refused locally: nothing was sent
            body = exc.body if isinstance(exc.body, dict) else {}
            print(f"refused: {exc.code}, {body.get('prompt_tokens')} prompt tokens")

    # For a framework that takes http_client= (LangChain's ChatOpenAI, instructor, ...).
    http = httpx.Client(transport=Transport(retry=RetryPolicy(deadline=60)))
    with openai.OpenAI(base_url=BASE_URL, api_key="unused", http_client=http, max_retries=0) as sdk:
        text = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=16)
        print(f"through the transport: {text.choices[0].text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
