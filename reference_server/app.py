"""The ASGI app: OpenAI-compatible endpoints in front of the ledger and the simulated engine.

The generation endpoints are plain ASGI callables rather than request/response functions, so one
coroutine owns a request's whole life, reading the body, admission, generation and streaming, and
its ``finally`` releases the reservation whatever happens: success, error, OOM, a client that
disconnects mid-stream, cancellation.

Prompts are never logged; an unexpected exception becomes a generic 500 JSON error with no
traceback text, and only its type is logged (no traceback: it could quote a prompt).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._admission import AdmissionQueue, Rejected, admissible_cap, room, too_busy
from ._errors import APIError, error_response
from ._journal import AdmissionLog
from ._metrics import build_registry
from ._requests import (
    GenerationRequest,
    Kind,
    check_content_type,
    count_prompt,
    parse_generation,
    parse_json_object,
)
from .config import ServerConfig
from .engine import Completion, EngineFaultError, EngineOOMError, SimulatedEngine
from .ledger import Handle, KVAdmissionController

__all__ = ["APIKeyMiddleware", "ServerState", "UnexpectedErrorMiddleware", "create_app"]

logger = logging.getLogger("reference_server")

#: Prompts longer than this many characters are tokenized in a worker thread.
_THREAD_TOKENIZE_CHARS = 32 * 1024
#: How much of an oversized body is read and discarded before answering 413, so the client sees
#: the answer instead of a reset connection.
_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/generate",
    "/health",
    "/metrics",
)


class ServerState:
    """Everything one server instance owns; ``app.state.server``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.admission_log = (
            AdmissionLog(config.admission_log) if config.admission_log is not None else None
        )
        self.engine = SimulatedEngine(
            tokenizer=config.tokenizer,
            capacity_tokens=config.total_kv_tokens,
            decode_rate=config.decode_rate,
            mean_output_tokens=config.mean_output_tokens,
            seed=config.seed,
            block_size=config.block_size,
            tick_seconds=config.tick_seconds,
            fault_rate=config.fault_rate,
        )
        self.ledger = KVAdmissionController(
            total_kv_tokens=config.total_kv_tokens,
            context_window=config.context_window,
            decode_rate=config.decode_rate,
            kv_bytes_per_token=config.kv_bytes_per_token,
            safety_fraction=config.safety_fraction,
            block_size=config.block_size,
            strategy=config.admission,
            max_concurrency=config.max_concurrency,
            # A sequence finishes within a few ticks of cap / rate; the estimate says so.
            release_margin=3 * config.tick_seconds + 0.02,
            output_quantile=config.retry_after_quantile,
            # An answer nobody reads is cut send_timeout after its worst case (see
            # _admit_and_run): a holder past its cap is expected to end then.
            overrun=config.send_timeout,
            on_event=self.admission_log,
        )
        self.queue = AdmissionQueue(
            self.ledger, max_wait=config.max_queue_wait, stagger=config.stagger_retry_after
        )
        self.created = int(time.time())
        # Completion ids: unique per server run (a random prefix) and cheap (a counter after it).
        self._id_prefix = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._requests = 0
        self._generation_requests = 0
        self._send_timeouts = 0
        self._responses: Counter[tuple[str, int]] = Counter()
        self.registry = build_registry(self.snapshot, self.responses)

    def completion_id(self, prefix: str) -> str:
        """A new id such as ``cmpl-3f9a0c1b2d4e0000002a``, as OpenAI's are opaque strings."""
        return f"{prefix}-{self._id_prefix}{next(self._ids):010x}"

    def count_request(self, path: str, *, generation: bool) -> None:
        with self._lock:
            self._requests += 1
            if generation:
                self._generation_requests += 1

    def count_send_timeout(self) -> None:
        with self._lock:
            self._send_timeouts += 1

    def count_response(self, path: str, status: int) -> None:
        route = path if path in _ROUTES else "other"
        with self._lock:
            self._responses[(route, status)] += 1

    def responses(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._responses)

    def snapshot(self) -> dict[str, float]:
        """Every metric by its Prometheus name (counters with ``_total``)."""
        ledger = self.ledger.stats()
        headroom = self.ledger.headroom(self.queue.now(), queued=self.queue.waiting_tokens)
        engine = self.engine.stats()
        with self._lock:
            requests, generation = self._requests, self._generation_requests
            send_timeouts = self._send_timeouts
        return {
            "kv_usable_tokens": ledger.usable_tokens,
            "kv_usable_bytes": ledger.usable_bytes,
            "kv_physical_capacity_tokens": engine.capacity_tokens,
            "kv_reserved_tokens": ledger.reserved_tokens,
            "kv_reserved_bytes": ledger.reserved_bytes,
            "kv_peak_reserved_tokens": ledger.peak_reserved_tokens,
            "kv_used_tokens": engine.used_tokens,
            "kv_peak_used_tokens": engine.peak_used_tokens,
            "kv_inflight_requests": ledger.inflight,
            "kv_queue_waiting_requests": self.queue.waiting,
            "kv_free_tokens": headroom.free,
            "kv_next_release_seconds": headroom.next_release_in,
            "kv_admitted_total": ledger.admitted_total,
            "kv_rejected_total": ledger.rejected_total,
            "kv_oom_events_total": engine.oom_events_total,
            "kv_oom_failed_requests_total": engine.oom_failed_sequences_total,
            "kv_injected_faults_total": engine.faults_total,
            "kv_generated_tokens_total": engine.generated_tokens_total,
            "kv_send_timeouts_total": send_timeouts,
            "kv_http_requests_total": requests,
            "kv_generation_requests_total": generation,
        }


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _state(scope: Scope) -> ServerState:
    state: ServerState = scope["app"].state.server
    return state


