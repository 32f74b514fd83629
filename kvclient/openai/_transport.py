"""httpx transports that put kvclient between an OpenAI-style client and the server: the core.

``POST .../completions`` and ``POST .../chat/completions`` are counted, their output cap made
explicit and clamped, refused locally when the prompt cannot fit, and sent through kvclient's
retry core (cooldown, send window, Retry-After) to the inner transport. Every other request goes
to the inner transport untouched. A streamed answer is handed on as it arrives, once its status
line says it was admitted: it is retried only before that.

What both transports do without I/O is here (``_Shared``); ``AsyncTransport`` is in
``_async_transport.py`` and ``Transport`` is generated from it (``scripts/unasync.py``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from .._client import (
    _MIN_ATTEMPT_TIMEOUT,
    _PACED,
    IDEMPOTENCY_HEADER,
    RETRY_COUNT_HEADER,
    BaseClient,
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
from .._retry import RetryCall
from ._plan import (
    InvalidCap,
    Plan,
    base_url_of,
    busy_response,
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


# The transports, importable from here as before (they import the core above).
from ._async_transport import AsyncTransport  # noqa: E402
from ._sync_transport import Transport  # noqa: E402
