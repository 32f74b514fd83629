"""Error answers of real servers, as they send them, and what the client makes of them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvclient import (
    APIStatusError,
    BadRequestError,
    InsufficientQuotaError,
    PromptTooLongError,
    RateLimitError,
    ServerBusyError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from kvclient.engines.errors import classify_error, parse_error_body
from tests.helpers import vllm_bodies
from tests.helpers.client import (
    make_async_client,
    make_client,
    new_server,
)

# --- "the prompt does not fit": never retried, PromptTooLongError with the server's numbers ---

CONTEXT_ERRORS: list[tuple[str, int, Any, int | None, int | None]] = [
    (
        "reference-413",
        413,
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens; the prompt has "
                "9000 tokens, which leaves no room for output.",
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
            }
        },
        9000,
        8192,
    ),
    (
        "openai-400",
        400,
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens. However, your "
                "messages resulted in 9000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        9000,
        8192,
    ),
    (
        "vllm-400-flat",
        400,
        {
            "object": "error",
            "message": "This model's maximum context length is 8192 tokens. However, you "
            "requested 9000 tokens (8000 in the messages, 1000 in the completion). Please reduce "
            "the length of the messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        8000,
        8192,
    ),
    (
        "vllm-400-nested",
        400,
        {
            "error": {
                "message": "This model's maximum context length is 4096 tokens. However, your "
                "request has 5000 input tokens. Please reduce the length of the input messages.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        5000,
        4096,
    ),
    (
        # vLLM 0.32 counts a prompt only to one token past the window: 2049 is a lower bound.
        "vllm-0.32-at-least",
        400,
        vllm_bodies.AT_LEAST,
        2049,
        2048,
    ),
    (
        # vLLM 0.32, a prompt of exactly the window without max_tokens: no numbers but the 0.
        "vllm-0.32-no-room",
        400,
        vllm_bodies.NO_ROOM,
        None,
        None,
    ),
    (
        "tgi-422",
        422,
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. "
            "Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
            "error_type": "validation",
        },
        4000,
        4096,
    ),
    (
        "tgi-422-inputs",
        422,
        {
            "error": "Input validation error: `inputs` must have less than 4096 tokens. "
            "Given: 5000",
            "error_type": "validation",
        },
        5000,
        4096,
    ),
    (
        "llamacpp-400",
        400,
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 5000,
                "n_ctx": 4096,
            }
        },
        5000,
        4096,
    ),
    (
        "llamacpp-400-new-wording",
        400,
        {
            "error": {
                "code": 400,
                "message": "request (9412 tokens) exceeds the available context size "
                "(8192 tokens), try increasing it",
                "type": "exceed_context_size_error",
            }
        },
        9412,
        8192,
    ),
    (
        "sglang-400",
        400,
        {
            "object": "error",
            "message": "The input (9000 tokens) is longer than the model's context length "
            "(8192 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        9000,
        8192,
    ),
]


@pytest.mark.parametrize(
    ("status", "body", "prompt_tokens", "context_window"),
    [case[1:] for case in CONTEXT_ERRORS],
    ids=[case[0] for case in CONTEXT_ERRORS],
)
def test_context_length_errors_of_real_servers(
    status: int, body: Any, prompt_tokens: int | None, context_window: int | None
) -> None:
    server = new_server()
    server.add("/v1/completions", httpx.Response(status, json=body))
    with make_client(server) as client, pytest.raises(PromptTooLongError) as info:
        client.complete("hello")
    assert len(server.posts) == 1  # never retried
    error = info.value
    assert error.status_code == status
    assert error.prompt_tokens == prompt_tokens
    assert error.context_window == context_window
    assert "too long" in str(error)
    assert error.body == body


def test_a_lower_bound_is_said_to_be_one() -> None:
    server = new_server()
    server.add("/v1/completions", httpx.Response(400, json=vllm_bodies.AT_LEAST))
    with make_client(server) as client, pytest.raises(PromptTooLongError) as info:
        client.complete("hello")
    assert info.value.prompt_tokens_lower_bound
    assert (info.value.prompt_tokens, info.value.context_window) == (2049, 2048)
    exact = PromptTooLongError(prompt_tokens=2049, context_window=2048)
    assert not exact.prompt_tokens_lower_bound
    assert "prompt of 2049 tokens" in str(exact)
    bound = PromptTooLongError(
        prompt_tokens=2049, context_window=2048, prompt_tokens_lower_bound=True
    )
    assert "prompt of at least 2049 tokens" in str(bound)


def test_max_tokens_below_one_other_than_zero_is_a_plain_bad_request() -> None:
    body = {"error": {"message": "max_tokens must be at least 1, got -3.", "code": 400}}
    verdict = classify_error(400, json.dumps(body))
    assert verdict.exception is BadRequestError


# --- "full now, come back later": retried --------------------------------------------------

OVERLOADS: list[tuple[str, int, dict[str, str], Any, type[APIStatusError]]] = [
    (
        "reference-429",
        429,
        {"Retry-After": "2", "retry-after-ms": "1800"},
        {
            "error": {
                "message": "KV cache budget exhausted",
                "type": "server_overloaded",
                "code": "kv_cache_full",
            }
        },
        RateLimitError,
    ),
    (
        "tgi-429",
        429,
        {},
        {"error": "Model is overloaded", "error_type": "overloaded"},
        RateLimitError,
    ),
    (
        "vllm-503",
        503,
        {},
        {
            "error": {
                "message": "The server is overloaded, please retry later",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        },
        ServiceUnavailableError,
    ),
    (
        "sglang-503",
        503,
        {},
        {
            "object": "error",
            "message": "The server is too busy; please retry later",
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        },
        ServiceUnavailableError,
    ),
    (
        "ollama-503",
        503,
        {},
        {"error": "server busy, please try again.  maximum pending requests exceeded"},
        ServiceUnavailableError,
    ),
]


@pytest.mark.parametrize(
    ("status", "headers", "body", "kind"),
    [case[1:] for case in OVERLOADS],
    ids=[case[0] for case in OVERLOADS],
)
def test_overload_answers_of_real_servers_are_retried(
    status: int, headers: dict[str, str], body: Any, kind: type[APIStatusError]
) -> None:
    server = new_server()
    server.add("/v1/completions", httpx.Response(status, headers=headers, json=body))
    with make_client(server) as client:
        result = client.complete("hello")
    assert result.attempts == 2
    assert result.history[0].status_code == status
    assert kind.__name__ in result.history[0].error


@pytest.mark.parametrize(
    ("status", "headers", "body", "kind"),
    [case[1:] for case in OVERLOADS],
    ids=[case[0] for case in OVERLOADS],
)
def test_overload_answers_exhausted_raise_server_busy_with_the_last_error(
    status: int, headers: dict[str, str], body: Any, kind: type[APIStatusError]
) -> None:
    server = new_server(default=httpx.Response(status, headers=headers, json=body))
    policy = server.clock.policy(max_attempts=2)
    with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError) as info:
        client.complete("hello")
    assert isinstance(info.value.last_error, kind)
    assert info.value.attempts == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "headers", "body", "kind"),
    [case[1:] for case in OVERLOADS],
    ids=[case[0] for case in OVERLOADS],
)
async def test_overloads_async(
    status: int, headers: dict[str, str], body: Any, kind: type[APIStatusError]
) -> None:
    server = new_server()
    server.add("/v1/completions", httpx.Response(status, headers=headers, json=body))
    async with make_async_client(server) as client:
        result = await client.complete("hello")
    assert result.attempts == 2


# --- the rest ------------------------------------------------------------------------------


def test_reference_429_carries_retry_after_ms() -> None:
    server = new_server()
    server.add(
        "/v1/completions",
        *(httpx.Response(429, headers={"Retry-After": "2", "retry-after-ms": "1800"}, json={}),),
    )
    policy = server.clock.policy(max_attempts=1)
    with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError) as info:
        client.complete("hello")
    assert info.value.retry_after == pytest.approx(1.8)
    assert isinstance(info.value.last_error, RateLimitError)
    assert info.value.last_error.retry_after == pytest.approx(1.8)


def test_insufficient_quota_openai_shape() -> None:
    body = {
        "error": {
            "message": "You exceeded your current quota, please check your plan and billing.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
    verdict = classify_error(429, json.dumps(body))
    assert verdict.exception is InsufficientQuotaError
    assert not verdict.retryable


def test_reference_request_too_large_is_a_plain_bad_request() -> None:
    body = {
        "error": {
            "message": "this request needs 9000 tokens of KV cache; the server can never hold "
            "more than 6000",
            "type": "invalid_request_error",
            "code": "request_too_large",
        }
    }
    verdict = classify_error(400, json.dumps(body))
    assert verdict.exception is BadRequestError
    assert not verdict.retryable
    assert verdict.details.code == "request_too_large"


def test_tgi_validation_error_that_is_not_about_context() -> None:
    body = {
        "error": "Input validation error: `top_p` must be > 0.0 and < 1.0",
        "error_type": "validation",
    }
    verdict = classify_error(422, json.dumps(body))
    assert verdict.exception is UnprocessableEntityError
    assert verdict.details.error_type == "validation"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "(empty body)"),
        (b"<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b'{"detail": [{"loc": ["body"], "msg": "field required"}]}', "field required"),
        (b"\xff\xfe garbage", "garbage"),
        (b"[1, 2, 3]", "[1, 2, 3]"),
    ],
)
def test_parse_error_body_of_any_shape(content: bytes, message: str) -> None:
    assert message in parse_error_body(content).message


def test_huge_error_bodies_are_cut_in_the_message() -> None:
    details = parse_error_body(json.dumps({"error": {"message": "x" * 1_000_000}}))
    assert len(details.message) <= 1000


def test_error_message_names_the_request_and_status() -> None:
    server = new_server()
    server.add(
        "/v1/completions",
        httpx.Response(401, json={"error": {"message": "Invalid API key", "type": "auth"}}),
    )
    with make_client(server) as client, pytest.raises(APIStatusError) as info:
        client.complete("hello")
    assert str(info.value) == "POST /v1/completions -> 401: Invalid API key"
    assert info.value.error_type == "auth"