# --- middleware --------------------------------------------------------------------------------


class CountingMiddleware:
    """Counts requests and responses by route and status, for ``/metrics`` and tests."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        self.state.count_request(
            path, generation=path in ("/v1/completions", "/v1/chat/completions", "/generate")
        )

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.state.count_response(path, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` (or ``api-key: <key>``), compared in constant time.

    ``/health`` and ``/metrics`` stay open for probes and scrapers.
    """

    def __init__(
        self, app: ASGIApp, api_key: str, exempt: tuple[str, ...] = ("/health", "/metrics")
    ) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")
        self.exempt = exempt

    def _authorized(self, headers: Headers) -> bool:
        supplied = headers.get("authorization", "")
        scheme, _, token = supplied.partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("api-key", "")
        # Compare the raw header bytes (Starlette decodes headers as latin-1) with the key's UTF-8
        # bytes: compare_digest refuses non-ASCII str. Always compare, even when empty.
        return hmac.compare_digest(token.strip().encode("latin-1"), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        if not self._authorized(Headers(scope=scope)):
            response = error_response(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# --- request reading ---------------------------------------------------------------------------


class _ClientGone(Exception):
    pass


def scope_header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case, as ASGI gives names), without building
    a ``Headers`` (a hot path)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds the server's limit of {limit} bytes",
        code="request_too_large",
    )


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, or a 413 after draining (bounded) what the client still sends."""
    declared = scope_header(scope, b"content-length")
    declared_size: int | None = None
    if declared is not None:
        try:
            declared_size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", code="invalid_request") from None
    if declared_size is not None and (declared_size < 0 or declared_size > _DRAIN_LIMIT_BYTES):
        # Too much to drain: answer at once (before the client has sent it all, if ever).
        raise (
            _too_large(limit)
            if declared_size > 0
            else APIError(400, "invalid Content-Length header", code="invalid_request")
        )
    chunks: list[bytes] = []
    total = 0
    over = declared_size is not None and declared_size > limit
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk: bytes = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            over = True
        if not over:
            chunks.append(chunk)
        if not message.get("more_body", False) or total > _DRAIN_LIMIT_BYTES:
            break
    if over:
        raise _too_large(limit)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _DisconnectWatch:
    """Cancels ``scope`` when the client goes away before its response is complete.

    Per ASGI, ``receive()`` answers ``http.disconnect`` once the response has been sent, and
    uvicorn, hypercorn and httpx's ASGITransport wake a pending ``receive()`` then. So after the
    response the watcher ends by itself: :meth:`finish` lets it, and cancels it only on a server
    that leaves it waiting. Cancelling it every time cost about 60 µs a request, a third of the
    endpoint's own work for one token (anyio formats a cancel reason and redelivers the
    cancellation until the task wakes).
    """

    def __init__(self, receive: Receive, scope: anyio.CancelScope) -> None:
        self._receive = receive
        self._scope = scope
        self._responded = False
        self._ended = False

    async def run(self) -> None:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    if not self._responded:
                        self._scope.cancel()
                    return
        finally:
            self._ended = True

    async def finish(self) -> None:
        """The response is complete: let the watcher see the disconnect that follows."""
        self._responded = True
        if not self._ended:
            await anyio.lowlevel.checkpoint()
            if not self._ended:
                self._scope.cancel()


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


class GenerationEndpoint:
    """``/v1/completions``, ``/v1/chat/completions`` and the seed's ``/generate``."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = _state(scope)
        try:
            check_content_type(scope_header(scope, b"content-type"))
            body = await _read_body(scope, receive, state.config.max_body_bytes)
            payload = parse_json_object(body)
            request = parse_generation(self.kind, payload)
            if payload.get("model") not in (None, state.config.model):
                # vLLM's answer to an unknown model, so that a typo is not served anyway.
                raise APIError(
                    404,
                    f"The model `{payload['model']}` does not exist. Served: {state.config.model}.",
                    type="NotFoundError",
                    code="model_not_found",
                    param="model",
                )
            prompt_tokens = await self._count(state, request)
            cap = admissible_cap(
                state.ledger,
                prompt_tokens,
                request.max_tokens,
                context_window=state.config.context_window,
                param="messages" if request.messages is not None else "prompt",
            )
        except _ClientGone:
            return
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        await self._admit_and_run(state, request, prompt_tokens, cap, scope, receive, send)

    async def _count(self, state: ServerState, request: GenerationRequest) -> int:
        counter = state.config.tokenizer
        if request.size_hint > _THREAD_TOKENIZE_CHARS:
            return await anyio.to_thread.run_sync(count_prompt, request, counter)
        return count_prompt(request, counter)

    async def _admit_and_run(
        self,
        state: ServerState,
        request: GenerationRequest,
        prompt_tokens: int,
        cap: int,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        async with anyio.create_task_group() as group:
            # The client going away cancels waiting and generating alike; finally blocks release.
            watch = _DisconnectWatch(receive, group.cancel_scope)
            group.start_soon(watch.run)
            try:
                client = scope.get("client")  # (host, port): staggered advice per connection
                handle = await state.queue.acquire(
                    prompt_tokens, cap, client=tuple(client) if client else None
                )
            except Rejected as rejected:
                busy = too_busy(state.ledger, rejected, prompt_tokens, cap, state.queue)
                await busy(scope, receive, send)
                await watch.finish()
                return
            # A client that stops reading must not pin the reservation: the answer may run
            # send_timeout past its worst case, then the group is cancelled (a cut stream).
            deadline = anyio.current_time() + handle.due_at - handle.admitted_at
            group.cancel_scope.deadline = deadline + state.config.send_timeout
            done = False

            async def watched_send(message: Message) -> None:
                # While a write waits on the client, the ledger can tell a stalled reader.
                handle.writing_since = time.monotonic()  # the admission queue's clock
                try:
                    await send(message)
                finally:
                    handle.writing_since = None

            try:
                if request.stream:
                    await self._stream(state, request, prompt_tokens, cap, watched_send)
                else:
                    await self._complete(state, request, handle, cap, scope, receive, watched_send)
                done = True
            finally:
                state.ledger.release(handle)
                state.queue.notify()
                if not done and anyio.current_time() >= group.cancel_scope.deadline:
                    state.count_send_timeout()
                    logger.warning("an answer was cut: not read within the send timeout")
            await watch.finish()

    async def _complete(
        self,
        state: ServerState,
        request: GenerationRequest,
        handle: Handle,
        cap: int,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        prompt_tokens = handle.prompt_tokens
        try:
            completion = await state.engine.generate(prompt_tokens, cap)
        except (EngineOOMError, EngineFaultError) as failure:
            message, code = _engine_failure(failure)
            response: Response = error_response(500, message, type=_ENGINE_ERROR_TYPE, code=code)
        else:
            state.ledger.record_output(completion.completion_tokens)
            # The answer goes out just before the finally that releases the handle: its room
            # is advertised as free already.
            headers = room(state.ledger, state.queue, releasing=handle)
            response = JSONResponse(self._body(state, completion, prompt_tokens), headers=headers)
        await response(scope, receive, send)

    def _body(self, state: ServerState, completion: Completion, prompt_tokens: int) -> Any:
        usage = _usage(prompt_tokens, completion.completion_tokens)
        model = state.config.model
        created = int(time.time())
        if self.kind == "generate":
            return {
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "usage": usage,
            }
        if self.kind == "chat":
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

    async def _stream(
        self,
        state: ServerState,
        request: GenerationRequest,
        prompt_tokens: int,
        cap: int,
        send: Send,
    ) -> None:
        chat = self.kind == "chat"
        ident = state.completion_id("chatcmpl" if chat else "cmpl")
        base = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.config.model,
        }

        def chunk(text: str | None, finish_reason: str | None, *, role: bool = False) -> bytes:
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
            await body(chunk("", None, role=True))

        async def on_text(text: str) -> None:
            await body(chunk(text, None))

        try:
            completion = await state.engine.generate(prompt_tokens, cap, on_text)
        except (EngineOOMError, EngineFaultError) as failure:
            # Headers are gone already: the error travels in the stream, as vLLM does.
            message, code = _engine_failure(failure)
            error = {"message": message, "type": _ENGINE_ERROR_TYPE, "param": None, "code": code}
            await body(_sse({"error": error}))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        state.ledger.record_output(completion.completion_tokens)
        await body(chunk(None if chat else "", completion.finish_reason))
        if request.include_usage:
            usage = _usage(prompt_tokens, completion.completion_tokens)
            await body(_sse({**base, "choices": [], "usage": usage}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


# --- small endpoints ---------------------------------------------------------------------------


async def _models(request: Request) -> Response:
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
        }
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
            body = await _read_body(scope, receive, state.config.max_body_bytes)
            request = parse_generation("tokenize", parse_json_object(body))
            tokenizer = state.config.tokenizer

            def work() -> tuple[int, list[int]]:
                count = count_prompt(request, tokenizer)
                if request.token_ids is not None:
                    return count, request.token_ids
                if request.prompt is not None:
                    return count, tokenizer.encode(request.prompt)
                assert request.messages is not None
                encode_messages = getattr(tokenizer, "encode_messages", None)
                if encode_messages is not None and getattr(tokenizer, "chat_template", None):
                    # --tokenizer: the ids of the rendered chat template, as vLLM answers.
                    return count, encode_messages(request.messages, tools=request.tools)
                ids: list[int] = []
                for message in request.messages:
                    for value in message.values():
                        if isinstance(value, str):
                            ids.extend(tokenizer.encode(value))
                return count, ids

            if request.size_hint > _THREAD_TOKENIZE_CHARS:
                count, ids = await anyio.to_thread.run_sync(work)
            else:
                count, ids = work()
            response: Response = JSONResponse(
                {"count": count, "max_model_len": state.config.context_window, "tokens": ids}
            )
        except _ClientGone:
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


# --- errors ------------------------------------------------------------------------------------


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    message = {
        404: f"no route {request.url.path!r}",
        405: f"method {request.method} is not allowed on {request.url.path!r}",
    }.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, code=code, headers=exc.headers)


def _internal_error() -> JSONResponse:
    return error_response(
        500, "The server had an internal error.", type="server_error", code="internal_error"
    )


def _kinds(exc: BaseException) -> str:
    """The type names of an exception, those inside a group (from a task group) unwrapped."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple) and inner:
        return ", ".join(_kinds(e) for e in inner)
    return type(exc).__name__


def _log_unexpected(exc: BaseException, path: str) -> None:
    # The types only: the message or the traceback could quote a prompt.
    logger.error("unexpected %s while serving %s", _kinds(exc), path)


async def _unexpected(request: Request, exc: Exception) -> Response:
    _log_unexpected(exc, request.url.path)
    return _internal_error()


class UnexpectedErrorMiddleware:
    """Answers an unexpected exception with a generic 500 and logs only its type, then stops it.

    Starlette's own handler (:func:`_unexpected`, for the outer middleware) re-raises after
    answering so that the ASGI server can log the traceback, and a traceback can quote a prompt.
    When the response has started (a stream), the connection is closed instead: a cut stream.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            _log_unexpected(exc, scope["path"])
            if not started:
                await _internal_error()(scope, receive, send)


def build_app(routes: list[Route], *, api_key: str | None, lifespan: Any = None) -> Starlette:
    """A Starlette app with this server's error handling and, with ``api_key``, its key check
    (shared by the reference server and the gateway)."""
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: _http_exception,
        Exception: _unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.add_middleware(UnexpectedErrorMiddleware)  # the innermost: 500s are counted
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def create_app(config: ServerConfig | None = None) -> Starlette:
    """The reference server as an ASGI app; ``app.state.server`` is its :class:`ServerState`."""
    config = config if config is not None else ServerConfig()
    state = ServerState(config)
    routes = [
        Route("/v1/completions", GenerationEndpoint("completions"), methods=["POST"]),
        Route("/v1/chat/completions", GenerationEndpoint("chat"), methods=["POST"]),
        Route("/generate", GenerationEndpoint("generate"), methods=["POST"]),
        Route("/tokenize", TokenizeEndpoint(), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    app = build_app(routes, api_key=config.api_key)
    app.add_middleware(CountingMiddleware, state=state)
    app.state.server = state
    return app
