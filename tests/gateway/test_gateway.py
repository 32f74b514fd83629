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
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import llama_engine
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.helpers.servers import at_zero, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvclient import AsyncClient, Client, Completion, KVClientError, RetryPolicy
from kvclient._routing import Endpoint, Health, choose, ranked
from kvclient.contract import CheckStatus, run_contract
from kvclient.loadgen import cli as bench_cli
from reference_server import RunningServer, running_server, serve_in_thread
from reference_server._runner import running_gateway
from reference_server.gateway import GatewayConfig, GatewayState

FAST = {"decode_rate": 4000.0, "tick_seconds": 0.005}
NO_EOS = {"128009": -100, "128001": -100}  # the tiny model's end tokens: run to the cap


def gateway_state(gateway: RunningServer) -> GatewayState:
    state: GatewayState = gateway.app.state.gateway
    return state


def gateway_at_zero(gateway: RunningServer) -> bool:
    return all(
        u.ledger is None or u.ledger.stats().reserved_tokens == 0
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
    picked = choose(endpoints, need)
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
    from reference_server.gateway import _with_cap

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
    from reference_server.gateway import _with_cap

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
    from reference_server.gateway import _completion_tokens

    text = 'say "completion_tokens": 999 and {"completion_tokens": 7}'
    answer = {"choices": [{"text": text}], "usage": {"prompt_tokens": 3, "completion_tokens": 12}}
    assert _completion_tokens(json.dumps(answer).encode()) == 12
    assert _completion_tokens(json.dumps({"choices": [{"text": text}]}).encode()) == 0
    assert _completion_tokens(b"not json") == 0


# --- in front of the reference server --------------------------------------------------------


def _bench(url: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"bench-{time.monotonic_ns()}.json"
    argv = [url, "--json", str(out), "--no-progress", "--seed", "7", *extra]
    # Failures are what these runs measure: the exit status must not depend on how many.
    assert bench_cli.main([*argv, "--max-failure-rate", "1"]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_prompt_admission_ooms_directly_and_never_through_the_gateway(tmp_path: Path) -> None:
    """The seed's mix (short prompts, large or unset caps) against prompt-length admission."""
    server_config = {
        **FAST,
        "kv_tokens": 8192,
        "context_window": 4096,
        "mean_output_tokens": 1500.0,
        "admission": "prompt",
    }
    load = ("--num-requests", "80", "--rate", "70")
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
    assert before["failed_by_cause"].get("bad_response", 0) > 0  # killed mid-decode
    assert metrics["kv_oom_events_total"] == 0
    # Every request completed but those the client refused locally (prompts over the window).
    refused = summary["failed_by_cause"].get("prompt_too_long", 0)
    assert summary["completed"] + refused == 80
    assert summary["refused_locally"] == refused  # counted apart: never sent
    assert summary["failed"] == 0


def test_contract_passes_through_the_gateway_in_front_of_the_reference_server() -> None:
    with (
        # Answers run to their caps (as the contract suite's own e2e tests set it up).
        running_server(
            decode_rate=2000.0,
            kv_tokens=4096,
            context_window=1024,
            mean_output_tokens=1e6,
            admission="prompt",
        ) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), decode_rate=2000.0)) as gateway,
    ):
        report = run_contract(gateway.base_url, burst=24, timeout=60)
        wait_for(lambda: gateway_at_zero(gateway))
    verdicts = {r.name: r.status for r in report.results}
    assert set(verdicts.values()) == {CheckStatus.PASS}, {
        r.name: r.evidence for r in report.results
    }


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
        admitted = [u.ledger.stats().admitted_total for u in state.upstreams if u.ledger]
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


@contextmanager
def scripted_upstream(app: Starlette) -> Iterator[RunningServer]:
    with serve_in_thread(app) as server:
        yield server


def _discoverable(routes: list[Route], *, window: int = 1024, kv: int = 4096) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "max_model_len": window}]})

    async def metrics(request: Request) -> Response:
        return Response(f"kv_physical_capacity_tokens {kv}\n")

    async def tokenize(request: Request) -> Response:
        return JSONResponse({"count": 3, "tokens": [1, 2, 3]})

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/tokenize", tokenize, methods=["POST"]),
            *routes,
        ]
    )


