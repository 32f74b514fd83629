"""Pure judgements of the contract suite: no I/O, no clock of their own.

Everything a check decides from what it saw lives here, so each rule is tested directly:
is this a valid Retry-After, is this a JSON error, what does ``/v1/models`` advertise, did a
burst end the way the contract says.

>>> judge_retry_after("2").seconds
2.0
>>> judge_retry_after("soon").problem
"'soon' is neither delta-seconds nor an HTTP-date"
>>> classify_error_body(b'{"error": {"message": "no", "code": "x"}}').shape
'openai'
"""

from __future__ import annotations

import email.utils
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._prometheus import parse_samples
from ..engines.errors import is_kv_exhaustion
from ._results import CheckStatus

__all__ = [
    "MAX_PLAUSIBLE_RETRY_AFTER",
    "BurstOutcome",
    "EngineLosses",
    "ErrorBody",
    "RetryAfterAdvice",
    "Verdict",
    "classify_error_body",
    "describe_counts",
    "judge_bad_input",
    "judge_completion_tokens",
    "judge_holders",
    "judge_overlong_prompt",
    "judge_retry_after",
    "judge_saturation",
    "prometheus_value",
    "usage_tokens",
]

#: An advised wait longer than this (seconds) is not back-pressure but an outage notice.
MAX_PLAUSIBLE_RETRY_AFTER = 3600.0

