"""httpx transports that put kvclient between an OpenAI-style client and the server: the base.

``POST .../completions`` and ``POST .../chat/completions`` are counted, their output cap made
explicit and clamped, refused locally when the prompt cannot fit, and sent on the client's own
send path (:mod:`kvclient._client`: routing over replicas and fail-over, cooldown, send window,
Retry-After, the immediate re-send on a connection the server had closed). Every other request
goes to the inner transport untouched. An answer is handed on as it arrives, once its status
line says it was admitted: it is retried only before that.

What both transports do without I/O is here (``_Shared``); ``AsyncTransport`` is in
``_async_transport.py`` and ``Transport`` is generated from it (``scripts/unasync.py``). This
module imports neither: they import it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from .._client import BaseClient
from .._exceptions import (
    APIConnectionError,
    APIStatusError,
    ChatTemplateError,
    KVClientError,
    PromptTooLongError,
    ServerBusyError,
)
from .._replicas import Call, normalize_base_url
from ..headers import PRIORITY_HEADER
from ._plan import (
    LOCAL_REASON,
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

__all__ = ["DEFAULT_LIMITS"]

#: The openai SDK's own connection limits, for the inner transport kvclient creates.
DEFAULT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
# Only used for discovery, and replaced by the first request's own base URL before that.
_UNKNOWN_BASE_URL = "http://base-url.invalid"


def _parse(content: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


logger = logging.getLogger("kvclient.openai")


class _LocalAnswers(logging.Filter):
    """Drops httpx's "HTTP Request" record of an answer kvclient made itself (a local refusal,
    "gave up"): httpx's client logs whatever its transport returns as a request it sent, and
    none was. The answer is told at DEBUG under kvclient's own logger instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            isinstance(args, tuple)
            and len(args) == 5
            and isinstance(args[4], str)
            and args[4].endswith(LOCAL_REASON)
        ):
            logger.debug("not sent, answered here: %s %s %s %s", args[0], args[1], args[3], args[4])
            return False
        return True


_LOCAL_ANSWERS = _LocalAnswers()


def _hide_local_answers() -> None:
    """Installed on httpx's logger when a transport is made (never on import); it only ever
    drops records of kvclient's own answers."""
    httpx_logger = logging.getLogger("httpx")
    if _LOCAL_ANSWERS not in httpx_logger.filters:
        httpx_logger.addFilter(_LOCAL_ANSWERS)


class _Shared:
    """What both transports do without I/O, around a kvclient client ``self._kv``."""

    _kv: BaseClient

    def _setup(self, base_url: str | Sequence[str] | None) -> None:
        self._base_url_known = base_url is not None
        self._learn_lock = threading.Lock()
        _hide_local_answers()

    @property
    def context_window(self) -> int | None:
        """The context window clamps go by (given, or discovered at the first request)."""
        return self._kv.context_window

    def _learn(self, request: httpx.Request, kind: str, body: dict[str, Any]) -> None:
        """Before discovery: where the API is (unless given), which model, and the caller's
        credentials, all from the SDK's first generation request."""
        kv = self._kv
        with self._learn_lock:
            if not self._base_url_known:
                kv.base_url, _credentials = normalize_base_url(base_url_of(request.url, kind))
                self._base_url_known = True
            model = body.get("model")
            if kv.model is None and isinstance(model, str):
                kv.model = model
            auth = request.headers.get("authorization")
            if auth and not any(name.lower() == "authorization" for name in kv.headers):
                kv.headers["Authorization"] = auth

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

    def _builder(
        self, request: httpx.Request, kind: str, plan: Plan
    ) -> Callable[[Call], httpx.Request]:
        """How each attempt sends the SDK's request: to the attempt's replica (the path after
        the API's base, e.g. ``/v1/chat/completions``), with the SDK's headers (and the
        client's priority where the request gives none) and extensions and the rewritten
        body."""
        api, _credentials = normalize_base_url(base_url_of(request.url, kind))
        tail = request.url.raw_path.decode("ascii")[len(httpx.URL(api).raw_path.rstrip(b"/")) :]
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name.lower() not in (b"content-length", b"host")
        ]
        priority = self._kv.priority
        if priority is not None and PRIORITY_HEADER not in request.headers:
            headers.append((PRIORITY_HEADER.encode("ascii"), str(priority).encode("ascii")))

        def build(call: Call) -> httpx.Request:
            return httpx.Request(
                request.method,
                call.replica.base_url + tail,
                headers=headers,
                content=plan.content,
                extensions=dict(request.extensions),
            )

        return build

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

    @staticmethod
    def _admitted(response: httpx.Response) -> httpx.Response:
        """The admitted answer as the SDK gets it: its body unread, holding the call's
        send-window slot until the SDK closes it."""
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=response.stream,
            extensions=response.extensions,
        )
