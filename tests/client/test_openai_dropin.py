"""kvclient.openai against respx mocks: the real openai SDK, kvclient's transport underneath.

What reaches the wire (the clamped cap under the caller's own key), what never does (a prompt
that cannot fit), and how often each request is sent (kvclient's policy, never the SDK's on top).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest
import respx

from kvclient import ChatTemplateError, RetryEvent, TiktokenCounter
from kvclient.headers import PRIORITY_HEADER
from kvclient.openai import LOCAL_HEADER, AsyncOpenAI, OpenAI, Transport
from kvclient.testing import FakeClock

HOST = "http://kv.test"
BASE = HOST + "/v1"
MODEL = "m"
CONTEXT = 1000
COUNTER = TiktokenCounter()
HI = [{"role": "user", "content": "Hello there"}]
HI_TOKENS = COUNTER.count_messages(HI)
# The SDK's own stream of a finished trio test: it breaks out of its event generator at [DONE]
# without closing it (openai/_streaming.py, AsyncStream.__stream__), and trio warns at collection.
SDK_TRIO_STREAM_WARNING = "ignore:Async generator 'openai._streaming:ResourceWarning"
# ... and so the httpx generators it was reading, which trio may collect first.
HTTPX_UNDER_SDK_STREAM_WARNING = "ignore:Async generator 'httpx._models:ResourceWarning"


def chat_ok(text: str = "hi") -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "c-1",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
        },
    )


def text_ok() -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "t-1",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": None}],
        },
    )


def busy(after: str = "2") -> httpx.Response:
    return httpx.Response(
        429,
        headers={"Retry-After": after},
        json={"error": {"message": "KV cache full", "type": "overloaded", "code": "kv_full"}},
    )


def chat_sse(*parts: str) -> httpx.Response:
    events = [
        {
            "id": "s",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}],
        }
        for part in parts
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)


def sent(route: respx.Route, index: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(route.calls[index].request.content)
    return body


def sdk(clock: FakeClock, **policy: Any) -> OpenAI:
    return OpenAI(
        base_url=BASE,
        api_key="k",
        context_window=CONTEXT,
        counter=COUNTER,
        retry=clock.policy(**policy),
    )


@pytest.fixture
def mock() -> Any:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


# --- the cap on the wire ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(None, CONTEXT - HI_TOKENS), (50_000, CONTEXT - HI_TOKENS), (7, 7)],
)
def test_chat_cap_is_explicit_and_clamped(
    mock: respx.Router, asked: int | None, expected: int
) -> None:
    route = mock.post("/chat/completions").mock(return_value=chat_ok())
    extra = {} if asked is None else {"max_tokens": asked}
    with sdk(FakeClock()) as client:
        answer = client.chat.completions.create(model=MODEL, messages=HI, **extra)
    assert answer.choices[0].message.content == "hi"
    body = sent(route)
    assert body["max_tokens"] == expected
    assert "max_completion_tokens" not in body  # never a second cap
    assert body["messages"] == HI
    assert body["model"] == MODEL


def test_max_completion_tokens_stays_the_callers_key(mock: respx.Router) -> None:
    route = mock.post("/chat/completions").mock(return_value=chat_ok())
    with sdk(FakeClock()) as client:
        client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=10**6)
    body = sent(route)
    assert body["max_completion_tokens"] == CONTEXT - HI_TOKENS
    assert "max_tokens" not in body


@pytest.mark.parametrize(
    ("prompt", "longest"),
    [
        ("Once upon a time", COUNTER.count("Once upon a time")),
        (
            ["short", "a somewhat longer prompt here"],
            COUNTER.count("a somewhat longer prompt here"),
        ),
        ([1, 2, 3, 4, 5], 5),
        ([[1, 2], [1, 2, 3, 4, 5, 6]], 6),
    ],
)
def test_completion_prompts_are_counted_by_the_longest(
    mock: respx.Router, prompt: Any, longest: int
) -> None:
    route = mock.post("/completions").mock(return_value=text_ok())
    with sdk(FakeClock()) as client:
        client.completions.create(model=MODEL, prompt=prompt)
    assert sent(route)["max_tokens"] == CONTEXT - longest
    assert sent(route)["prompt"] == prompt


# --- refused locally ---------------------------------------------------------------------------


def test_a_prompt_that_cannot_fit_is_a_bad_request_and_nothing_is_sent(
    mock: respx.Router,
) -> None:
    route = mock.post("/chat/completions").mock(return_value=chat_ok())
    long = [{"role": "user", "content": "word " * 1200}]
    with sdk(FakeClock()) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=10)
    error = caught.value
    assert error.code == "context_length_exceeded"
    assert isinstance(error.body, dict)
    assert error.body["prompt_tokens"] == COUNTER.count_messages(long)
    assert error.body["context_window"] == CONTEXT
    assert "nothing was sent" in error.message
    assert error.response.headers[LOCAL_HEADER] == "refused"
    assert route.call_count == 0


def test_a_conversation_the_template_rejects_is_a_bad_request_and_nothing_is_sent(
    mock: respx.Router,
) -> None:
    class Strict:
        """A counter whose chat template rejects every conversation (as Gemma's rejects roles
        that do not alternate)."""

        def count(self, text: str) -> int:
            return COUNTER.count(text)

        def count_messages(self, messages: Any) -> int:
            raise ChatTemplateError("Conversation roles must alternate user/assistant")

    route = mock.post("/chat/completions").mock(return_value=chat_ok())
    client = OpenAI(base_url=BASE, api_key="k", context_window=CONTEXT, counter=Strict())
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=twice)
    assert caught.value.code == "chat_template_error"
    assert "must alternate" in caught.value.message
    assert route.call_count == 0


@pytest.mark.parametrize("cap", [0, -3, "10"])
def test_a_cap_that_is_not_a_positive_integer_is_refused_locally(
    mock: respx.Router, cap: Any
) -> None:
    route = mock.post("/completions").mock(return_value=text_ok())
    with sdk(FakeClock()) as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=cap)
    assert caught.value.code == "invalid_value"
    assert route.call_count == 0


# --- retries: kvclient's, once ------------------------------------------------------------------


def test_429_retry_after_is_honoured_with_one_key_and_counted_attempts(
    mock: respx.Router,
) -> None:
    route = mock.post("/chat/completions").mock(side_effect=[busy("2"), chat_ok()])
    clock = FakeClock()
    events: list[RetryEvent] = []
    client = OpenAI(
        base_url=BASE,
        api_key="k",
        context_window=CONTEXT,
        retry=clock.policy(),
        on_retry=events.append,
    )
    with client:
        answer = client.chat.completions.create(model=MODEL, messages=HI)
    assert answer.choices[0].message.content == "hi"
    assert route.call_count == 2
    assert 2.0 <= clock.sleeps[0] <= 2.0 * 1.1 + 0.1  # the server's 2 s plus jitter above it
    assert [e.retry_after for e in events] == [2.0]
    first, second = (route.calls[i].request.headers for i in (0, 1))
    assert (first["X-Retry-Count"], second["X-Retry-Count"]) == ("0", "1")
    assert first["Idempotency-Key"] == second["Idempotency-Key"]
    assert first["Authorization"] == "Bearer k"  # the SDK's own headers are kept


def test_giving_up_is_the_sdks_rate_limit_error_and_the_sdk_adds_no_retry(
    mock: respx.Router,
) -> None:
    route = mock.post("/chat/completions").mock(side_effect=lambda request: busy("1"))
    with sdk(FakeClock(), max_attempts=3) as client, pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=HI)
    assert route.call_count == 3
    error = caught.value
    assert error.code == "server_busy"
    assert isinstance(error.body, dict)
    assert error.body["attempts"] == 3
    assert error.body["last_status"] == 429
    assert "gave up after 3 attempts" in error.message
    assert error.response.headers["retry-after"] == "1"


def test_the_bare_transport_keeps_an_sdk_with_retries_from_multiplying(
    mock: respx.Router,
) -> None:
    """A framework's own ``openai.OpenAI(max_retries=5)`` over the transport: kvclient's three
    attempts, not 3 x 6."""
    route = mock.post("/chat/completions").mock(side_effect=lambda request: busy("1"))
    clock = FakeClock()
    transport = Transport(context_window=CONTEXT, retry=clock.policy(max_attempts=3))
    with (
        httpx.Client(transport=transport) as http,
        openai.OpenAI(base_url=BASE, api_key="k", http_client=http, max_retries=5) as client,
        pytest.raises(openai.RateLimitError),
    ):
        client.chat.completions.create(model=MODEL, messages=HI)
    assert route.call_count == 3


@pytest.mark.parametrize(
    ("status", "error"), [(400, openai.BadRequestError), (500, openai.InternalServerError)]
)
def test_the_servers_own_errors_reach_the_sdk_once(
    mock: respx.Router, status: int, error: type[Exception]
) -> None:
    answer = httpx.Response(status, json={"error": {"message": "no", "code": "bad"}})
    route = mock.post("/chat/completions").mock(return_value=answer)
    with sdk(FakeClock()) as client, pytest.raises(error) as caught:
        client.chat.completions.create(model=MODEL, messages=HI)
    assert route.call_count == 1
    assert isinstance(caught.value, openai.APIStatusError)
    assert caught.value.status_code == status


def test_503_is_retried_then_succeeds(mock: respx.Router) -> None:
    route = mock.post("/completions").mock(side_effect=[httpx.Response(503), text_ok()])
    with sdk(FakeClock()) as client:
        answer = client.completions.create(model=MODEL, prompt="hi")
    assert answer.choices[0].text == "x"
    assert route.call_count == 2


def test_a_connection_failure_is_retried_then_the_sdks_connection_error(
    mock: respx.Router,
) -> None:
    route = mock.post("/completions").mock(side_effect=httpx.ConnectError("refused"))
    with sdk(FakeClock(), max_attempts=2) as client, pytest.raises(openai.APIConnectionError):
        client.completions.create(model=MODEL, prompt="hi")
    assert route.call_count == 2


# --- everything the SDK offers still works ---------------------------------------------------


def test_with_raw_response_and_with_options(mock: respx.Router) -> None:
    answer = chat_ok()
    answer.headers["x-request-id"] = "req-7"
    route = mock.post("/chat/completions").mock(return_value=answer)
    with sdk(FakeClock()) as client:
        copy = client.with_options(timeout=5.0)
        assert copy.kvclient_transport is client.kvclient_transport  # one cooldown, one window
        raw = copy.chat.completions.with_raw_response.create(
            model=MODEL, messages=HI, max_tokens=10**6
        )
        assert raw.headers["x-request-id"] == "req-7"
        assert raw.parse().choices[0].message.content == "hi"
        with pytest.raises(ValueError, match="max_retries"):
            client.with_options(max_retries=2)
    assert sent(route)["max_tokens"] == CONTEXT - HI_TOKENS


def test_models_and_embeddings_pass_through_untouched(mock: respx.Router) -> None:
    models = mock.get("/models").mock(
        return_value=httpx.Response(
            200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        )
    )
    embeddings = mock.post("/embeddings").mock(side_effect=[busy("1")])
    with sdk(FakeClock()) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model=MODEL, input="hi")
    request = embeddings.calls[0].request
    body = json.loads(request.content)
    assert body["input"] == "hi"
    assert "max_tokens" not in body
    assert "X-Retry-Count" not in request.headers  # kvclient never touched it
    assert embeddings.call_count == 1
    assert models.call_count == 1


def test_a_stream_is_retried_before_its_first_byte_then_passed_through(
    mock: respx.Router,
) -> None:
    route = mock.post("/chat/completions").mock(side_effect=[busy("1"), chat_sse("a", "b", "c")])
    with sdk(FakeClock()) as client:
        stream = client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        parts = [chunk.choices[0].delta.content for chunk in stream]
        window = client.kvclient_transport.client._window
    assert parts == ["a", "b", "c"]
    assert route.call_count == 2
    assert sent(route)["stream"] is True
    assert "stream_options" not in sent(route)
    assert window.requests == 0
    assert window.in_flight == 0


# --- discovery ---------------------------------------------------------------------------------


def test_a_closed_keep_alive_connection_is_resent_at_once_as_the_client_does(
    mock: respx.Router,
) -> None:
    """llama.cpp closes the connection after each stream: no backoff, no attempt spent."""
    closed = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    route = mock.post("/chat/completions").mock(side_effect=[closed, chat_sse("a", "b")])
    clock = FakeClock()
    retries: list[Any] = []
    client = OpenAI(
        base_url=BASE,
        api_key="k",
        context_window=CONTEXT,
        counter=COUNTER,
        retry=clock.policy(),
        on_retry=retries.append,
    )
    with client:
        stream = client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        parts = [chunk.choices[0].delta.content for chunk in stream]
    assert parts == ["a", "b"]
    assert route.call_count == 2
    assert (retries, clock.sleeps) == ([], [])


def test_the_context_window_is_discovered_once_with_the_sdks_credentials(
    mock: respx.Router,
) -> None:
    listing = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 300}]}
    models = mock.get("/models").mock(return_value=httpx.Response(200, json=listing))
    route = mock.post("/chat/completions").mock(return_value=chat_ok())
    with OpenAI(base_url=BASE, api_key="secret", retry=FakeClock().policy()) as client:
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=HI)
        assert client.kvclient_transport.context_window == 300
    assert models.call_count == 1
    assert models.calls[0].request.headers["Authorization"] == "Bearer secret"
    assert sent(route)["max_tokens"] == 300 - HI_TOKENS


def test_an_unknown_context_window_is_a_bad_request_and_no_generation_is_sent() -> None:
    """No engine's dialect gives a window: every probe of discovery answers 404."""
    listing = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
    with respx.mock(base_url=HOST, assert_all_called=False) as router:
        router.get("/v1/models").mock(return_value=httpx.Response(200, json=listing))
        route = router.post("/v1/chat/completions").mock(return_value=chat_ok())
        probes = router.route().mock(return_value=httpx.Response(404))
        with (
            OpenAI(base_url=BASE, api_key="k", retry=FakeClock().policy()) as client,
            pytest.raises(openai.BadRequestError) as caught,
        ):
            client.chat.completions.create(model=MODEL, messages=HI)
    assert caught.value.code == "context_window_unknown"
    assert "context_window=" in caught.value.message
    assert probes.call_count >= 1  # the other engines' dialects were tried
    assert route.call_count == 0


