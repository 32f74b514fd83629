"""What the gateway changes in what passes through it: pure functions, no I/O.

The body goes upstream with its output cap made explicit and clamped to what was reserved (and,
for an engine that only stops a stream when its client leaves, a plain request asked as a
stream), without a field that would set the engine's scheduling order; of the client's headers
only a stated few go on (:data:`FORWARDED_HEADERS`), within bounds; an answer's headers lose
what belongs to one hop, what the HTTP client sets itself, and the upstream's RateLimit fields
(the gateway's ledger says what the gateway will admit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kvclient.engines.spend import LENGTH_FIELDS, MIN_LENGTH_FIELDS, SCHEDULING_FIELDS

from ..http.errors import APIError

__all__ = [
    "FORWARDED_HEADERS",
    "MAX_FORWARDED_BYTES",
    "MAX_FORWARDED_FIELDS",
    "as_stream",
    "assembled_headers",
    "request_headers",
    "response_headers",
    "with_cap",
]

#: The client's request headers that go upstream, and no other (ASGI servers give names
#: lower-cased): what the body is and what the client takes back, and tracing (W3C trace
#: context; a request id, which vLLM takes for its own). What stays here: what belongs to one
#: hop, cookies, the client's own headers, ``Prefer`` (the gateway honours it), an engine's
#: routing hints (vLLM's and SGLang's ``X-Data-Parallel-Rank`` would put KV where the gateway
#: reserved none).
FORWARDED_HEADERS = frozenset(
    {b"content-type", b"accept", b"traceparent", b"tracestate", b"x-request-id"}
)
#: The client's credentials: checked by the gateway when it has a key, and then never sent on;
#: without one they are the engine's, and go on.
_CLIENT_CREDENTIALS = frozenset({b"authorization", b"api-key"})
#: Bounds on what goes upstream of the client's headers: fields, and bytes of names and values.
MAX_FORWARDED_FIELDS = 16
MAX_FORWARDED_BYTES = 8 * 1024
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
    """The client's headers as they go upstream: those of :data:`FORWARDED_HEADERS` (and its
    credentials, unless ``drop_credentials``); a 431 naming the header past the bounds
    (:data:`MAX_FORWARDED_FIELDS`, :data:`MAX_FORWARDED_BYTES`) rather than a part of them."""
    allowed = FORWARDED_HEADERS if drop_credentials else FORWARDED_HEADERS | _CLIENT_CREDENTIALS
    forwarded: list[tuple[bytes, bytes]] = []
    size = 0
    for name, value in headers:
        if name.lower() not in allowed:
            continue
        size += len(name) + len(value)
        forwarded.append((name, value))
        if len(forwarded) > MAX_FORWARDED_FIELDS or size > MAX_FORWARDED_BYTES:
            header = name.decode("latin-1")
            raise APIError(
                431,
                f"the {header!r} header takes the headers sent on to the engine past "
                f"{MAX_FORWARDED_FIELDS} fields or {MAX_FORWARDED_BYTES} bytes",
                code="request_header_fields_too_large",
                param=header,
            )
    return forwarded


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An upstream answer's headers as they go to the client (lower-cased names)."""
    return [(name.lower(), value) for name, value in headers if name.lower() not in _RESPONSE_DROP]


def with_cap(raw: bytes, body: dict[str, Any], cap: int) -> bytes:
    """The body that goes upstream: the client's own bytes with every output-length field (in
    any engine's dialect, :data:`~kvclient.engines.spend.LENGTH_FIELDS`) the reserved cap.

    - no length field at all: ``max_tokens`` appended to the client's bytes (no key of the
      object decodes to it, so the appended one is the only one);
    - ``max_tokens`` alone, already the cap, written once and without escapes: the bytes
      unchanged (a key spelled with ``\\u`` escapes or given twice could be read otherwise by
      another parser);
    - anything else: the parsed body re-encoded with each length field given set to the cap
      (and a minimum length above the cap, :data:`~kvclient.engines.spend.MIN_LENGTH_FIELDS`,
      lowered to it), and without the fields that would set the engine's scheduling order
      (:data:`~kvclient.engines.spend.SCHEDULING_FIELDS`: vLLM's ``priority``).
    """
    given = [name for name in LENGTH_FIELDS if name in body]
    dropped = [name for name in SCHEDULING_FIELDS if name in body]
    # A minimum length above the cap: the engine would refuse the request; it is the cap.
    floors = [
        name
        for name in MIN_LENGTH_FIELDS
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > cap
    ]
    if not given and not floors and not dropped:
        end = raw.rstrip()
        if end.endswith(b"}"):
            inner = end[:-1].rstrip()
            comma = b"" if inner.endswith(b"{") else b","
            return b'%s%s"max_tokens":%d}' % (inner, comma, cap)
    elif (
        not floors
        and not dropped
        and (
            given == ["max_tokens"]
            and body["max_tokens"] == cap
            and type(body["max_tokens"]) is int
            and b"\\u" not in raw
            and raw.count(b'"max_tokens"') == 1
        )
    ):
        return raw
    capped = {name: value for name, value in body.items() if name not in dropped}
    for name in [*(given or ["max_tokens"]), *floors]:
        capped[name] = cap
    return json.dumps(capped).encode()


def as_stream(content: bytes, *, every_chunk: bool = False) -> tuple[bytes, bool]:
    """A body (as :func:`with_cap` made it) asked as a stream, with its usage in the last chunk
    (``"stream_options": {"include_usage": true}``) and, ``every_chunk``, in every chunk too
    (``continuous_usage_stats``: how the peak rule follows a holder's progress); the client's
    other stream options kept. Also whether the client had asked for the usage itself.
    Re-encoded, so the engine reads what was parsed here."""
    body = json.loads(content)
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    asked = options.get("include_usage") is True
    options["include_usage"] = True
    if every_chunk:
        options["continuous_usage_stats"] = True
    body["stream"] = True
    body["stream_options"] = options
    return json.dumps(body).encode(), asked


#: A stream's headers that do not describe the plain answer assembled from it.
_STREAM_ONLY = frozenset({b"content-type", b"x-accel-buffering", b"cache-control"})


def assembled_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers of a plain answer assembled from a stream (those of :func:`response_headers`):
    JSON instead of the event stream."""
    kept = [(name, value) for name, value in headers if name not in _STREAM_ONLY]
    return [*kept, (b"content-type", b"application/json")]
