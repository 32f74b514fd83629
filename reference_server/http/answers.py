"""The answers admission gives over HTTP: the cap a request is admitted with (or the 413 and 400
that refuse it for good), the 429 with Retry-After, and the RateLimit headers of the room left.

Shared by both apps; the syntax of RateLimit and Retry-After lives in :mod:`kvclient.headers`.
"""

from __future__ import annotations

import math
import time

from starlette.responses import JSONResponse, Response
from starlette.types import Send

from kvclient import effective_output_cap
from kvclient.headers import POLICY_HEADER, RATELIMIT_HEADER, format_ratelimit

from ..admission.ledger import Handle, Headroom, KVAdmissionController
from ..admission.queue import AdmissionQueue, Rejected
from .errors import APIError

__all__ = [
    "admissible_cap",
    "ratelimit_headers",
    "retry_after_header",
    "room",
    "send_whole",
    "too_busy",
]


async def send_whole(response: Response, send: Send) -> None:
    """Send a whole (not streamed) Starlette response through ASGI ``send``."""
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def ratelimit_headers(room: Headroom, *, queues: bool = False) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit`` for ``room`` (see :mod:`kvclient.headers` for the
    syntax, the ``kvtok`` unit and ``kvqueue``: ``queues``, what does not fit waits in a FIFO
    queue); none for a strategy whose room is not in reserved tokens."""
    if not room.advertised:
        return {}
    policy, current = format_ratelimit(
        quota=room.usable, remaining=room.free, reset=room.next_release_in, queues=queues
    )
    return {POLICY_HEADER: policy, RATELIMIT_HEADER: current}


def room(
    ledger: KVAdmissionController,
    queue: AdmissionQueue | None = None,
    releasing: Handle | None = None,
    *,
    holder: Handle | None = None,
) -> dict[str, str]:
    """The RateLimit headers for an answer of a server with ``ledger`` (and ``queue``, whose
    room it is: a shared ledger's is every gateway's) now; ``holder``, the request answered
    (a fair queue gives its tenant's room)."""
    if queue is None:
        return ratelimit_headers(ledger.headroom(time.monotonic(), releasing=releasing))
    return ratelimit_headers(queue.headroom(releasing, holder=holder), queues=queue.max_wait > 0)


def retry_after_header(seconds: float) -> tuple[str, str]:
    """``(Retry-After, retry-after-ms)``: whole seconds, at least 1; milliseconds, at least 1."""
    whole = max(1, math.ceil(seconds))
    millis = max(1, math.ceil(seconds * 1000))
    return str(whole), str(millis)


def admissible_cap(
    ledger: KVAdmissionController,
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    context_window: int,
    param: str,
) -> int:
    """The output cap a request is reserved (and generated) with, or the :class:`APIError` that
    refuses it for good: 413 when the prompt fills the context, 400 ``kv_budget_exceeded`` when
    even an empty ledger could not hold it (a 429 would send it round forever)."""
    cap = effective_output_cap(max_tokens, prompt_tokens, context_window)
    if cap is None:
        raise APIError(
            413,
            f"This model's maximum context length is {context_window} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for output.",
            code="context_length_exceeded",
            param=param,
        )
    need = ledger.need_tokens(prompt_tokens, cap)
    if ledger.never_fits(need):
        fits = ledger.max_output_that_fits(prompt_tokens)
        hint = f"set max_tokens <= {fits}" if fits >= 1 else "shorten the prompt"
        raise APIError(
            400,
            f"This request can never be admitted: it needs {need} KV tokens ({prompt_tokens} "
            f"prompt + {cap} output cap, in blocks of {ledger.block_size}) but the server's "
            f"whole usable budget is {ledger.usable_tokens} tokens; {hint}.",
            code="kv_budget_exceeded",
            param="max_tokens",
        )
    return cap


def too_busy(
    ledger: KVAdmissionController,
    rejected: Rejected,
    prompt_tokens: int,
    cap: int,
    queue: AdmissionQueue | None = None,
) -> JSONResponse:
    """The 429 for a request the budget cannot take now, with Retry-After and retry-after-ms,
    and the room left (RateLimit headers)."""
    reserved, inflight = queue.load() if queue is not None else ledger.load()
    seconds, millis = retry_after_header(rejected.retry_after)
    if rejected.room is not None:  # the refused request's own tenant's room
        queues = queue is not None and queue.max_wait > 0
        advertised = ratelimit_headers(rejected.room, queues=queues)
    else:
        advertised = room(ledger, queue)
    queued = f", {rejected.queued_ahead} queued ahead" if rejected.queued_ahead else ""
    return APIError(
        429,
        f"KV cache budget exhausted: this request needs {rejected.need} tokens "
        f"({prompt_tokens} prompt + {cap} output cap) and {reserved} of "
        f"{ledger.usable_tokens} usable tokens are reserved by {inflight} in-flight "
        f"requests{queued}. Retry after {int(millis) / 1000:.3f} seconds.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": seconds, "retry-after-ms": millis, **advertised},
    ).response()