def test_the_gateway_listens_and_forwards_over_ipv6_loopback() -> None:
    """``--host ::1`` and an upstream at ``http://[::1]:PORT``: bracketed URLs both ways."""
    from reference_server._runner import serve_front_in_thread
    from reference_server.gateway import create_gateway_app

    async def completions(request: Request) -> Response:
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 0}})

    app = _discoverable([Route("/v1/completions", completions, methods=["POST"])])
    with serve_in_thread(app, host="::1") as up:
        assert up.base_url == f"http://[::1]:{up.port}"
        gateway = create_gateway_app(GatewayConfig(upstreams=(up.base_url,)))
        with serve_front_in_thread(gateway, max_body_bytes=1 << 20, host="::1") as gw:
            assert gw.base_url.startswith("http://[::1]:")
            answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 200, answer.text
            assert httpx.get(gw.base_url + "/health").json()["status"] == "ok"


def test_upstream_503_without_retry_after_reaches_the_client_with_one() -> None:
    seen: list[dict[str, Any]] = []

    async def busy(request: Request) -> Response:
        seen.append(await request.json())
        return JSONResponse({"error": {"message": "queue full", "type": "unavailable"}}, 503)

    app = _discoverable([Route("/v1/completions", busy, methods=["POST"])])
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

    app = _discoverable([Route("/v1/chat/completions", chat, methods=["POST"])])
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


# --- counting while forwarding (overlap_count) -------------------------------------------------


