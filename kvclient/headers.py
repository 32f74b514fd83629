"""The headers a server says "not yet" and "how much room" with: read by the client, written by
our servers. The one place for their syntax.

**Retry-After** (RFC 9110 10.2.3) and ``retry-after-ms`` (OpenAI's and vLLM's milliseconds):
:func:`parse_retry_after` reads them.

>>> parse_retry_after({"Retry-After": "2"})
2.0
>>> parse_retry_after({"retry-after-ms": "1500", "Retry-After": "2"})
1.5
>>> parse_retry_after({"Retry-After": "soon"}) is None
True
>>> parse_retry_after({"Retry-After": "1, 2"})  # two headers, as httpx joins them
2.0

**RateLimit**: our servers (the reference server and the gateway) say how much KV budget they
have in the structured-field syntax of the IETF draft "RateLimit header fields for HTTP"
(draft-ietf-httpapi-ratelimit-headers-12): one quota policy named ``"kv"``::

    RateLimit-Policy: "kv";q=29491;kvtok
    RateLimit: "kv";r=1200;t=2;tms=1200

``q`` is the usable KV budget, ``r`` what is free now (usable minus reserved minus what queued
requests wait for), ``t`` whole seconds until the next reservation is due to end (0: none in
flight). The draft counts requests or bytes and has no unit for KV-cache tokens, so the policy
carries a parameter of ours, ``kvtok`` (a Boolean, true): the quota is in KV tokens, counted as
the server reserves them (prompt + output cap, in whole KV blocks). A policy without it is not
ours and is ignored; so is anything malformed. ``tms``, also ours, is ``t`` in milliseconds:
reservations here last seconds, and whole seconds would keep a stale hint up to a second too
long. ``kvqueue`` (ours, a Boolean on the policy) says the server queues what does not fit (a
FIFO admission queue, ``--max-queue-wait``): a client then sends at once and takes its place in
that line, since holding requests locally only loses them their places (measured: 80 requests
through a queueing gateway took 61 s paced, 14 s sent at once). :func:`format_ratelimit` writes
them, :func:`parse_ratelimit` reads them; :class:`kvclient._pacing.Pacer` acts on what they say.

>>> policy, current = format_ratelimit(quota=29491, remaining=1200, reset=1.2)
>>> policy, current
('"kv";q=29491;kvtok', '"kv";r=1200;t=2;tms=1200')
>>> parse_ratelimit({"RateLimit-Policy": policy, "RateLimit": current})
RoomHint(quota=29491, remaining=1200, reset=1.2, queues=False)
>>> parse_ratelimit({"RateLimit": '"default";r=5;t=1'}) is None
True

**X-Priority** (ours, :data:`PRIORITY_HEADER`): a request's priority class, an integer, lower
served first and 0 when absent, as vLLM's own ``priority`` field. kvclient's clients send it
with their ``priority`` option; a server that serves classes (the gateway's tenant fairness)
reads it.

Both parsers take an ``httpx.Headers`` (repeated headers kept apart) or a plain mapping (names
matched in any case), read through :func:`header_values`, and never raise.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MS_PARAM",
    "POLICY_HEADER",
    "POLICY_NAME",
    "PRIORITY_HEADER",
    "QUEUE_PARAM",
    "RATELIMIT_HEADER",
    "UNIT_PARAM",
    "RoomHint",
    "format_ratelimit",
    "header_values",
    "parse_ratelimit",
    "parse_retry_after",
]


#: A request's priority class: an integer, lower served first, 0 when absent.
PRIORITY_HEADER = "X-Priority"


def header_values(headers: Mapping[str, str] | Any, name: str) -> list[str]:
    """Every value of header ``name``, in order: httpx's ``Headers`` keeps repeated headers
    apart in ``get_list``; in a plain mapping the name matches in any case, and bytes values are
    read as latin-1. Anything else (no headers at all, values of other types) gives nothing.

    >>> header_values({"retry-after": "1", "Retry-After": b"2"}, "Retry-After")
    ['1', '2']
    """
    get_list = getattr(headers, "get_list", None)
    if callable(get_list):
        values = get_list(name)
        if isinstance(values, list):
            return [value for value in values if isinstance(value, str)]
    items = getattr(headers, "items", None)
    if not callable(items):
        return []
    lowered = name.lower()
    found: list[str] = []
    for key, value in items():
        if not (isinstance(key, str) and key.lower() == lowered):
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str):
            found.append(value)
    return found


# --- Retry-After -----------------------------------------------------------------------------

# A header longer than this is garbage (or hostile); never feed megabytes to float() or a parser.
# (Room for a few values: repeated headers arrive joined by commas.)
_MAX_HEADER_LENGTH = 256
_MAX_HEADER_VALUES = 8
_DELTA_SECONDS = re.compile(r"\s*(\d{1,20}(?:\.\d{1,9})?)\s*")


def _items(value: str) -> list[str]:
    """The values one header line carries: several joined by commas (``"1, 2"``) or one.

    An IMF-fixdate has a comma of its own (``Sun, 06 Nov 1994 ...``): a part that is not a
    number is joined with the next one before parsing.
    """
    parts = value.split(",")
    items: list[str] = []
    i = 0
    while i < len(parts) and len(items) < _MAX_HEADER_VALUES:
        part = parts[i]
        if _DELTA_SECONDS.fullmatch(part) or i + 1 == len(parts):
            items.append(part)
            i += 1
        else:
            items.append(part + "," + parts[i + 1])
            i += 2
    return items


def _delta(item: str, per_second: float) -> float | None:
    match = _DELTA_SECONDS.fullmatch(item)
    if not match:
        return None
    seconds = float(match.group(1)) / per_second
    return seconds if math.isfinite(seconds) else None


def _date_delta(item: str, now: float | None) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(item.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # asctime dates carry no zone; every HTTP-date is GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    current = time.time() if now is None else now
    delta = when.timestamp() - current
    return max(0.0, delta) if math.isfinite(delta) else None


def _largest(values: list[str], parse: Callable[[str], float | None]) -> float | None:
    found = [
        seconds
        for value in values
        if len(value) <= _MAX_HEADER_LENGTH
        for item in _items(value)
        if (seconds := parse(item)) is not None
    ]
    return max(found, default=None)


def parse_retry_after(
    headers: Mapping[str, str] | Any, *, now: float | None = None
) -> float | None:
    """The server's advised wait in seconds, or None when it gave no usable advice.

    ``retry-after-ms`` (milliseconds) wins over ``Retry-After``, which is either delta-seconds
    (integer or decimal) or an HTTP-date, read relative to ``now`` (Unix time, default: the
    current time). A date in the past means "now": ``0.0``. When a header is repeated (httpx
    joins repeats as ``"1, 2"``), the largest valid value counts: the server's floor. Anything
    malformed, negative, non-finite or absurdly long is ignored. Never raises.
    """
    try:
        millis = _largest(header_values(headers, "retry-after-ms"), lambda v: _delta(v, 1000.0))
        if millis is not None:
            return millis
        return _largest(
            header_values(headers, "retry-after"),
            lambda v: value if (value := _delta(v, 1.0)) is not None else _date_delta(v, now),
        )
    except Exception:  # a header parser must never take the client down
        return None


# --- RateLimit -------------------------------------------------------------------------------

POLICY_HEADER = "RateLimit-Policy"
RATELIMIT_HEADER = "RateLimit"
#: The quota policy's name, and our parameter saying that its unit is KV tokens.
POLICY_NAME = "kv"
UNIT_PARAM = "kvtok"
#: Our parameter on the policy saying that the server queues requests that do not fit yet.
QUEUE_PARAM = "kvqueue"
MS_PARAM = "tms"
_MAX_FIELD_LENGTH = 1024
_INTEGER = re.compile(r"\d{1,15}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomHint:
    """What a server advertised: usable budget, free now, seconds to the next due release."""

    quota: int | None
    remaining: int
    reset: float | None
    #: The server queues what does not fit (FIFO): pacing before the send would only lose places.
    queues: bool = False


def format_ratelimit(
    *, quota: int, remaining: int, reset: float, queues: bool = False
) -> tuple[str, str]:
    """``(RateLimit-Policy, RateLimit)`` values for a budget of ``quota`` KV tokens with
    ``remaining`` free and the next release due in ``reset`` seconds (``t`` rounded up to
    whole seconds, ``tms`` to milliseconds); ``queues``: the server queues what does not fit."""
    reset = max(0.0, reset) if math.isfinite(reset) else 0.0
    queue = f";{QUEUE_PARAM}" if queues else ""
    return (
        f'"{POLICY_NAME}";q={max(0, quota)};{UNIT_PARAM}{queue}',
        f'"{POLICY_NAME}";r={max(0, remaining)};t={math.ceil(reset)};'
        f"{MS_PARAM}={math.ceil(reset * 1000)}",
    )


def _joined(headers: Mapping[str, str] | Any, name: str) -> str | None:
    """A field's lines joined as one List (RFC 9651 3.1), or None when absent or too long."""
    values = header_values(headers, name)
    if not values:
        return None
    joined = ", ".join(values)
    return joined if len(joined) <= _MAX_FIELD_LENGTH else None


