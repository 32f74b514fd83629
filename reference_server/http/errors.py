"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.responses import JSONResponse

__all__ = ["APIError", "bad_request", "internal_error", "log_unexpected"]

logger = logging.getLogger("reference_server")


class APIError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI-shaped JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        """The answer: ``{"error": {"message", "type", "param", "code"}}`` with this status."""
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_request"
) -> APIError:
    return APIError(400, message, code=code, param=param)


def internal_error() -> JSONResponse:
    """The answer to an unexpected exception: generic, with nothing of the request in it."""
    return APIError(
        500, "The server had an internal error.", type="server_error", code="internal_error"
    ).response()


def _kinds(exc: BaseException) -> str:
    """The type names of an exception, those inside a group (from a task group) unwrapped."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple) and inner:
        return ", ".join(_kinds(e) for e in inner)
    return type(exc).__name__


def log_unexpected(exc: BaseException, path: str) -> None:
    """Log an unexpected exception by its types only: its message or traceback could quote a
    prompt."""
    logger.error("unexpected %s while serving %s", _kinds(exc), path)
