"""The ASGI app in-process (httpx.ASGITransport), on asyncio and trio."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from kvclient import TiktokenCounter
from kvclient.headers import parse_ratelimit
from reference_server import ServerConfig, ServerState, create_app

pytestmark = pytest.mark.anyio

COUNTER = TiktokenCounter()
FAST: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 2048,
    "decode_rate": 20_000.0,
    "mean_output_tokens": 50.0,
    "tick_seconds": 0.005,
}


def app_with(**overrides: Any) -> Starlette:
    return create_app(ServerConfig(**{**FAST, **overrides}))


def state_of(app: Starlette) -> ServerState:
    state: ServerState = app.state.server
    return state


@asynccontextmanager
async def client_for(app: Starlette, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, **kw)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


def assert_ledger_at_zero(app: Starlette) -> None:
    state = state_of(app)
    stats = state.ledger.stats()
    assert stats.reserved_tokens == 0
    assert stats.inflight == 0
    assert stats.admitted_total == stats.released_total
    assert state.engine.stats().running == 0
    assert state.engine.stats().used_tokens == 0
    assert state.queue.waiting == 0


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "code"} <= set(error)
    return error


async def post_json(client: httpx.AsyncClient, path: str, payload: Any) -> httpx.Response:
    return await client.post(path, json=payload)


async def wait_until(predicate: Any) -> None:
    """Poll server state (it has no event to wait on), for at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - polling state another task owns
            await anyio.sleep(0.002)


# --- the small endpoints ---------------------------------------------------------------------


async def test_models_lists_the_model_with_max_model_len() -> None:
    async with client_for(app_with()) as client:
        body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "kvclient-sim"
    assert body["data"][0]["max_model_len"] == 2048


async def test_models_carries_the_room_left_as_ratelimit_headers() -> None:
    # A client reads /v1/models before its first request: the room there paces its first burst.
    app = app_with()
    ledger = state_of(app).ledger
    async with client_for(app) as client:
        empty = parse_ratelimit((await client.get("/v1/models")).headers)
        handle = ledger.try_admit(100, 900, now=time.monotonic())
        assert handle is not None
        held = parse_ratelimit((await client.get("/v1/models")).headers)
        ledger.release(handle)
    assert empty is not None
    assert held is not None
    assert empty.quota == ledger.usable_tokens
    assert empty.remaining == ledger.usable_tokens
    assert held.remaining == ledger.usable_tokens - ledger.need_tokens(100, 900)
    assert held.reset is not None
    assert held.reset > 0


async def test_models_carries_no_room_where_admission_is_not_by_reservation() -> None:
    async with client_for(app_with(admission="prompt")) as client:
        answer = await client.get("/v1/models")
    assert answer.status_code == 200
    assert parse_ratelimit(answer.headers) is None


async def test_tokenize_answers_like_vllm() -> None:
    async with client_for(app_with()) as client:
        body = (await client.post("/tokenize", json={"prompt": "hello world, again"})).json()
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat = (await client.post("/tokenize", json={"messages": messages})).json()
    assert body == {
        "count": COUNTER.count("hello world, again"),
        "max_model_len": 2048,
        "tokens": COUNTER.encode("hello world, again"),
    }
    assert chat["count"] == COUNTER.count_messages(messages)


async def test_health_and_metrics() -> None:
    async with client_for(app_with()) as client:
        assert (await client.get("/health")).json()["status"] == "ok"
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "kv_reserved_tokens",
        "kv_reserved_bytes",
        "kv_used_tokens",
        "kv_inflight_requests",
        "kv_admitted_total",
        "kv_rejected_total",
        "kv_oom_events_total",
        "kv_usable_tokens",
        "kv_physical_capacity_tokens",
        "kv_peak_reserved_tokens",
        "kv_peak_used_tokens",
    ):
        assert f"\n{name} " in text, name
    assert "\nkv_admitted_total 1.0" in text
    assert "\nkv_usable_tokens 3686.0" in text


async def test_two_apps_keep_separate_metrics() -> None:
    first, second = app_with(), app_with()
    async with client_for(first) as client:
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    async with client_for(second) as client:
        text = (await client.get("/metrics")).text
    assert "\nkv_admitted_total 0.0" in text


