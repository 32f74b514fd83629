"""The one generation endpoint both apps serve, over a :class:`Backend`.

One coroutine owns a request's whole life: it reads and parses the body, has the backend count
and cap it, routes it to a target (a ledger and its FIFO queue), waits for admission there, has
the backend answer it, and releases the reservation in ``finally`` whatever happens: success,
an engine error, a cut answer, a client that goes away, cancellation.

- **A client that goes away is gone.** A read EOF or a reset from the client (uvicorn's
  ``http.disconnect``) cancels the request wherever it is: queued, generating or relaying.
  A request cut while the engine ran it keeps its reservation until the engine has let it go
  (:meth:`Backend.let_go`), then releases it.
- **A stalled reader is cut.** A write that waits longer than ``send_timeout`` for the client to
  read ends the request (nginx's ``send_timeout``), so a client that stops reading cannot pin a
  reservation.
- **Fail-over before the first byte only.** When the backend could not answer at all (an upstream
  that was not reached), the request goes to the next target; once any byte of an answer has been
  sent, never.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from kvclient import sequences_reservation_tokens, shared_prompt_tokens

from ..admission.ledger import Handle, KVAdmissionController
from ..admission.queue import AdmissionQueue, LedgerUnavailable, Rejected
from .answers import too_busy
from .errors import APIError
from .requests import (
    ClientGone,
    GenerationRequest,
    Kind,
    check_content_type,
    parse_generation,
    parse_json_object,
    preferred_wait,
    read_body,
    scope_header,
)
from .serving import answer_cut

__all__ = ["DEFAULT_SEND_TIMEOUT", "Backend", "GenerationEndpoint", "Plan", "Target"]

logger = logging.getLogger("reference_server")

#: Seconds a write of an answer may wait for the client to read before the request ends.
DEFAULT_SEND_TIMEOUT = 10.0


class Target(Protocol):
    """Where a reservation is held: a ledger and the FIFO queue in front of it."""

    @property
    def ledger(self) -> KVAdmissionController: ...

    @property
    def queue(self) -> AdmissionQueue: ...

    @property
    def shares_prompt(self) -> bool:
        """Whether the sequences of one request share the prompt's full blocks there (the
        engine's prefix cache is on), or each holds the whole prompt."""
        ...


