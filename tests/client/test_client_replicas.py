"""One client, several replicas (``base_url=[...]``): routing, fail-over, health, accounting.

Over ``httpx.MockTransport`` on a fake clock; tests/e2e/test_e2e_replicas.py runs real servers.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient import AsyncClient, Client
from kvclient._exceptions import APIConnectionError, KVClientError
from kvclient._pacing import format_ratelimit
from kvclient.testing import FakeClock
from tests.helpers.client import (
    COUNTER,
    MODEL,
    broken_sse,
    busy,
    ok_completion,
    sse,
    text_events,
)

URLS = ["http://a.test", "http://b.test", "http://c.test"]
Handler = Callable[[httpx.Request], httpx.Response]


def room(response: httpx.Response, remaining: int, quota: int = 10_000) -> httpx.Response:
    policy, current = format_ratelimit(quota=quota, remaining=remaining, reset=5.0)
    response.headers["RateLimit-Policy"] = policy
    response.headers["RateLimit"] = current
    return response


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


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


def test_a_single_url_and_a_list_of_one_behave_alike() -> None:
    one = Client(base_url="http://a.test/v1", model=MODEL, context_window=1000)
    listed = Client(base_url=["http://a.test/v1"], model=MODEL, context_window=1000)
    assert one.base_url == listed.base_url == "http://a.test"
    assert listed.base_urls == ("http://a.test",)


@pytest.mark.parametrize(
    ("urls", "error"),
    [
        ([], "non-empty"),
        (["http://a.test", "http://a.test/v1"], "twice"),
        (["http://u:p@a.test", "http://b.test"], "different credentials"),
        (["ftp://a.test"], "http://"),
    ],
)
def test_bad_replica_lists_are_refused(urls: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Client(base_url=urls, model=MODEL, context_window=1000)


def test_requests_go_where_the_advertised_room_is() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": lambda r: room(ok_completion(), remaining=300),
        "b.test": lambda r: room(ok_completion(), remaining=9_000),
    }
    with client(replies, hits, clock) as kv:
        for _ in range(10):
            kv.complete("hello", max_tokens=400)
    # Before any hint both are unknown (a, then b by what is in flight); once a says it has
    # 300 free, a request of 400+ goes to b.
    assert hits["b.test"] >= 8
    assert all(r.requests == 0 and r.tokens == 0 for r in kv._replicas)


def test_a_refused_connection_goes_to_another_replica_at_once_and_sets_it_aside() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {"a.test": refused, "b.test": lambda r: ok_completion()}
    with client(replies, hits, clock, max_attempts=1) as kv:
        first = kv.complete("hello", max_tokens=10)
        assert first.attempts == 1  # not a retry: the same attempt, on another replica
        for _ in range(5):
            kv.complete("hello", max_tokens=10)
        assert hits == Counter({"a.test": 1, "b.test": 6})  # set aside after one refusal
        clock.advance(2.5)  # past the set-aside time: one request probes it
        kv.complete("hello", max_tokens=10)
        assert hits["a.test"] == 2
        replies["a.test"] = lambda r: ok_completion()
        clock.advance(2.5)
        kv.complete("hello", max_tokens=10)  # the probe succeeds: back in service
        assert hits["a.test"] == 3
        assert kv._replicas[0].health.in_service(clock.now)


def test_a_503_fails_over_at_once_and_the_replica_is_avoided() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": lambda r: busy(None, status=503),
        "b.test": lambda r: ok_completion(),
    }
    with client(replies, hits, clock, max_attempts=1) as kv:
        for _ in range(8):
            assert kv.complete("hello", max_tokens=10).attempts == 1
    # The 503 narrowed a's send window to nothing in flight: b, whose room is unknown (so
    # presumed larger), takes the rest.
    assert hits == Counter({"a.test": 1, "b.test": 8})
    assert kv._replicas[0].health.failures == 1


def test_when_every_replica_is_down_the_connection_error_is_raised() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {"a.test": refused, "b.test": refused}
    kv = client(replies, hits, clock, max_attempts=2)
    with kv, pytest.raises(APIConnectionError, match="before any answer"):
        kv.complete("hello", max_tokens=10)
    # The first attempt tried both; the second went to the one set aside longest (the other
    # was set aside too, so it was not tried again within the attempt).
    assert hits == Counter({"a.test": 2, "b.test": 1})
    assert all(r.requests == 0 for r in kv._replicas)


def test_a_429_cools_down_only_its_replica() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": lambda r: busy("30"),
        "b.test": lambda r: ok_completion(),
    }
    with client(replies, hits, clock) as kv:
        done = kv.complete("hello", max_tokens=10)
        assert done.attempts == 1  # a is full, b has room: the same attempt goes there
        assert clock.now < 30  # without waiting out a's Retry-After
        assert kv._replicas[0].cooldown.remaining(clock.now) > 25  # a cools down, alone
        for _ in range(4):
            kv.complete("hello", max_tokens=10)
    assert hits["a.test"] == 1


def test_a_stream_fails_over_before_its_first_event() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": refused,
        "b.test": lambda r: sse(*text_events("hi", " there")),
    }
    kv = client(replies, hits, clock, max_attempts=1)
    with kv, kv.complete_stream("hello", max_tokens=10) as stream:
        text = "".join(chunk.text for chunk in stream)
    assert text == "hi there"
    assert stream.completion.attempts == 1
    assert all(r.requests == 0 and r.tokens == 0 for r in kv._replicas)


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


def models_with(window: int) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            data = [{"id": MODEL, "object": "model", "max_model_len": window}]
            return httpx.Response(200, json={"object": "list", "data": data})
        return ok_completion()

    return handler


def discovering(replies: dict[str, Handler], hits: Counter[str], clock: FakeClock) -> Client:
    return Client(
        base_url=URLS[: len(replies)],
        counter=COUNTER,
        retry=clock.policy(),
        transport=by_host(replies, hits),
    )


def test_discovery_asks_every_replica_and_clamps_to_the_smallest_window() -> None:
    hits: Counter[str] = Counter()
    replies = {"a.test": models_with(1000), "b.test": models_with(800), "c.test": models_with(900)}
    with discovering(replies, hits, FakeClock()) as kv:
        done = kv.complete("hello")  # no cap: up to the window, here the smallest one's
        assert kv.model == MODEL
        assert kv.context_window == 800
        assert [r.context_window for r in kv._replicas] == [1000, 800, 900]
        assert done.max_tokens == 800 - done.prompt_tokens


def test_discovery_skips_a_replica_that_does_not_answer() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies = {"a.test": refused, "b.test": models_with(700)}
    with discovering(replies, hits, clock) as kv:
        kv.complete("hello", max_tokens=5)
        assert kv.context_window == 700
        assert hits["a.test"] == 1  # asked once, not retried until the deadline
        assert clock.now == 0  # nothing waited
        assert kv._replicas[0].health.set_aside
        assert [r.context_window for r in kv._replicas] == [None, 700]


def test_discovery_with_no_replica_answering_raises_as_one_would() -> None:
    hits: Counter[str] = Counter()
    clock = FakeClock()
    replies = {"a.test": refused, "b.test": refused}
    kv = Client(
        base_url=URLS[:2],
        counter=COUNTER,
        retry=clock.policy(max_attempts=2),
        transport=by_host(replies, hits),
    )
    with kv, pytest.raises(APIConnectionError, match="before any answer"):
        kv.complete("hello", max_tokens=5)
    assert kv.context_window is None


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


def test_a_retry_is_routed_afresh_not_to_the_first_replica() -> None:
    hits: Counter[str] = Counter()
    seen: list[str] = []

    def a(request: httpx.Request) -> httpx.Response:
        seen.append("a")
        return busy(None, status=503)

    def b(request: httpx.Request) -> httpx.Response:
        seen.append("b")
        if seen.count("b") == 1:  # full for a moment, with room advertised behind it
            return room(busy(None, ms="50"), remaining=5_000)
        return room(ok_completion(), remaining=5_000)

    with client({"a.test": a, "b.test": b}, hits, FakeClock()) as kv:
        done = kv.complete("hello", max_tokens=10)
    # The first attempt tried a (503) then b (429); the retry goes where the room is (b), not
    # back to the first replica in the list.
    assert seen == ["a", "b", "b"]
    assert done.attempts == 2