# --- generation ----------------------------------------------------------------------------------


async def test_completion_usage_agrees_with_tokenize_and_the_client_count() -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    async with client_for(app_with()) as client:
        response = await client.post(
            "/v1/completions", json={"model": "kvclient-sim", "prompt": prompt, "max_tokens": 30}
        )
        counted = (await client.post("/tokenize", json={"prompt": prompt})).json()["count"]
    body = response.json()
    assert response.status_code == 200
    assert body["object"] == "text_completion"
    usage = body["usage"]
    assert usage["prompt_tokens"] == counted == COUNTER.count(prompt)
    text = body["choices"][0]["text"]
    assert usage["completion_tokens"] == COUNTER.count(text) <= 30
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_chat_counts_the_prompt_with_the_chat_formula() -> None:
    messages = [{"role": "user", "content": "Say something.", "name": "ann"}]
    app = app_with()
    async with client_for(app) as client:
        response = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 8}
        )
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == COUNTER.count_messages(messages)
    assert body["usage"]["completion_tokens"] <= 8
    assert_ledger_at_zero(app)


async def test_finish_reasons_stop_and_length() -> None:
    async with client_for(app_with(mean_output_tokens=5.0)) as client:
        short = (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1000})
        ).json()
    async with client_for(app_with(mean_output_tokens=100_000.0)) as client:
        long = (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10})).json()
    assert short["choices"][0]["finish_reason"] == "stop"
    assert long["choices"][0]["finish_reason"] == "length"
    assert long["usage"]["completion_tokens"] == 10


async def test_ignore_eos_and_min_tokens_as_vllm_reads_them() -> None:
    async with client_for(app_with(mean_output_tokens=5.0)) as client:
        ignored = await client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 300, "ignore_eos": True}
        )
        held = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "a"}],
                "max_tokens": 300,
                "min_tokens": 120,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert ignored.json()["usage"]["completion_tokens"] == 300
    assert ignored.json()["choices"][0]["finish_reason"] == "length"
    usage = json.loads(sse_events(held.text)[-2])["usage"]
    assert usage["completion_tokens"] >= 120


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1"),
        ({"min_tokens": 11}, "min_tokens must be less than or equal to max_tokens=10, got 11"),
    ],
)
async def test_bad_ignore_eos_and_min_tokens_are_400(fields: dict[str, Any], needle: str) -> None:
    app = app_with()
    async with client_for(app) as client:
        answer = await client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 10, **fields}
        )
    assert answer.status_code == 400
    assert needle in error_of(answer)["message"]
    assert_ledger_at_zero(app)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def test_chat_streaming_ends_with_done_and_reports_usage() -> None:
    app = app_with(mean_output_tokens=100_000.0, decode_rate=5000.0)
    payload = {
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client_for(app) as client:
        response = await client.post("/v1/chat/completions", json=payload)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40 == COUNTER.count(text)
    assert_ledger_at_zero(app)


async def test_completions_streaming() -> None:
    app = app_with()
    async with client_for(app) as client:
        response = await client.post(
            "/v1/completions", json={"prompt": "go", "max_tokens": 20, "stream": True}
        )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert_ledger_at_zero(app)


async def test_seed_generate_endpoint() -> None:
    async with client_for(app_with()) as client:
        body = (await client.post("/generate", json={"prompt": "hello", "max_tokens": 12})).json()
    assert body["prompt_tokens"] == COUNTER.count("hello")
    assert 1 <= body["completion_tokens"] <= 12
    assert body["finish_reason"] in ("stop", "length")


async def test_unset_max_tokens_reserves_up_to_the_context() -> None:
    app = app_with(mean_output_tokens=100_000.0, decode_rate=2000.0)
    state = state_of(app)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(post_json, client, "/v1/completions", {"prompt": "hi"})
        await wait_until(lambda: state.ledger.stats().inflight == 1)
        # 1 prompt token + (2048 - 1) output: the whole context, in blocks of 16.
        assert state.ledger.stats().reserved_tokens == 2048
        group.cancel_scope.cancel()


async def test_huge_max_tokens_is_clamped_not_refused() -> None:
    async with client_for(app_with()) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**30})
    assert response.status_code == 200


