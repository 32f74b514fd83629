"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

__all__ = ["APIError", "error_response"]


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


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
        return error_response(
            self.status,
            self.message,
            type=self.type,
            code=self.code,
            param=self.param,
            headers=self.headers,
        )


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_request"
) -> APIError:
    return APIError(400, message, code=code, param=param)