class _Gate:
    """A switch the test thread sets and the upstream's handlers (on another loop) wait on."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    async def passed(self) -> None:
        if not await anyio.to_thread.run_sync(self._open.wait, 10.0):
            raise TimeoutError("the gate never opened")


def _counting_upstream(
    counts: dict[str, tuple[int, _Gate | float]],
    streams: dict[str, _Gate],
    log: list[tuple[str, str, int]],
    *,
    window: int = 1024,
    kv: int = 4096,
) -> Starlette:
    """An upstream whose /tokenize answers prompt ``p`` with ``counts[p]`` once its gate opens
    (or after that many seconds), and whose completion of ``p`` streams until ``streams[p]``
    opens (else answers at once). ``log``: (what, prompt, client port), in the order seen."""

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt", "")
        log.append(("tokenize", prompt, request.client.port if request.client else 0))
        count, gate = counts[prompt]
        if isinstance(gate, _Gate):
            await gate.passed()
        else:
            await anyio.sleep(gate)
        log.append(("counted", prompt, 0))
        return JSONResponse({"count": count, "tokens": [0] * count})

    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        log.append(("complete", prompt, request.client.port if request.client else 0))
        gate = streams.get(prompt)
        if gate is None:
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return JSONResponse({"choices": [{"index": 0, "text": "x"}], "usage": usage})

        async def events() -> Any:
            yield 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            await gate.passed()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = _discoverable(
        [Route("/v1/completions", completions, methods=["POST"])], window=window, kv=kv
    )
    app.router.routes.insert(0, Route("/tokenize", tokenize, methods=["POST"]))
    return app


def test_a_request_with_a_cap_goes_while_its_count_is_on_the_way_then_its_reservation_shrinks() -> (
    None
):
    """The whole window is held until the count lands (no request can outgrow it), then the
    exact need: the count's round trip is off the request's path."""
    count_gate, stream_gate = _Gate(), _Gate()
    log: list[tuple[str, str, int]] = []
    # Room for the four windows a request is admitted on a window beside (_OVERLAP_ROOM).
    app = _counting_upstream({"a": (10, count_gate)}, {"a": stream_gate}, log, kv=16384)
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
        httpx.Client(base_url=gw.base_url, timeout=10) as http,
    ):
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 20, "stream": True}
        ) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            assert next(lines).startswith("data:")  # answered while the count is held back
            assert ("counted", "a", 0) not in log
            ledger = gateway_state(gw).upstreams[0].ledger  # discovered on the first request
            assert ledger is not None
            assert ledger.stats().reserved_tokens == ledger.need_tokens(1024 - 20, 20)
            count_gate.open()
            wait_for(lambda: ledger.stats().reserved_tokens == ledger.need_tokens(10, 20))
            stream_gate.open()
            assert [line for line in lines if line][-1] == "data: [DONE]"
        wait_for(lambda: gateway_at_zero(gw))
    kinds = [what for what, _, _ in log]
    assert kinds.index("complete") < kinds.index("counted")


def test_a_request_that_fits_once_counts_land_waits_for_them_instead_of_a_429() -> None:
    """A is admitted on the whole window (four were free), three fillers take the rest; B does
    not fit beside A's window, but fits beside A's count: it waits for that count to land
    instead of being refused on a reservation about to shrink."""
    a_count, held = _Gate(), _Gate()
    log: list[tuple[str, str, int]] = []
    fillers = ["c1", "c2", "c3"]
    counts: dict[str, tuple[int, _Gate | float]] = {"a": (10, a_count), "b": (10, 0.0)}
    counts.update(dict.fromkeys(fillers, (10, 0.0)))
    app = _counting_upstream(counts, {"a": held, **dict.fromkeys(fillers, held)}, log)
    with ExitStack() as stack:
        up = stack.enter_context(scripted_upstream(app))
        config = GatewayConfig(
            upstreams=(up.base_url,), kv_tokens=(4 * 1024 + 16,), safety_fraction=1.0
        )
        gw = stack.enter_context(running_gateway(config))
        http = stack.enter_context(httpx.Client(base_url=gw.base_url, timeout=10))
        streams = []
        for prompt, cap in [("a", 20)] + [(c, 1014) for c in fillers]:  # a filler's cap: no
            body = {"prompt": prompt, "max_tokens": cap, "stream": True}  # room to overlap
            stream = stack.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert stream.status_code == 200
            streams.append(stream)
        ledger = gateway_state(gw).upstreams[0].ledger
        assert ledger is not None
        window, filler, counted = (
            ledger.need_tokens(1024 - 20, 20),
            ledger.need_tokens(10, 1014),
            ledger.need_tokens(10, 20),
        )
        assert ledger.stats().reserved_tokens == window + 3 * filler  # A still on its window
        assert window + 3 * filler + counted > ledger.usable_tokens
        assert counted + 3 * filler + counted <= ledger.usable_tokens
        opened = threading.Timer(0.3, a_count.open)
        opened.start()
        started = time.monotonic()
        answer = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 20})
        waited = time.monotonic() - started
        opened.join()
        assert answer.status_code == 200, answer.text
        assert waited >= 0.25  # it waited for A's count, not for anyone's end
        held.open()
        for stream in streams:
            for _ in stream.iter_lines():
                pass
        wait_for(lambda: gateway_at_zero(gw))
    # B was counted before A's count landed, and forwarded after it.
    assert log.index(("counted", "b", 0)) < log.index(("counted", "a", 0))
    completes = [p for w, p, _ in log if w == "complete"]
    assert completes[-1] == "b"


def test_an_unset_cap_count_first_and_little_room_wait_for_the_count_before_forwarding() -> None:
    """No overlap without a cap (the cap comes from the count), with --count-first, or where
    fewer than four windows are free (this upstream's 4,096 KV tokens hold three and a half)."""
    gates = {"u": _Gate(), "f": _Gate(), "r": _Gate()}
    log: list[tuple[str, str, int]] = []
    app = _counting_upstream({p: (10, gate) for p, gate in gates.items()}, {}, log)
    with scripted_upstream(app) as up:
        cases = [
            (GatewayConfig(upstreams=(up.base_url,)), {"prompt": "u"}),  # its cap needs the count
            (
                GatewayConfig(upstreams=(up.base_url,), overlap_count=False),
                {"prompt": "f", "max_tokens": 20},
            ),
            (GatewayConfig(upstreams=(up.base_url,)), {"prompt": "r", "max_tokens": 20}),
        ]
        for config, body in cases:
            with running_gateway(config) as gw:
                timer = threading.Timer(0.2, gates[str(body["prompt"])].open)
                timer.start()
                answer = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=10)
                timer.join()
                assert answer.status_code == 200
                wait_for(lambda: gateway_at_zero(gw))
    seen = [(what, prompt) for what, prompt, _ in log]
    for prompt in gates:
        assert seen.index(("counted", prompt)) < seen.index(("complete", prompt))


def test_a_count_that_lands_after_its_answer_keeps_its_connection() -> None:
    """A count that lands after its answer (the upstream counts it after generating) is left to
    land: cancelled, it would abort its pooled connection, and each count would connect anew."""
    log: list[tuple[str, str, int]] = []
    gates = {f"p{i}": _Gate() for i in range(10)}
    counts: dict[str, tuple[int, _Gate | float]] = {p: (10, g) for p, g in gates.items()}
    app = _counting_upstream(counts, {}, log, kv=16384)
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
        httpx.Client(base_url=gw.base_url, timeout=10) as http,
    ):
        for prompt, gate in gates.items():
            answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            assert answer.status_code == 200
            assert ("counted", prompt, 0) not in log  # answered before its count landed
            gate.open()
            wait_for(lambda p=prompt: ("counted", p, 0) in log)
        wait_for(lambda: gateway_at_zero(gw))
    ports = {port for what, _, port in log if what in ("tokenize", "complete")}
    assert len(ports) <= 4  # a few pooled connections, not a new one for each of 10 counts


