"""Several replicas, one client (``base_url=[...]``): routing, fail-over, health, accounting.

Every behaviour runs through ``AsyncClient`` and through the openai drop-in
(``kvclient.openai.AsyncOpenAI(base_url=[...])``), which sends on the same path. Over
``httpx.MockTransport`` on a fake clock; tests/e2e/test_e2e_replicas.py runs real servers.

The source of tests/client/_sync/test_replicas.py (``python scripts/unasync.py``): edit this
file. What only threads or tasks can express is in tests/client/test_client_replicas.py.
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx
import openai
import pytest

from kvclient import AsyncClient, RetryEvent
from kvclient._exceptions import APIConnectionError
from kvclient.openai import AsyncOpenAI
from kvclient.testing import FakeClock
from tests.helpers.client import (
    COUNTER,
    MODEL,
    busy,
    ok_completion,
    refused,
    room,
    sse,
    text_events,
)

pytestmark = pytest.mark.anyio

URLS = ["http://a.test", "http://b.test", "http://c.test"]
Handler = Callable[[httpx.Request], httpx.Response]


def models_with(window: int) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            data = [{"id": MODEL, "object": "model", "max_model_len": window}]
            return httpx.Response(200, json={"object": "list", "data": data})
        return ok_completion()

    return handler


class Via:
    """One way to send completions over the replicas ``replies`` answers for: kvclient's own
    client (``"client"``) or the openai drop-in (``"openai"``).

    ``hits`` counts the requests per host, ``caps`` the ``max_tokens`` each generation request
    carried. Without ``context_window`` the model and window are discovered.
    """

    def __init__(
        self,
        kind: str,
        replies: dict[str, Handler],
        clock: FakeClock,
        *,
        context_window: int | None = 1000,
        **policy: Any,
    ) -> None:
        self.hits: Counter[str] = Counter()
        self.caps: list[int] = []
        self.retries: list[RetryEvent] = []

        def handler(request: httpx.Request) -> httpx.Response:
            host = request.url.host
            self.hits[host] += 1
            if request.method == "POST":
                self.caps.append(json.loads(request.content)["max_tokens"])
            return replies[host](request)

        options: dict[str, Any] = {
            "context_window": context_window,
            "counter": COUNTER,
            "retry": clock.policy(**policy),
            "on_retry": self.retries.append,
        }
        urls = URLS[: len(replies)]
        transport = httpx.MockTransport(handler)
        self.sdk: AsyncOpenAI | None = None
        if kind == "client":
            model = MODEL if context_window is not None else None
            self.client = AsyncClient(base_url=urls, model=model, transport=transport, **options)
        else:
            self.sdk = AsyncOpenAI(base_url=urls, api_key="sk-test", transport=transport, **options)
            self.client = self.sdk.kvclient_transport.client
        self.connection_error = (
            APIConnectionError if self.sdk is None else openai.APIConnectionError
        )

    async def __aenter__(self) -> Via:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.sdk is None:
            await self.client.aclose()
        else:
            await self.sdk.close()

    @property
    def replicas(self) -> list[Any]:
        return list(self.client._replicas)

    def idle(self) -> bool:
        """Nothing is left in flight on any replica or in any send window."""
        return all(
            r.requests == 0 and r.tokens == 0 and r.window.in_flight == 0 for r in self.replicas
        )

    async def complete(self, prompt: str, max_tokens: int | None = None) -> int:
        """Send one completion; the attempts it took."""
        before = len(self.retries)
        if self.sdk is None:
            return (await self.client.complete(prompt, max_tokens=max_tokens)).attempts
        await self.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        return 1 + len(self.retries) - before

    async def stream(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        """Stream one completion; its text and the attempts it took."""
        before = len(self.retries)
        if self.sdk is None:
            async with self.client.complete_stream(prompt, max_tokens=max_tokens) as stream:
                text = "".join([chunk.text async for chunk in stream])
            return text, stream.completion.attempts
        chunks = await self.sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True
        )
        text = "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])
        del chunks
        gc.collect()  # while the test's warning filters are on (see the stream test)
        return text, 1 + len(self.retries) - before


@pytest.fixture(params=["client", "openai"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_single_url_and_a_list_of_one_behave_alike() -> None:
    one = AsyncClient(base_url="http://a.test/v1", model=MODEL, context_window=1000)
    listed = AsyncClient(base_url=["http://a.test/v1"], model=MODEL, context_window=1000)
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
async def test_bad_replica_lists_are_refused(urls: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AsyncClient(base_url=urls, model=MODEL, context_window=1000)


async def test_requests_go_where_the_advertised_room_is(kind: str) -> None:
    replies: dict[str, Handler] = {
        "a.test": lambda r: room(ok_completion(), remaining=300),
        "b.test": lambda r: room(ok_completion(), remaining=9_000),
    }
    async with Via(kind, replies, FakeClock()) as via:
        for _ in range(10):
            await via.complete("hello", max_tokens=400)
        # Before any hint both are unknown (a, then b by what is in flight); once a says it
        # has 300 free, a request of 400+ goes to b.
        assert via.hits["b.test"] >= 8
        assert via.idle()


async def test_a_refused_connection_goes_to_another_replica_at_once_and_sets_it_aside(
    kind: str,
) -> None:
    clock = FakeClock()
    replies: dict[str, Handler] = {"a.test": refused, "b.test": lambda r: ok_completion()}
    async with Via(kind, replies, clock, max_attempts=1) as via:
        # Not a retry: the same attempt, on another replica.
        assert await via.complete("hello", max_tokens=10) == 1
        for _ in range(5):
            await via.complete("hello", max_tokens=10)
        assert via.hits == Counter({"a.test": 1, "b.test": 6})  # set aside after one refusal
        clock.advance(2.5)  # past the set-aside time: one request probes it
        await via.complete("hello", max_tokens=10)
        assert via.hits["a.test"] == 2
        replies["a.test"] = lambda r: ok_completion()
        clock.advance(2.5)
        await via.complete("hello", max_tokens=10)  # the probe succeeds: back in service
        assert via.hits["a.test"] == 3
        assert via.replicas[0].health.in_service(clock.now)


async def test_a_503_fails_over_at_once_and_the_replica_is_avoided(kind: str) -> None:
    replies: dict[str, Handler] = {
        "a.test": lambda r: busy(None, status=503),
        "b.test": lambda r: ok_completion(),
    }
    async with Via(kind, replies, FakeClock(), max_attempts=1) as via:
        for _ in range(8):
            assert await via.complete("hello", max_tokens=10) == 1
        # The 503 narrowed a's send window to nothing in flight: b, whose room is unknown (so
        # presumed larger), takes the rest.
        assert via.hits == Counter({"a.test": 1, "b.test": 8})
        assert via.replicas[0].health.failures == 1


async def test_when_every_replica_is_down_the_connection_error_is_raised(kind: str) -> None:
    replies: dict[str, Handler] = {"a.test": refused, "b.test": refused}
    async with Via(kind, replies, FakeClock(), max_attempts=2) as via:
        with pytest.raises(via.connection_error):
            await via.complete("hello", max_tokens=10)
        # The first attempt tried both; the second went to the one set aside longest (the
        # other was set aside too, so it was not tried again within the attempt).
        assert via.hits == Counter({"a.test": 2, "b.test": 1})
        assert via.idle()


async def test_a_429_cools_down_only_its_replica(kind: str) -> None:
    clock = FakeClock()
    replies: dict[str, Handler] = {
        "a.test": lambda r: busy("30"),
        "b.test": lambda r: ok_completion(),
    }
    async with Via(kind, replies, clock) as via:
        # a is full, b has room: the same attempt goes there.
        assert await via.complete("hello", max_tokens=10) == 1
        assert clock.now < 30  # without waiting out a's Retry-After
        assert via.replicas[0].cooldown.remaining(clock.now) > 25  # a cools down, alone
        for _ in range(4):
            await via.complete("hello", max_tokens=10)
        assert via.hits["a.test"] == 1


# The openai SDK's async stream stops at [DONE] and leaves its own generators (and httpx's
# under them) unfinished; trio warns when it collects them.
@pytest.mark.filterwarnings("ignore:Async generator 'openai._streaming:ResourceWarning")
@pytest.mark.filterwarnings("ignore:Async generator 'httpx._models:ResourceWarning")
async def test_a_stream_fails_over_before_its_first_event(kind: str) -> None:
    replies: dict[str, Handler] = {
        "a.test": refused,
        "b.test": lambda r: sse(*text_events("hi", " there")),
    }
    async with Via(kind, replies, FakeClock(), max_attempts=1) as via:
        text, attempts = await via.stream("hello", max_tokens=10)
        assert (text, attempts) == ("hi there", 1)
        assert via.idle()


async def test_a_retry_is_routed_afresh_not_to_the_first_replica(kind: str) -> None:
    seen: list[str] = []

    def a(request: httpx.Request) -> httpx.Response:
        seen.append("a")
        return busy(None, status=503)

    def b(request: httpx.Request) -> httpx.Response:
        seen.append("b")
        if seen.count("b") == 1:  # full for a moment, with room advertised behind it
            return room(busy(None, ms="50"), remaining=5_000)
        return room(ok_completion(), remaining=5_000)

    async with Via(kind, {"a.test": a, "b.test": b}, FakeClock()) as via:
        attempts = await via.complete("hello", max_tokens=10)
    # The first attempt tried a (503) then b (429); the retry goes where the room is (b), not
    # back to the first replica in the list.
    assert seen == ["a", "b", "b"]
    assert attempts == 2


async def test_discovery_asks_every_replica_and_clamps_to_the_smallest_window(kind: str) -> None:
    replies = {"a.test": models_with(1000), "b.test": models_with(800), "c.test": models_with(900)}
    async with Via(kind, replies, FakeClock(), context_window=None) as via:
        await via.complete("hello")  # no cap: up to the window, here the smallest one's
        assert via.client.model == MODEL
        assert via.client.context_window == 800
        assert [r.context_window for r in via.replicas] == [1000, 800, 900]
        assert via.caps == [800 - COUNTER.count("hello")]


async def test_discovery_skips_a_replica_that_does_not_answer(kind: str) -> None:
    clock = FakeClock()
    replies = {"a.test": refused, "b.test": models_with(700)}
    async with Via(kind, replies, clock, context_window=None) as via:
        await via.complete("hello", max_tokens=5)
        assert via.client.context_window == 700
        assert via.hits["a.test"] == 1  # asked once, not retried until the deadline
        assert clock.now == 0  # nothing waited
        assert via.replicas[0].health.set_aside
        assert [r.context_window for r in via.replicas] == [None, 700]


async def test_discovery_with_no_replica_answering_raises_as_one_would(kind: str) -> None:
    replies = {"a.test": refused, "b.test": refused}
    async with Via(kind, replies, FakeClock(), context_window=None, max_attempts=2) as via:
        with pytest.raises(via.connection_error):
            await via.complete("hello", max_tokens=5)
        assert via.client.context_window is None
