"""Chaos end to end: kvclient and raw httpx clients against the real server (uvicorn, loopback)
cancel, time out, hang up and get injected engine faults at random points, on asyncio and trio.

Afterwards nothing may be left behind: every reservation and KV block back, no OOM in reserve
mode, no 5xx but the injected ones, no task or thread left running on either side, no unfinished
async generator, and no prompt text in any log.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import gc
import json
import logging
import random
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from kvclient import (
    APIConnectionError,
    APIResponseError,
    AsyncClient,
    Client,
    InternalServerError,
    KVClientError,
    PromptTooLongError,
    RetryPolicy,
    ServerBusyError,
)
from kvclient._client import _Body
from kvclient.loadgen import make_prompt
from reference_server import RunningServer, ServerConfig, create_app, serve_in_thread

#: In every prompt: it must never appear in a log line.
MARKER = "zanzibar-quokka-4471"
CONFIG = ServerConfig(
    kv_tokens=4096,
    context_window=2048,
    decode_rate=8000.0,
    mean_output_tokens=200.0,
    tick_seconds=0.005,
    fault_rate=0.12,
    seed=8,
)
REQUESTS = 110
SETTLE_SECONDS = 5.0


# --- watching the server and the logs ------------------------------------------------------------


class LoopProbe:
    """Remembers the server's event loop, so the test can count the tasks running on it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)


def server_tasks(probe: LoopProbe) -> int:
    """Tasks alive on the server's loop (uvicorn's own and one per request being served)."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # not this one

    assert probe.loop is not None
    return asyncio.run_coroutine_threadsafe(count(), probe.loop).result(5)


def resting_tasks(probe: LoopProbe) -> int:
    """The server's task count once it is idle (the same for 0.1 s)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    last = server_tasks(probe)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = server_tasks(probe)
        if now == last:
            return now
        last = now
    pytest.fail("the server never came to rest")


@contextmanager
def chaos_server(config: ServerConfig = CONFIG) -> Iterator[tuple[RunningServer, LoopProbe]]:
    app = create_app(config)
    probe = LoopProbe(app)
    with serve_in_thread(probe, log_level="debug") as running:  # type: ignore[arg-type]
        # serve_in_thread serves the probe; look inside through the app itself.
        yield RunningServer(app=app, host=running.host, port=running.port), probe


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock_:
            self.records.append(record)

    def texts(self) -> list[str]:
        formatter = logging.Formatter()
        with self.lock_:
            records = list(self.records)
        return [formatter.format(r) + repr(r.__dict__) for r in records]


_LOGGERS = ("", "kvclient", "reference_server", "httpx", "httpcore", "uvicorn", "uvicorn.error")


@contextmanager
def capture_all_logs() -> Iterator[Capture]:
    """Every log record of the process at DEBUG, uvicorn's too (its loggers do not propagate).

    Enter it once the server runs: uvicorn's logging set-up replaces its loggers' handlers.
    """
    capture = Capture()
    saved = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.DEBUG)
        logger.addHandler(capture)
    try:
        yield capture
    finally:
        for logger, level in saved:
            logger.removeHandler(capture)
            logger.setLevel(level)


def assert_no_prompt_in_logs(capture: Capture) -> None:
    texts = capture.texts()
    assert texts, "the log capture saw nothing: it is not wired"
    leaked = [t for t in texts if MARKER in t]
    assert not leaked, leaked[:3]