def test_upstream_500_is_answered_in_our_shape_and_never_retried() -> None:
    calls = []

    async def oom(request: Request) -> Response:
        calls.append(1)
        return JSONResponse({"error": {"code": 500, "message": "Context size has been exceeded."
                                       , "type": "server_error"}}, 500)  # fmt: skip

    app = _discoverable([Route("/v1/completions", oom, methods=["POST"])])
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

    app = _discoverable([Route("/v1/completions", endless, methods=["POST"])])
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
    assert upstream.ledger is not None
    assert upstream.ledger.stats().rejected_total >= 1  # refused with 429 instead of dying


@pytest.mark.llama_cpp
def test_contract_passes_through_the_gateway_in_front_of_llama_cpp(
    unified_llama: llama_engine.LlamaServer,
) -> None:
    with running_gateway(GatewayConfig(upstreams=(unified_llama.url,))) as gateway:
        report = run_contract(gateway.base_url, burst=8, burst_max_tokens=64, timeout=90)
        wait_for(lambda: gateway_at_zero(gateway))
    verdicts = {r.name: r.status for r in report.results}
    assert set(verdicts.values()) == {CheckStatus.PASS}, {
        r.name: r.evidence for r in report.results
    }


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
    assert "ConnectError" in dead_row["problem"]
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
    from reference_server._gateway_cli import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(
        ["--upstream", "http://127.0.0.1:1", "--upstream", "http://127.0.0.1:2/",
         "--kv-tokens", "4096", "--max-queue-wait", "5"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.upstreams == ("http://127.0.0.1:1", "http://127.0.0.1:2/")
    assert (config.kv_tokens, config.max_queue_wait) == ((4096,), 5.0)
    assert config.overlap_count
    first = config_from_args(parser.parse_args(["--upstream", "http://a:1", "--count-first"]))
    assert not first.overlap_count
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

    app = _discoverable([Route("/v1/completions", firehose, methods=["POST"])], kv=4096)
    with scripted_upstream(app) as up:
        config = GatewayConfig(upstreams=(up.base_url,), send_timeout=0.3)
        with running_gateway(config) as gateway:
            reader = _unread_stream(gateway)
            # Not one byte read, the socket kept open: cut and released all the same.
            wait_for(lambda: gateway_at_zero(gateway), timeout=10)
            assert closed.wait(5), "the upstream stream was not closed"
            reader.close()


def test_a_slow_reader_gets_every_event_in_order_while_the_upstream_is_held_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spliced relay: while the client's socket is full the upstream is not read (so the
    gateway buffers nothing), then resumed; every event arrives, in order, within the send
    timeout."""
    blob = "y" * 20_000
    count = 60  # 1.2 MB: far more than a 16 KB send buffer and the front's 64 KB hold

    async def burst(request: Request) -> Response:
        async def events() -> Any:
            for i in range(count):
                yield f'data: {{"choices":[{{"index":0,"text":"{i}:{blob}"}}]}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    from reference_server._upstream_http import UpstreamResponse

    held = []
    real_pause = UpstreamResponse.pause

    def spy_pause(self: UpstreamResponse) -> None:
        held.append(1)
        real_pause(self)

    monkeypatch.setattr(UpstreamResponse, "pause", spy_pause)
    app = _discoverable([Route("/v1/completions", burst, methods=["POST"])], kv=4096)
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
            assert held, "the client's socket never filled: nothing was held back"
            wait_for(lambda: gateway_at_zero(gateway))


def test_an_upstreams_cookie_reaches_its_caller_and_nobody_else() -> None:
    cookies_seen: list[str | None] = []

    async def sets_cookie(request: Request) -> Response:
        cookies_seen.append(request.headers.get("cookie"))
        body = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
        return JSONResponse(body, headers={"set-cookie": "session=alice; Path=/"})

    app = _discoverable([Route("/v1/completions", sets_cookie, methods=["POST"])])
    with (
        scripted_upstream(app) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gw,
    ):
        first = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        httpx.post(gw.base_url + "/v1/completions", json={"prompt": "b", "max_tokens": 1})
    assert first.headers["set-cookie"].startswith("session=alice")
    assert cookies_seen == [None, None]


# --- the front: a client that half-closes after its request still gets its answer -----------


def _half_closed_exchange(host: str, port: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        sock.shutdown(socket.SHUT_WR)  # done sending: HTTP lets the client still read
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def _check_half_closed_answers(host: str, port: int) -> None:
    data = _half_closed_exchange(host, port, {"prompt": "hello", "max_tokens": 50})
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    assert json.loads(payload)["usage"]["completion_tokens"] == 50
    data = _half_closed_exchange(host, port, {"prompt": "hi", "max_tokens": 20, "stream": True})
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert b"data: [DONE]" in data


def test_a_half_closed_client_gets_its_answer_through_the_gateway() -> None:
    with (
        running_server(**FAST, kv_tokens=4096, context_window=1024) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,))) as gateway,
    ):
        _check_half_closed_answers(gateway.host, gateway.port)
        wait_for(lambda: gateway_at_zero(gateway) and at_zero(up))


def test_the_clis_front_on_uvloop_answers_half_closed_clients_too() -> None:
    """``kvclient gateway`` as it runs (its own process, httptools, uvloop)."""
    pytest.importorskip("uvloop")
    port = llama_engine.free_port()
    with running_server(**FAST, kv_tokens=4096, context_window=1024) as up:
        cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--upstream", up.base_url,
               "--port", str(port), "--loop", "uvloop", "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        try:

            def healthy() -> bool:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(healthy, timeout=30)
            _check_half_closed_answers("127.0.0.1", port)
            wait_for(lambda: at_zero(up))
        finally:
            proc.terminate()
            proc.wait(10)
            if proc.stderr is not None:
                proc.stderr.close()


def test_the_generation_fast_lane_keeps_the_key_check_and_the_routers_answers() -> None:
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
            wait_for(lambda: upstream.ledger is not None and upstream.ledger.stats().inflight)
            assert upstream.queue is not None
            assert upstream.ledger is not None
            payload = json.dumps({"prompt": "b", "max_tokens": 600}).encode()
            leaver = socket.create_connection((gateway.host, gateway.port))
            leaver.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            queue = upstream.queue
            wait_for(lambda: queue.waiting == 1)
            # A reset, not a half-close: the client is gone.
            leaver.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            leaver.close()
            wait_for(lambda: queue.waiting == 0, timeout=1)  # before the holder is done
            assert upstream.ledger.stats().inflight == 1  # only the holder
            holder.join(30)
            wait_for(lambda: gateway_at_zero(gateway) and at_zero(up))
            assert upstream.ledger.stats().admitted_total == 1  # the leaver was never forwarded


def test_an_unexpected_error_on_the_fast_lane_is_a_generic_500_or_a_cut_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The generation lane has no UnexpectedErrorMiddleware around it: its own guard answers a
    generic 500 before the answer started (the type logged, never the message: it could quote a
    prompt), cuts the answer after, and the reservation is released either way."""
    from reference_server import gateway as gateway_module

    secret = "a prompt that must not reach the log"
    real_relay = gateway_module.GatewayGeneration._relay

    async def broken_count(*args: Any) -> int:
        raise RuntimeError(secret)

    async def broken_relay(self: Any, upstream: Any, response: Any, watch: Any, *_: Any) -> int:
        await watch.send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError(secret)

    # Counting first (an answer waits for its count), so that a broken count comes before it.
    with (
        running_server(**FAST, kv_tokens=4096, context_window=1024) as up,
        running_gateway(GatewayConfig(upstreams=(up.base_url,), overlap_count=False)) as gateway,
        httpx.Client(base_url=gateway.base_url, timeout=10) as http,
    ):
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        with monkeypatch.context() as patch:
            patch.setattr(gateway_module.GatewayGeneration, "_count", broken_count)
            answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "internal_error"
        with monkeypatch.context() as patch:
            patch.setattr(gateway_module.GatewayGeneration, "_relay", broken_relay)
            with pytest.raises(httpx.HTTPError):
                http.post("/v1/completions", json={**body, "stream": True}).read()
        assert gateway_module.GatewayGeneration._relay is real_relay
        wait_for(lambda: gateway_at_zero(gateway))
        assert http.post("/v1/completions", json=body).status_code == 200
    assert secret not in caplog.text
    assert "unexpected RuntimeError while serving /v1/completions" in caplog.text
