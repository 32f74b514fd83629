"""kvclient.openai against the real reference server over loopback: the real openai SDK, sync
and async (asyncio and trio), plain and streamed. Attempts are counted by the server."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from kvclient import RetryEvent, RetryPolicy, TiktokenCounter
from kvclient.openai import AsyncOpenAI, OpenAI, Transport
from reference_server import RunningServer, running_server
from tests.helpers.servers import at_zero, hold, wait_for

COUNTER = TiktokenCounter()
MODEL = "kvclient-sim"
CONTEXT = 2048
CONFIG: dict[str, Any] = {
    "kv_tokens": 4096,  # usable 3686
    "context_window": CONTEXT,
    "decode_rate": 4000.0,
    "mean_output_tokens": 1e6,  # always run to the cap: the cap sent is the cap reached
    "tick_seconds": 0.005,
}
HI = [{"role": "user", "content": "Hi"}]
# See tests/client/test_openai_dropin.py: the SDK's async stream leaves its generators to trio's GC.
SDK_TRIO_STREAM_WARNING = "ignore:Async generator 'openai._streaming:ResourceWarning"
HTTPX_UNDER_SDK_STREAM_WARNING = "ignore:Async generator 'httpx._models:ResourceWarning"


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with running_server(**CONFIG) as running:
        yield running


def attempts(server: RunningServer) -> float:
    m = server.metrics()
    return m["kv_admitted_total"] + m["kv_rejected_total"]


def test_the_discovered_window_clamps_and_the_server_reaches_that_cap(
    server: RunningServer,
) -> None:
    with OpenAI(base_url=server.base_url + "/v1", api_key="k") as client:
        text = client.completions.create(model=MODEL, prompt="Once upon a time")
        chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10**6)
        assert client.kvclient_transport.context_window == CONTEXT  # from /v1/models
        listed = client.models.list().data[0]
    assert text.usage is not None
    assert chat.usage is not None
    assert text.usage.prompt_tokens == COUNTER.count("Once upon a time")
    assert text.usage.completion_tokens == CONTEXT - text.usage.prompt_tokens
    assert chat.usage.prompt_tokens == COUNTER.count_messages(HI)
    assert chat.usage.completion_tokens == CONTEXT - chat.usage.prompt_tokens
    assert (listed.model_extra or {}).get("max_model_len") == CONTEXT  # passed through
    wait_for(lambda: at_zero(server))


def test_a_prompt_over_the_context_never_reaches_the_server(server: RunningServer) -> None:
    with OpenAI(base_url=server.base_url + "/v1", api_key="k", context_window=CONTEXT) as client:
        before = server.metrics()["kv_http_requests_total"]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "word " * 3000}]
            )
    assert caught.value.code == "context_length_exceeded"
    assert server.metrics()["kv_http_requests_total"] == before
    assert server.metrics()["kv_generation_requests_total"] == 0


def test_429_retry_after_is_honoured_and_every_attempt_is_kvclients(
    server: RunningServer,
) -> None:
    events: list[tuple[float, RetryEvent]] = []
    holder = hold(server, 2000)  # 2008 of 3686 tokens for ~0.5 s
    before = attempts(server)
    with OpenAI(
        base_url=server.base_url + "/v1",
        api_key="k",
        context_window=CONTEXT,
        on_retry=lambda event: events.append((time.monotonic(), event)),
    ) as client:
        answer = client.completions.create(model=MODEL, prompt="y", max_tokens=2000)
        done = time.monotonic()
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 2000
    assert events
    assert events[0][1].status_code == 429
    advice = events[0][1].retry_after
    assert advice is not None
    assert advice > 0
    assert done - events[0][0] >= advice  # it waited at least what the server said
    # Every attempt the server saw: the holder's, kvclient's refused ones, and the one that ran.
    assert attempts(server) - before == len(events) + 1
    assert server.metrics()["kv_rejected_total"] == len(events)
    holder.join(10)
    wait_for(lambda: at_zero(server))


@pytest.mark.parametrize("sdk_retries", [None, 3])
def test_giving_up_is_a_rate_limit_error_after_kvclients_attempts_only(
    server: RunningServer, sdk_retries: int | None
) -> None:
    """kvclient's one attempt and no more, whether through ``kvclient.openai.OpenAI`` or a
    plain ``openai.OpenAI(max_retries=3)`` over the transport."""
    policy = RetryPolicy(max_attempts=1)
    url = server.base_url + "/v1"
    client: openai.OpenAI
    if sdk_retries is None:
        client = OpenAI(base_url=url, api_key="k", context_window=CONTEXT, retry=policy)
    else:
        http = httpx.Client(transport=Transport(context_window=CONTEXT, retry=policy))
        client = openai.OpenAI(base_url=url, api_key="k", http_client=http, max_retries=sdk_retries)
    holder = hold(server, 2000)  # 2008 of 3686 tokens for ~0.5 s: 2000 more do not fit
    with client, pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="y", max_tokens=2000)
    assert caught.value.code == "server_busy"
    assert server.metrics()["kv_rejected_total"] == 1
    holder.join(10)
    wait_for(lambda: at_zero(server))


def test_a_sync_stream_passes_event_by_event(server: RunningServer) -> None:
    with OpenAI(base_url=server.base_url + "/v1", api_key="k", context_window=CONTEXT) as client:
        with client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        ) as stream:
            chunks = list(stream)
        window = client.kvclient_transport.client._window
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert COUNTER.count(text) == 12
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert window.requests == 0
    wait_for(lambda: at_zero(server))


@pytest.mark.anyio
@pytest.mark.filterwarnings(SDK_TRIO_STREAM_WARNING)
@pytest.mark.filterwarnings(HTTPX_UNDER_SDK_STREAM_WARNING)
async def test_async_plain_and_streamed(server: RunningServer) -> None:
    async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="k") as client:
        text = await client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
        stream = await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=8, stream=True
        )
        parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="word " * 3000)
        del stream
        gc.collect()  # while the warning filter is active
    assert text.usage is not None
    assert text.usage.completion_tokens == CONTEXT - COUNTER.count("hi")
    assert COUNTER.count("".join(parts)) == 8
    for _ in range(200):  # the server finishes its side of the stream on its own thread
        if at_zero(server):
            break
        await anyio.sleep(0.01)
    assert at_zero(server)


def test_the_dropin_example_logs_no_http_request_lines() -> None:
    """examples/openai_dropin.py: its local refusal appears as the SDK's BadRequestError and in
    no "HTTP Request:" log line (nothing was sent), and neither do the requests that were."""
    example = Path(__file__).resolve().parents[2] / "examples" / "openai_dropin.py"
    with running_server(decode_rate=5000.0, mean_output_tokens=20) as server:
        out = subprocess.run(
            [sys.executable, str(example)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=example.parents[1],
            env={**os.environ, "KVCLIENT_BASE_URL": server.base_url},
        )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: context_length_exceeded" in out.stdout
    assert "HTTP Request:" not in out.stderr