_DELTA_SECONDS = re.compile(r"[0-9]{1,10}")
_MILLISECONDS = re.compile(r"[0-9]{1,13}(?:\.[0-9]{1,6})?")
_MAX_HEADER = 64
# Statuses that ask the client to come back later: never right for a request that cannot fit.
_RETRYABLE = frozenset({408, 425, 429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Verdict:
    status: CheckStatus
    evidence: str
    details: Mapping[str, Any] = field(default_factory=dict)


# --- Retry-After --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryAfterAdvice:
    """A refusal's advised wait: ``seconds`` when usable, ``problem`` when not (or dubious)."""

    raw: str | None
    seconds: float | None
    problem: str | None
    millis_raw: str | None = None

    @property
    def valid(self) -> bool:
        return self.problem is None

    @property
    def missing(self) -> bool:
        return self.raw is None and self.millis_raw is None


def judge_retry_after(
    value: str | None, *, millis: str | None = None, now: float | None = None
) -> RetryAfterAdvice:
    """Judge a ``Retry-After`` value (and the optional ``retry-after-ms``) as RFC 9110 does.

    Valid: delta-seconds (digits only) of at least 1, or an HTTP-date in the future (relative to
    ``now``, Unix time; needed for dates only). ``0``, a past date, decimals, negatives, text and
    waits over an hour are problems: each either invites an immediate retry storm or cannot be
    honoured. ``retry-after-ms`` must be a number and agree with ``Retry-After`` within a second.
    """
    if value is None:
        if millis is None:
            return RetryAfterAdvice(None, None, "no Retry-After header")
        return RetryAfterAdvice(None, None, "retry-after-ms without Retry-After", millis)
    text = value.strip()
    seconds: float | None = None
    problem: str | None = None
    if len(text) > _MAX_HEADER:
        problem = f"Retry-After of {len(text)} characters"
    elif _DELTA_SECONDS.fullmatch(text):
        seconds = float(int(text))
        if seconds < 1:
            problem = "Retry-After: 0 invites an immediate retry"
    else:
        try:
            date = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            date = None
        if date is None or date.tzinfo is None:
            problem = f"{text!r} is neither delta-seconds nor an HTTP-date"
        elif now is None:
            problem = "an HTTP-date Retry-After needs the current time to judge"
        else:
            seconds = max(0.0, date.timestamp() - now)
            if seconds <= 0:
                problem = f"Retry-After date {text!r} is in the past"
    if problem is None and seconds is not None and seconds > MAX_PLAUSIBLE_RETRY_AFTER:
        problem = f"Retry-After of {seconds:.0f} s is implausibly long"
    if problem is None and millis is not None:
        text_ms = millis.strip()
        if not _MILLISECONDS.fullmatch(text_ms):
            problem = f"retry-after-ms {millis!r} is not a number of milliseconds"
        elif seconds is not None and abs(float(text_ms) / 1000.0 - seconds) > 1.0:
            problem = f"retry-after-ms {text_ms} disagrees with Retry-After {text}"
    return RetryAfterAdvice(value, seconds, problem, millis)


# --- error bodies -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """What an error answer's body is: ``openai`` (``{"error": {"message", ...}}``), ``json``
    (another JSON object: FastAPI's ``detail``, TGI's ``{"error": "..."}``), or ``none``."""

    shape: str
    message: str | None = None
    code: str | None = None
    type: str | None = None

    @property
    def is_json(self) -> bool:
        return self.shape != "none"

    def describe(self) -> str:
        if self.shape == "none":
            return "no JSON error body"
        label = self.code or self.type
        return f"JSON error{f' {label}' if label else ''}"


def classify_error_body(content: bytes) -> ErrorBody:
    """Classify an error response's body. Never raises."""
    try:
        value = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ErrorBody("none")
    if not isinstance(value, dict):
        return ErrorBody("none")
    error = value.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code")
        kind = error.get("type")
        return ErrorBody(
            "openai",
            message=error["message"],
            code=str(code) if code is not None else None,
            type=kind if isinstance(kind, str) else None,
        )
    for key in ("error", "detail", "message"):
        if key in value:
            raw = value[key]
            message = raw if isinstance(raw, str) else json.dumps(raw)[:200]
            kind = value.get("error_type") or value.get("type")
            return ErrorBody("json", message=message, type=kind if isinstance(kind, str) else None)
    return ErrorBody("none")


def judge_overlong_prompt(status: int | None, body: ErrorBody, *, prompt_tokens: str) -> Verdict:
    """A prompt longer than the context: 413 preferred, 400/422 accepted, with a JSON error."""
    if status is None:
        return Verdict(CheckStatus.FAIL, f"prompt of {prompt_tokens}: connection dropped")
    seen = f"prompt of {prompt_tokens} -> {status} ({body.describe()})"
    if 200 <= status < 300:
        return Verdict(CheckStatus.FAIL, f"{seen}: accepted (truncated or ignored the context)")
    if status >= 500:
        return Verdict(CheckStatus.FAIL, f"{seen}: a server error, never acceptable")
    if status in _RETRYABLE:
        return Verdict(CheckStatus.FAIL, f"{seen}: retryable, but the request can never fit")
    if not body.is_json:
        return Verdict(CheckStatus.FAIL, f"{seen}: the error is not JSON")
    if status == 413:
        return Verdict(CheckStatus.PASS, seen)
    if status in (400, 422):
        return Verdict(CheckStatus.PASS, f"{seen}; 413 preferred")
    return Verdict(CheckStatus.FAIL, f"{seen}: expected 413 (or 400/422)")


def judge_bad_input(case: str, status: int | None, body: ErrorBody) -> str | None:
    """The problem with the answer to one bad request, or None when it was a 4xx JSON error."""
    if status is None:
        return f"{case}: connection dropped"
    if 200 <= status < 300:
        return f"{case}: accepted with {status}"
    if status >= 500:
        return f"{case}: {status}"
    if not 400 <= status < 500:
        return f"{case}: unexpected {status}"
    if status == 429:
        return f"{case}: 429 (retryable) for a request that is simply wrong"
    if not body.is_json:
        return f"{case}: {status} without a JSON error"
    return None


# --- /v1/models and usage -----------------------------------------------------------------------


def usage_tokens(body: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` from a completion's ``usage``, None where absent."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None, None

    def number(key: str) -> int | None:
        value = usage.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return value

    return number("prompt_tokens"), number("completion_tokens")


def judge_completion_tokens(completion_tokens: int | None, limit: int, what: str) -> str | None:
    """The problem when ``completion_tokens`` exceeds ``limit`` (or is unknown), else None."""
    if completion_tokens is None:
        return f"{what}: no usage.completion_tokens in the answer"
    if completion_tokens > limit:
        return f"{what}: {completion_tokens} completion tokens > {limit}"
    return None


def prometheus_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in Prometheus text format (read by
    :func:`kvclient._prometheus.parse_samples`), or None; None too for NaN and infinities."""
    for sample in parse_samples(text):
        if sample.name == name and not sample.labels:
            return sample.value if math.isfinite(sample.value) else None
    return None


# --- the burst ----------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class BurstOutcome:
    """What happened to one request of a burst.

    ``status`` is None when no answer arrived (``transport_error`` says why; ``unfinished`` when
    the check's deadline cut it). ``completed`` is set for an admitted (2xx) request whose body or
    stream ended properly; ``problem`` says what was wrong otherwise (an error event mid-stream,
    a stream cut off, an unreadable body).
    """

    streamed: bool = False
    status: int | None = None
    transport_error: str | None = None
    unfinished: bool = False
    retry_after: RetryAfterAdvice | None = None
    error_code: str | None = None
    #: The error's own words (an error status's body, an error event mid-stream).
    error_message: str | None = None
    completed: bool = False
    problem: str | None = None

    @property
    def admitted(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def out_of_kv(self) -> bool:
        """Whether its error says the engine ran out of KV cache."""
        return is_kv_exhaustion(self.error_code, self.error_message)

    @property
    def died(self) -> bool:
        """Admitted, then lost before its end: an error event or a cut stream, a broken body, or
        an error status that says the KV cache ran out (only a running request meets that)."""
        if self.unfinished:
            return False
        if self.admitted:
            return not self.completed
        return self.status is not None and self.status >= 500 and self.out_of_kv


@dataclass(frozen=True, slots=True)
class EngineLosses:
    """What the engine's own ``/metrics`` counted while the checks ran: ``count`` of ``kind``
    (``metric``), which ``meaning`` explains."""

    count: float
    kind: str
    metric: str
    meaning: str = ""

    def describe(self) -> str:
        what = f"{self.count:g} {self.kind} ({self.metric})"
        return f"{what}: {self.meaning}" if self.meaning else what


def describe_counts(counter: Mapping[Any, int]) -> str:
    """``"429 x12, 200 x4"``: most common first."""
    ordered = sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0])))
    return ", ".join(f"{key} x{count}" for key, count in ordered)


def _codes(outcomes: Iterable[BurstOutcome]) -> str:
    codes = Counter(o.error_code for o in outcomes if o.error_code)
    return f" ({describe_counts(codes)})" if codes else ""


def describe_deaths(died: Sequence[BurstOutcome], admitted: int) -> str:
    """``"5 admitted requests died mid-decode, 5 of them out of KV memory (OOM): error event
    mid-stream x3, 500 x2 (kv_cache_oom x5)"``."""
    how = Counter(o.problem or f"{o.status}" for o in died)
    oom = sum(o.out_of_kv for o in died)
    of = f" of {admitted}" if admitted > len(died) else ""
    plural = "" if max(admitted, len(died)) == 1 else "s"
    kv = f", {oom} of them out of KV memory (OOM)" if oom else ""
    return (
        f"{len(died)}{of} admitted request{plural} died mid-decode{kv}: "
        f"{describe_counts(how)}{_codes(died)}"
    )


def judge_holders(holders: Sequence[BurstOutcome], losses: EngineLosses | None) -> str | None:
    """The problem when requests held open by a check died, or the engine counted losses while
    they ran; None when neither."""
    died = [o for o in holders if o.died]
    admitted = sum(o.admitted for o in holders)
    problems = [describe_deaths(died, admitted)] if died else []
    if losses is not None and losses.count > 0:
        problems.append(losses.describe())
    return "; ".join(problems) or None


def judge_saturation(
    outcomes: Sequence[BurstOutcome],
    *,
    require_retry_after: bool = True,
    losses: EngineLosses | None = None,
) -> Verdict:
    """A saturating burst: refusals are 429/503 with a valid Retry-After, never 5xx or a dropped
    connection, and every admitted request completes: none dies mid-decode (an error event, a
    stream cut short, an error status that says the KV cache ran out) and the engine's own
    counter of preemptions or OOM losses (``losses``, None when it exposes none) did not move."""
    statuses = Counter(o.status if o.status is not None else "no answer" for o in outcomes)
    details: dict[str, Any] = {"statuses": {str(k): v for k, v in statuses.items()}}
    admitted = [o for o in outcomes if o.status is not None and 200 <= o.status < 300]
    refused = [o for o in outcomes if o.status in (429, 503)]
    died = [o for o in outcomes if o.died]
    server_errors = [
        o
        for o in outcomes
        if o.status is not None and o.status >= 500 and o.status != 503 and not o.died
    ]
    dropped = [o for o in outcomes if o.status is None and not o.unfinished]
    unfinished = [o for o in outcomes if o.unfinished]
    other = [
        o for o in outcomes if o.status is not None and 300 <= o.status < 500 and o.status != 429
    ]
    advice = [o.retry_after for o in refused if o.retry_after is not None]
    missing = [a for a in advice if a.missing]
    invalid = [a for a in advice if not a.missing and not a.valid]
    waits = [a.seconds for a in advice if a.valid and a.seconds is not None]
    details.update(
        admitted=len(admitted),
        completed=sum(o.completed for o in admitted),
        died=len(died),
        died_out_of_kv=sum(o.out_of_kv for o in died),
        refused=len(refused),
        retry_after_missing=len(missing),
        retry_after_invalid=sorted({a.problem or "" for a in invalid}),
        retry_after_seconds=sorted(set(waits)),
    )

    summary = f"{len(outcomes)} sent: {describe_counts(statuses)}"
    failures: list[str] = []
    if died:
        failures.append(describe_deaths(died, len(admitted) + sum(not o.admitted for o in died)))
    if server_errors:
        failures.append(f"{len(server_errors)} server errors{_codes(server_errors)}")
    if dropped:
        kinds = Counter(o.transport_error or "?" for o in dropped)
        failures.append(f"{len(dropped)} dropped connections ({describe_counts(kinds)})")
    if unfinished:
        failures.append(f"{len(unfinished)} unfinished at the deadline (raise --timeout)")
    if other:
        failures.append(f"{len(other)} unexpected 3xx/4xx{_codes(other)}")
    if invalid:
        failures.append(f"invalid Retry-After: {invalid[0].problem}")
    if missing and require_retry_after:
        failures.append(f"{len(missing)} of {len(refused)} refusals without Retry-After")
    if losses is not None:
        details["engine_losses"] = {
            "count": losses.count,
            "kind": losses.kind,
            "metric": losses.metric,
        }
        if losses.count > 0:
            failures.append(losses.describe())
    if failures:
        return Verdict(CheckStatus.FAIL, f"{summary}; " + "; ".join(failures), details)
    if not refused:
        return Verdict(
            CheckStatus.UNSUPPORTED,
            f"{summary}: never refused (the server queues, or raise --burst); no 5xx, "
            f"{len(admitted)} admitted all completed",
            details,
        )
    done = f"{len(admitted)} admitted all completed"
    if missing:
        return Verdict(
            CheckStatus.UNSUPPORTED,
            f"{summary}: refusals carry no Retry-After (allowed); no 5xx, {done}",
            details,
        )
    low, high = min(waits, default=0.0), max(waits, default=0.0)
    span = f"{low:g} s" if low == high else f"{low:g}-{high:g} s"
    return Verdict(
        CheckStatus.PASS, f"{summary}: Retry-After {span}; no 5xx, no drops, {done}", details
    )
