"""Every field that spends KV is priced: output caps under any engine's name, several sequences,
and the prompt as the engine renders it (or the request is refused)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import llama_engine
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvclient import TiktokenCounter
from reference_server.gateway import GatewayConfig
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import discoverable, scripted_upstream

NO_EOS = {"128009": -100, "128001": -100}  # the tiny model's end tokens: run to the cap


def _peak(gateway: Any) -> int:
    return int(gateway.gateway.known[0].ledger.stats().peak_reserved_tokens)


def _at_zero(gateway: Any) -> bool:
    return all(k.ledger.stats().reserved_tokens == 0 for k in gateway.gateway.known)


@pytest.mark.llama_cpp
@pytest.mark.parametrize(("n_predict", "generated"), [(60, 60), (-1, None)])
def test_llama_cpps_n_predict_never_exceeds_the_reservation(
    llama: llama_engine.LlamaServer, n_predict: int, generated: int | None
) -> None:
    """llama.cpp obeys ``n_predict`` over ``max_tokens``: the reservation covers it, and what
    goes upstream is the reserved cap."""
    with running_gateway(GatewayConfig(upstreams=(llama.url,))) as gw:
        body = {"prompt": "Once", "max_tokens": 8, "n_predict": n_predict, "logit_bias": NO_EOS}
        answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: _at_zero(gw))
        peak = _peak(gw)
        largest = gw.gateway.window(gw.gateway.known)  # the most it can ever admit
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    reserved_cap = peak - usage["prompt_tokens"]
    assert usage["completion_tokens"] <= reserved_cap
    if generated is not None:
        assert usage["completion_tokens"] == generated
        assert reserved_cap >= generated
    else:  # until the context is full: reserved as an unset cap, the whole window
        assert peak >= largest


@pytest.mark.llama_cpp
@pytest.mark.parametrize("field", ["n", "n_cmpl"])
def test_several_sequences_are_admitted_and_priced_as_several(
    llama: llama_engine.LlamaServer, field: str
) -> None:
    """``n: 2`` (or llama.cpp's alias ``n_cmpl``) is two sequences, each with its own prompt in
    llama.cpp's slots: reserved as 2 x (prompt + cap)."""
    with running_gateway(GatewayConfig(upstreams=(llama.url,))) as gw:
        body = {"prompt": "Once upon", "max_tokens": 20, field: 2, "logit_bias": NO_EOS}
        answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: _at_zero(gw))
        peak = _peak(gw)
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    prompt = payload["usage"]["prompt_tokens"]
    assert peak >= 2 * (prompt + 20)
    for choice in payload["choices"]:
        assert len(choice["text"]) > 0


