"""``kvclient gateway`` in front of real servers on loopback ports: the reference server (in the
admission modes that OOM), a real llama.cpp engine with a unified KV cache, and scripted
upstreams for the failure paths."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import llama_engine
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvclient import AsyncClient, Client, Completion, KVClientError, RetryPolicy
from kvclient.contract import CheckStatus, run_contract
from kvclient.headers import parse_ratelimit
from kvclient.routing import Endpoint, Health, ranked
from reference_server import RunningServer, running_server, serve_in_thread
from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.testing import running_gateway
from tests.helpers.servers import at_zero, bench_summary_run, wait_for
from tests.helpers.upstreams import discoverable, scripted_upstream

FAST = {"decode_rate": 4000.0, "tick_seconds": 0.005}
NO_EOS = {"128009": -100, "128001": -100}  # the tiny model's end tokens: run to the cap


def gateway_state(gateway: RunningServer) -> GatewayState:
    state: GatewayState = gateway.app.state.gateway
    return state


def gateway_at_zero(gateway: RunningServer) -> bool:
    return all(
        u.known is None or u.known.ledger.stats().reserved_tokens == 0
        for u in gateway_state(gateway).upstreams
    )


# --- the pure rules --------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.integers(-5, 5000)), st.integers(0, 9), st.booleans()),
        max_size=6,
    ),
    st.integers(0, 5000),
)
def test_routing_picks_a_fitting_endpoint_with_the_most_room(
    views: list[tuple[int | None, int, bool]], need: int
) -> None:
    endpoints = [Endpoint(free, flight, ok) for free, flight, ok in views]
    order = ranked(endpoints, need)
    picked = order[0] if order else None
    fitting = [
        i for i, e in enumerate(endpoints) if e.in_service and (e.free is None or e.free >= need)
    ]
    if not fitting:
        assert picked is None
        return
    assert picked in fitting
    best = endpoints[picked]
    for i in fitting:
        other = endpoints[i]
        if best.free is not None and other.free is None:
            raise AssertionError("an unknown budget ranks as the most room")
        if best.free is not None and other.free is not None:
            assert best.free >= other.free
    assert sorted(ranked(endpoints, need)) == fitting


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    fields=st.dictionaries(st.sampled_from(["prompt", "model", "stream", "n", "x"]), _JSON),
    given_cap=st.one_of(st.none(), st.integers(1, 50)),
    cap=st.integers(1, 50),
    indent=st.sampled_from([None, 2]),
)
def test_the_forwarded_body_is_the_clients_with_the_reserved_cap(
    fields: dict[str, Any], given_cap: int | None, cap: int, indent: int | None
) -> None:
    from reference_server.gateway.rewrite import with_cap as _with_cap

    body = dict(fields)
    if given_cap is not None:
        body["max_tokens"] = given_cap
    raw = json.dumps(body, indent=indent).encode() + b"\n"
    sent = _with_cap(raw, json.loads(raw), cap)
    assert json.loads(sent) == {**body, "max_tokens": cap}
    if given_cap == cap and b"\\u" not in raw:
        assert sent == raw  # nothing to change: the client's bytes
    if given_cap is None:
        assert sent.startswith(raw.rstrip()[:-1].rstrip())  # appended to the client's bytes


@pytest.mark.parametrize(
    "raw",
    [
        b'{"max_tokens": 9000, "max_tokens": 5}',  # a parser keeping the first would read 9000
        b'{"max_tok\\u0065ns": 9000, "max_tokens": 5}',  # the same key, spelled otherwise
        b'{"max_tokens": 5, "max_completion_tokens": 9000}',
    ],
)
def test_a_cap_that_could_be_read_otherwise_is_re_encoded(raw: bytes) -> None:
    from reference_server.gateway.rewrite import with_cap as _with_cap

    sent = _with_cap(raw, json.loads(raw), 5)
    assert sent != raw
    assert sent.count(b"max_tokens") == 1
    assert b"9000" not in sent


def test_health_sets_aside_after_failures_and_probes_back_once() -> None:
    health = Health(threshold=2, cooldown=5.0)
    health.failed(0.0)
    assert health.in_service(0.0)
    health.failed(1.0)
    assert not health.in_service(2.0)
    assert health.in_service(6.0)
    health.begin(6.0)  # the probe
    assert not health.in_service(6.1)  # one probe at a time
    health.failed(6.2)
    assert not health.in_service(10.0)
    assert health.in_service(11.3)
    health.begin(11.3)
    health.succeeded()
    assert health.in_service(11.4)
    assert not health.set_aside
    health.failed(12.0, at_once=True)
    assert not health.in_service(12.1)


def test_completion_tokens_are_read_from_usage_not_from_the_generated_text() -> None:
    from reference_server.gateway.progress import completion_tokens as _completion_tokens

    text = 'say "completion_tokens": 999 and {"completion_tokens": 7}'
    answer = {"choices": [{"text": text}], "usage": {"prompt_tokens": 3, "completion_tokens": 12}}
    assert _completion_tokens(json.dumps(answer).encode()) == 12
    assert _completion_tokens(json.dumps({"choices": [{"text": text}]}).encode()) == 0
    assert _completion_tokens(b"not json") == 0


# --- in front of the reference server --------------------------------------------------------


_bench = bench_summary_run


def test_prompt_admission_ooms_directly_and_never_through_the_gateway(tmp_path: Path) -> None:
    """The seed's mix (short prompts, large or unset caps) against prompt-length admission."""
    server_config = {
        **FAST,
        "kv_tokens": 8192,
        "context_window": 4096,
        "mean_output_tokens": 1500.0,
        "admission": "prompt",
    }
    load = ("--requests", "80", "--rate", "70")
    with running_server(**server_config) as direct:
        before = _bench(direct.base_url, tmp_path, *load)["summary"]
        direct_ooms = direct.metrics()["kv_oom_events_total"]
    # Told the engine's speed (for Retry-After until it has measured it); what does not fit
    # waits in the FIFO queue.
    with running_server(**server_config) as upstream:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), decode_rate=4000.0, max_queue_wait=30.0
        )
        with running_gateway(config) as gateway:
            summary = _bench(gateway.base_url, tmp_path, *load)["summary"]
            wait_for(lambda: gateway_at_zero(gateway) and at_zero(upstream))
        metrics = upstream.metrics()
    assert direct_ooms > 0
    assert before["failed_by_cause"].get("oom", 0) > 0  # killed mid-decode
    assert metrics["kv_oom_events_total"] == 0
    # Every request completed but those the client refused locally (prompts over the window).
    refused = summary["failed_by_cause"].get("prompt_too_long", 0)
    assert summary["completed"] + refused == 80
    assert summary["refused_locally"] == refused  # counted apart: never sent
    assert summary["failed"] == 0


