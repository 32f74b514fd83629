"""Waiting for admission: a FIFO queue in front of the (pure) ledger.

Requests wait in arrival order: while anyone is queued, a newcomer queues behind them even if it
would fit now, so a large request at the head is not starved by a stream of small ones. Only the
head tries the ledger; a release wakes the head. anyio primitives are created per waiter, inside
the running loop, so the queue works under asyncio and trio.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Hashable

import anyio
from starlette.responses import JSONResponse

from kvclient import effective_output_cap
from kvclient._pacing import POLICY_HEADER, RATELIMIT_HEADER, format_ratelimit

from ._errors import APIError, error_response
from .ledger import Handle, Headroom, KVAdmissionController

__all__ = ["AdmissionQueue", "Rejected", "admissible_cap", "ratelimit_headers", "room", "too_busy"]


class Rejected(Exception):
    """No budget within the allowed wait. ``retry_after`` is the ledger's estimate, in seconds."""

    def __init__(self, *, need: int, retry_after: float, queued_ahead: int) -> None:
        super().__init__(f"no KV budget for {need} tokens; retry after {retry_after:.3f}s")
        self.need = need
        self.retry_after = retry_after
        self.queued_ahead = queued_ahead


class _Waiter:
    __slots__ = ("event", "need")

    def __init__(self, need: int) -> None:
        self.need = need
        self.event = anyio.Event()


class AdmissionQueue:
    def __init__(
        self,
        ledger: KVAdmissionController,
        *,
        max_wait: float,
        stagger: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.max_wait = max_wait
        self.stagger = stagger
        self._clock = clock
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def now(self) -> float:
        """The queue's clock: the one the ledger's due times are on."""
        return self._clock()

    @property
    def waiting_tokens(self) -> int:
        """KV tokens the queued requests wait for: not free for a newcomer, who queues behind."""
        return sum(w.need for w in self._waiters)

    def _reject(
        self, need: int, output_cap: int, ahead: int, extra_need: int, client: Hashable | None
    ) -> Rejected:
        # With staggering, unqueued rejections become promises, so clients turned away together
        # get times that each fit; a queued request's estimate counts those ahead of it instead.
        wait = self.ledger.retry_after(
            need + extra_need,
            self._clock(),
            duration=output_cap / self.ledger.decode_rate,
            promise=self.stagger and ahead == 0,
            client=client,
        )
        self.ledger.record_rejection(need, wait)
        return Rejected(need=need, retry_after=wait, queued_ahead=ahead)

    def notify(self) -> None:
        """Something was released: let the head of the queue try again."""
        if self._waiters:
            self._waiters[0].event.set()

    async def acquire(
        self, prompt_tokens: int, output_cap: int, *, client: Hashable | None = None
    ) -> Handle:
        """A handle for the request, or :class:`Rejected` after at most ``max_wait`` seconds.

        ``client`` identifies the caller for staggered advice (its connection's address).
        """
        need = self.ledger.need_tokens(prompt_tokens, output_cap)
        if not self._waiters:
            handle = self.ledger.try_admit(
                prompt_tokens, output_cap, now=self._clock(), count_rejection=False, need=need
            )
            if handle is not None:
                return handle
        if self.max_wait <= 0:
            raise self._reject(
                need, output_cap, len(self._waiters), sum(w.need for w in self._waiters), client
            )

        waiter = _Waiter(need)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(self.max_wait):
                while True:
                    if self._waiters[0] is waiter:
                        handle = self.ledger.try_admit(
                            prompt_tokens,
                            output_cap,
                            now=self._clock(),
                            count_rejection=False,
                            need=need,
                        )
                        if handle is not None:
                            return handle
                    await waiter.event.wait()
                    waiter.event = anyio.Event()
            ahead = self._waiters.index(waiter)
            extra = sum(self._waiters[i].need for i in range(ahead))
            raise self._reject(need, output_cap, ahead, extra, client)
        finally:
            was_head = bool(self._waiters) and self._waiters[0] is waiter
            with contextlib.suppress(ValueError):  # always queued here; belt and braces
                self._waiters.remove(waiter)
            if was_head:
                self.notify()  # the next in line may fit now


def ratelimit_headers(room: Headroom, *, queues: bool = False) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit`` for ``room`` (see :mod:`kvclient._pacing` for the
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
) -> dict[str, str]:
    """The RateLimit headers for an answer of a server with ``ledger`` (and ``queue``) now."""
    queued = queue.waiting_tokens if queue is not None else 0
    now = queue.now() if queue is not None else time.monotonic()
    queues = queue is not None and queue.max_wait > 0
    return ratelimit_headers(
        ledger.headroom(now, releasing=releasing, queued=queued), queues=queues
    )


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
    stats = ledger.stats()
    seconds, millis = retry_after_header(rejected.retry_after)
    queued = f", {rejected.queued_ahead} queued ahead" if rejected.queued_ahead else ""
    return error_response(
        429,
        f"KV cache budget exhausted: this request needs {rejected.need} tokens "
        f"({prompt_tokens} prompt + {cap} output cap) and {stats.reserved_tokens} of "
        f"{stats.usable_tokens} usable tokens are reserved by {stats.inflight} in-flight "
        f"requests{queued}. Retry after {int(millis) / 1000:.3f} seconds.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": seconds, "retry-after-ms": millis, **room(ledger, queue)},
    )