# --- errors ------------------------------------------------------------------------------------


async def test_prompt_over_the_context_is_413_with_the_numbers() -> None:
    app = app_with()
    prompt = "word " * 3000
    async with client_for(app) as client:
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"]
    assert str(COUNTER.count(prompt)) in error["message"]
    assert state_of(app).ledger.stats().admitted_total == 0


async def test_a_request_that_could_never_fit_is_not_a_429() -> None:
    app = app_with(kv_tokens=1000, context_window=2048)  # usable 900
    async with client_for(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1500})
        fitting = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 800})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "kv_budget_exceeded"
    assert "max_tokens <= 895" in error["message"]
    assert "retry-after" not in response.headers
    assert fitting.status_code == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
        (b'"just a string"', "JSON object"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1"),
        (b'{"prompt": "x", "max_tokens": -5}', "max_tokens must be at least 1"),
        (b'{"prompt": "x", "max_tokens": "10"}', "max_tokens must be an integer"),
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens must be an integer"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens must be an integer"),
        (b'{"prompt": "x", "stream": "yes"}', "stream must be a boolean"),
        (b'{"prompt": 42}', "prompt must be"),
        (b'{"prompt": ["a", "b"]}', "one prompt"),
        (b'{"max_tokens": 5}', "prompt is required"),
        (b'{"prompt": "x", "n": 3}', "n must be 1"),
        (b'{"prompt": "x", "model": 7}', "model must be a string"),
        (b'{"prompt": "x", "max_tokens": NaN}', "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
async def test_bad_input_is_400_with_a_clear_message(body: bytes, needle: str) -> None:
    app = app_with()
    async with client_for(app) as client:
        response = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert needle in error_of(response)["message"]
    assert_ledger_at_zero(app)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({}, "messages is required"),
        ({"messages": []}, "non-empty"),
        ({"messages": "hi"}, "non-empty"),
        ({"messages": [1]}, "must be an object"),
        ({"messages": [{"content": "x"}]}, "role must be a string"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "at least"),
    ],
)
async def test_bad_chat_input_is_400(payload: dict[str, Any], needle: str) -> None:
    async with client_for(app_with()) as client:
        response = await client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 400
    assert needle in error_of(response)["message"]


async def test_unknown_fields_are_ignored() -> None:
    async with client_for(app_with()) as client:
        response = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 3, "temperature": 0.2, "frobnicate": {"a": [1]}},
        )
    assert response.status_code == 200


async def test_wrong_content_type_is_415() -> None:
    async with client_for(app_with()) as client:
        response = await client.post(
            "/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"}
        )
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"