def _vllm_like(tokenized: list[dict[str, Any]], forwarded: list[dict[str, Any]]) -> Any:
    """An upstream that says it is vLLM and counts a request's own chat template."""

    async def models(request: Request) -> Response:
        entry = {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics(request: Request) -> Response:
        text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0\n'
        return Response(text)

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        tokenized.append(body)
        # A template that renders a long system prompt: 900 tokens, not 10.
        return JSONResponse({"count": 900 if "chat_template" in body else 10, "tokens": []})

    async def chat(request: Request) -> Response:
        forwarded.append(await request.json())
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    app = discoverable([Route("/v1/chat/completions", chat, methods=["POST"])])
    app.router.routes[:3] = [
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]
    return app


def test_a_requests_own_chat_template_is_counted_as_rendered() -> None:
    tokenized: list[dict[str, Any]] = []
    forwarded: list[dict[str, Any]] = []
    template = "{% for m in messages %}" + "x " * 2000 + "{{ m.content }}{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": template,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    with (
        scripted_upstream(_vllm_like(tokenized, forwarded)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/chat/completions", json=body)
        wait_for(lambda: _at_zero(gw))
    assert answer.status_code == 200, answer.text
    assert tokenized[-1]["chat_template"] == template
    assert tokenized[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert forwarded[-1]["max_tokens"] == 4096 - 900  # the rendered prompt's room, not 4086


@pytest.mark.parametrize("field", ["chat_template", "documents"])
def test_a_rendering_the_gateway_cannot_count_is_refused_by_name(field: str) -> None:
    tokenized: list[dict[str, Any]] = []
    forwarded: list[dict[str, Any]] = []
    body = {"messages": [{"role": "user", "content": "hi"}], field: "x"}
    # Counting locally, nothing can render the request's own template; vLLM's /tokenize takes
    # no documents.
    counter = TiktokenCounter() if field == "chat_template" else None
    with (
        scripted_upstream(_vllm_like(tokenized, forwarded)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), counter=counter)) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == field
    assert error["code"] == "uncountable_field"
    assert forwarded == []


def test_beam_search_is_refused_by_name() -> None:
    tokenized: list[dict[str, Any]] = []
    forwarded: list[dict[str, Any]] = []
    body = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}
    with (
        scripted_upstream(_vllm_like(tokenized, forwarded)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "use_beam_search"
    assert forwarded == []


def test_a_minimum_length_above_the_cap_is_lowered_to_it() -> None:
    from reference_server.gateway.rewrite import with_cap

    body = {"prompt": "x", "max_tokens": 900, "min_tokens": 900}
    sent = json.loads(with_cap(json.dumps(body).encode(), body, 500))
    assert (sent["max_tokens"], sent["min_tokens"]) == (500, 500)
    body = {"prompt": "x", "max_tokens": 500, "min_tokens": 20}
    raw = json.dumps(body).encode()
    assert with_cap(raw, body, 500) == raw  # already within: the client's bytes unchanged


# --- several sequences, as vLLM runs them -------------------------------------------------------


def _vllm_sequences(
    prefix_caching: bool,
    release: threading.Event | None = None,
    forwarded: list[dict[str, Any]] | None = None,
) -> Any:
    """An upstream that says it is vLLM (blocks of 16, its prefix cache on or off) and counts
    every prompt as 1,000 tokens; its answers (plain or streamed, completions or chats) wait
    for ``release`` when given; what it was sent goes to ``forwarded``."""
    caching = "True" if prefix_caching else "False"

    async def models(request: Request) -> Response:
        entry = {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics(request: Request) -> Response:
        return Response(
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024",'
            f'enable_prefix_caching="{caching}"}} 1.0\n'
        )

    async def tokenize(request: Request) -> Response:
        return JSONResponse({"count": 1000, "tokens": list(range(1000))})

    async def generate(request: Request) -> Response:
        body = await request.json()
        if forwarded is not None:
            forwarded.append(body)
        if body.get("stream") and body.get("prompt_logprobs"):
            message = "prompt_logprobs are not available when stream is enabled"
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        n = body.get("n", 1)
        usage = {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}
        if request.url.path.endswith("/chat/completions"):
            piece: dict[str, Any] = {"delta": {"role": "assistant", "content": "x"}}
            whole: dict[str, Any] = {"message": {"role": "assistant", "content": "x"}}
        else:
            piece = whole = {"text": "x"}
        if body.get("stream"):
            chunk = {"id": "c", "choices": [{"index": 0, **piece, "finish_reason": "stop"}]}
            events = [{**chunk, "usage": usage}, {"id": "c", "choices": [], "usage": usage}]

            async def stream() -> Any:  # the first token, then the rest once released
                yield f"data: {json.dumps(events[0])}\n\n"
                if release is not None:
                    await anyio.to_thread.run_sync(release.wait)
                yield f"data: {json.dumps(events[1])}\n\ndata: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        if release is not None:
            await anyio.to_thread.run_sync(release.wait)
        choices = [{"index": i, **whole, "finish_reason": "stop"} for i in range(n)]
        return JSONResponse({"id": "c", "choices": choices, "usage": usage})

    app = discoverable(
        [
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ]
    )
    app.router.routes[:3] = [
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]
    return app


@pytest.mark.parametrize(("prefix_caching", "reserved"), [(True, 1888), (False, 8832)])
def test_n_sequences_are_reserved_as_vllm_holds_its_children(
    prefix_caching: bool, reserved: int
) -> None:
    """vLLM runs ``n`` as ``n`` child requests: with its prefix cache on they share the prompt's
    full blocks (62 of 16 tokens) and each keeps its partial last block with its cap (7
    blocks); without it, each holds all of its 1,000 + 100 tokens (69 blocks). Counted once and
    rounded once it would be 1,808 either way."""
    body = {"prompt": "a long prompt", "max_tokens": 100, "n": 8}
    with (
        scripted_upstream(_vllm_sequences(prefix_caching)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), max_running=(8,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
        wait_for(lambda: _at_zero(gw))
        peak = _peak(gw)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 8
    assert peak == reserved


def test_each_of_n_sequences_takes_a_running_place() -> None:
    """``n: 6`` takes six of the eight places the engine runs (``--max-running``): a request of
    three more waits, one of two is admitted beside it; more sequences than the engine ever
    runs at once is a 400 naming ``n``."""
    release = threading.Event()
    with scripted_upstream(_vllm_sequences(True, release)) as up:
        config = GatewayConfig(upstreams=(up.base_url,), max_running=(8,), max_queue_wait=0.0)
        with running_gateway(config) as gw, httpx.Client(base_url=gw.base_url, timeout=30) as http:

            def send(n: int) -> httpx.Response:
                body = {"prompt": "p", "max_tokens": 10, "n": n}
                return http.post("/v1/completions", json=body)

            try:
                with ThreadPoolExecutor(2) as pool:
                    six = pool.submit(send, 6)
                    wait_for(lambda: bool(gw.gateway.known) and _running(gw) == 6)
                    assert send(3).status_code == 429  # 6 + 3 > 8: no room, no wait
                    two = pool.submit(send, 2)
                    wait_for(lambda: _running(gw) == 8)
                    release.set()
                    assert six.result().status_code == 200
                    assert two.result().status_code == 200
            finally:
                release.set()
            never = send(9)
    assert never.status_code == 400, never.text
    error = never.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_sequences", "n")


def _running(gateway: Any) -> int:
    """Sequences the gateway's holders run (a request of ``n`` counts ``n``)."""
    known = gateway.gateway.known
    return sum(h.sequences for k in known for h in k.ledger.live_handles())


# --- what keys and what steers the engine's prefix cache and its scheduling ------------------

_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _held_prefixes(bodies: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The prefix keys the gateway gave each of ``bodies``, all held at once (the engine
    answers once every one is in)."""
    release = threading.Event()
    with scripted_upstream(_vllm_sequences(True, release)) as up:
        config = GatewayConfig(upstreams=(up.base_url,), max_running=(8,))
        with running_gateway(config) as gw, ThreadPoolExecutor(len(bodies)) as pool:
            try:
                answers = []
                for body in bodies:  # one after another: the handles in the bodies' order
                    answers.append(
                        pool.submit(
                            httpx.post, gw.base_url + "/v1/chat/completions", json=body, timeout=30
                        )
                    )
                    count = len(answers)
                    wait_for(lambda: _live(gw) == count)  # noqa: B023
                [known] = gw.gateway.known
                prefixes = [h.prefix for h in known.ledger.live_handles()]
            finally:
                release.set()
            assert [a.result().status_code for a in answers] == [200] * len(bodies)
    return prefixes


def _live(gateway: Any) -> int:
    return sum(len(k.ledger.live_handles()) for k in gateway.gateway.known)


def _chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 10, **extra}


def test_prefix_keys_are_salted_with_the_requests_cache_salt() -> None:
    """vLLM mixes ``cache_salt`` into its prefix-cache keys: equal text with different salts,
    or one salted and one not, shares no block; the same salt does."""
    plain, a, again, b = _held_prefixes(
        [
            _chat("the same text"),
            _chat("the same text", cache_salt="a"),
            _chat("the same text", cache_salt="a"),
            _chat("the same text", cache_salt="b"),
        ]
    )
    assert len(plain) == 62  # 1,000 tokens in blocks of 16, the last one the engine's own
    assert a == again
    assert not set(plain) & set(a)
    assert not set(a) & set(b)


def test_a_prompt_with_an_image_lends_and_borrows_no_prefix_blocks() -> None:
    """The engine's token ids stand for an image by placeholders that are the same for any
    image: requests with equal text and different images must not look shared."""
    text = {"type": "text", "text": "describe it"}
    plain, first, second = _held_prefixes(
        [_chat([text]), _chat([text, _IMAGE]), _chat([text, {**_IMAGE, "image_url": {"url": "x"}}])]
    )
    assert len(plain) == 62
    assert (first, second) == ((), ())


def test_the_engines_scheduling_priority_is_taken_out() -> None:
    """vLLM's ``priority`` field would let any client make the engine preempt the requests
    admitted before it: it does not reach the engine."""
    forwarded: list[dict[str, Any]] = []
    with (
        scripted_upstream(_vllm_sequences(True, forwarded=forwarded)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), max_running=(8,))) as gw,
    ):
        answer = httpx.post(
            gw.base_url + "/v1/completions",
            json={"prompt": "p", "max_tokens": 5, "priority": -100},
            timeout=30,
        )
    assert answer.status_code == 200, answer.text
    assert "priority" not in forwarded[-1]
    assert forwarded[-1]["max_tokens"] == 5


def test_kv_transfer_params_are_refused_by_name() -> None:
    """Disaggregated prefill's ``kv_transfer_params`` has the engine take KV from elsewhere or
    keep a request's blocks after it ends: KV no reservation holds."""
    forwarded: list[dict[str, Any]] = []
    body = {"prompt": "p", "max_tokens": 5, "kv_transfer_params": {"do_remote_decode": True}}
    with (
        scripted_upstream(_vllm_sequences(True, forwarded=forwarded)) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), max_running=(8,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "kv_transfer_params"
    assert forwarded == []


def test_a_plain_request_vllm_refuses_as_a_stream_stays_plain_and_counts_whole() -> None:
    """vLLM refuses ``prompt_logprobs`` in a stream: such a plain request is not turned into a
    stream to follow its progress; it goes as asked and counts at its whole reservation."""
    release = threading.Event()
    forwarded: list[dict[str, Any]] = []
    body = _chat("hi", prompt_logprobs=1)
    with scripted_upstream(_vllm_sequences(True, release, forwarded)) as up:
        config = GatewayConfig(upstreams=(up.base_url,), max_running=(8,))
        with running_gateway(config) as gw, ThreadPoolExecutor(1) as pool:
            try:
                url = gw.base_url + "/v1/chat/completions"
                answer = pool.submit(httpx.post, url, json=body, timeout=30)
                wait_for(lambda: _live(gw) == 1)
                [handle] = gw.gateway.known[0].ledger.live_handles()
                tracked = handle.tracked
            finally:
                release.set()
            result = answer.result()
    assert result.status_code == 200, result.text
    assert result.json()["choices"][0]["message"]["content"] == "x"
    assert "stream" not in forwarded[-1]
    assert not tracked
