"""kvclient, unchanged, against a real llama.cpp ``llama-server`` on a loopback port.

The engine and its tiny random-weight model (real Llama-3 vocabulary) are built by
``scripts/test_setup.py``; the ``llama`` fixture (tests/conftest.py) runs it with 4 slots of
512 tokens (``-c 2048 -np 4``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import llama_engine
import pytest

from kvclient import (
    AsyncClient,
    Client,
    HuggingFaceCounter,
    PromptTooLongError,
    RetryPolicy,
)
from kvclient.contract import CheckStatus, run_contract
from kvclient.loadgen import cli as bench_cli

pytestmark = pytest.mark.llama_cpp

WINDOW = 512  # -c 2048 / --parallel 4
NEL = "\u0085"
NEL_TOKEN = 116360  # "\x85" in the Llama-3 vocabulary
MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def counter(llama_engine_ready: None) -> HuggingFaceCounter:
    return HuggingFaceCounter(str(llama_engine.tokenizer_dir() / "tokenizer.json"))


def _client(url: str, **kw: Any) -> Client:
    kw.setdefault("retry", RetryPolicy(deadline=60))
    return Client(base_url=url, **kw)


def _long_prompt(counter: HuggingFaceCounter, tokens: int) -> str:
    words = " ".join(f"word{i}" for i in range(tokens))
    ids = counter.encode(words)[:tokens]
    return counter.decode(ids)


# --- the surface, sync and async ----------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sync_client_discovers_the_window_and_generates(
    llama: llama_engine.LlamaServer, chat: bool, stream: bool
) -> None:
    with _client(llama.url) as client:
        if stream:
            opened = (
                client.chat_stream(MESSAGES, max_tokens=12)
                if chat
                else client.complete_stream("Once upon a time", max_tokens=12)
            )
            with opened as s:
                text = "".join(chunk.text for chunk in s)
            result = s.completion
            assert result.text == text
        else:
            result = (
                client.chat(MESSAGES, max_tokens=12)
                if chat
                else client.complete("Once upon a time", max_tokens=12)
            )
        assert client.context_window == WINDOW  # meta.n_ctx: no context_window= given
        assert client.model is not None
        assert client.model.endswith(".gguf")
    assert result.finish_reason in ("length", "stop")
    assert result.usage is not None
    assert 1 <= result.usage.completion_tokens <= 12
    assert result.attempts == 1


@pytest.mark.anyio
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_async_client_discovers_the_window_and_generates(
    llama: llama_engine.LlamaServer, chat: bool, stream: bool
) -> None:
    async with AsyncClient(base_url=llama.url, retry=RetryPolicy(deadline=60)) as client:
        if stream:
            opened = (
                client.chat_stream(MESSAGES, max_tokens=12)
                if chat
                else client.complete_stream("Once upon a time", max_tokens=12)
            )
            async with opened as s:
                text = "".join([chunk.text async for chunk in s])
            result = s.completion
            assert result.text == text
        else:
            result = await (
                client.chat(MESSAGES, max_tokens=12)
                if chat
                else client.complete("Once upon a time", max_tokens=12)
            )
        assert client.context_window == WINDOW
    assert result.usage is not None
    assert 1 <= result.usage.completion_tokens <= 12


def test_unset_max_tokens_is_clamped_to_the_slot_window(
    llama: llama_engine.LlamaServer, counter: HuggingFaceCounter
) -> None:
    seen: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        if request.method == "POST":
            seen.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=60)
    with _client(llama.url, counter=counter, http_client=http) as client:
        result = client.complete("Hello", logit_bias={"128009": -100, "128001": -100})
    http.close()
    prompt_tokens = counter.count("Hello") + 1  # the server adds BOS
    assert seen[-1]["max_tokens"] == WINDOW - counter.count("Hello")
    assert result.usage is not None
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.prompt_tokens + result.usage.completion_tokens <= WINDOW


# --- prompts that do not fit --------------------------------------------------------------------


def test_prompt_too_long_is_refused_locally_with_nothing_sent(
    llama: llama_engine.LlamaServer, counter: HuggingFaceCounter
) -> None:
    posts: list[str] = []
    http = httpx.Client(
        event_hooks={
            "request": [lambda r: posts.append(r.url.path) if r.method == "POST" else None]
        }
    )
    with (
        _client(llama.url, counter=counter, http_client=http) as client,
        pytest.raises(PromptTooLongError) as caught,
    ):
        client.complete(_long_prompt(counter, 600))
    http.close()
    assert posts == []
    assert (caught.value.prompt_tokens, caught.value.context_window) == (600, WINDOW)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_servers_400_is_prompt_too_long_with_its_kind(
    llama: llama_engine.LlamaServer, counter: HuggingFaceCounter, stream: bool
) -> None:
    # A client told a larger window than the server's sends the prompt; llama.cpp refuses it.
    prompt = _long_prompt(counter, 600)
    with _client(llama.url, counter=counter, context_window=100_000) as client:
        if stream:
            opened = client.complete_stream(prompt, max_tokens=8)
            with pytest.raises(PromptTooLongError) as caught:
                opened.__enter__()
        else:
            with pytest.raises(PromptTooLongError) as caught:
                client.complete(prompt, max_tokens=8)
    error = caught.value
    assert error.code == "exceed_context_size_error"
    assert error.context_window == WINDOW
    assert error.prompt_tokens == 601  # with the BOS the server adds


# --- queueing, start-up, keep-alive -------------------------------------------------------------


@pytest.mark.anyio
async def test_more_streams_than_slots_queue_within_the_read_timeout(
    llama: llama_engine.LlamaServer,
) -> None:
    """llama.cpp queues what its 4 slots cannot take: no headers until a slot frees."""
    results: list[Any] = []
    async with AsyncClient(
        base_url=llama.url, retry=RetryPolicy(deadline=60), timeout=httpx.Timeout(30, connect=5)
    ) as client:

        async def one(i: int) -> None:
            async with client.complete_stream(f"Story number {i}:", max_tokens=48) as s:
                async for _ in s:
                    pass
            results.append(s.completion)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
    assert len(results) == 12
    assert all(r.attempts == 1 and r.usage.completion_tokens >= 1 for r in results)


def test_the_start_up_503_is_retried(llama_engine_ready: None) -> None:
    server = llama_engine.LlamaServer(ctx=1024, parallel=2)
    server.start(wait=False)  # listening, still loading the model: 503 "Loading model"
    retries: list[Any] = []
    policy = RetryPolicy(deadline=60, max_attempts=100)
    try:
        with _client(server.url, retry=policy, on_retry=retries.append) as client:
            result = client.complete("Hello", max_tokens=4)
    finally:
        server.stop()
    assert result.usage is not None
    assert retries, "the model loaded before the first request: nothing was retried"
    assert {event.status_code for event in retries} == {503}


def test_200_sequential_streams_on_one_client_need_no_backoff(
    llama: llama_engine.LlamaServer,
) -> None:
    """llama.cpp closes the connection after each stream; kvclient re-sends at once."""
    retries = []
    with _client(llama.url, on_retry=retries.append) as client:
        for i in range(200):
            with client.complete_stream(f"{i}", max_tokens=2) as s:
                for _ in s:
                    pass
            assert s.completion.attempts == 1
    assert retries == []


class _Sends(httpx.BaseTransport):
    """The transport under a client, counting what it is asked to send: a call's attempts
    and its immediate re-sends on a connection llama.cpp had closed."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.count = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.count += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_the_openai_drop_in_streams_as_the_client_does(llama: llama_engine.LlamaServer) -> None:
    """50 sequential streamed chats through kvclient.openai.OpenAI and through Client: no
    backoff at all, and each is one attempt plus at most one immediate re-send."""
    from kvclient.openai import OpenAI

    calls = 50
    client_sends, sdk_sends = _Sends(), _Sends()
    client_retries: list[Any] = []
    sdk_retries: list[Any] = []
    per_call: dict[str, list[int]] = {"client": [], "openai": []}
    with _client(llama.url, transport=client_sends, on_retry=client_retries.append) as client:
        client.discover()  # the window and model: every send counted below is a chat's
        for i in range(calls):
            before = client_sends.count
            with client.chat_stream([{"role": "user", "content": f"{i}"}], max_tokens=2) as s:
                for _ in s:
                    pass
            assert (s.completion.attempts, s.completion.retry_wait) == (1, 0.0)
            per_call["client"].append(client_sends.count - before)
        model = client.model
    assert model is not None
    sdk = OpenAI(
        base_url=llama.url + "/v1",
        api_key="unused",
        context_window=WINDOW,  # as discovered above: every send counted below is a chat's
        transport=sdk_sends,
        retry=RetryPolicy(deadline=60),
        on_retry=sdk_retries.append,
    )
    with sdk:
        sdk.models.list()  # not a generation request: straight to the server
        for i in range(calls):
            before = sdk_sends.count
            stream = sdk.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"{i}"}],
                max_tokens=2,
                stream=True,
            )
            with stream:
                for _ in stream:
                    pass
            per_call["openai"].append(sdk_sends.count - before)
    for name, retries in (("client", client_retries), ("openai", sdk_retries)):
        assert retries == [], name  # no attempt beyond the first, so no wait at all
        assert sum(event.wait for event in retries) == 0
        assert set(per_call[name]) <= {1, 2}, (name, per_call[name])  # one send + one re-send


