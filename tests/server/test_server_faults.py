"""Injected engine faults (``fault_rate``): a 500 ``injected_fault`` (an error event in a stream),
counted in ``kv_injected_faults_total``, the reservation given back; kvclient does not retry it."""

from __future__ import annotations

import gc
import json
import logging
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from kvclient import (
    APIResponseError,
    AsyncClient,
    AsyncStream,
    Client,
    InternalServerError,
    RetryPolicy,
    TiktokenCounter,
)
from reference_server import (
    EngineFaultError,
    ServerConfig,
    ServerState,
    SimulatedEngine,
    create_app,
    running_server,
)
from tests.helpers.servers import wait_for

COUNTER = TiktokenCounter()
FAST: dict[str, Any] = {
    "kv_tokens": 4096,
    "context_window": 2048,
    "decode_rate": 20_000.0,
    "mean_output_tokens": 100_000.0,  # every request runs to its cap: faults land mid-output
    "tick_seconds": 0.005,
}
INJECTED = {"message": "injected fault", "type": "server_error", "param": None}


def engine(**kw: Any) -> SimulatedEngine:
    settings: dict[str, Any] = {
        "tokenizer": COUNTER,
        "capacity_tokens": 100_000,
        "decode_rate": 50_000.0,
        "mean_output_tokens": 30.0,
        "tick_seconds": 0.001,
        **kw,
    }
    return SimulatedEngine(**settings)


def faulty_app(**overrides: Any) -> Any:
    return create_app(ServerConfig(**{**FAST, "fault_rate": 1.0, **overrides}))


def state_of(app: Any) -> ServerState:
    state: ServerState = app.state.server
    return state


def assert_released_soon(state: ServerState) -> None:
    """:func:`assert_released` for a server in another thread: a client can see an answer end
    (a fault event, a cut connection) a moment before the server's ``finally`` has run."""
    wait_for(lambda: state.ledger.stats().inflight == 0 and state.engine.stats().running == 0)
    assert_released(state)


def assert_released(state: ServerState) -> None:
    ledger = state.ledger.stats()
    assert ledger.reserved_tokens == 0
    assert ledger.inflight == 0
    assert ledger.admitted_total == ledger.released_total
    stats = state.engine.stats()
    assert stats.running == 0
    assert stats.used_tokens == 0


@asynccontextmanager
async def http_for(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def sse_payloads(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), float("inf")])
def test_fault_rate_outside_0_1_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="fault_rate"):
        ServerConfig(fault_rate=rate)
    with pytest.raises(ValueError, match="fault_rate"):
        engine(fault_rate=rate)


def test_cli_option_sets_the_fault_rate() -> None:
    from reference_server.simulated.cli import build_parser, config_from_args

    parser = build_parser()
    assert "--fault-rate" in parser.format_help()
    assert config_from_args(parser.parse_args([])).fault_rate == 0.0
    assert config_from_args(parser.parse_args(["--fault-rate", "0.02"])).fault_rate == 0.02


# --- the engine --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_fault_rate_one_fails_every_sequence_at_a_token_before_its_end() -> None:
    eng = engine(fault_rate=1.0, mean_output_tokens=100_000.0)
    for cap in (1, 5, 40, 200):
        delivered: list[str] = []

        async def on_text(text: str, generated: int, into: list[str] = delivered) -> None:
            into.append(text)

        with pytest.raises(EngineFaultError) as info:
            await eng.generate(10, cap, on_text)
        generated = info.value.generated_tokens
        assert 0 <= generated < cap
        assert COUNTER.count("".join(delivered)) == generated  # what was streamed, no more
        assert str(info.value) == f"injected fault after {generated} generated tokens"
    stats = eng.stats()
    assert stats.faults_total == 4
    assert stats.finished_total == 0
    assert stats.running == 0
    assert stats.used_tokens == 0


@pytest.mark.anyio
async def test_no_faults_by_default() -> None:
    eng = engine()
    for _ in range(50):
        await eng.generate(5, 50)
    assert eng.stats().faults_total == 0
    assert eng.stats().finished_total == 50


@pytest.mark.anyio
async def test_faults_are_seeded_and_change_no_other_output() -> None:
    """Same seed: the same sequences fail; those that do not fail say exactly what they would
    have said without faults (faults draw from their own generator)."""

    async def run(rate: float, seed: int) -> list[str | None]:
        eng = engine(fault_rate=rate, seed=seed)
        texts: list[str | None] = []
        for _ in range(60):
            try:
                texts.append((await eng.generate(5, 80)).text)
            except EngineFaultError:
                texts.append(None)
        assert eng.stats().faults_total == texts.count(None)
        return texts

    clean = await run(0.0, seed=11)
    faulty = await run(0.3, seed=11)
    assert faulty == await run(0.3, seed=11)
    assert 5 <= faulty.count(None) <= 35
    assert all(f is None or f == c for f, c in zip(faulty, clean, strict=True))
    assert faulty != await run(0.3, seed=12)


# --- the app -----------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 50}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"prompt": "hi", "max_tokens": 50}),
    ],
)
async def test_a_fault_is_a_500_injected_fault_and_the_reservation_comes_back(
    path: str, body: dict[str, Any]
) -> None:
    app = faulty_app()
    state = state_of(app)
    async with http_for(app) as http:
        response = await http.post(path, json=body)
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 500
    assert response.json() == {"error": {**INJECTED, "code": "injected_fault"}}
    assert "\nkv_injected_faults_total 1.0" in metrics
    assert state.snapshot()["kv_injected_faults_total"] == 1
    assert state.responses() == {(path, 500): 1, ("/metrics", 200): 1}
    assert_released(state)


