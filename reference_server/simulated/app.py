"""``kvclient serve``'s app: OpenAI-compatible endpoints in front of the ledger and the simulated
engine.

The generation endpoints are :class:`~reference_server.http.generation.GenerationEndpoint` over
:class:`SimulatedBackend`; the rest are small Starlette routes. Prompts are never logged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvclient import Tokenizer
from kvclient.engines.behaviour import prefix_salt

from ..admission.ledger import Handle
from ..http.answers import admissible_cap, room, send_whole
from ..http.errors import APIError, bad_request
from ..http.generation import GenerationEndpoint, Plan, Target
from ..http.middleware import build_app
from ..http.requests import (
    THREAD_TOKENIZE_CHARS,
    ClientGone,
    GenerationRequest,
    Kind,
    check_content_type,
    count_prompt,
    parse_generation,
    parse_json_object,
    read_body,
    scope_header,
)
from .config import ServerConfig
from .engine import EngineFaultError, EngineOOMError, Generated
from .state import CountingMiddleware, ServerState

__all__ = ["EngineInput", "ServerState", "SimulatedBackend", "create_app", "prompt_ids"]


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _state(scope: Scope) -> ServerState:
    state: ServerState = scope["app"].state.server
    return state


# --- responses ---------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_ENGINE_ERROR_TYPE = "server_error"
_OOM_CODE = "kv_cache_oom"
_FAULT_CODE = "injected_fault"
_FAULT_MESSAGE = "injected fault"


def _engine_failure(error: EngineOOMError | EngineFaultError) -> tuple[str, str]:
    """The message and code an engine failure is answered with."""
    if isinstance(error, EngineFaultError):
        return _FAULT_MESSAGE, _FAULT_CODE
    return str(error), _OOM_CODE


@dataclass(frozen=True, slots=True)
class Stopping:
    """vLLM's sampling parameters that hold a sequence's end back: ``ignore_eos`` (run to the
    cap) and ``min_tokens`` (no end before that many tokens)."""

    min_tokens: int = 0
    ignore_eos: bool = False


def _stopping(payload: dict[str, Any], cap: int) -> Stopping:
    """The request's :class:`Stopping`, refused with vLLM's 400s when malformed."""
    ignore_eos = payload.get("ignore_eos", False)
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos must be a boolean", param="ignore_eos")
    min_tokens = payload.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
        raise bad_request("min_tokens must be an integer", param="min_tokens")
    if min_tokens < 0:
        raise bad_request(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
            param="min_tokens",
        )
    if min_tokens > cap:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={cap}, got {min_tokens}.",
            param="min_tokens",
        )
    return Stopping(min_tokens=min_tokens, ignore_eos=ignore_eos)


@dataclass(frozen=True, slots=True)
class EngineInput:
    """What the engine needs of a planned request beyond its sizes: its :class:`Stopping`, and
    its prompt's token ids and ``cache_salt`` (for prefix sharing; no ids when prefix caching
    is off)."""

    stopping: Stopping
    prompt_ids: list[int] | None = None
    cache_salt: str | None = None


def _engine_options(plan: Plan) -> dict[str, Any]:
    given = plan.extra if isinstance(plan.extra, EngineInput) else EngineInput(Stopping())
    return {
        "min_tokens": given.stopping.min_tokens,
        "ignore_eos": given.stopping.ignore_eos,
        "prompt_ids": given.prompt_ids,
        "cache_salt": given.cache_salt,
    }


def prompt_ids(request: GenerationRequest, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a request's prompt, as ``/tokenize`` answers them: the ids given, the
    prompt encoded, or for messages the rendered chat template's ids (``--tokenizer``) or the
    ids of the message texts without the framing."""
    if request.token_ids is not None:
        return request.token_ids
    if request.prompt is not None:
        return tokenizer.encode(request.prompt)
    assert request.messages is not None
    encode_messages = getattr(tokenizer, "encode_messages", None)
    if encode_messages is not None and getattr(tokenizer, "chat_template", None):
        ids: list[int] = encode_messages(request.messages, tools=request.tools)
        return ids
    ids = []
    for message in request.messages:
        for value in message.values():
            if isinstance(value, str):
                ids.extend(tokenizer.encode(value))
    return ids


