"""What the simulated engine models for the gateway's peak-of-the-sum admission, seen through the
app: lockstep steps, a cap on running sequences with a waiting line, shared prefix blocks, and
streams that carry their exact progress (vLLM's ``continuous_usage_stats``)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette

from reference_server import ServerConfig, ServerState, running_server
from reference_server.simulated.cli import build_parser, config_from_args
from tests.server.test_server_app import COUNTER, FAST, app_with, client_for, state_of

pytestmark = pytest.mark.anyio


async def wait_until(predicate: Any) -> None:
    """Poll server state (it has no event to wait on), for at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - polling state another task owns
            await anyio.sleep(0.002)


def scraped(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split(" ")
            values[name] = float(value)
    return values


def at_rest(app: Starlette) -> None:
    state = state_of(app)
    stats = state.engine.stats()
    assert (stats.running, stats.waiting, stats.used_tokens) == (0, 0, 0)
    assert state.ledger.stats().reserved_tokens == 0


# --- lockstep steps ----------------------------------------------------------------------------


async def test_requests_running_together_advance_by_the_same_steps() -> None:
    app = app_with(decode_rate=50.0)  # 10 tokens: 0.2 s each
    engine = state_of(app).engine
    body = {"prompt": "together", "max_tokens": 10, "ignore_eos": True}
    async with client_for(app) as client, anyio.create_task_group() as group:
        for _ in range(2):
            group.start_soon(lambda: client.post("/v1/completions", json=body))
    stats = engine.stats()
    assert stats.generated_tokens_total == 20
    # One token each per shared step: 10 steps, plus those the second came late by.
    assert 10 <= stats.steps_total < 20
    assert state_of(app).snapshot()["kv_generated_tokens_total"] == 20


# --- the cap on running sequences --------------------------------------------------------------


async def test_beyond_max_running_a_request_waits_in_the_engine_and_metrics_show_it() -> None:
    app = app_with(max_running=1, decode_rate=200.0)
    engine = state_of(app).engine
    # 50 tokens at 200/s: each runs 0.25 s, long enough to be seen waiting on a busy machine.
    body = {"prompt": list(range(200)), "max_tokens": 50, "ignore_eos": True}
    answers: list[httpx.Response] = []

    async with client_for(app) as client, anyio.create_task_group() as group:

        async def post() -> None:
            answers.append(await client.post("/v1/completions", json=body))

        group.start_soon(post)
        await wait_until(lambda: engine.stats().running == 1)
        group.start_soon(post)
        await wait_until(lambda: engine.stats().waiting == 1)
        metrics = scraped((await client.get("/metrics")).text)
        assert metrics["kv_engine_requests_running"] == 1
        assert metrics["kv_engine_requests_waiting"] == 1
        assert metrics["kv_engine_max_running"] == 1
        # The waiting one holds no KV (its prompt alone is 13 blocks): only the running one's
        # prompt + output so far, at most 250 tokens in 16 blocks.
        assert metrics["kv_used_tokens"] <= 256
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [50, 50]
    stats = engine.stats()
    assert stats.steps_total == 100  # one after the other: 50 steps each
    metrics = state_of(app).snapshot()
    assert metrics["kv_generated_tokens_total"] == 100
    assert metrics["kv_engine_requests_waiting"] == 0
    at_rest(app)


async def test_engine_settings_are_exported() -> None:
    async with client_for(app_with()) as client:
        plain = scraped((await client.get("/metrics")).text)
    async with client_for(app_with(prefix_caching=False, block_size=32)) as client:
        other = scraped((await client.get("/metrics")).text)
    assert "kv_engine_max_running" not in plain  # unbounded: not exported
    assert (plain["kv_engine_prefix_caching"], plain["kv_engine_block_size"]) == (1, 16)
    assert (other["kv_engine_prefix_caching"], other["kv_engine_block_size"]) == (0, 32)
    assert plain["kv_engine_requests_running"] == plain["kv_engine_requests_waiting"] == 0


# --- shared prefix blocks ----------------------------------------------------------------------

PREFIX = list(range(1000, 1512))  # 512 tokens: 32 blocks of 16


def _shared_prefix_body(own: int) -> dict[str, Any]:
    # 520 prompt tokens and 8 generated: 33 blocks from start to end (the last prompt token's
    # block has room for the output). At 20 tokens/s, 0.4 s.
    prompt = [*PREFIX, *range(own, own + 8)]
    return {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}


async def test_a_request_after_the_first_token_charges_only_its_own_blocks() -> None:
    app = app_with(decode_rate=20.0)
    engine = state_of(app).engine
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/v1/completions", json=_shared_prefix_body(0)))
        await wait_until(lambda: engine.stats().generated_tokens_total >= 1)
        group.start_soon(lambda: client.post("/v1/completions", json=_shared_prefix_body(100)))
        await wait_until(lambda: engine.stats().running == 2)
        assert engine.stats().used_tokens == (33 + 1) * 16
    stats = engine.stats()
    assert stats.shared_blocks_total == 32
    assert stats.peak_used_tokens == (33 + 1) * 16
    at_rest(app)


async def test_requests_sent_together_both_charge_their_prefix() -> None:
    app = app_with(decode_rate=20.0)
    engine = state_of(app).engine
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def post(own: int) -> None:
            await client.post("/v1/completions", json=_shared_prefix_body(own))

        group.start_soon(post, 0)
        group.start_soon(post, 100)
    stats = engine.stats()
    assert stats.shared_blocks_total == 0  # both were still in prefill when the other came
    assert stats.peak_used_tokens == 2 * 33 * 16
    at_rest(app)


async def test_without_prefix_caching_nothing_is_shared() -> None:
    app = app_with(decode_rate=20.0, prefix_caching=False)
    engine = state_of(app).engine
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/v1/completions", json=_shared_prefix_body(0)))
        await wait_until(lambda: engine.stats().generated_tokens_total >= 1)
        await client.post("/v1/completions", json=_shared_prefix_body(100))
    assert engine.stats().shared_blocks_total == 0
    assert engine.stats().peak_used_tokens == 2 * 33 * 16


async def test_chat_prompts_with_the_same_first_messages_share_them() -> None:
    app = app_with(decode_rate=20.0)
    engine = state_of(app).engine
    system = {"role": "system", "content": "You are terse. " * 60}

    def body(question: str) -> dict[str, Any]:
        messages = [system, {"role": "user", "content": question}]
        return {"messages": messages, "max_tokens": 2, "ignore_eos": True}

    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/v1/chat/completions", json=body("Why?")))
        await wait_until(lambda: engine.stats().generated_tokens_total >= 1)
        await client.post("/v1/chat/completions", json=body("How so?"))
    assert engine.stats().shared_blocks_total >= 10


async def test_prompt_admission_still_overflows_the_pool() -> None:
    # Sharing and a cap on running sequences do not save an engine that admits by prompt.
    app = app_with(
        admission="prompt",
        kv_tokens=1024,
        decode_rate=4000.0,
        mean_output_tokens=100_000.0,
        max_running=4,
    )
    statuses: list[int] = []
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def post() -> None:
            body = {"prompt": "hi " * 40, "max_tokens": 500}
            statuses.append((await client.post("/v1/completions", json=body)).status_code)

        for _ in range(6):
            group.start_soon(post)
    assert 500 in statuses
    assert state_of(app).engine.stats().oom_events_total >= 1
    at_rest(app)


# --- continuous usage in streams ---------------------------------------------------------------


def _events(text: str) -> list[dict[str, Any]]:
    data = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _piece(chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return ""
    choice = chunk["choices"][0]
    text: str = choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
    return text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_gives_the_exact_progress_in_every_chunk(path: str) -> None:
    app = app_with(decode_rate=2000.0, mean_output_tokens=100_000.0)
    prompt = "Tell me about the river."
    asked: dict[str, Any] = {"prompt": prompt}
    if "chat" in path:
        asked = {"messages": [{"role": "user", "content": prompt}]}
    body: dict[str, Any] = {
        **asked,
        "max_tokens": 60,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with client_for(app) as client:
        response = await client.post(path, json=body)
        counted = (await client.post("/tokenize", json=asked)).json()["count"]
    chunks = _events(response.text)
    assert len(chunks) > 3
    text = ""
    for chunk in chunks:
        usage = chunk["usage"]
        text += _piece(chunk)
        assert usage["prompt_tokens"] == counted
        assert usage["completion_tokens"] == COUNTER.count(text)  # exactly what came so far
        assert usage["total_tokens"] == counted + usage["completion_tokens"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 60


async def test_usage_only_at_the_end_without_continuous_stats() -> None:
    app = app_with(decode_rate=2000.0, mean_output_tokens=100_000.0)
    async with client_for(app) as client:
        plain = await client.post(
            "/v1/completions",
            json={
                "prompt": "go",
                "max_tokens": 30,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        # vLLM: continuous stats only with include_usage.
        alone = await client.post(
            "/v1/completions",
            json={
                "prompt": "go",
                "max_tokens": 30,
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
        )
        bad = await client.post(
            "/v1/completions",
            json={
                "prompt": "go",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"},
            },
        )
    chunks = _events(plain.text)
    assert ["usage" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert not any("usage" in c for c in _events(alone.text))
    assert bad.status_code == 400


def test_streamed_chunks_leave_at_each_tick_with_their_usage() -> None:
    # A real server: the client reads the first pieces while the engine still generates.
    with running_server(
        **{**FAST, "decode_rate": 200.0, "mean_output_tokens": 100_000.0}
    ) as server:
        body = {
            "prompt": "go",
            "max_tokens": 60,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        progress: list[tuple[int, int]] = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    generated = json.loads(line[6:])["usage"]["completion_tokens"]
                    progress.append((generated, server.engine.stats().running))
    assert progress[-1][0] == 60
    early = [running for generated, running in progress if 0 < generated < 60]
    assert len(early) > 2
    assert early[0] == 1  # read while its sequence was still running


# --- the command line --------------------------------------------------------------------------


def test_the_engine_options_reach_the_config() -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert (config.max_running, config.throughput, config.prefix_caching) == (None, None, True)
    argv = ["--max-running", "8", "--throughput", "5000", "--no-prefix-caching"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.max_running, config.throughput, config.prefix_caching) == (8, 5000.0, False)
    assert config_from_args(build_parser().parse_args(["--prefix-caching"])).prefix_caching
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-caching", "--no-prefix-caching"])
    state = ServerState(config)
    assert state.engine.max_running == 8
    assert state.engine.throughput == state.ledger.throughput == 5000.0


@pytest.mark.parametrize(
    "fields", [{"max_running": 0}, {"throughput": 0.0}, {"prefix_caching": "yes"}]
)
def test_bad_engine_settings_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        ServerConfig(**fields)