async def test_oversized_body_is_413_json() -> None:
    app = app_with(max_body_bytes=10_000)
    async with client_for(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x" * 20_000})
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    assert_ledger_at_zero(app)


async def test_unknown_route_and_wrong_method_are_json() -> None:
    async with client_for(app_with()) as client:
        missing = await client.get("/v2/nothing")
        wrong = await client.get("/v1/completions")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found"
    assert wrong.status_code == 405
    assert error_of(wrong)["code"] == "method_not_allowed"


async def test_api_key_is_required_when_set() -> None:
    app = app_with(api_key="s3cret")
    async with client_for(app) as client:
        missing = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        odd = await client.get("/v1/models", headers={"Authorization": "Bearer s3crét".encode()})
        good = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        alt = await client.get("/v1/models", headers={"api-key": "s3cret"})
        health = await client.get("/health")
    assert missing.status_code == wrong.status_code == odd.status_code == 401
    assert error_of(missing)["code"] == "invalid_api_key"
    assert good.status_code == alt.status_code == health.status_code == 200
    assert state_of(app).ledger.stats().admitted_total == 0


async def test_a_non_ascii_api_key_works() -> None:
    app = app_with(api_key="clé-ü")
    async with client_for(app) as client:
        good = await client.get("/v1/models", headers={"Authorization": "Bearer clé-ü".encode()})
        latin = await client.get(
            "/v1/models", headers={"Authorization": "Bearer clé-ü".encode("latin-1")}
        )
    assert good.status_code == 200
    assert latin.status_code == 401


# --- back-pressure -------------------------------------------------------------------------------


async def test_saturation_answers_429_with_retry_after_from_the_ledger() -> None:
    # usable 3686; a 2000-token reservation leaves no room for another.
    app = app_with(decode_rate=1000.0, mean_output_tokens=100_000.0)
    state = state_of(app)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(post_json, client, "/v1/completions", {"prompt": "a", "max_tokens": 1999})
        await wait_until(lambda: state.ledger.stats().inflight == 1)
        response = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 1999})
        group.cancel_scope.cancel()
    assert response.status_code == 429
    error = error_of(response)
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "rate_limit_error"
    # The holder is due ~2 s after admission (1999 tokens at 1000/s).
    millis = int(response.headers["retry-after-ms"])
    assert 1500 <= millis <= 2100
    assert int(response.headers["retry-after"]) == -(-millis // 1000)  # whole seconds, rounded up
    assert state.ledger.stats().rejected_total == 1
    assert_ledger_at_zero(app)


async def test_retry_after_is_at_least_one_second() -> None:
    app = app_with(decode_rate=20_000.0, mean_output_tokens=100_000.0)
    state = state_of(app)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(post_json, client, "/v1/completions", {"prompt": "a", "max_tokens": 2000})
        await wait_until(lambda: state.ledger.stats().inflight == 1)
        response = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2000})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert 1 <= int(response.headers["retry-after-ms"]) <= 1000


async def test_queue_wait_admits_in_arrival_order_without_starving_large_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # usable 3686. A holds 1008; B needs 3008 and queues; C needs 112 and would fit beside A,
    # but arrived after B, so it waits behind B.
    app = app_with(
        context_window=4096, decode_rate=8000.0, mean_output_tokens=100_000.0, max_queue_wait=5.0
    )
    state = state_of(app)
    admitted: list[int] = []
    real_try_admit = state.ledger.try_admit

    def recording_try_admit(prompt_tokens: int, output_cap: int, **kw: Any) -> Any:
        handle = real_try_admit(prompt_tokens, output_cap, **kw)
        if handle is not None:
            admitted.append(output_cap)
        return handle

    monkeypatch.setattr(state.ledger, "try_admit", recording_try_admit)

    async def post(max_tokens: int) -> None:
        response = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": max_tokens}
        )
        assert response.status_code == 200, response.text

    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(post, 1000)
        await wait_until(lambda: state.ledger.stats().inflight == 1)
        group.start_soon(post, 3000)
        await wait_until(lambda: state.queue.waiting == 1)
        group.start_soon(post, 100)
        await wait_until(lambda: state.queue.waiting == 2)
        assert state.ledger.stats().inflight == 1  # the small one did not jump the queue
    assert admitted == [1000, 3000, 100]
    assert state.ledger.stats().rejected_total == 0
    assert_ledger_at_zero(app)


async def test_queue_wait_times_out_with_429() -> None:
    app = app_with(decode_rate=1000.0, mean_output_tokens=100_000.0, max_queue_wait=0.1)
    state = state_of(app)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(post_json, client, "/v1/completions", {"prompt": "a", "max_tokens": 3000})
        await wait_until(lambda: state.ledger.stats().inflight == 1)
        start = anyio.current_time()
        response = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 3000})
        waited = anyio.current_time() - start
        group.cancel_scope.cancel()
    assert response.status_code == 429
    assert waited >= 0.09
    assert int(response.headers["retry-after"]) >= 1
    assert state.ledger.stats().rejected_total == 1
    assert_ledger_at_zero(app)


# --- OOM ---------------------------------------------------------------------------------


async def test_prompt_mode_ooms_mid_decode_and_reports_kv_cache_oom() -> None:
    app = app_with(
        admission="prompt", kv_tokens=1024, decode_rate=4000.0, mean_output_tokens=100_000.0
    )
    responses: list[httpx.Response] = []

    async def post() -> None:
        responses.append(
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500})
        )

    async with client_for(app) as client, anyio.create_task_group() as group:
        for _ in range(6):
            group.start_soon(post)
    statuses = sorted(r.status_code for r in responses)
    assert 500 in statuses
    failed = [r for r in responses if r.status_code == 500]
    assert {(error_of(r)["type"], error_of(r)["code"]) for r in failed} == {
        ("server_error", "kv_cache_oom")
    }
    assert state_of(app).engine.stats().oom_events_total >= 1
    assert_ledger_at_zero(app)


