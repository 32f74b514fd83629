"""ASGI middleware both apps use, each a class with ``__init__(app, ...)`` and
``async __call__(scope, receive, send)``, and :func:`build_app`, which assembles them."""

from __future__ import annotations

import hmac
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, internal_error, log_unexpected

__all__ = ["APIKeyMiddleware", "AbsoluteFormMiddleware", "UnexpectedErrorMiddleware", "build_app"]


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
            response = APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ).response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class AbsoluteFormMiddleware:
    """A request target in absolute form (``GET http://host/v1/models``) is routed by its path:
    a server must accept it (RFC 9112 3.2.2), and uvicorn's h11 protocol passes it on whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("http://", "https://")):
            path = urllib.parse.urlsplit(scope["path"]).path or "/"
            scope = {**scope, "path": path, "raw_path": path.encode("latin-1")}
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """Answers an unexpected exception with a generic 500 and logs only its type, then stops it.

    Starlette's own handler (for the outer middleware) re-raises after answering so that the
    ASGI server can log the traceback, and a traceback can quote a prompt. When the response has
    started (a stream), the connection is closed instead: a cut stream.
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
            log_unexpected(exc, scope["path"])
            if not started:
                await internal_error()(scope, receive, send)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    message = {
        404: f"no route {request.url.path!r}",
        405: f"method {request.method} is not allowed on {request.url.path!r}",
    }.get(exc.status_code, str(exc.detail))
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log_unexpected(exc, request.url.path)
    return internal_error()


def build_app(routes: list[Route], *, api_key: str | None, lifespan: Any = None) -> Starlette:
    """A Starlette app with the servers' error handling and, with ``api_key``, the key check."""
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: _http_exception,
        Exception: _unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.add_middleware(UnexpectedErrorMiddleware)  # the innermost: 500s are counted
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(AbsoluteFormMiddleware)  # the outermost: every route sees the path
    return app