# --- construction ------------------------------------------------------------------------------


def test_the_sdks_retries_cannot_be_turned_on() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        OpenAI(base_url=BASE, api_key="k", max_retries=2)
    with pytest.raises(TypeError, match="http_client"):
        OpenAI(base_url=BASE, api_key="k", http_client=httpx.Client())


def test_importing_kvclient_never_imports_openai() -> None:
    code = (
        "import sys, kvclient, kvclient.openai\n"
        "assert 'openai' not in sys.modules, 'kvclient imported openai'\n"
        "kvclient.openai.Transport(context_window=10).close()\n"
        "assert 'openai' not in sys.modules, 'the transport imported openai'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- priority: X-Priority ------------------------------------------------------------------------


def test_priority_goes_as_x_priority_and_a_calls_own_header_wins(mock: respx.Router) -> None:
    route = mock.post("/chat/completions").mock(side_effect=lambda request: chat_ok())
    texts = mock.post("/completions").mock(side_effect=lambda request: text_ok())
    with sdk(FakeClock()) as client:
        client.chat.completions.create(model=MODEL, messages=HI)
    with OpenAI(
        base_url=BASE, api_key="k", context_window=CONTEXT, counter=COUNTER, priority=3
    ) as client:
        client.chat.completions.create(model=MODEL, messages=HI)
        client.chat.completions.create(
            model=MODEL, messages=HI, extra_headers={PRIORITY_HEADER: "-2"}
        )
        client.completions.create(model=MODEL, prompt="hi")
    assert [c.request.headers.get("x-priority") for c in route.calls] == [None, "3", "-2"]
    assert texts.calls[0].request.headers["x-priority"] == "3"
    assert all("priority" not in json.loads(c.request.content) for c in route.calls)


# --- async (asyncio and trio) ----------------------------------------------------------------


def async_sdk(clock: FakeClock, **policy: Any) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=BASE,
        api_key="k",
        context_window=CONTEXT,
        counter=COUNTER,
        retry=clock.policy(**policy),
    )