# --- streams that carry U+0085 -------------------------------------------------------------------


def test_a_stream_of_nel_characters_is_read_intact(llama: llama_engine.LlamaServer) -> None:
    bias = {str(NEL_TOKEN): 100}
    with _client(llama.url) as client:
        with client.chat_stream(MESSAGES, max_tokens=16, logit_bias=bias) as s:
            chunks = [chunk.text for chunk in s]
        plain = client.chat(MESSAGES, max_tokens=16, logit_bias=bias)
    assert s.completion.text == "".join(chunks)
    assert s.completion.text.count(NEL) >= 8
    assert plain.text.count(NEL) >= 8


@pytest.fixture(scope="module")
def nel_llama(llama_engine_ready: None) -> Any:
    """A llama-server whose every answer is mostly U+0085 (a server-wide logit bias)."""
    extra = ("--logit-bias", f"{NEL_TOKEN}+100")
    with llama_engine.LlamaServer(ctx=2048, parallel=4, extra=extra) as server:
        yield server


def test_bench_reads_nel_streams_intact(
    nel_llama: llama_engine.LlamaServer, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    argv = [
        *(nel_llama.url, "--requests", "12", "--concurrency", "4", "--seed", "1"),
        *("--prompt-tokens", "8:40", "--max-tokens-range", "8:32"),
        *("--json", str(out), "--no-progress"),
    ]
    assert bench_cli.main(argv) == 0
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (12, 0)


# --- the contract suite, run for real -----------------------------------------------------------

#: What the README's llama.cpp section states, as run here.
LLAMA_CPP_VERDICTS = {
    "context_window": CheckStatus.PASS,
    "bad_input": CheckStatus.FAIL,  # malformed JSON gets a 500
    "prompt_too_long": CheckStatus.PASS,  # 400 exceed_context_size_error ("413 preferred")
    "unset_max_tokens": CheckStatus.PASS,
    "explicit_max_tokens": CheckStatus.PASS,
    "saturation": CheckStatus.UNSUPPORTED,  # queues, never refuses
    "retry_after_honest": CheckStatus.UNSUPPORTED,
    "capacity_returns": CheckStatus.PASS,
}


@pytest.mark.parametrize("server", ["llama", "nel_llama"])
def test_contract_verdicts_against_llama_cpp(server: str, request: pytest.FixtureRequest) -> None:
    target: llama_engine.LlamaServer = request.getfixturevalue(server)
    report = run_contract(target.url, burst=8, burst_max_tokens=32, timeout=60)
    verdicts = {r.name: r.status for r in report.results}
    assert verdicts == LLAMA_CPP_VERDICTS, {r.name: r.evidence for r in report.results}