@pytest.mark.parametrize(
    "fairness",
    [None, FairPolicy(tenants={"a": Tenant(weight=2.0)}, default=Tenant(max_share=0.9))],
    ids=["fifo", "fair shares"],
)
def test_contract_passes_through_the_gateway_in_front_of_the_reference_server(
    fairness: FairPolicy | None,
) -> None:
    contract_passes_through_a_gateway(fairness=fairness)


def not_passed(report: Any) -> dict[str, tuple[str, str]]:
    """Each check that did not pass, by name: its status and its evidence."""
    return {
        r.name: (r.status.value, r.evidence) for r in report.results if r.status != CheckStatus.PASS
    }


#: The reference server's decode rate behind the contract-through-a-gateway tests, tokens/s.
RATE_THROUGH_A_GATEWAY = 800.0


def contract_passes_through_a_gateway(**config: Any) -> None:
    """The contract suite through a gateway (``config``: its settings beyond the upstream) in
    front of the reference server, every check passed, the ledger back to zero."""
    with (
        # Answers run to their caps (as the contract suite's own e2e tests set it up), slowly
        # enough that a burst's holders still run when its probe comes on a loaded machine (at
        # 2,000 tokens/s a burst's caps took a few tens of ms: 1 run in 12 found it drained).
        running_server(
            decode_rate=RATE_THROUGH_A_GATEWAY,
            kv_tokens=4096,
            context_window=1024,
            mean_output_tokens=1e6,
            admission="prompt",
        ) as up,
        running_gateway(
            GatewayConfig(upstreams=(up.base_url,), decode_rate=RATE_THROUGH_A_GATEWAY, **config)
        ) as gateway,
    ):
        report = run_contract(gateway.base_url, burst=24, timeout=60)
        wait_for(lambda: gateway_at_zero(gateway))
    assert not_passed(report) == {}