@pytest.mark.anyio
async def test_async_clamps_and_honours_retry_after(mock: respx.Router) -> None:
    route = mock.post("/chat/completions").mock(side_effect=[busy("3"), chat_ok()])
    clock = FakeClock()
    async with async_sdk(clock) as client:
        answer = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10**5)
    assert answer.choices[0].message.content == "hi"
    assert route.call_count == 2
    assert clock.sleeps[0] >= 3.0
    assert sent(route)["max_tokens"] == CONTEXT - HI_TOKENS


@pytest.mark.anyio
async def test_async_refusal_and_giving_up(mock: respx.Router) -> None:
    route = mock.post("/completions").mock(side_effect=lambda request: busy("1"))
    async with async_sdk(FakeClock(), max_attempts=2) as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="word " * 1200)
        assert route.call_count == 0
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model=MODEL, prompt="hi")
    assert caught.value.code == "server_busy"
    assert route.call_count == 2


@pytest.mark.anyio
@pytest.mark.filterwarnings(SDK_TRIO_STREAM_WARNING)
@pytest.mark.filterwarnings(HTTPX_UNDER_SDK_STREAM_WARNING)
async def test_async_stream_is_retried_before_its_first_byte(mock: respx.Router) -> None:
    route = mock.post("/chat/completions").mock(side_effect=[busy("1"), chat_sse("x", "y")])
    async with async_sdk(FakeClock()) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        parts = [chunk.choices[0].delta.content async for chunk in stream]
        window = client.kvclient_transport.client._window
        del stream
        gc.collect()  # while the warning filter above is active (see SDK_TRIO_STREAM_WARNING)
    assert parts == ["x", "y"]
    assert route.call_count == 2
    assert window.requests == 0