def settle(server: RunningServer, probe: LoopProbe, baseline_tasks: int) -> None:
    """Give the server a few seconds to notice every disconnect; then all must be back."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        ledger = server.ledger.stats()
        engine = server.engine.stats()
        tasks = server_tasks(probe)
        if (ledger.inflight, engine.running, tasks) == (0, 0, baseline_tasks):
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"not back at rest after {SETTLE_SECONDS}s: {ledger}, {engine}, "
                f"{tasks} server tasks (baseline {baseline_tasks})"
            )
        time.sleep(0.01)
    assert ledger.reserved_tokens == 0
    assert ledger.admitted_total == ledger.released_total
    assert engine.used_tokens == 0
    assert server.state.queue.waiting == 0
    assert engine.oom_events_total == 0  # reserve mode never overflows the pool


def assert_only_injected_5xx(server: RunningServer, capture: Capture) -> None:
    answered_5xx = sum(n for (_, status), n in server.state.responses().items() if status >= 500)
    assert answered_5xx <= server.engine.stats().faults_total
    errors = [r for r in capture.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:3]]


def non_executor_threads() -> set[threading.Thread]:
    # Worker caches of the test's own event loop are not leaks: asyncio's default executor
    # (getaddrinfo) is bounded and joined when the loop closes; trio's idle workers exit by
    # themselves after 10 s.
    return {t for t in threading.enumerate() if not t.name.startswith(("asyncio_", "Trio thread"))}


# --- the async chaos -----------------------------------------------------------------------------

#: Set per request: a retry wait or cooldown hold cancels this scope (see ``sleep_or_cancel``).
_cancel_when_waiting: contextvars.ContextVar[anyio.CancelScope | None] = contextvars.ContextVar(
    "cancel_when_waiting", default=None
)


@dataclasses.dataclass
class Tally:
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    cancelled_while_waiting: int = 0
    unexpected: list[str] = dataclasses.field(default_factory=list)

    def outcomes_named(self, outcome: str) -> int:
        return sum(n for key, n in self.outcomes.items() if key.endswith(f":{outcome}"))


def classify(error: BaseException) -> str:
    """The outcome name of an expected failure; anything else is a test failure."""
    if isinstance(error, InternalServerError):
        return "injected_500" if error.code == "injected_fault" else f"UNEXPECTED 500 {error}"
    if isinstance(error, APIResponseError):
        return "injected_mid_stream" if "injected fault" in str(error) else f"UNEXPECTED {error}"
    if isinstance(error, ServerBusyError):
        return "busy"
    if isinstance(error, APIConnectionError):
        return "timeout"  # only the tiny-timeout clients may see these (checked below)
    return f"UNEXPECTED {type(error).__name__}: {error}"


async def read_stream(stream: Any, limit: int | None = None) -> int:
    chunks = 0
    async with stream:
        async for _ in stream:
            chunks += 1
            if limit is not None and chunks >= limit:
                break
    return chunks


async def hang_up_after(response: httpx.Response, chunks: int) -> None:
    """Read ``chunks`` chunks, then close the connection mid-body.

    The rest of httpx's generator chain is then run to its (immediate) end: abandoned half-way,
    trio would warn about each of them when they are collected.
    """
    body = response.aiter_raw()
    async for _ in body:
        chunks -= 1
        if chunks == 0:
            break
    await response.aclose()
    with contextlib.suppress(httpx.HTTPError):
        async for _ in body:
            pass


ASYNC_ACTIONS = (
    "complete",
    "chat",
    "stream",
    "cancel_before_send",
    "cancel_at_random",
    "cancel_while_waiting",
    "cancel_mid_stream",
    "break_mid_stream",
    "tiny_timeout",
    "raw_stream_hang_up",
    "raw_cancel",
)


async def one_async(
    i: int,
    rng: random.Random,
    client: AsyncClient,
    impatient: AsyncClient,
    raw: httpx.AsyncClient,
    tally: Tally,
) -> None:
    action = ASYNC_ACTIONS[i % len(ASYNC_ACTIONS)]
    prompt = f"{MARKER}{make_prompt(rng.randint(5, 300), rng)}"
    cap = rng.randint(20, 1200)
    k = rng.randint(1, 6)
    delay = rng.uniform(0.0, 0.25)
    outcome = "ok"
    try:
        with anyio.CancelScope() as scope:
            if action == "complete":
                await client.complete(prompt, max_tokens=cap)
            elif action == "chat":
                await client.chat([{"role": "user", "content": prompt}], max_tokens=cap)
            elif action == "stream":
                await read_stream(client.chat_stream([{"role": "user", "content": prompt}]))
            elif action == "cancel_before_send":
                scope.cancel()
                await client.complete(prompt, max_tokens=cap)
            elif action == "cancel_at_random":
                scope.deadline = anyio.current_time() + delay
                await client.complete(prompt, max_tokens=cap)
            elif action == "cancel_while_waiting":
                _cancel_when_waiting.set(scope)
                await client.complete(prompt, max_tokens=max(cap, 800))
            elif action == "cancel_mid_stream":
                async with client.complete_stream(prompt, max_tokens=cap) as stream:
                    async for _ in stream:
                        k -= 1
                        if k == 0:
                            scope.cancel()
            elif action == "break_mid_stream":
                await read_stream(client.complete_stream(prompt, max_tokens=cap), limit=k)
            elif action == "tiny_timeout":
                await impatient.complete(prompt, max_tokens=cap)
            elif action == "raw_stream_hang_up":
                body = {"prompt": prompt, "max_tokens": cap, "stream": True}
                response = await raw.send(raw_request(raw, body), stream=True)
                try:
                    await hang_up_after(response, k)
                finally:
                    await response.aclose()
            else:
                scope.deadline = anyio.current_time() + delay
                await raw.send(raw_request(raw, {"prompt": prompt, "max_tokens": cap}))
        if scope.cancelled_caught:
            outcome = "cancelled"
    except KVClientError as error:
        outcome = classify(error)
        if outcome == "timeout" and action != "tiny_timeout":
            outcome = f"UNEXPECTED {type(error).__name__}: {error}"
    except httpx.HTTPError as error:  # raw clients
        outcome = f"UNEXPECTED {type(error).__name__}: {error}"
    tally.outcomes[f"{action}:{outcome}"] += 1
    if outcome.startswith("UNEXPECTED"):
        tally.unexpected.append(f"{action}: {outcome}")


def raw_request(raw: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Request:
    """A raw POST whose body is not an async generator: httpx's own (for ``json=``) is left
    suspended when a send is cancelled mid-write, and trio warns when it collects it; kvclient
    avoids the same way (``kvclient._client._Body``)."""
    request = raw.build_request("POST", "/v1/completions", json=body)
    request.stream = _Body(request.content)
    return request


def chaos_policy(tally: Tally, **kw: Any) -> RetryPolicy:
    async def sleep_or_cancel(seconds: float) -> None:
        scope = _cancel_when_waiting.get()
        if scope is not None:
            tally.cancelled_while_waiting += 1
            scope.cancel()
        await anyio.sleep(seconds)

    return RetryPolicy(async_sleep=sleep_or_cancel, **{"max_attempts": 5, "deadline": 10, **kw})


@pytest.mark.anyio
async def test_async_chaos_leaves_nothing_behind(anyio_backend: str) -> None:
    rng = random.Random(20261130)
    tally = Tally()
    threads_before = non_executor_threads()
    with (
        warnings.catch_warnings(record=True) as caught,
        chaos_server() as (server, probe),
        capture_all_logs() as logs,
    ):
        warnings.simplefilter("always")
        async with httpx.AsyncClient(base_url=server.base_url) as warm:
            assert (await warm.get("/health")).status_code == 200
        baseline_tasks = resting_tasks(probe)
        tasks_before = len(anyio.get_running_tasks())

        timeout = httpx.Timeout(rng.choice([0.005, 0.02, 0.05]))
        async with (
            # Not pacing: the chaos must include 429s, most of which a paced client avoids (the
            # impatient one paces).
            AsyncClient(base_url=server.base_url, retry=chaos_policy(tally, pace=False)) as client,
            AsyncClient(
                base_url=server.base_url,
                timeout=timeout,
                retry=chaos_policy(tally, max_attempts=2, deadline=1),
            ) as impatient,
            httpx.AsyncClient(base_url=server.base_url, timeout=10) as raw,
            anyio.create_task_group() as group,
        ):
            for i in range(REQUESTS):
                group.start_soon(one_async, i, rng, client, impatient, raw, tally)
                await anyio.sleep(rng.uniform(0, 0.01))

        assert len(anyio.get_running_tasks()) == tasks_before
        gc.collect()
        settle(server, probe, baseline_tasks)
        assert_only_injected_5xx(server, logs)
        metrics = server.metrics()
    print(f"\n{anyio_backend}: {dict(sorted(tally.outcomes.items()))}")
    print(f"cancelled while waiting: {tally.cancelled_while_waiting}; server: {metrics}")
    assert tally.unexpected == []
    assert sum(tally.outcomes.values()) == REQUESTS
    # The chaos really happened: faults, 429s, cancellations in a retry wait, successes.
    assert metrics["kv_injected_faults_total"] >= 3
    assert metrics["kv_rejected_total"] >= 3
    assert tally.cancelled_while_waiting >= 1
    assert tally.outcomes_named("ok") >= 10
    assert non_executor_threads() == threads_before
    assert [str(w.message) for w in caught] == []  # no unfinished generator, no warning
    assert_no_prompt_in_logs(logs)


# --- the sync client from threads ----------------------------------------------------------------


SYNC_ACTIONS = ("complete", "stream", "break_mid_stream", "chat")


def test_sync_clients_in_threads_with_random_timeouts_leave_nothing_behind() -> None:
    rng = random.Random(7)
    threads_before = set(threading.enumerate())
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    with chaos_server() as (server, probe), capture_all_logs() as logs:
        httpx.get(server.base_url + "/health")
        baseline_tasks = resting_tasks(probe)
        # The impatient ones do not retry their timeouts: each one is a client hanging up.
        clients = [
            Client(
                base_url=server.base_url,
                timeout=httpx.Timeout(timeout),
                retry=RetryPolicy(max_attempts=1 if timeout < 0.1 else 4, deadline=10),
            )
            for timeout in (0.005, 0.02, 0.3, 30.0)
        ]
        jobs = [
            (
                SYNC_ACTIONS[i % len(SYNC_ACTIONS)],
                rng.choice(clients),
                f"{MARKER}{make_prompt(rng.randint(5, 300), rng)}",
                rng.randint(20, 1200),
                rng.randint(1, 5),
            )
            for i in range(64)
        ]

        def one(job: tuple[str, Client, str, int, int]) -> None:
            action, client, prompt, cap, k = job
            outcome = "ok"
            try:
                if action == "complete":
                    client.complete(prompt, max_tokens=cap)
                elif action == "chat":
                    client.chat([{"role": "user", "content": prompt}], max_tokens=cap)
                else:
                    limit = k if action == "break_mid_stream" else None
                    with client.complete_stream(prompt, max_tokens=cap) as stream:
                        for n, _ in enumerate(stream, start=1):
                            if n == limit:
                                break
            except KVClientError as error:
                outcome = classify(error)
            with lock:
                outcomes[outcome] += 1

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, jobs))
        for client in clients:
            client.close()
        settle(server, probe, baseline_tasks)
        assert_only_injected_5xx(server, logs)
        metrics = server.metrics()
    print(f"\nsync: {dict(outcomes)}; server: {metrics}")
    assert not [o for o in outcomes if o.startswith("UNEXPECTED")], outcomes
    assert outcomes["timeout"] >= 1
    assert outcomes["ok"] >= 5
    assert metrics["kv_injected_faults_total"] >= 1
    assert set(threading.enumerate()) == threads_before
    assert_no_prompt_in_logs(logs)


# --- prompts never reach the logs ----------------------------------------------------------------


def test_prompts_never_reach_the_logs_on_any_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Success, stream, 429 and retries, injected faults, 400, 413 and an unexpected 500 whose
    exception quotes the prompt: nothing logged at any level by kvclient, the server, uvicorn,
    httpx or httpcore contains the prompt."""
    config = dataclasses.replace(CONFIG, kv_tokens=2048, fault_rate=0.3, seed=1)
    prompt = f"{MARKER} tell me a secret"
    with chaos_server(config) as (server, _), capture_all_logs() as logs:
        base = server.base_url
        # Not pacing itself from the server's room: the 429 path is taken for sure.
        with Client(base_url=base, retry=RetryPolicy(max_attempts=8, pace=False)) as client:

            def call(i: int) -> None:
                try:
                    if i % 2:
                        client.complete(prompt, max_tokens=1500)
                    else:
                        with client.complete_stream(prompt, max_tokens=1500) as stream:
                            for _ in stream:
                                pass
                except KVClientError:
                    pass

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(call, range(12)))
            with pytest.raises(PromptTooLongError):
                client.complete(prompt * 2000)
        assert server.metrics()["kv_rejected_total"] >= 1  # 429s were logged as retries
        assert server.metrics()["kv_injected_faults_total"] >= 1
        with httpx.Client(base_url=base) as raw:
            for body in (
                {"prompt": prompt * 2000},
                {"prompt": prompt, "max_tokens": -1},
                {"prompt": [prompt, prompt]},
                {"messages": [{"role": prompt}]},
            ):
                assert 400 <= raw.post("/v1/completions", json=body).status_code < 500
            assert raw.post("/v1/completions", content=prompt.encode()).status_code == 400

            def broken(*args: object, **kwargs: object) -> None:
                raise RuntimeError(f"engine choked on {prompt!r}")

            monkeypatch.setattr(server.engine, "generate", broken)
            response = raw.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
            assert response.status_code == 500
            assert MARKER not in response.text
    assert any(r.name.startswith("kvclient") for r in logs.records)
    assert_no_prompt_in_logs(logs)


# --- helpers used above, checked -----------------------------------------------------------------


def test_classify_names_every_expected_failure() -> None:
    request = httpx.Request("POST", "http://127.0.0.1/v1/completions")

    def status(code: str) -> InternalServerError:
        body = json.dumps({"error": {"message": "m", "code": code}}).encode()
        response = httpx.Response(500, content=body, request=request)
        return InternalServerError("m", response=response, code=code)

    assert classify(status("injected_fault")) == "injected_500"
    assert classify(status("internal_error")).startswith("UNEXPECTED")
    assert classify(APIResponseError("mid-stream: injected fault")) == "injected_mid_stream"
    assert classify(APIResponseError("truncated")).startswith("UNEXPECTED")
    assert classify(ServerBusyError("x", retry_after=1.0, attempts=2)) == "busy"
    assert classify(ValueError("x")).startswith("UNEXPECTED")
