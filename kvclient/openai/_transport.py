"""httpx transports that put kvclient between an OpenAI-style client and the server.

``POST .../completions`` and ``POST .../chat/completions`` are counted, their output cap made
explicit and clamped, refused locally when the prompt cannot fit, and sent through kvclient's
retry core (cooldown, send window, Retry-After) to the inner transport. Every other request goes
to the inner transport untouched. A streamed answer is handed on as it arrives, once its status
line says it was admitted: it is retried only before that.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from .._client import (
    _MIN_ATTEMPT_TIMEOUT,
    _PACED,
    IDEMPOTENCY_HEADER,
    RETRY_COUNT_HEADER,
    AsyncClient,
    BaseClient,
    Client,
    _Body,
    _normalize_base_url,
)
from .._exceptions import (
    APIConnectionError,
    APIStatusError,
    ChatTemplateError,
    KVClientError,
    PromptTooLongError,
    ServerBusyError,
)
from .._models import RetryEvent
from .._retry import RetryCall, RetryPolicy
from .._tokens import TokenCounter
from ._plan import (
    InvalidCap,
    Plan,
    base_url_of,
    busy_response,
    generation_kind,
    invalid_response,
    local_error_response,
    passed_on,
    plan_request,
    refusal_response,
)

__all__ = ["AsyncTransport", "Transport"]

#: The openai SDK's own connection limits, for the inner transport kvclient creates.
DEFAULT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
# Only used for discovery, and replaced by the first request's own base URL before that.
_UNKNOWN_BASE_URL = "http://base-url.invalid"


class _Releasing(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An admitted answer's body: closing it gives back the call's send-window room.

    Iteration is the inner stream's own (no generator of ours to leave unfinished).
    """

    __slots__ = ("_release", "_stream")

    def __init__(self, stream: Any, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._stream)

    def __aiter__(self) -> AsyncIterator[bytes]:
        iterator: AsyncIterator[bytes] = self._stream.__aiter__()
        return iterator

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._done()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._done()