# --- logging ---------------------------------------------------------------------------------


def test_an_answer_made_locally_is_not_logged_as_an_http_request(
    mock: respx.Router, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every answer its transport returns as "HTTP Request: ..."; a request refused
    locally was never sent, so it gets no such line (only a DEBUG one under kvclient's logger)."""
    mock.post("/chat/completions").mock(return_value=chat_ok())
    long = [{"role": "user", "content": "word " * 1200}]
    caplog.set_level("INFO", logger="httpx")  # as an application logging at INFO has it
    caplog.set_level("DEBUG")  # second: the capturing handler takes the last level set
    with sdk(FakeClock()) as client:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=long, max_tokens=10)
        client.chat.completions.create(model=MODEL, messages=HI)
    requests = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert requests, "the request that was sent is still logged by httpx"
    assert all("200 OK" in line for line in requests), requests
    ours = [r for r in caplog.records if r.name == "kvclient.openai"]
    assert len(ours) == 1, [(r.name, r.levelname, r.getMessage()[:80]) for r in caplog.records]
    assert ours[0].levelname == "DEBUG"
    assert "not sent" in ours[0].getMessage()


@pytest.mark.anyio
async def test_async_priority_goes_as_x_priority_only_when_set(mock: respx.Router) -> None:
    route = mock.post("/chat/completions").mock(side_effect=lambda request: chat_ok())
    async with async_sdk(FakeClock()) as client:
        await client.chat.completions.create(model=MODEL, messages=HI)
    async with AsyncOpenAI(
        base_url=BASE, api_key="k", context_window=CONTEXT, counter=COUNTER, priority=0
    ) as client:
        await client.chat.completions.create(model=MODEL, messages=HI)
    assert [c.request.headers.get("x-priority") for c in route.calls] == [None, "0"]