def test_two_upstreams_share_by_free_budget_and_survive_one_dying() -> None:
    # Each request holds its reservation for 0.67 s: the 32 of a wave overlap even when a loaded
    # machine spreads their sends, so the big upstream fills up and the small one gets some.
    upstream = {**FAST, "context_window": 1024, "decode_rate": 150.0}
    with ExitStack() as stack:
        big = stack.enter_context(running_server(**upstream, kv_tokens=4096))
        doomed = ExitStack()
        small = doomed.enter_context(running_server(**upstream, kv_tokens=2048))
        stack.callback(doomed.close)
        config = GatewayConfig(upstreams=(big.base_url, small.base_url), failure_threshold=1)
        gateway = stack.enter_context(running_gateway(config))
        state = gateway_state(gateway)

        async def wave(n: int) -> list[Any]:
            results: list[Any] = []
            policy = RetryPolicy(deadline=30)
            async with AsyncClient(base_url=gateway.base_url, retry=policy) as client:

                async def one(i: int) -> None:
                    try:
                        if i % 4 == 3:
                            async with client.complete_stream(f"x {i}", max_tokens=100) as s:
                                async for _ in s:
                                    pass
                            results.append(s.completion)
                        else:
                            results.append(await client.complete(f"x {i}", max_tokens=100))
                    except KVClientError as exc:  # must be a clear error, checked below
                        results.append(exc)

                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
            return results

        first = anyio.run(wave, 32)
        assert all(isinstance(r, Completion) for r in first), first
        admitted = [k.ledger.stats().admitted_total for k in state.known]
        assert admitted[0] > admitted[1] > 0  # both served; more budget took more

        second: list[Any] = []
        runner = threading.Thread(target=lambda: second.extend(anyio.run(wave, 32)))
        runner.start()
        time.sleep(0.15)
        doomed.close()  # the small upstream stops mid-run
        runner.join(60)
        assert not runner.is_alive(), "requests hung after an upstream died"
        wait_for(lambda: gateway_at_zero(gateway))
        wait_for(lambda: at_zero(big))  # its own finally runs on its own thread
    failed = [r for r in second if not isinstance(r, Completion)]
    # Nothing lost: every request completed or failed with a clear error; only streams that had
    # started on the dying upstream may fail.
    assert len(second) == 32
    for error in failed:
        assert isinstance(error, KVClientError)
        assert "stream" in str(error)


# --- scripted upstreams: failures and pass-through ---------------------------------------------


