"""What the gateway changes in what passes through it: pure functions, no I/O.

The body goes upstream with its output cap made explicit and clamped to what was reserved (and,
for an engine that only stops a stream when its client leaves, a plain request asked as a
stream); the headers lose what belongs to one hop, what the HTTP client sets itself, and the
gateway's own credentials; an answer's headers lose the same, and the upstream's RateLimit
fields (the gateway's ledger says what the gateway will admit).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from kvclient._dialects import LENGTH_FIELDS, MIN_LENGTH_FIELDS

__all__ = [
    "as_stream",
    "assembled_headers",
    "completion_tokens",
    "request_headers",
    "response_headers",
    "with_cap",
]

#: Request headers that belong to one hop (RFC 9110 7.6.1) or that the upstream client sets
#: itself (ASGI servers give header names lower-cased).
_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
        b"expect",
    }
)
#: The client's credentials for the gateway: checked by the gateway, never sent on.
_CLIENT_CREDENTIALS = frozenset({b"authorization", b"api-key"})
_RESPONSE_DROP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"content-encoding",
        b"date",
        b"server",
        b"ratelimit",
        b"ratelimit-policy",
    }
)


def request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, drop_credentials: bool
) -> list[tuple[bytes, bytes]]:
    """The client's headers as they go upstream."""
    dropped = _HOP_HEADERS | _CLIENT_CREDENTIALS if drop_credentials else _HOP_HEADERS
    return [(name, value) for name, value in headers if name.lower() not in dropped]


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An upstream answer's headers as they go to the client (lower-cased names)."""
    return [(name.lower(), value) for name, value in headers if name.lower() not in _RESPONSE_DROP]


def with_cap(raw: bytes, body: dict[str, Any], cap: int) -> bytes:
    """The body that goes upstream: the client's own bytes with every output-length field (in
    any engine's dialect, :data:`~kvclient._dialects.LENGTH_FIELDS`) the reserved cap.

    - no length field at all: ``max_tokens`` appended to the client's bytes (no key of the
      object decodes to it, so the appended one is the only one);
    - ``max_tokens`` alone, already the cap, written once and without escapes: the bytes
      unchanged (a key spelled with ``\\u`` escapes or given twice could be read otherwise by
      another parser);
    - anything else: the parsed body re-encoded with each length field given set to the cap
      (and a minimum length above the cap, :data:`~kvclient._dialects.MIN_LENGTH_FIELDS`,
      lowered to it).
    """
    given = [name for name in LENGTH_FIELDS if name in body]
    # A minimum length above the cap: the engine would refuse the request; it is the cap.
    floors = [
        name
        for name in MIN_LENGTH_FIELDS
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > cap
    ]
    if not given and not floors:
        end = raw.rstrip()
        if end.endswith(b"}"):
            inner = end[:-1].rstrip()
            comma = b"" if inner.endswith(b"{") else b","
            return b'%s%s"max_tokens":%d}' % (inner, comma, cap)
    elif not floors and (
        given == ["max_tokens"]
        and body["max_tokens"] == cap
        and type(body["max_tokens"]) is int
        and b"\\u" not in raw
        and raw.count(b'"max_tokens"') == 1
    ):
        return raw
    capped = dict(body)
    for name in [*(given or ["max_tokens"]), *floors]:
        capped[name] = cap
    return json.dumps(capped).encode()


def as_stream(content: bytes) -> bytes:
    """A plain request's body (as :func:`with_cap` made it) asked as a stream, with its usage
    in the last chunk: ``"stream": true``, ``"stream_options": {"include_usage": true}`` (the
    client's other stream options kept). Re-encoded, so the engine reads what was parsed here."""
    body = json.loads(content)
    options = body.get("stream_options")
    body["stream"] = True
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return json.dumps(body).encode()


#: A stream's headers that do not describe the plain answer assembled from it.
_STREAM_ONLY = frozenset({b"content-type", b"x-accel-buffering", b"cache-control"})


def assembled_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers of a plain answer assembled from a stream (those of :func:`response_headers`):
    JSON instead of the event stream."""
    kept = [(name, value) for name, value in headers if name not in _STREAM_ONLY]
    return [*kept, (b"content-type", b"application/json")]


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})\b')


def completion_tokens(content: bytes) -> int:
    """``usage.completion_tokens`` of an answer, found without parsing the whole answer again
    (in JSON text a key is always a quoted string; inside generated text its quotes are
    escaped, so the pattern cannot match there). The last one counts: usage comes last. 0 when
    absent or not a plain integer of at most 12 digits."""
    at = content.rfind(b'"completion_tokens"')
    if at < 0:
        return 0
    found = _COMPLETION_TOKENS.match(content, at)
    return int(found.group(1)) if found else 0
