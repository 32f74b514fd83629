"""kvclient's Client and AsyncClient against the real reference server, over loopback.

The acceptance of the reference-server issue: a prompt over the context is refused before any
send; saturation gives a 429 with a sensible Retry-After; retries then succeed; one client's 429
cools the whole client down instead of every request finding out for itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from kvclient import (
    AsyncClient,
    Client,
    Completion,
    PromptTooLongError,
    RateLimitError,
    RetryEvent,
    RetryPolicy,
    ServerBusyError,
    TiktokenCounter,
)
from reference_server import RunningServer, running_server
from tests.helpers.servers import at_zero, hold, wait_for

COUNTER = TiktokenCounter()
#: The model and window given to a client that must send before it knows the room: with both,
#: it skips discovery (whose /v1/models answer advertises the room) and hears of a full ledger
#: only from a 429, which is what the tests of 429s need.
MODEL = "kvclient-sim"
CONFIG: dict[str, Any] = {
    "kv_tokens": 4096,  # usable 3686
    "context_window": 2048,
    "decode_rate": 4000.0,
    "mean_output_tokens": 1e6,  # always run to the cap: timings are predictable
    "tick_seconds": 0.005,
}


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with running_server(**CONFIG) as running:
        yield running


@pytest.fixture
def slow_server() -> Iterator[RunningServer]:
    """Decoding at 1,000 tokens/s: a holder of 2,000 tokens runs 2 s, long enough that a busy
    machine cannot start the requests meant to meet it only after it is gone."""
    with running_server(**{**CONFIG, "decode_rate": 1000.0}) as running:
        yield running


def test_prompt_over_the_context_is_refused_without_a_send(server: RunningServer) -> None:
    with Client(base_url=server.base_url, model="kvclient-sim", context_window=2048) as client:
        before = server.metrics()
        with pytest.raises(PromptTooLongError) as exc:
            client.complete("word " * 3000, max_tokens=10)
        after = server.metrics()
    assert exc.value.prompt_tokens == COUNTER.count("word " * 3000)
    assert exc.value.context_window == 2048
    assert after["kv_http_requests_total"] == before["kv_http_requests_total"]
    assert after["kv_generation_requests_total"] == before["kv_generation_requests_total"] == 0


def test_discovered_context_window_still_refuses_without_a_generation_send(
    server: RunningServer,
) -> None:
    with Client(base_url=server.base_url) as client:
        with pytest.raises(PromptTooLongError):
            client.chat([{"role": "user", "content": "word " * 3000}])
        assert client.context_window == 2048  # from /v1/models max_model_len
    assert server.metrics()["kv_generation_requests_total"] == 0


def test_client_counts_and_server_usage_agree(server: RunningServer) -> None:
    with Client(base_url=server.base_url) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        chat = client.chat(messages, max_tokens=20)
        text = client.complete("Once upon a time", max_tokens=20)
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == chat.prompt_tokens
    assert text.usage is not None
    assert text.usage.prompt_tokens == text.prompt_tokens
    assert text.usage.completion_tokens == COUNTER.count(text.text) == 20


def test_unset_max_tokens_is_sent_clamped(server: RunningServer) -> None:
    with Client(base_url=server.base_url, context_window=2048) as client:
        completion = client.complete("hi", max_tokens=None)
    assert completion.max_tokens == 2048 - COUNTER.count("hi")
    assert completion.usage is not None
    assert completion.usage.completion_tokens == completion.max_tokens


def test_saturation_gives_a_429_with_a_sensible_retry_after(server: RunningServer) -> None:
    holder = hold(server, 2000)  # 2000 tokens at 4000/s: due in ~0.5 s
    policy = RetryPolicy(max_attempts=1)
    with (
        Client(base_url=server.base_url, model=MODEL, context_window=2048, retry=policy) as client,
        pytest.raises((RateLimitError, ServerBusyError)) as exc,
    ):
        client.complete("y", max_tokens=2000)
    error = exc.value
    advice = error.retry_after
    if advice is None and isinstance(error, ServerBusyError):
        assert isinstance(error.last_error, RateLimitError)
        advice = error.last_error.retry_after
    assert advice is not None
    assert 0.2 <= advice <= 1.0  # retry-after-ms: the holder's remaining decode time
    assert server.metrics()["kv_rejected_total"] == 1
    holder.join(10)


def test_retries_then_succeed(slow_server: RunningServer) -> None:
    server = slow_server
    holder = hold(server, 2000)
    with Client(base_url=server.base_url, model=MODEL, context_window=2048) as client:
        completion = client.complete("y", max_tokens=2000)
    assert completion.attempts >= 2
    assert completion.retry_wait > 0
    assert completion.history
    assert completion.history[0].status_code == 429
    assert completion.finish_reason == "length"
    holder.join(10)
    wait_for(lambda: at_zero(server))


Finished = tuple[Completion, float]  # a completion and the monotonic time it came back


def _large_refused_then_small(
    server: RunningServer, policy: RetryPolicy
) -> tuple[Finished, list[Finished], float, float]:
    """With 2008 tokens held by another client, one client sends a large request (1808
    tokens: refused, it fits only once the holder is done) and, once told to wait, three small
    ones (108: they fit now). Returns the large, the small, when the 429 came and its advice."""
    holder = hold(server, 2000)  # 2008 reserved; due in ~2 s
    retried = threading.Event()
    events: list[RetryEvent] = []
    results: dict[str, Finished] = {}

    def on_retry(event: RetryEvent) -> None:
        events.append(event)
        retried.set()

    with Client(
        base_url=server.base_url,
        model=MODEL,
        context_window=2048,
        on_retry=on_retry,
        retry=policy,
    ) as client:

        def one(name: str, max_tokens: int) -> None:
            results[name] = (client.complete("y", max_tokens=max_tokens), time.monotonic())

        first = threading.Thread(target=one, args=("large", 1800))
        first.start()
        assert retried.wait(5)
        told = time.monotonic()
        advice = events[0].retry_after
        assert advice is not None
        others = [threading.Thread(target=one, args=(f"small{i}", 100)) for i in range(3)]
        for thread in others:
            thread.start()
        for thread in [first, *others]:
            thread.join(30)
    holder.join(10)
    assert len(results) == 4
    assert server.metrics()["kv_rejected_total"] == 1  # only the first request heard "no"
    wait_for(lambda: at_zero(server))
    return results["large"], [results[f"small{i}"] for i in range(3)], told, advice


def test_cooldown_is_honoured_across_requests_of_one_client(slow_server: RunningServer) -> None:
    """After one 429, the client's other requests wait out the advice instead of sending.

    The later requests are small: the server would have admitted them at once, so a 429-free
    run with ``retry_wait > 0`` shows they were held by the client, not refused by the server.
    (Without pacing: the room the 429 advertises would let them go, as the next test shows.)
    """
    _, small, told, advice = _large_refused_then_small(slow_server, RetryPolicy(pace=False))
    for completion, finished in small:
        assert completion.attempts == 1
        assert completion.retry_wait > 0
        assert finished - told >= advice * 0.9


def test_the_room_a_429_advertises_lets_what_fits_go_at_once(slow_server: RunningServer) -> None:
    """Pacing (the default): the 429 says 1678 tokens are free, so the small requests (112 in
    blocks) go at once and are admitted; the large one still waits for room."""
    (large, large_finished), small, told, advice = _large_refused_then_small(
        slow_server, RetryPolicy()
    )
    assert large.attempts == 2
    assert large_finished - told >= advice * 0.9
    for completion, _ in small:
        assert completion.attempts == 1
        assert completion.retry_wait == 0


def test_paced_in_order_requests_wait_behind_an_earlier_refused_one(
    slow_server: RunningServer,
) -> None:
    """``pace_in_order``: held requests go in the order their calls started, as a FIFO-queued
    server admits them: the small requests would fit, but the large one refused before them
    goes first, once the holder is done. No request hears "no" twice."""
    policy = RetryPolicy(pace_in_order=True)
    (large, large_finished), small, told, advice = _large_refused_then_small(slow_server, policy)
    assert large.attempts == 2
    assert large_finished - told >= advice * 0.9
    for completion, finished in small:
        assert completion.attempts == 1
        assert completion.retry_wait > 0  # held behind the large one, not refused
        assert finished - told >= advice * 0.9


def test_cooldown_holds_the_large_and_lets_the_small_fill_the_room(
    slow_server: RunningServer,
) -> None:
    """With ``cooldown_by_size``, after a 429 for a large request, the client's requests small
    enough to fit in what is left go at once and are admitted, while the large one waits out the
    advice.

    (That requests at least as large are held is checked against a scripted server in
    the client tests; here the real server shows the small ones really fit.)
    """
    policy = RetryPolicy(cooldown_by_size=True)
    (large, large_finished), small, told, advice = _large_refused_then_small(slow_server, policy)
    assert large.attempts == 2
    assert large_finished - told >= advice * 0.9
    for completion, _ in small:
        assert completion.attempts == 1
        assert completion.retry_wait == 0


def test_streaming_through_the_client(server: RunningServer) -> None:
    with (
        Client(base_url=server.base_url) as client,
        client.chat_stream([{"role": "user", "content": "go"}], max_tokens=25) as stream,
    ):
        text = "".join(chunk.text for chunk in stream)
        completion = stream.completion
    assert completion.text == text
    assert COUNTER.count(text) == 25
    wait_for(lambda: at_zero(server))


@pytest.mark.anyio
async def test_async_client_end_to_end(server: RunningServer) -> None:
    async with AsyncClient(base_url=server.base_url) as client:
        with pytest.raises(PromptTooLongError):
            await client.complete("word " * 3000)  # the window discovered, with the room
        # The ledger fills after discovery: the room the client saw there is gone, and only
        # the server's 429 says so.
        holder = await anyio.to_thread.run_sync(hold, server, 2000)
        retried = await client.complete("y", max_tokens=2000)
        assert retried.attempts >= 2
        async with client.chat_stream(
            [{"role": "user", "content": "stream"}], max_tokens=15
        ) as stream:
            pieces = [chunk.text async for chunk in stream]
        assert COUNTER.count("".join(pieces)) == 15
    holder.join(10)
    with anyio.fail_after(5):
        while not at_zero(server):  # noqa: ASYNC110 - polling state the server thread owns
            await anyio.sleep(0.005)