def _parse(content: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class _Shared:
    """What both transports do without I/O, around a kvclient client ``self._kv``."""

    _kv: BaseClient

    def _setup(self, base_url: str | None) -> None:
        self._base_url_known = base_url is not None
        self._learn_lock = threading.Lock()

    @property
    def context_window(self) -> int | None:
        """The context window clamps go by (given, or discovered at the first request)."""
        return self._kv.context_window

    def _learn(self, request: httpx.Request, kind: str, body: dict[str, Any]) -> None:
        """Before discovery: where the API is, which model, and the caller's credentials, all
        from the SDK's first generation request."""
        kv = self._kv
        with self._learn_lock:
            if not self._base_url_known:
                kv.base_url, _credentials = _normalize_base_url(base_url_of(request.url, kind))
                self._base_url_known = True
            model = body.get("model")
            if kv.model is None and isinstance(model, str):
                kv.model = model
            auth = request.headers.get("authorization")
            http: httpx.Client | httpx.AsyncClient = kv._http  # type: ignore[attr-defined]
            if auth and "authorization" not in http.headers:
                http.headers["Authorization"] = auth

    @staticmethod
    def _discovery_failed(exc: KVClientError) -> httpx.Response:
        if isinstance(exc, ServerBusyError):
            return busy_response(exc)
        return local_error_response(
            f"kvclient could not learn the context window: {exc}; nothing was sent",
            "context_window_unknown",
        )

    def _plan(self, kind: str, body: dict[str, Any]) -> Plan | httpx.Response | None:
        try:
            return plan_request(self._kv, kind, body)
        except PromptTooLongError as exc:
            return refusal_response(exc, kind)
        except InvalidCap as exc:
            return invalid_response(exc)
        except ChatTemplateError as exc:
            # The model's template rejects the conversation: the server would answer 400 too.
            return local_error_response(f"{exc}; nothing was sent", "chat_template_error")

    def _new_call(self, plan: Plan) -> RetryCall:
        kv = self._kv
        return RetryCall(
            kv.retry, kv._cooldown, size=plan.size, on_retry=kv.on_retry, pacer=kv._pacer
        )

    @staticmethod
    def _outgoing(
        request: httpx.Request, plan: Plan, call: RetryCall, idempotency_key: str
    ) -> httpx.Request:
        """The request as sent by one attempt: the rewritten body, the SDK's headers, its
        timeouts capped at the time left before kvclient's deadline."""
        left = max(call.time_left(), _MIN_ATTEMPT_TIMEOUT)
        timeouts = request.extensions.get("timeout") or {}
        capped = {
            key: left if timeouts.get(key) is None else min(timeouts[key], left)
            for key in ("connect", "read", "write", "pool")
        }
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        outgoing = httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=plan.content,
            extensions={**request.extensions, "timeout": capped, _PACED: call.paced},
        )
        if IDEMPOTENCY_HEADER not in outgoing.headers:
            outgoing.headers[IDEMPOTENCY_HEADER] = idempotency_key
        outgoing.headers[RETRY_COUNT_HEADER] = str(call.attempts - 1)
        outgoing.stream = _Body(plan.content)
        return outgoing

    @staticmethod
    def _gave_up(exc: KVClientError) -> httpx.Response:
        """The SDK's answer for a call kvclient ended; a connection failure is raised as the
        httpx error it was, which the SDK maps to its ``APIConnectionError``/``APITimeoutError``."""
        if isinstance(exc, ServerBusyError):
            return busy_response(exc)
        response = getattr(exc, "response", None)
        if isinstance(exc, (APIStatusError, PromptTooLongError)) and response is not None:
            return passed_on(response)
        if isinstance(exc, APIConnectionError):
            cause = exc.__cause__
            if isinstance(cause, httpx.HTTPError):
                raise cause
            raise httpx.TransportError(exc.message) from exc
        raise exc

    def _admitted(self, response: httpx.Response, call: RetryCall) -> httpx.Response:
        kv = self._kv

        def release() -> None:
            kv._release_slot("ok", call)  # type: ignore[attr-defined]

        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Releasing(response.stream, release),
            extensions=response.extensions,
        )


class Transport(_Shared, httpx.BaseTransport):
    """A sync httpx transport giving an OpenAI-style client kvclient's behaviour.

    >>> http = httpx.Client(transport=Transport(context_window=8192))  # doctest: +SKIP
    >>> sdk = openai.OpenAI(base_url=url, http_client=http, max_retries=0)  # doctest: +SKIP

    ``inner`` is the transport that reaches the server (default: ``httpx.HTTPTransport`` with the
    openai SDK's connection limits); the other options are :class:`kvclient.Client`'s. Without
    ``context_window`` it is discovered once, from ``GET /v1/models`` at the base URL of the
    first generation request, for that request's model. Keep the SDK's own retries off
    (``max_retries=0``): kvclient marks its answers ``x-should-retry: false``, but the SDK would
    still retry connection failures that kvclient already retried.
    """

    _kv: Client

    def __init__(
        self,
        *,
        inner: httpx.BaseTransport | None = None,
        base_url: str | None = None,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float = 0.0,
        on_retry: Callable[[RetryEvent], None] | None = None,
    ) -> None:
        self._inner = inner if inner is not None else httpx.HTTPTransport(limits=DEFAULT_LIMITS)
        self._kv = Client(
            base_url=base_url or _UNKNOWN_BASE_URL,
            context_window=context_window,
            counter=counter,
            retry=retry,
            safety_margin=safety_margin,
            on_retry=on_retry,
            transport=self._inner,
        )
        self._setup(base_url)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        kind = generation_kind(request.method, request.url.path)
        body = _parse(request.read()) if kind is not None else None
        if kind is None or body is None:
            return self._inner.handle_request(request)
        kv = self._kv
        if kv.context_window is None:
            self._learn(request, kind, body)
            try:
                kv._discover()
            except APIConnectionError as exc:
                return self._gave_up(exc)
            except KVClientError as exc:
                return self._discovery_failed(exc)
        plan = self._plan(kind, body)
        if plan is None:
            return self._inner.handle_request(request)
        if isinstance(plan, httpx.Response):
            return plan
        key = str(uuid.uuid4())
        inner = self._inner

        def attempt(call: RetryCall) -> httpx.Response:
            outgoing = self._outgoing(request, plan, call, key)
            try:
                response = inner.handle_request(outgoing)
            except httpx.HTTPError as exc:
                raise kv._transport_error(exc, outgoing, answered=False) from exc
            response.request = outgoing
            kv._note_room(response)  # the server's advertised room paces later calls
            if response.status_code < 400:
                return response
            try:
                response.read()
            except httpx.HTTPError as exc:
                raise kv._transport_error(exc, outgoing, answered=True) from exc
            finally:
                response.close()
            raise kv._status_error(response)

        call = self._new_call(plan)
        try:
            response = kv._run(call, attempt, keep_slot=True)
        except KVClientError as exc:
            return self._gave_up(exc)
        return self._admitted(response, call)

    def close(self) -> None:
        self._kv.close()  # closes the inner transport too