def ledger_away(away: LedgerUnavailable) -> JSONResponse:
    """503 with Retry-After: the shared ledger cannot be reached, so nothing new is admitted."""
    seconds = max(1, math.ceil(away.retry_after))
    error = APIError(
        503,
        "the shared admission ledger is unreachable; new requests are refused until it is back. "
        f"Retry after {seconds} seconds.",
        type="server_error",
        code="ledger_unavailable",
        headers={"Retry-After": str(seconds), "retry-after-ms": str(int(away.retry_after * 1000))},
    )
    return error.response()


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A request read, counted and capped: what is reserved and what is generated."""

    request: GenerationRequest
    payload: dict[str, Any]
    raw: bytes
    prompt_tokens: int
    #: The output cap admitted: the reservation is prompt_tokens + cap, in whole blocks.
    cap: int
    #: Sequences generated, each up to ``cap`` and each in blocks of its own (see :meth:`held`).
    sequences: int = 1
    #: Anything else the backend decided while planning (the gateway: the body it forwards).
    extra: Any = None
    #: The prompt's token ids as the engine counted them, when it said (for shared prefixes),
    #: and what keeps prompts of different models apart.
    token_ids: tuple[int, ...] | None = None
    model: str | None = None
    #: The request's own salt of the engine's prefix-cache keys (vLLM's ``cache_salt``): only
    #: prompts with the same model and salt share blocks.
    cache_salt: str | None = None
    #: Whose request it is and its priority class (lower first), for a fair queue; a FIFO
    #: queue serves all alike.
    tenant: str | None = None
    priority: int = 0

    def held(self, target: Target) -> tuple[int, int]:
        """(prompt, output) tokens the reservation holds at ``target``: their sum, in whole
        blocks, is :func:`kvclient.sequences_reservation_tokens`. Each sequence holds its own
        blocks (vLLM runs ``n`` as ``n`` requests); where the engine's prefix cache is on
        (``target.shares_prompt``) the prompt's full blocks are held once for all, each
        sequence keeping its own partial last block. The output part of each sequence is its
        cap and the rest of its last block.
        """
        prompt, n = self.prompt_tokens, self.sequences
        if n == 1:
            return prompt, self.cap
        block, shares = target.ledger.block_size, target.shares_prompt
        total = sequences_reservation_tokens(
            prompt, self.cap, sequences=n, block_size=block, shared_prompt=shares
        )
        shared = shared_prompt_tokens(prompt, block) if shares else 0
        held_prompt = shared + n * (prompt - shared)
        return held_prompt, total - held_prompt


class Backend(Protocol):
    """What answers admitted requests: the simulated engine, or the upstream relay."""

    max_body_bytes: int
    send_timeout: float

    async def plan(
        self, scope: Scope, request: GenerationRequest, payload: dict[str, Any], raw: bytes
    ) -> Plan:
        """Count and cap the request, or raise the :class:`APIError` that refuses it."""
        ...

    def route(self, plan: Plan, tried: Set[int]) -> Target:
        """Where ``plan`` waits for admission (``tried``: ids of targets that failed it before
        any byte of an answer); an :class:`APIError` (503) when there is nowhere."""
        ...

    async def run(self, target: Target, handle: Handle, plan: Plan, send: Send) -> bool:
        """Answer the admitted request through ``send``. False: the target failed before any
        byte was sent, and the request may go elsewhere."""
        ...

    def answer_cut(self) -> None:
        """An answer was cut by the send timeout (for the metrics)."""
        ...

    async def let_go(self, target: Target, handle: Handle) -> None:
        """Return once the engine has let go of ``handle``'s request, cut before its end (its
        client gone, or not reading): its reservation is held until then."""
        ...


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancels ``scope`` when the client goes away. Per ASGI, ``receive()`` also answers
    ``http.disconnect`` once the response is complete, when cancelling changes nothing."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class _StallWatch:
    """Ends the request when a write of its answer waits longer than ``timeout`` for the client
    to read. The writes only note when they begin and end (in the ledger too: its Retry-After
    counts a stalled holder as ending when it is cut, and the peak rule counts a slow reader as
    advancing at the engine's speed); one task per request checks, a quarter of the timeout
    apart."""

    def __init__(
        self, scope: anyio.CancelScope, timeout: float, on_cut: Callable[[], None]
    ) -> None:
        self._scope = scope
        self._timeout = timeout
        self._on_cut = on_cut
        self._since: float | None = None
        self.cut = False

    def watching(self, send: Send, queue: AdmissionQueue, handle: Handle) -> Send:
        ledger = queue.ledger

        async def watched(message: Message) -> None:
            self._since = time.monotonic()
            ledger.writing(handle, queue.now())
            try:
                await send(message)
            finally:
                self._since = None
                ledger.written(handle, queue.now())

        return watched

    async def run(self) -> None:
        while True:
            await anyio.sleep(self._timeout / 4)
            since = self._since
            if since is not None and time.monotonic() - since >= self._timeout:
                # Counted before the cancellation releases the reservation: whoever sees the
                # ledger back at zero sees the cut counted too.
                self._on_cut()
                self.cut = True
                logger.info("an answer was cut: not read within the send timeout")
                self._scope.cancel()
                return


class GenerationEndpoint:
    """``/v1/completions``, ``/v1/chat/completions`` (and the seed's ``/generate``)."""

    def __init__(self, kind: Kind, backend: Backend) -> None:
        self.kind = kind
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        backend = self.backend
        try:
            check_content_type(scope_header(scope, b"content-type"))
            raw = await read_body(scope, receive, backend.max_body_bytes)
            payload = parse_json_object(raw)
            request = parse_generation(self.kind, payload)
            plan = await backend.plan(scope, request, payload, raw)
        except ClientGone:
            return
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        async with anyio.create_task_group() as group:
            # The client going away, or not reading, cancels waiting and answering alike;
            # finally blocks release.
            stall = _StallWatch(group.cancel_scope, backend.send_timeout, backend.answer_cut)
            group.start_soon(_watch_disconnect, receive, group.cancel_scope)
            group.start_soon(stall.run)
            await self._admit_and_run(plan, scope, receive, send, stall)
            group.cancel_scope.cancel()  # the answer is complete: the watchers end
        if stall.cut:
            answer_cut()  # in this task: uvicorn logs the unfinished answer here

    async def _admit_and_run(
        self, plan: Plan, scope: Scope, receive: Receive, send: Send, stall: _StallWatch
    ) -> None:
        backend = self.backend
        peer = scope.get("client")  # (host, port): staggered advice per connection
        client = tuple(peer) if peer else None
        wait = preferred_wait(scope)  # the client's patience bounds its time in the queue
        tried: set[int] = set()
        while True:
            try:
                target = backend.route(plan, tried)
            except APIError as error:
                await error.response()(scope, receive, send)
                return
            ledger, queue = target.ledger, target.queue
            prompt_held, output_held = plan.held(target)
            try:
                handle = await queue.acquire(
                    prompt_held,
                    output_held,
                    sequences=plan.sequences,
                    client=client,
                    max_wait=wait,
                    # One sequence, its progress followed: it lends its prefix once past its
                    # prefill (several sequences count whole, sharing nothing).
                    prefix=(
                        ledger.prefix_keys(plan.token_ids, (plan.model, plan.cache_salt))
                        if plan.sequences == 1
                        else ()
                    ),
                    tenant=plan.tenant,
                    priority=plan.priority,
                    model=plan.model,
                    # One sequence: its progress is relayed from the engine's own stream.
                    follow=plan.sequences == 1,
                )
            except Rejected as rejected:
                busy = too_busy(ledger, rejected, prompt_held, output_held, queue)
                await busy(scope, receive, send)
                return
            except LedgerUnavailable as away:
                await ledger_away(away)(scope, receive, send)
                return
            try:
                if await backend.run(target, handle, plan, stall.watching(send, queue, handle)):
                    return
            except anyio.get_cancelled_exc_class():
                # Cut: the engine holds the sequence until it has seen the abort, and so does
                # the reservation (the next waiter is not sent before the engine let go).
                with anyio.CancelScope(shield=True):
                    await backend.let_go(target, handle)
                raise
            finally:
                await queue.release(handle)
            tried.add(id(target))