class SimulatedBackend:
    """The simulated engine behind the generation endpoint: one ledger, one queue, one engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.max_body_bytes = state.config.max_body_bytes
        self.send_timeout = state.config.send_timeout

    async def plan(
        self, scope: Scope, request: GenerationRequest, payload: dict[str, Any], raw: bytes
    ) -> Plan:
        state = self.state
        if request.sequences > 1:
            raise bad_request(
                "n must be 1: this server generates one choice per request", param="n"
            )
        if payload.get("model") not in (None, state.config.model):
            # vLLM's answer to an unknown model, so that a typo is not served anyway.
            raise APIError(
                404,
                f"The model `{payload['model']}` does not exist. Served: {state.config.model}.",
                type="NotFoundError",
                code="model_not_found",
                param="model",
            )
        tokenizer = state.config.tokenizer
        sharing, block_size = state.config.prefix_caching, state.config.block_size

        def tokenize() -> tuple[int, list[int] | None]:
            count = count_prompt(request, tokenizer)  # first: its errors are the 400s
            # The ids only name shareable blocks: a prompt of one block or less has none.
            shareable = sharing and count > block_size
            return count, prompt_ids(request, tokenizer) if shareable else None

        if request.size_hint > THREAD_TOKENIZE_CHARS:
            prompt_tokens, ids = await anyio.to_thread.run_sync(tokenize)
        else:
            prompt_tokens, ids = tokenize()
        cap = admissible_cap(
            state.ledger,
            prompt_tokens,
            request.max_tokens,
            context_window=state.config.context_window,
            param="messages" if request.messages is not None else "prompt",
        )
        stopping = _stopping(payload, cap)
        return Plan(
            request=request,
            payload=payload,
            raw=raw,
            prompt_tokens=prompt_tokens,
            cap=cap,
            extra=EngineInput(stopping, ids, prefix_salt(payload)),
        )

    def route(self, plan: Plan, tried: Set[int]) -> Target:
        return self.state

    def answer_cut(self) -> None:
        self.state.count_send_timeout()

    async def let_go(self, target: Target, handle: Handle) -> None:
        """The engine is in this process: a cancelled request has left it already."""

    async def run(self, target: Target, handle: Handle, plan: Plan, send: Send) -> bool:
        if plan.request.stream:
            await self._stream(plan, send)
        else:
            await self._complete(plan, handle, send)
        return True

    async def _complete(self, plan: Plan, handle: Handle, send: Send) -> None:
        state = self.state
        try:
            completion = await state.engine.generate(
                plan.prompt_tokens, plan.cap, **_engine_options(plan)
            )
        except (EngineOOMError, EngineFaultError) as failure:
            message, code = _engine_failure(failure)
            response: Response = APIError(
                500, message, type=_ENGINE_ERROR_TYPE, code=code
            ).response()
        else:
            state.ledger.record_output(completion.completion_tokens)
            # The answer goes out just before the finally that releases the handle: its room
            # is advertised as free already.
            headers = room(state.ledger, state.queue, releasing=handle)
            body = self._body(plan.request.kind, completion, plan.prompt_tokens)
            response = JSONResponse(body, headers=headers)
        await send_whole(response, send)

    def _body(self, kind: Kind, completion: Generated, prompt_tokens: int) -> Any:
        state = self.state
        usage = _usage(prompt_tokens, completion.completion_tokens)
        model = state.config.model
        created = int(time.time())
        if kind == "generate":
            return {
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "usage": usage,
            }
        if kind == "chat":
            return {
                "id": state.completion_id("chatcmpl"),
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": completion.text},
                        "logprobs": None,
                        "finish_reason": completion.finish_reason,
                    }
                ],
                "usage": usage,
            }
        return {
            "id": state.completion_id("cmpl"),
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": completion.text,
                    "logprobs": None,
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": usage,
        }

    async def _stream(self, plan: Plan, send: Send) -> None:
        state, request = self.state, plan.request
        prompt_tokens, cap = plan.prompt_tokens, plan.cap
        chat = request.kind == "chat"
        ident = state.completion_id("chatcmpl" if chat else "cmpl")
        base = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.config.model,
        }

        def chunk(
            text: str | None, finish_reason: str | None, generated: int, *, role: bool = False
        ) -> bytes:
            if chat:
                delta: dict[str, str] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None}
            choice["finish_reason"] = finish_reason
            if request.continuous_usage:
                # vLLM's continuous_usage_stats: the exact progress in every chunk.
                usage = _usage(prompt_tokens, generated)
                return _sse({**base, "choices": [choice], "usage": usage})
            return _sse({**base, "choices": [choice]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *_encoded(room(state.ledger, state.queue)),
                ],
            }
        )
        if chat:
            await body(chunk("", None, 0, role=True))

        async def on_text(text: str, generated: int) -> None:
            await body(chunk(text, None, generated))

        try:
            completion = await state.engine.generate(
                prompt_tokens, cap, on_text, **_engine_options(plan)
            )
        except (EngineOOMError, EngineFaultError) as failure:
            # Headers are gone already: the error travels in the stream, as vLLM does.
            message, code = _engine_failure(failure)
            error = {"message": message, "type": _ENGINE_ERROR_TYPE, "param": None, "code": code}
            await body(_sse({"error": error}))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        state.ledger.record_output(completion.completion_tokens)
        await body(
            chunk(None if chat else "", completion.finish_reason, completion.completion_tokens)
        )
        if request.include_usage:
            usage = _usage(prompt_tokens, completion.completion_tokens)
            await body(_sse({**base, "choices": [], "usage": usage}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


# --- small endpoints ---------------------------------------------------------------------------


async def _models(request: Request) -> Response:
    """The model and its window, with the room left now (RateLimit headers): a client learns
    how much it may send before its first request, not from a burst of refusals."""
    state: ServerState = request.app.state.server
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.config.model,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "kvclient",
                    "root": state.config.model,
                    "max_model_len": state.config.context_window,
                }
            ],
        },
        headers=room(state.ledger, state.queue),
    )


class TokenizeEndpoint:
    """vLLM's ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` to count, max_model_len, ids.

    For messages, ``count`` follows the chat formula (framing included, as the generation
    endpoints count it) and ``tokens`` holds the ids of the message texts without the framing.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = _state(scope)
        try:
            check_content_type(scope_header(scope, b"content-type"))
            body = await read_body(scope, receive, state.config.max_body_bytes)
            request = parse_generation("tokenize", parse_json_object(body))
            tokenizer = state.config.tokenizer

            def work() -> tuple[int, list[int]]:
                return count_prompt(request, tokenizer), prompt_ids(request, tokenizer)

            if request.size_hint > THREAD_TOKENIZE_CHARS:
                count, ids = await anyio.to_thread.run_sync(work)
            else:
                count, ids = work()
            response: Response = JSONResponse(
                {"count": count, "max_model_len": state.config.context_window, "tokens": ids}
            )
        except ClientGone:
            return
        except APIError as error:
            response = error.response()
        await response(scope, receive, send)


async def _health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    stats = state.ledger.stats()
    return JSONResponse(
        {
            "status": "ok",
            "admission": stats.strategy,
            "inflight": stats.inflight,
            "reserved_tokens": stats.reserved_tokens,
            "usable_tokens": stats.usable_tokens,
        }
    )


async def _metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def create_app(config: ServerConfig | None = None) -> Starlette:
    """The reference server as an ASGI app; ``app.state.server`` is its :class:`ServerState`."""
    config = config if config is not None else ServerConfig()
    state = ServerState(config)
    backend = SimulatedBackend(state)
    routes = [
        Route("/v1/completions", GenerationEndpoint("completions", backend), methods=["POST"]),
        Route("/v1/chat/completions", GenerationEndpoint("chat", backend), methods=["POST"]),
        Route("/generate", GenerationEndpoint("generate", backend), methods=["POST"]),
        Route("/tokenize", TokenizeEndpoint(), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    app = build_app(routes, api_key=config.api_key)
    app.add_middleware(CountingMiddleware, state=state)
    app.state.server = state
    return app