class AsyncTransport(_Shared, httpx.AsyncBaseTransport):
    """The async :class:`Transport` (asyncio and trio), for ``httpx.AsyncClient`` and
    ``openai.AsyncOpenAI``; ``inner`` defaults to ``httpx.AsyncHTTPTransport``."""

    _kv: AsyncClient

    def __init__(
        self,
        *,
        inner: httpx.AsyncBaseTransport | None = None,
        base_url: str | None = None,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float = 0.0,
        on_retry: Callable[[RetryEvent], None] | None = None,
    ) -> None:
        self._inner = (
            inner if inner is not None else httpx.AsyncHTTPTransport(limits=DEFAULT_LIMITS)
        )
        self._kv = AsyncClient(
            base_url=base_url or _UNKNOWN_BASE_URL,
            context_window=context_window,
            counter=counter,
            retry=retry,
            safety_margin=safety_margin,
            on_retry=on_retry,
            transport=self._inner,
        )
        self._setup(base_url)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        kind = generation_kind(request.method, request.url.path)
        body = _parse(await request.aread()) if kind is not None else None
        if kind is None or body is None:
            return await self._inner.handle_async_request(request)
        kv = self._kv
        if kv.context_window is None:
            self._learn(request, kind, body)
            try:
                await kv._discover()
            except APIConnectionError as exc:
                return self._gave_up(exc)
            except KVClientError as exc:
                return self._discovery_failed(exc)
        plan = self._plan(kind, body)
        if plan is None:
            return await self._inner.handle_async_request(request)
        if isinstance(plan, httpx.Response):
            return plan
        key = str(uuid.uuid4())
        inner = self._inner

        async def attempt(call: RetryCall) -> httpx.Response:
            outgoing = self._outgoing(request, plan, call, key)
            try:
                response = await inner.handle_async_request(outgoing)
            except httpx.HTTPError as exc:
                raise kv._transport_error(exc, outgoing, answered=False) from exc
            response.request = outgoing
            kv._note_room(response)  # the server's advertised room paces later calls
            if response.status_code < 400:
                return response
            try:
                await response.aread()
            except httpx.HTTPError as exc:
                raise kv._transport_error(exc, outgoing, answered=True) from exc
            finally:
                await response.aclose()
            raise kv._status_error(response)

        call = self._new_call(plan)
        try:
            response = await kv._run(call, attempt, keep_slot=True)
        except KVClientError as exc:
            return self._gave_up(exc)
        return self._admitted(response, call)

    async def aclose(self) -> None:
        await self._kv.aclose()  # closes the inner transport too