@pytest.mark.anyio
@pytest.mark.parametrize("chat", [False, True])
async def test_a_fault_mid_stream_is_an_error_event_without_done(chat: bool) -> None:
    app = faulty_app()
    state = state_of(app)
    body: dict[str, Any] = {"max_tokens": 300, "stream": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    else:
        path, body["prompt"] = "/v1/completions", "hi"
    async with http_for(app) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 200  # the headers went before the fault
    payloads = sse_payloads(response.text)
    assert "[DONE]" not in payloads
    assert payloads[-1] == {"error": {**INJECTED, "code": "injected_fault"}}
    for payload in payloads[:-1]:
        assert payload["choices"][0]["finish_reason"] is None
    assert state.engine.stats().faults_total == 1
    assert_released(state)


@pytest.mark.anyio
async def test_faulted_and_healthy_requests_side_by_side_all_release() -> None:
    app = faulty_app(fault_rate=0.5, seed=3)
    state = state_of(app)
    statuses: list[int] = []
    async with http_for(app) as http:
        for i in range(30):
            response = await http.post(
                "/v1/completions", json={"prompt": "go", "max_tokens": 20, "stream": i % 2 == 0}
            )
            statuses.append(response.status_code)
    faults = state.engine.stats().faults_total
    assert 5 <= faults <= 25
    assert statuses.count(500) == sum(1 for s in statuses[1::2] if s == 500)  # non-streams only
    assert state.ledger.stats().admitted_total == 30
    assert_released(state)


# --- kvclient's view -----------------------------------------------------------------------------


def kvclient_for(app: Any) -> AsyncClient:
    return AsyncClient(
        base_url="http://testserver",
        model="kvclient-sim",
        context_window=2048,
        transport=httpx.ASGITransport(app=app),
        retry=RetryPolicy(max_attempts=5),
    )


@pytest.mark.anyio
async def test_kvclient_raises_internal_server_error_and_does_not_retry() -> None:
    app = faulty_app()
    state = state_of(app)
    async with kvclient_for(app) as client:
        with pytest.raises(InternalServerError) as info:
            await client.complete("hi", max_tokens=40)
    assert info.value.status_code == 500
    assert info.value.code == "injected_fault"
    assert info.value.retryable is False
    assert info.value.attempts == 1
    assert state.ledger.stats().admitted_total == 1  # one request: nothing retried
    assert_released(state)


async def read_to_the_end(stream: AsyncStream) -> None:
    async with stream:
        async for _ in stream:
            pass


def unfinished_generators(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, ResourceWarning) and "garbage collected" in str(w.message)
    ]


@pytest.mark.anyio
async def test_kvclient_stream_error_event_is_an_api_response_error_and_leaks_nothing() -> None:
    # On trio this once left httpx's line and text generators unfinished (trio warns when it
    # collects them): the stream now finishes the whole generator chain under it.
    app = faulty_app()
    state = state_of(app)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with kvclient_for(app) as client:
            for stream in (
                client.complete_stream("hi", max_tokens=300),
                client.chat_stream([{"role": "user", "content": "hi"}], max_tokens=300),
            ):
                with pytest.raises(APIResponseError, match="injected fault"):
                    await read_to_the_end(stream)
        gc.collect()
    assert state.ledger.stats().admitted_total == 2  # nothing retried
    assert_released(state)
    assert unfinished_generators(caught) == []


def test_sync_client_against_the_real_server() -> None:
    with (
        running_server(**FAST, fault_rate=1.0) as server,
        Client(base_url=server.base_url, retry=RetryPolicy(max_attempts=5)) as client,
    ):
        with pytest.raises(InternalServerError) as info:
            client.chat([{"role": "user", "content": "hi"}], max_tokens=30)
        assert info.value.code == "injected_fault"
        assert info.value.attempts == 1
        with (
            pytest.raises(APIResponseError, match="injected fault"),
            client.chat_stream([{"role": "user", "content": "hi"}], max_tokens=300) as stream,
        ):
            for _ in stream:
                pass
        assert server.metrics()["kv_injected_faults_total"] == 2
        assert server.ledger.stats().admitted_total == 2
        assert_released_soon(server.state)


# --- unexpected errors: generic 500, the type logged, nothing re-raised to uvicorn ---------------


def test_an_unexpected_error_is_logged_by_type_only_and_cuts_a_started_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "the-prompt-says-swordfish"

    async def broken(
        prompt_tokens: int, max_tokens: int, on_text: Any = None, **options: Any
    ) -> None:
        if on_text is not None:
            await on_text(" partial", 1)
        raise RuntimeError(f"engine choked on {secret}")

    with running_server(**FAST) as server, httpx.Client(base_url=server.base_url) as http:
        monkeypatch.setattr(server.engine, "generate", broken)
        with caplog.at_level(logging.DEBUG):
            response = http.post("/v1/completions", json={"prompt": secret, "max_tokens": 5})
            assert response.status_code == 500
            assert response.json()["error"]["code"] == "internal_error"
            body = {"prompt": secret, "max_tokens": 5, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):
                    stream.read()  # the connection closes before the end of the body
        assert secret not in response.text
        assert_released_soon(server.state)
        assert server.state.responses()[("/v1/completions", 500)] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "unexpected RuntimeError while serving /v1/completions" in errors
    assert all(secret not in r.getMessage() and not r.exc_info for r in caplog.records)