def _our_params(field: str) -> dict[str, str | None] | None:
    """The parameters of the ``"kv"`` member of a List field, or None when it has none."""
    # Split by hand: our names and values hold no commas, semicolons or escapes.
    for member in field.split(","):
        item, *params = member.split(";")
        name = item.strip()
        if len(name) >= 2 and name[0] == name[-1] == '"':
            name = name[1:-1]
        if name != POLICY_NAME:
            continue
        found: dict[str, str | None] = {}
        for param in params:
            key, equals, value = param.partition("=")
            found[key.strip()] = value.strip() if equals else None
        return found
    return None


def _integer(value: str | None) -> int | None:
    if value is None or not _INTEGER.fullmatch(value):
        return None
    return int(value)


def parse_ratelimit(headers: Mapping[str, str] | Any) -> RoomHint | None:
    """The ``"kv"`` room a response advertises, or None (absent, not in KV tokens, malformed).

    Both fields are needed: the policy marked ``kvtok`` (the unit) and the current ``r``.
    Never raises.
    """
    try:
        policy_field = _joined(headers, POLICY_HEADER)
        current_field = _joined(headers, RATELIMIT_HEADER)
        if policy_field is None or current_field is None:
            return None
        policy = _our_params(policy_field)
        if policy is None or UNIT_PARAM not in policy or policy[UNIT_PARAM] not in (None, "?1"):
            return None
        current = _our_params(current_field)
        if current is None:
            return None
        remaining = _integer(current.get("r"))
        if remaining is None:
            return None
        millis = _integer(current.get(MS_PARAM))
        seconds = _integer(current.get("t"))
        if millis is not None:
            reset: float | None = millis / 1000
        else:
            reset = None if seconds is None else float(seconds)
        return RoomHint(
            quota=_integer(policy.get("q")),
            remaining=remaining,
            reset=reset,
            queues=QUEUE_PARAM in policy and policy[QUEUE_PARAM] in (None, "?1"),
        )
    except Exception:  # a header parser must never take the client down
        return None
