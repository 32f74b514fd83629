"""Pacing from the room a server advertises: the RateLimit header fields, written and read (pure).

Our servers (the reference server and the gateway) say how much KV budget they have in the
structured-field syntax of the IETF draft "RateLimit header fields for HTTP"
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
long. These are the only lines that know the syntax.

:class:`Pacer` turns the latest hint into "send now, or hold this long": one per client.

>>> policy, current = format_ratelimit(quota=29491, remaining=1200, reset=1.2)
>>> policy, current
('"kv";q=29491;kvtok', '"kv";r=1200;t=2;tms=1200')
>>> parse_ratelimit({"RateLimit-Policy": policy, "RateLimit": current})
RoomHint(quota=29491, remaining=1200, reset=1.2)
>>> parse_ratelimit({"RateLimit": '"default";r=5;t=1'}) is None
True
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PACE_MAX_AGE",
    "MS_PARAM",
    "PACE_LAG",
    "PACE_POLL",
    "PACE_TRICKLE",
    "POLICY_HEADER",
    "POLICY_NAME",
    "RATELIMIT_HEADER",
    "UNIT_PARAM",
    "Pacer",
    "RoomHint",
    "format_ratelimit",
    "parse_ratelimit",
]

POLICY_HEADER = "RateLimit-Policy"
RATELIMIT_HEADER = "RateLimit"
#: The quota policy's name, and our parameter saying that its unit is KV tokens.
POLICY_NAME = "kv"
UNIT_PARAM = "kvtok"
MS_PARAM = "tms"
#: A hint is trusted for at most this long (seconds), and never past its ``t``: the room it
#: describes changes with every admission and release, most of which this client does not see.
DEFAULT_PACE_MAX_AGE = 1.0
#: A held request asks again this often (seconds): a fresher hint may have arrived meanwhile.
PACE_POLL = 0.02
#: Once a hint has aged out, one held request goes per this many seconds until a fresh hint
#: comes (its answer brings one); after _FORGET_AFTER x max_age without any, all go again.
PACE_TRICKLE = 0.05
_FORGET_AFTER = 10
#: Sends this recent (seconds) when a hint arrives may not have reached the server when it wrote
#: the hint: they stay counted against the new hint instead of being forgotten. Generous: on a
#: loaded 2-core machine 50 ms let one request in twenty collect a 429 in the retry storm.
PACE_LAG = 0.25

_MAX_FIELD_LENGTH = 1024
_INTEGER = re.compile(r"\d{1,15}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomHint:
    """What a server advertised: usable budget, free now, seconds to the next due release."""

    quota: int | None
    remaining: int
    reset: float | None


def format_ratelimit(*, quota: int, remaining: int, reset: float) -> tuple[str, str]:
    """``(RateLimit-Policy, RateLimit)`` values for a budget of ``quota`` KV tokens with
    ``remaining`` free and the next release due in ``reset`` seconds (``t`` rounded up to
    whole seconds, ``tms`` to milliseconds)."""
    reset = max(0.0, reset) if math.isfinite(reset) else 0.0
    return (
        f'"{POLICY_NAME}";q={max(0, quota)};{UNIT_PARAM}',
        f'"{POLICY_NAME}";r={max(0, remaining)};t={math.ceil(reset)};'
        f"{MS_PARAM}={math.ceil(reset * 1000)}",
    )


def _joined(headers: Mapping[str, str] | Any, name: str) -> str | None:
    """A field's lines joined as one List (RFC 9651 3.1), or None when absent or too long."""
    get_list = getattr(headers, "get_list", None)
    if callable(get_list):
        values = [v for v in get_list(name) if isinstance(v, str)]
    else:
        lowered = name.lower()
        values = [v for k, v in headers.items() if isinstance(k, str) and k.lower() == lowered]
        values = [v for v in values if isinstance(v, str)]
    if not values:
        return None
    joined = ", ".join(values)
    return joined if len(joined) <= _MAX_FIELD_LENGTH else None


def _our_params(field: str) -> dict[str, str | None] | None:
    """The parameters of the ``"kv"`` member of a List field, or None when it has none."""
    # Split by hand (our names and values hold no commas, semicolons or escapes): a regex over
    # the whole member costs several times more, on every answer.
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
        return RoomHint(quota=_integer(policy.get("q")), remaining=remaining, reset=reset)
    except Exception:  # a header parser must never take the client down
        return None