def test_models_carries_the_room_of_the_upstream_with_the_most() -> None:
    # What a client reads at discovery to pace its first burst: the room the next request
    # would most likely find (the upstream with the most free budget).
    upstream = {**FAST, "context_window": 1024}
    with ExitStack() as stack:
        big = stack.enter_context(running_server(**upstream, kv_tokens=4096))
        small = stack.enter_context(running_server(**upstream, kv_tokens=2048))
        config = GatewayConfig(upstreams=(small.base_url, big.base_url))
        gateway = stack.enter_context(running_gateway(config))
        first = parse_ratelimit(httpx.get(gateway.base_url + "/v1/models").headers)
        ledgers = {k.upstream.url: k.ledger for k in gateway_state(gateway).known}
        big_ledger = ledgers[big.base_url]
        handle = big_ledger.try_admit(100, 3000, now=time.monotonic())
        assert handle is not None
        try:
            held = parse_ratelimit(httpx.get(gateway.base_url + "/v1/models").headers)
        finally:
            big_ledger.release(handle)
    small_ledger = ledgers[small.base_url]
    assert first is not None
    assert held is not None
    assert (first.quota, first.remaining) == (big_ledger.usable_tokens, big_ledger.usable_tokens)
    # The big one now has less free than the small one: the small one's room is advertised.
    assert big_ledger.usable_tokens - big_ledger.need_tokens(100, 3000) < small_ledger.usable_tokens
    assert (held.quota, held.remaining) == (small_ledger.usable_tokens, small_ledger.usable_tokens)


def test_the_gateway_listens_and_forwards_over_ipv6_loopback() -> None:
    """``--host ::1`` and an upstream at ``http://[::1]:PORT``: bracketed URLs both ways."""

    async def completions(request: Request) -> Response:
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    app = discoverable([Route("/v1/completions", completions, methods=["POST"])])
    with serve_in_thread(app, host="::1") as up:
        assert up.base_url == f"http://[::1]:{up.port}"
        with running_gateway(GatewayConfig(upstreams=(up.base_url,)), host="::1") as gw:
            assert gw.base_url.startswith("http://[::1]:")
            answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 200, answer.text
            assert httpx.get(gw.base_url + "/health").json()["status"] == "ok"


