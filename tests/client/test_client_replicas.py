"""Several replicas, one client: what only threads, tasks or generated scripts can express.

The behaviours themselves, on ``AsyncClient``, ``Client`` and the openai drop-in, are in
tests/client/_async/test_replicas.py (and its generated sync twin).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient import AsyncClient, Client, RetryPolicy
from kvclient._exceptions import KVClientError
from kvclient._pacing import Pacer
from kvclient._replicas import Replicas
from kvclient.headers import format_ratelimit
from kvclient.testing import FakeClock
from tests.helpers.client import (
    COUNTER,
    MODEL,
    broken_sse,
    busy,
    ok_completion,
    refused,
    room,
    sse,
    text_events,
)

URLS = ["http://a.test", "http://b.test", "http://c.test"]
Handler = Callable[[httpx.Request], httpx.Response]


def by_host(replies: dict[str, Handler], hits: Counter[str]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        hits[host] += 1
        return replies[host](request)

    return httpx.MockTransport(handler)


def client(
    replies: dict[str, Handler], hits: Counter[str], clock: FakeClock, **policy: object
) -> Client:
    return Client(
        base_url=URLS[: len(replies)],
        model=MODEL,
        context_window=1000,
        counter=COUNTER,
        retry=clock.policy(**policy),
        transport=by_host(replies, hits),
    )


OUTCOMES = st.sampled_from(["ok", "429", "503", "refused", "400", "stream", "cut"])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(OUTCOMES, OUTCOMES, OUTCOMES), min_size=1, max_size=6))
def test_in_flight_accounting_returns_to_zero_whatever_happens(
    script: list[tuple[str, str, str]],
) -> None:
    clock = FakeClock()
    step = {"n": 0}

    def reply(index: int) -> Handler:
        def handler(request: httpx.Request) -> httpx.Response:
            outcome = script[step["n"] % len(script)][index]
            if outcome == "refused":
                return refused(request)
            streamed = b'"stream"' in request.content
            if outcome == "stream" and streamed:
                return sse(*text_events("a", "b"))
            if outcome == "cut" and streamed:  # the connection drops after one event
                return broken_sse(*text_events("a", "b")[:1])
            return {
                "429": lambda: room(busy(None, ms="10"), remaining=0),
                "503": lambda: busy(None, status=503),
                "400": lambda: httpx.Response(400, json={"error": {"message": "bad"}}),
            }.get(outcome, lambda: room(ok_completion(), remaining=5_000))()

        return handler

    hits: Counter[str] = Counter()
    replies = {host: reply(i) for i, host in enumerate(["a.test", "b.test", "c.test"])}
    with client(replies, hits, clock, max_attempts=3, deadline=5.0) as kv:
        for n in range(len(script)):
            step["n"] = n
            try:
                if n % 2:
                    with kv.complete_stream("hello", max_tokens=20) as stream:
                        for _ in stream:
                            pass
                else:
                    kv.complete("hello", max_tokens=20)
            except KVClientError:
                pass
            assert all(r.requests == 0 and r.tokens == 0 for r in kv._replicas), kv._replicas
            assert all(r.window.in_flight == 0 for r in kv._replicas)


@pytest.mark.anyio
async def test_async_client_fails_over_and_counts_nothing_left_in_flight() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": refused,
        "b.test": lambda r: room(ok_completion(), remaining=5_000),
        "c.test": lambda r: room(ok_completion(), remaining=5_000),
    }
    kv = AsyncClient(
        base_url=URLS,
        model=MODEL,
        context_window=1000,
        counter=COUNTER,
        retry=clock.policy(max_attempts=1),
        transport=by_host(replies, hits),
    )
    async with kv, anyio.create_task_group() as tg:
        for _ in range(12):
            tg.start_soon(kv.complete, "hello")
    assert hits["a.test"] == 1
    assert hits["b.test"] + hits["c.test"] == 12
    assert all(r.requests == 0 and r.tokens == 0 for r in kv._replicas)


def test_threads_share_one_multi_replica_client_and_leave_nothing_in_flight() -> None:
    hits: Counter[str] = Counter()
    lock = threading.Lock()
    count = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        with lock:
            count["n"] += 1
            n = count["n"]
        if n % 5 == 0:
            return refused(request)
        return room(ok_completion(), remaining=5_000 - 7 * (n % 50))

    replies = {"a.test": flaky, "b.test": flaky, "c.test": lambda r: busy(None, status=503)}
    errors: list[BaseException] = []
    with client(replies, hits, FakeClock(), max_attempts=3) as kv:

        def work() -> None:
            for _ in range(15):
                try:
                    kv.complete("hello", max_tokens=10)
                except KVClientError as exc:  # every replica refused this one: allowed
                    errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        assert all(r.requests == 0 and r.tokens == 0 for r in kv._replicas), kv._replicas
        assert all(r.window.in_flight == 0 and r.window.requests == 0 for r in kv._replicas)
    assert len(errors) < 6  # most calls found a replica that answered


class _OursPacer(Pacer):
    """Records the ``ours`` each hint is observed with."""

    __slots__ = ("ours",)

    def __init__(self) -> None:
        super().__init__()
        self.ours: list[int | None] = []

    def observe(self, *args: Any, ours: int | None = None, **kw: Any) -> None:
        self.ours.append(ours)
        super().observe(*args, ours=ours, **kw)


@pytest.mark.parametrize(
    ("status", "media", "ours"),
    [
        (200, "application/json", 300 + 200 + 2 * 16),  # released as it was answered
        (429, "application/json", 300 + 200 + 2 * 16),  # refused: it reserved nothing
        (200, "text/event-stream", 400 + 300 + 200 + 3 * 16),  # its stream holds its room
    ],
)
def test_the_room_a_hint_shows_held_is_ours_by_the_send_window(
    status: int, media: str, ours: int
) -> None:
    replicas = Replicas(["http://a.test"], RetryPolicy())
    replica = replicas[0]
    replica.pacer = spy = _OursPacer()
    calls = [replicas.new_call(size) for size in (400, 300, 200)]
    for call in calls:
        assert replica.window.try_acquire(0.0, call.size)
    request = httpx.Request(
        "POST", "http://a.test/v1/completions", extensions=calls[0].extensions()
    )
    policy, current = format_ratelimit(quota=1000, remaining=100, reset=1.0)
    headers = {"RateLimit-Policy": policy, "RateLimit": current, "Content-Type": media}
    replicas.note_room(httpx.Response(status, headers=headers, request=request))
    assert spy.ours == [ours]
    off = Replicas(["http://a.test"], RetryPolicy(window=False))
    off[0].pacer = spy = _OursPacer()
    alone = httpx.Request("POST", "http://a.test/v1/completions")
    off.note_room(httpx.Response(status, headers=headers, request=alone))
    assert spy.ours == [None]  # no window, nothing counted: hints age as before
