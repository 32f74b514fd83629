"""The API key check never short-cuts: every request's token is compared in constant time."""

from __future__ import annotations

import hmac

import pytest
from starlette.datastructures import Headers

from reference_server.http.middleware import APIKeyMiddleware


async def _app(scope: object, receive: object, send: object) -> None:  # never reached
    raise AssertionError


@pytest.mark.parametrize(
    ("headers", "supplied", "ok"),
    [
        ({}, b"", False),  # missing: still compared (with nothing)
        ({"authorization": "Bearer s3cret"}, b"s3cret", True),
        ({"authorization": "Bearer s3"}, b"s3", False),  # a prefix: no early exit on length
        ({"authorization": "Bearer s3cret-and-more"}, b"s3cret-and-more", False),
        ({"authorization": "Basic s3cret"}, b"", False),  # not a bearer token
        ({"api-key": "s3cret"}, b"s3cret", True),
    ],
)
def test_every_key_is_compared_with_compare_digest(
    monkeypatch: pytest.MonkeyPatch, headers: dict[str, str], supplied: bytes, ok: bool
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    middleware = APIKeyMiddleware(_app, "s3cret")
    assert middleware._authorized(Headers(headers)) is ok
    assert calls == [(supplied, b"s3cret")]