def test_upstream_503_without_retry_after_reaches_the_client_with_one() -> None:
    seen: list[dict[str, Any]] = []

    async def busy(request: Request) -> Response:
        seen.append(await request.json())
        return JSONResponse({"error": {"message": "queue full", "type": "unavailable"}}, 503)

    app = discoverable([Route("/v1/completions", busy, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi"})
        wait_for(lambda: gateway_at_zero(gw))
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert seen == [{"prompt": "hi", "max_tokens": 1024 - 3}]  # the explicit, clamped cap


def test_a_chats_tools_are_counted_by_the_upstreams_tokenize() -> None:
    """The template lays the tools out in the prompt: counted without them, the reservation
    would fall short by their tokens."""
    tokenized: list[dict[str, Any]] = []
    forwarded: list[dict[str, Any]] = []

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        tokenized.append(body)
        return JSONResponse({"count": 40 if "tools" in body else 10, "tokens": []})

    async def chat(request: Request) -> Response:
        forwarded.append(await request.json())
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    app = discoverable([Route("/v1/chat/completions", chat, methods=["POST"])])
    app.router.routes.insert(0, Route("/tokenize", tokenize, methods=["POST"]))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
        answer = httpx.post(gw.base_url + "/v1/chat/completions", json=body)
        wait_for(lambda: gateway_at_zero(gw))
    assert answer.status_code == 200
    assert tokenized[-1]["tools"] == tools
    assert forwarded[-1]["max_tokens"] == 1024 - 40  # the window less the tools' count too


def test_upstream_500_is_answered_in_our_shape_and_never_retried() -> None:
    calls = []

    async def oom(request: Request) -> Response:
        calls.append(1)
        return JSONResponse({"error": {"code": 500, "message": "Context size has been exceeded."
                                       , "type": "server_error"}}, 500)  # fmt: skip

    app = discoverable([Route("/v1/completions", oom, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        wait_for(lambda: gateway_at_zero(gw))
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "upstream_error"
    assert "Context size has been exceeded" in error["message"]
    assert calls == [1]


def test_a_client_that_goes_away_mid_stream_closes_the_upstream_and_releases() -> None:
    closed = threading.Event()

    async def endless(request: Request) -> Response:
        async def events() -> Any:
            try:
                for i in range(10_000):
                    yield f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode()
                    await anyio.sleep(0.01)
            finally:
                closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    app = discoverable([Route("/v1/completions", endless, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        with Client(base_url=gw.base_url) as client:
            stream = client.complete_stream("hi", max_tokens=500)
            with stream:
                for _ in zip(range(3), stream, strict=False):
                    pass
        assert closed.wait(5), "the upstream stream was not closed"
        wait_for(lambda: gateway_at_zero(gw))


# --- in front of a real llama.cpp engine -------------------------------------------------------


@pytest.fixture(scope="module")
def unified_llama(llama_engine_ready: None) -> Iterator[llama_engine.LlamaServer]:
    """One KV pool of 512 tokens shared by 4 slots, each allowed the whole 512."""
    with llama_engine.LlamaServer(ctx=512, parallel=4, unified=True) as server:
        yield server


async def _raw_burst(url: str, n: int, max_tokens: int) -> list[int]:
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(i: int) -> None:
            body = {"prompt": f"Story {i}", "max_tokens": max_tokens, "logit_bias": NO_EOS}
            statuses.append((await http.post("/v1/completions", json=body)).status_code)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    return statuses


@pytest.mark.llama_cpp
def test_a_burst_that_dies_mid_decode_directly_completes_through_the_gateway(
    unified_llama: llama_engine.LlamaServer,
) -> None:
    # Four requests of ~204 tokens each fit the 512-token pool alone; together they overrun it.
    direct = anyio.run(_raw_burst, unified_llama.url, 4, 200)
    assert direct.count(500) >= 1, direct  # "Context size has been exceeded", mid-decode

    with running_gateway(GatewayConfig(upstreams=(unified_llama.url,))) as gateway:

        async def through() -> list[Any]:
            done: list[Any] = []
            async with AsyncClient(
                base_url=gateway.base_url, retry=RetryPolicy(deadline=90)
            ) as client:

                async def one(i: int) -> None:
                    done.append(
                        await client.complete(f"Story {i}", max_tokens=200, logit_bias=NO_EOS)
                    )

                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(one, i)
            return done

        results = anyio.run(through)
        wait_for(lambda: gateway_at_zero(gateway))
        upstream = gateway_state(gateway).upstreams[0]
    assert [r.usage.completion_tokens for r in results] == [200] * 4
    assert upstream.errors == 0
    assert upstream.known is not None
    # What did not fit waited in the gateway's queue instead of dying: the peak never outgrew
    # the pool, and only one or two requests were admitted at a time.
    stats = upstream.known.ledger.stats()
    assert stats.peak_reserved_tokens <= stats.usable_tokens
    assert stats.peak_inflight < 4


@pytest.mark.llama_cpp
def test_contract_passes_through_the_gateway_in_front_of_llama_cpp(
    unified_llama: llama_engine.LlamaServer,
) -> None:
    with running_gateway(GatewayConfig(upstreams=(unified_llama.url,))) as gateway:
        report = run_contract(gateway.base_url, burst=8, burst_max_tokens=400, timeout=90)
        wait_for(lambda: gateway_at_zero(gateway))
    assert not_passed(report) == {}


@pytest.mark.llama_cpp
def test_contract_fails_llama_cpp_with_a_unified_cache_alone(
    unified_llama: llama_engine.LlamaServer,
) -> None:
    # 8 x (prompt + 200) outgrow the 512-token pool: llama.cpp admits them all, and those that
    # run out of room die mid-decode ("Context size has been exceeded").
    report = run_contract(
        unified_llama.url, burst=8, burst_max_tokens=200, timeout=90, only=("saturation",)
    )
    [saturation] = report.results
    assert saturation.status is CheckStatus.FAIL, saturation.evidence
    assert "mid-decode" in saturation.evidence


def test_an_upstream_that_never_answers_is_set_aside_and_the_other_serves() -> None:
    dead = f"http://127.0.0.1:{llama_engine.free_port()}"  # nothing listens there
    with running_server(**FAST, kv_tokens=4096, context_window=1024) as live:
        config = GatewayConfig(upstreams=(dead, live.base_url))
        with running_gateway(config) as gateway:
            with Client(base_url=gateway.base_url) as client:
                result = client.complete("hello", max_tokens=8)
            health = httpx.get(gateway.base_url + "/health").json()
    assert result.usage is not None
    assert result.usage.completion_tokens == 8
    dead_row, live_row = health["upstreams"]
    assert dead_row["in_service"] is False
    assert "ConnectorError" in dead_row["problem"]  # nothing listens there
    assert live_row["in_service"] is True


def test_no_upstream_in_service_is_a_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{llama_engine.free_port()}"
    with running_gateway(GatewayConfig(upstreams=(dead,))) as gateway:
        answer = httpx.post(gateway.base_url + "/v1/completions", json={"prompt": "hi"})
        health = httpx.get(gateway.base_url + "/health")
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "upstream_unavailable"
    assert health.status_code == 503


def test_the_cli_builds_its_config_and_refuses_what_cannot_work(tmp_path: Path) -> None:
    from reference_server.gateway.cli import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(
        ["--upstream", "http://127.0.0.1:1", "--upstream", "http://127.0.0.1:2/",
         "--kv-tokens", "4096", "--max-queue-wait", "5"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.upstreams == ("http://127.0.0.1:1", "http://127.0.0.1:2/")
    assert (config.kv_tokens, config.max_queue_wait) == ((4096,), 5.0)
    for bad in (["--kv-tokens", "0"], ["--kv-tokens", "-5"], ["--context-window", "0"]):
        with pytest.raises(ValueError, match="at least 1"):
            config_from_args(parser.parse_args(["--upstream", "http://a:1", *bad]))
    with pytest.raises(ValueError, match="more --kv-tokens"):
        config_from_args(
            parser.parse_args(["--upstream", "http://a:1", "--kv-tokens", "1", "--kv-tokens", "2"])
        )
    with pytest.raises(ValueError, match="--tokenizer"):
        config_from_args(
            parser.parse_args(["--upstream", "http://a:1", "--tokenizer", str(tmp_path / "no")])
        )
    with pytest.raises(ValueError, match="http"):
        GatewayConfig(upstreams=("127.0.0.1:8000",))
    lag = parser.parse_args(["--upstream", "http://a:1", "--relay-lag", "0.05"])
    assert config_from_args(lag).relay_lag == 0.05
    with pytest.raises(ValueError, match="--relay-lag"):
        config_from_args(parser.parse_args(["--upstream", "http://a:1", "--relay-lag", "-1"]))


def _unread_stream(gateway: RunningServer) -> socket.socket:
    """A streamed completion asked on a raw socket with a tiny receive buffer, once it holds a
    reservation; nothing read yet."""
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    reader.connect((gateway.host, gateway.port))
    payload = json.dumps({"prompt": "x", "max_tokens": 100, "stream": True}).encode()
    reader.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    wait_for(lambda: not gateway_at_zero(gateway))
    return reader


def test_a_client_that_stops_reading_is_cut_after_the_send_timeout() -> None:
    closed = threading.Event()
    blob = "x" * 60_000

    async def firehose(request: Request) -> Response:
        async def events() -> Any:
            try:
                for _ in range(100_000):
                    yield f'data: {{"choices":[{{"index":0,"text":"{blob}"}}]}}\n\n'.encode()
                    await anyio.lowlevel.checkpoint()
            finally:
                closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    app = discoverable([Route("/v1/completions", firehose, methods=["POST"])], kv=4096)
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), send_timeout=0.3)
        with running_gateway(config) as gateway:
            reader = _unread_stream(gateway)
            # Not one byte read, the socket kept open: cut and released all the same.
            wait_for(lambda: gateway_at_zero(gateway), timeout=10)
            assert closed.wait(5), "the upstream stream was not closed"
            reader.close()


def test_a_slow_reader_gets_every_event_in_order_while_the_upstream_is_held_back() -> None:
    """While the client's socket is full the relay waits (and so does the upstream); every event
    arrives, in order, within the send timeout."""
    blob = "y" * 20_000
    count = 60  # 1.2 MB: far more than a 16 KB send buffer and the front's 64 KB hold

    async def burst(request: Request) -> Response:
        async def events() -> Any:
            for i in range(count):
                yield f'data: {{"choices":[{{"index":0,"text":"{i}:{blob}"}}]}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = discoverable([Route("/v1/completions", burst, methods=["POST"])], kv=4096)
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), send_timeout=5.0)
        with running_gateway(config, send_buffer=16_384) as gateway:
            reader = _unread_stream(gateway)
            reader.settimeout(10)
            time.sleep(0.5)  # not reading yet: the gateway's writes back up, well within 5 s
            raw = b""
            while not raw.endswith(b"\r\n0\r\n\r\n"):
                chunk = reader.recv(65536)
                assert chunk, "the gateway closed the stream"
                raw += chunk
            reader.close()
            seen = [
                int(m.group(1))
                for m in re.finditer(rb'data: \{"choices":\[\{"index":0,"text":"(\d+):', raw)
            ]
            assert seen == list(range(count))
            wait_for(lambda: gateway_at_zero(gateway))


def test_an_upstreams_cookie_reaches_its_caller_and_nobody_else() -> None:
    cookies_seen: list[str | None] = []

    async def sets_cookie(request: Request) -> Response:
        cookies_seen.append(request.headers.get("cookie"))
        body = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
        return JSONResponse(body, headers={"set-cookie": "session=alice; Path=/"})

    app = discoverable([Route("/v1/completions", sets_cookie, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        first = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        httpx.post(gw.base_url + "/v1/completions", json={"prompt": "b", "max_tokens": 1})
    assert first.headers["set-cookie"].startswith("session=alice")
    assert cookies_seen == [None, None]


# --- a client that goes away -----------------------------------------------------------------


def test_a_client_that_half_closes_is_gone_and_its_request_ends() -> None:
    """A read EOF from the client ends its request (as nginx, Go and uvicorn take it): the
    reservation comes back long before the engine would have finished."""
    with (
        running_server(**{**FAST, "decode_rate": 200.0}, kv_tokens=4096, context_window=1024,
                       mean_output_tokens=1e6) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gateway,
    ):  # fmt: skip
        payload = json.dumps({"prompt": "hello", "max_tokens": 800}).encode()  # 4 s of decoding
        with socket.create_connection((gateway.host, gateway.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            wait_for(lambda: not gateway_at_zero(gateway))
            started = time.monotonic()
            sock.shutdown(socket.SHUT_WR)
            wait_for(lambda: gateway_at_zero(gateway) and at_zero(up), timeout=2)
            assert time.monotonic() - started < 1.5


def test_the_cli_serves_on_uvloop_and_says_where() -> None:
    """``kvclient gateway`` as it runs: its own process, httptools, uvloop, its URL printed."""
    pytest.importorskip("uvloop")
    port = llama_engine.free_port()
    with running_server(**FAST, kv_tokens=4096, context_window=1024) as up:
        cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--upstream", up.base_url,
               "--port", str(port), "--loop", "uvloop", "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:

            def healthy() -> bool:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(healthy, timeout=30)
            with Client(base_url=f"http://127.0.0.1:{port}") as client:
                assert client.complete("hi", max_tokens=5).usage.completion_tokens == 5
            wait_for(lambda: at_zero(up))
            busy = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            assert busy.returncode == 2
            assert busy.stderr.strip().splitlines()[-1].endswith("is already in use")
            assert "Traceback" not in busy.stderr
        finally:
            proc.terminate()
            proc.wait(10)
            stderr = proc.stderr.read() if proc.stderr else ""
            if proc.stderr is not None:
                proc.stderr.close()
    assert f"listening on http://127.0.0.1:{port}" in stderr


def test_the_key_is_checked_on_generation_and_never_sent_upstream() -> None:
    with (
        running_server(**FAST, kv_tokens=4096, context_window=1024) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), api_key="sesame")) as gateway,
        httpx.Client(base_url=gateway.base_url, timeout=10) as http,
    ):
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 401
        key = {"Authorization": "Bearer sesame"}
        answer = http.post("/v1/completions", json=body, headers=key)
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 2
        assert http.get("/v1/completions", headers=key).status_code == 405  # the router's
        assert http.get("/health").status_code == 200  # open, as in the reference server
        wait_for(lambda: gateway_at_zero(gateway))


def test_a_queued_request_whose_client_goes_away_leaves_the_queue_unforwarded() -> None:
    with running_server(
        **{**FAST, "decode_rate": 400.0}, kv_tokens=1024, context_window=1024,
        mean_output_tokens=1e6,
    ) as up:  # fmt: skip
        config = GatewayConfig(upstreams=(up.base_url,), max_queue_wait=30.0, decode_rate=400.0)
        with running_gateway(config) as gateway:
            holder = threading.Thread(
                target=httpx.post,
                args=(gateway.base_url + "/v1/completions",),
                kwargs={"json": {"prompt": "a", "max_tokens": 600}, "timeout": 30},
            )
            holder.start()  # 1.5 s of decoding; the next one cannot fit beside it
            upstream = gateway_state(gateway).upstreams[0]
            wait_for(lambda: upstream.known is not None and upstream.known.ledger.stats().inflight)
            assert upstream.known is not None
            ledger, queue = upstream.known.ledger, upstream.known.queue
            payload = json.dumps({"prompt": "b", "max_tokens": 600}).encode()
            leaver = socket.create_connection((gateway.host, gateway.port))
            leaver.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            wait_for(lambda: queue.waiting == 1)
            # A reset, not a half-close: the client is gone.
            leaver.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            leaver.close()
            wait_for(lambda: queue.waiting == 0, timeout=1)  # before the holder is done
            assert ledger.stats().inflight == 1  # only the holder
            holder.join(30)
            wait_for(lambda: gateway_at_zero(gateway) and at_zero(up))
            assert ledger.stats().admitted_total == 1  # the leaver was never forwarded


def test_an_unexpected_error_is_a_generic_500_or_a_cut_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error answers a generic 500 before the answer started (the type logged,
    never the message: it could quote a prompt), cuts the answer after, and the reservation is
    released either way."""
    from reference_server.gateway import relay

    secret = "a prompt that must not reach the log"

    async def broken_count(*args: Any) -> int:
        raise RuntimeError(secret)

    async def broken_stream(self: Any, known: Any, response: Any, send: Any, *_: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError(secret)

    with (
        running_server(**FAST, kv_tokens=4096, context_window=1024) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gateway,
        httpx.Client(base_url=gateway.base_url, timeout=10) as http,
    ):
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        with monkeypatch.context() as patch:
            patch.setattr(relay.UpstreamBackend, "_count", broken_count)
            answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "internal_error"
        with monkeypatch.context() as patch:
            patch.setattr(relay.UpstreamBackend, "_stream", broken_stream)
            with pytest.raises(httpx.HTTPError):
                http.post("/v1/completions", json={**body, "stream": True}).read()
        wait_for(lambda: gateway_at_zero(gateway))
        assert http.post("/v1/completions", json=body).status_code == 200
    assert secret not in caplog.text
    assert "unexpected RuntimeError while serving /v1/completions" in caplog.text