async def test_oom_mid_stream_sends_an_error_event() -> None:
    app = app_with(
        admission="prompt", kv_tokens=512, decode_rate=4000.0, mean_output_tokens=100_000.0
    )
    texts: list[str] = []

    async def post() -> None:
        response = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 400, "stream": True}
        )
        texts.append(response.text)

    async with client_for(app) as client, anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(post)
    errors = [
        json.loads(e)["error"]
        for t in texts
        for e in sse_events(t)
        if e != "[DONE]" and "error" in json.loads(e)
    ]
    assert errors
    assert all(e["code"] == "kv_cache_oom" for e in errors)
    assert_ledger_at_zero(app)


# --- release on every path ---------------------------------------------------------------------


async def test_ledger_back_to_zero_after_successes_and_errors() -> None:
    app = app_with()
    async with client_for(app) as client:
        for _ in range(3):
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10})
            await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
            )
            await client.post("/v1/completions", content=b"{")
            await client.post("/v1/completions", json={"prompt": "w " * 3000})
    assert state_of(app).ledger.stats().admitted_total == 6
    assert_ledger_at_zero(app)


async def test_cancelled_request_releases_its_reservation() -> None:
    app = app_with(decode_rate=1000.0, mean_output_tokens=100_000.0)
    state = state_of(app)
    async with client_for(app) as client:
        with anyio.move_on_after(0.1):
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1500})
    assert state.ledger.stats().admitted_total == 1
    assert_ledger_at_zero(app)


async def test_unexpected_exception_is_a_generic_500_and_still_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = app_with()
    state = state_of(app)

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("internal detail: prompt was top secret")

    monkeypatch.setattr(state.engine, "generate", broken)
    async with client_for(app, raise_app_exceptions=False) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert response.status_code == 500
    error = error_of(response)
    assert error["code"] == "internal_error"
    assert "secret" not in response.text
    assert "Traceback" not in response.text
    assert_ledger_at_zero(app)


def _scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }


class _Peer:
    """The ASGI server's side, by hand: ``receive()`` gives the body once, then waits until
    ``gone`` is set and answers ``http.disconnect``. With ``disconnect_after_response`` the
    end of the response sets ``gone`` (as uvicorn does); without it only the test does."""

    def __init__(self, body: bytes, *, disconnect_after_response: bool) -> None:
        self.body = body
        self.disconnect_after_response = disconnect_after_response
        self.sent: list[dict[str, Any]] = []
        self.gone = anyio.Event()
        self.responded = False
        self._delivered = False

    async def receive(self) -> dict[str, Any]:
        if not self._delivered:
            self._delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.responded = True
            if self.disconnect_after_response:
                self.gone.set()


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_releases_the_reservation(stream: bool) -> None:
    """Drive the ASGI app by hand: the client goes away after the first streamed chunk."""
    app = app_with(decode_rate=2000.0, mean_output_tokens=100_000.0)
    state = state_of(app)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1500, "stream": stream}
    ).encode()
    peer = _Peer(body, disconnect_after_response=True)

    async def hang_up() -> None:
        if stream:
            await wait_until(lambda: len(peer.sent) >= 3)  # start, role chunk, some text
        else:
            await wait_until(lambda: state.engine.stats().generated_tokens_total > 0)
        assert state.ledger.stats().inflight == 1
        peer.gone.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(hang_up)
            await app(_scope("/v1/chat/completions", body), peer.receive, peer.send)
    assert not any(m.get("body", b"").endswith(b"[DONE]\n\n") for m in peer.sent)
    assert not peer.responded
    assert state.engine.stats().finished_total == 0
    assert_ledger_at_zero(app)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("wakes_receive", [True, False])