class Pacer:
    """The latest room a server advertised, less what this client has sent since (pure).

    :meth:`observe` records a hint with the time it arrived; :meth:`take` answers whether a
    request of ``need`` KV tokens may go now (and counts it as sent) or how long to hold it
    before asking again. A hint ages out after ``max_age`` seconds, or ``lag`` after its ``t``
    (the next due release: the answer that shows it takes a moment) when that is sooner: then
    one request per ``PACE_TRICKLE`` goes until an answer brings a fresh hint, and after ten
    times ``max_age`` without one, every request goes. Before any hint every request goes, as
    without pacing.
    Sends made less than ``lag`` seconds before a hint arrives still count against it: the
    server may have written it before they reached it.
    A request larger than the whole advertised budget goes too: the server refuses it for good,
    which a hold would only delay. Thread- and task-safe: the lock is held for arithmetic only.

    >>> pacer = Pacer(max_age=1.0)
    >>> pacer.observe(10.0, RoomHint(quota=1000, remaining=300, reset=5))
    >>> pacer.take(10.1, 200), pacer.take(10.1, 200)   # the second does not fit what is left
    (0.0, 0.02)
    >>> pacer.take(11.0, 200)                          # the hint has aged out
    0.0
    """

    __slots__ = (
        "_expires", "_free", "_lock", "_quota", "_recent", "_seen", "_sent", "_trickle", "lag",
        "max_age",
    )  # fmt: skip

    def __init__(self, *, max_age: float = DEFAULT_PACE_MAX_AGE, lag: float = PACE_LAG) -> None:
        if not (isinstance(max_age, (int, float)) and max_age > 0 and math.isfinite(max_age)):
            raise ValueError(f"max_age must be a positive number of seconds, got {max_age!r}")
        if not (isinstance(lag, (int, float)) and 0 <= lag < math.inf):
            raise ValueError(f"lag must be a finite number of seconds >= 0, got {lag!r}")
        self.max_age = float(max_age)
        self.lag = float(lag)
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the latest sends
        self._lock = threading.Lock()
        self._free = 0
        self._quota: int | None = None
        self._sent = 0
        self._seen = -math.inf
        self._expires = -math.inf
        self._trickle = -math.inf

    def __repr__(self) -> str:
        return f"Pacer(free={self._free}, sent={self._sent}, expires={self._expires:.3f})"

    def observe(self, now: float, hint: RoomHint, own: tuple[float, int] | None = None) -> None:
        """A response that arrived at monotonic time ``now`` advertised ``hint``.

        ``own`` is the answered request's send, ``(when, need)`` as :meth:`take` let it go: the
        hint already accounts for it (reserved, released or refused), so it is not counted again.
        """
        age = self.max_age
        if hint.reset:
            age = min(age, float(hint.reset) + self.lag)
        with self._lock:
            if now < self._seen:
                return  # an older answer read late: the newer one stands
            recent = self._recent
            while recent and recent[0][0] < now - self.lag:
                recent.popleft()
            if own is not None:
                with contextlib.suppress(ValueError):
                    recent.remove(own)
            self._free = hint.remaining
            self._quota = hint.quota
            self._sent = sum(tokens for _, tokens in recent)
            self._seen = now
            self._expires = now + age

    def take(self, now: float, need: int) -> float:
        """0.0: send now (``need`` is counted against the hint); else seconds to hold first."""
        with self._lock:
            if self._quota is not None and need > self._quota:
                self._note(now, need)
                return 0.0
            if now >= self._expires:
                if now >= self._expires + _FORGET_AFTER * self.max_age or now >= self._trickle:
                    # Stale: one request per PACE_TRICKLE goes, and its answer (a 429 at once,
                    # if the room is gone) brings a fresh hint. Letting every held request go
                    # the moment a hint ages out sent a herd: nearly all the retry storm's 429s.
                    self._trickle = now + PACE_TRICKLE
                    self._note(now, need)
                    return 0.0
                return min(PACE_POLL, self._trickle - now)
            if self._sent + need <= self._free:
                self._note(now, need)
                return 0.0
            return min(PACE_POLL, self._expires - now)

    def take_if_fits(self, now: float, need: int) -> bool:
        """Whether a live hint has room for ``need`` now (then it is counted as sent)."""
        with self._lock:
            if now < self._expires and self._sent + need <= self._free:
                self._note(now, need)
                return True
            return False

    def send_anyway(self, now: float, need: int) -> None:
        """Count a request that goes despite the hint (its deadline would not wait)."""
        with self._lock:
            self._note(now, need)

    def _note(self, now: float, need: int) -> None:
        self._sent += need
        if self.lag > 0:
            recent = self._recent
            recent.append((now, need))
            if len(recent) > 4096 or recent[0][0] < now - self.lag:  # bounded, whatever happens
                while recent and (len(recent) > 4096 or recent[0][0] < now - self.lag):
                    recent.popleft()
