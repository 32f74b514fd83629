"""Many concurrent chat calls with kvclient's AsyncClient (asyncio here; trio works the same).

    python -m reference_server &            # or any OpenAI-compatible server
    python examples/async_chat.py           # KVCLIENT_BASE_URL=http://host:port to change

When the server answers 429 with Retry-After, the whole client cools down: the other tasks
hold their sends until then instead of each collecting a 429 of its own.
"""

from __future__ import annotations

import os

import anyio

from kvclient import AsyncClient, KVClientError, RetryBudget, RetryPolicy

BASE_URL = os.environ.get("KVCLIENT_BASE_URL", "http://127.0.0.1:8000")


async def main() -> None:
    policy = RetryPolicy(max_attempts=6, deadline=90, retry_budget=RetryBudget())
    async with AsyncClient(base_url=BASE_URL, retry=policy) as client:

        async def ask(n: int) -> None:
            messages = [{"role": "user", "content": f"Give me fun fact number {n} about GPUs."}]
            try:
                answer = await client.chat(messages, max_tokens=96)
            except KVClientError as exc:
                print(f"[{n}] {type(exc).__name__}: {exc}")
                return
            print(
                f"[{n}] attempts={answer.attempts} waited={answer.retry_wait:.2f}s "
                f"max_tokens={answer.max_tokens}: {answer.text[:60]!r}"
            )

        async with anyio.create_task_group() as tg:
            for n in range(16):
                tg.start_soon(ask, n)

        async with client.complete_stream("Once upon a time", max_tokens=32) as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
        print(f"\n{stream.completion.usage}")


if __name__ == "__main__":
    anyio.run(main)