async def test_request_ends_after_its_response_whatever_receive_does(
    stream: bool, wakes_receive: bool
) -> None:
    """ASGI says receive() answers http.disconnect once the response is sent; the endpoint's
    disconnect watcher relies on it to end by itself, and must not hang on a server that leaves
    a pending receive() waiting (``wakes_receive=False``)."""
    app = app_with()
    body = json.dumps({"prompt": "hi", "max_tokens": 5, "stream": stream}).encode()
    peer = _Peer(body, disconnect_after_response=wakes_receive)
    with anyio.fail_after(10):
        await app(_scope("/v1/completions", body), peer.receive, peer.send)
    assert peer.sent[0]["status"] == 200
    assert peer.responded
    if stream:
        assert peer.sent[-1]["body"] == b"data: [DONE]\n\n"
    else:
        assert json.loads(peer.sent[-1]["body"])["usage"]["completion_tokens"] >= 1
    assert_ledger_at_zero(app)


async def test_concurrency_mode_ooms_under_short_prompt_large_cap_traffic() -> None:
    app = app_with(
        admission="concurrency",
        max_concurrency=8,
        kv_tokens=1024,
        decode_rate=4000.0,
        mean_output_tokens=100_000.0,
    )
    statuses: list[int] = []

    async def post() -> None:
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500})
        statuses.append(response.status_code)

    async with client_for(app) as client, anyio.create_task_group() as group:
        for _ in range(6):
            group.start_soon(post)
    assert 500 in statuses
    assert state_of(app).engine.stats().oom_events_total >= 1
    assert_ledger_at_zero(app)


async def _drive_and_hang_up(app: Starlette, path: str, body: bytes, after: float) -> None:
    """Raw ASGI: send the request, then disconnect ``after`` seconds later."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep(after)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(_scope(path, body), receive, send)


_ACTIONS = st.tuples(
    st.sampled_from(["ok", "chat", "stream", "cancel", "disconnect", "bad", "too_long"]),
    st.integers(1, 1500),
    st.floats(0.0, 0.03),
)


@settings(max_examples=50, deadline=None)
@given(
    actions=st.lists(_ACTIONS, min_size=1, max_size=8),
    admission=st.sampled_from(["reserve", "prompt"]),
    backend=st.sampled_from(["asyncio", "trio"]),
    queue_wait=st.sampled_from([0.0, 0.05]),
)
def test_random_request_mixes_leave_the_ledger_at_zero(
    actions: list[tuple[str, int, float]], admission: str, backend: str, queue_wait: float
) -> None:
    """Random concurrent mixes of successes, streams, cancellations, disconnects, bad input and
    (in prompt mode) OOMs: whatever happens, every reservation and every block comes back."""
    app = app_with(
        admission=admission,
        kv_tokens=2048,
        context_window=1024,
        decode_rate=20_000.0,
        mean_output_tokens=300.0,
        max_queue_wait=queue_wait,
    )

    async def one(client: httpx.AsyncClient, kind: str, cap: int, delay: float) -> None:
        completion = {"prompt": "go", "max_tokens": cap}
        chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": cap}
        if kind == "ok":
            response = await client.post("/v1/completions", json=completion)
        elif kind == "chat":
            response = await client.post("/v1/chat/completions", json=chat)
        elif kind == "stream":
            response = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        elif kind == "cancel":
            with anyio.move_on_after(delay):
                await client.post("/v1/completions", json=completion)
            return
        elif kind == "disconnect":
            body = json.dumps({**chat, "stream": cap % 2 == 0}).encode()
            await _drive_and_hang_up(app, "/v1/chat/completions", body, delay)
            return
        elif kind == "bad":
            response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        else:
            response = await client.post("/v1/completions", json={"prompt": "w " * 2000})
        assert response.status_code in (200, 400, 413, 429, 500)
        if response.status_code == 500:
            assert error_of(response)["code"] == "kv_cache_oom"

    async def main() -> None:
        async with client_for(app) as client, anyio.create_task_group() as group:
            for kind, cap, delay in actions:
                group.start_soon(one, client, kind, cap, delay)

    anyio.run(main, backend=backend)
    assert_ledger_at_zero(app)
    if admission == "reserve":
        assert state_of(app).engine.stats().oom_events_total == 0
