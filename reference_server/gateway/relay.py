"""The upstream relay: the gateway's :class:`~reference_server.http.generation.Backend`.

Each request is counted as its engine renders it (the upstream's own ``/tokenize`` when it has
one, else the configured counter; a rendering it cannot count is refused), priced with every
field that spends KV (output caps under any engine's name, several sequences), routed to the
upstream where it fits best, and forwarded with every output cap set to the one reserved. The
answer is relayed as it comes; a stream piece by piece. When the client goes away the request is
cancelled and the unfinished upstream answer reset, which engines take as an abort, and the
reservation released. An engine that runs a plain request on regardless but stops a stream
(llama.cpp) is sent a plain request as a stream, and the client the plain answer assembled
from it (:mod:`.assemble`; an error event mid-stream answered as the error status the engine
would have sent); where neither works, the reservation is held until the answer is in.

Fail-over: a request goes to another upstream only when the first could not be reached or broke
before any byte of an answer; an answer that has started is never retried elsewhere.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from starlette.responses import Response
from starlette.types import Scope, Send

from kvclient import parse_retry_after
from kvclient.engines.behaviour import (
    PROGRESS_ENGINES,
    prefix_salt,
    runs_on_after_reset,
    streams_as_asked,
    text_only,
)
from kvclient.engines.tokenize import RENDER_FIELDS, Tokenized, countable_render_fields
from kvclient.routing import pick

from ..admission.ledger import Handle
from ..http.answers import admissible_cap, retry_after_header, room, send_whole
from ..http.errors import APIError
from ..http.generation import Plan, Target
from ..http.requests import THREAD_TOKENIZE_CHARS, GenerationRequest, count_prompt
from .assemble import Assembler, BrokenStream, EngineError
from .progress import ProgressReader, completion_tokens
from .rewrite import as_stream, assembled_headers, request_headers, response_headers, with_cap
from .state import GatewayState
from .tenancy import with_tenant
from .upstream import (
    UPSTREAM_ERRORS,
    Known,
    Upstream,
    UpstreamUnavailable,
    read_limited,
    release,
)

__all__ = ["UpstreamBackend", "unavailable"]

logger = logging.getLogger("kvclient.gateway")


#: Bytes of the piece before a stream's last searched for its usage figure (one usage event is
#: a few hundred bytes; it may straddle two pieces).
_USAGE_TAIL = 4096


def unavailable(message: str, retry_after: float = 1.0) -> APIError:
    """A 503 with Retry-After: nothing can take the request now."""
    seconds, millis = retry_after_header(retry_after)
    return APIError(
        503,
        message,
        type="server_error",
        code="upstream_unavailable",
        headers={"Retry-After": seconds, "retry-after-ms": millis},
    )


def _room_headers(
    known: Known, releasing: Handle | None = None, *, holder: Handle | None = None
) -> list[tuple[bytes, bytes]]:
    headers = room(known.ledger, known.queue, releasing, holder=holder)
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _upstream_error(
    upstream: Upstream,
    response: aiohttp.ClientResponse,
    status: int,
    headers: list[tuple[bytes, bytes]],
    content: bytes,
) -> Response:
    """An upstream's error answer: 4xx and 429/503 pass through as the engine sent them, a 429's
    or 503's advice rewritten in the syntax RFC 9110 allows (the gateway's own, one second, when
    the engine gave none it could read); any other 5xx becomes our shape, same status."""
    if status < 500 or status == 503:
        passed = Response(content, status_code=status)
        if status in (429, 503):
            advice = parse_retry_after(response.headers)
            seconds, millis = retry_after_header(1.0 if advice is None else advice)
            headers = [(k, v) for k, v in headers if k not in (b"retry-after", b"retry-after-ms")]
            headers += [(b"retry-after", seconds.encode()), (b"retry-after-ms", millis.encode())]
        passed.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
        return passed
    try:
        detail = json.loads(content).get("error", {})
        message = detail.get("message") if isinstance(detail, dict) else str(detail)
        code = detail.get("type") or detail.get("code") if isinstance(detail, dict) else None
    except (ValueError, AttributeError, RecursionError):
        message, code = content[:300].decode("utf-8", "replace"), None
    return APIError(
        status,
        f"upstream {upstream.name} answered {status}: {message}",
        type="upstream_error",
        code=str(code) if code is not None else None,
    ).response()


def _not_final(upstream: Upstream, status: int) -> Response:
    """An informational status given as the answer (aiohttp hands on a 101 Switching
    Protocols; the request asked for no upgrade): a broken upstream, a JSON 502 that names it.
    Nothing of it is relayed: uvicorn cannot frame a 1xx as an answer, and would drop the
    client's connection."""
    upstream.failure()
    return APIError(
        502,
        f"upstream {upstream.name} answered {status}, not an answer to the request",
        type="upstream_error",
        code="upstream_answer_broken",
    ).response()


def _refuse_uncounted(field: str | None) -> None:
    if field is not None:
        raise APIError(
            400,
            f"`{field}` changes the prompt the engine renders, and the gateway cannot count "
            "it here (its count would fall short of what the engine holds); leave it out, or "
            "count by an engine's /tokenize that takes it (vLLM).",
            param=field,
            code="uncountable_field",
        )


def _refuse_never_fitting(plan: Plan, known: list[Known]) -> None:
    """A 400 for a request of several sequences that no upstream could ever admit: more KV
    than its whole usable budget, or more sequences than it runs at once (each runs in a
    place of its own)."""
    running = [k.ledger.max_concurrency for k in known]
    if all(most is not None and plan.sequences > most for most in running):
        most = max(m for m in running if m is not None)
        raise APIError(
            400,
            f"This request can never be admitted: its {plan.sequences} sequences each run in a "
            f"place of their own, and no upstream runs more than {most} at once; ask for "
            "fewer sequences.",
            code="too_many_sequences",
            param="n",
        )
    needs = [(k.ledger.need_tokens(*plan.held(k)), k.ledger.usable_tokens) for k in known]
    if all(need > usable for need, usable in needs):
        need, usable = min(needs, key=lambda pair: pair[0] - pair[1])
        raise APIError(
            400,
            f"This request can never be admitted: {plan.sequences} sequences of up to "
            f"{plan.cap} tokens need {need} KV tokens, more than the usable budget ({usable}); "
            "ask for fewer or shorter sequences.",
            code="kv_budget_exceeded",
            param="n",
        )


def _followed(piece: bytes, reader: ProgressReader | None, known: Known, handle: Handle) -> bytes:
    """A piece of a stream as it goes on (with a ``reader``: the whole events it completes,
    what the client did not ask for taken out), the holder's progress followed on the way."""
    if reader is None:
        return piece
    events = reader.feed(piece)
    if reader.generated:
        known.queue.progress(handle, reader.generated)
    return events


#: The paths whose plain answers can be assembled from a stream, and whether they chat.
_ASSEMBLED = {"/v1/chat/completions": True, "/v1/completions": False}


@dataclass(frozen=True, slots=True)
class _Assembled:
    """A plain answer assembled from a stream: the engine's answer (200) or its error."""

    status: int
    content: bytes


@dataclass(frozen=True, slots=True)
class _Forward:
    """What goes upstream: the body with the cap, the client's headers that may pass."""

    content: bytes
    headers: list[tuple[bytes, bytes]]


class UpstreamBackend:
    """Plans, routes and relays requests for a :class:`GatewayState`."""

    def __init__(self, state: GatewayState, path: str) -> None:
        self.state = state
        self.path = path
        self.max_body_bytes = state.config.max_body_bytes
        self.send_timeout = state.config.send_timeout

    def answer_cut(self) -> None:
        self.state.counters.send_timeouts += 1

    async def let_go(self, target: Target, handle: Handle) -> None:
        """Wait for the engine to let go of a request cut before its end: the relay reset its
        connection, and the engine frees the sequence at the step after its API process has
        seen the abort. Returns when a scrape read since shows it running no more than the
        other holders, or after a step's time at the current batch and the relay's lag (the
        allowance for the engine's API process), whichever comes first."""
        assert isinstance(target, Known)
        ledger, watch = target.ledger, target.upstream.watch
        live = ledger.live_handles()
        others = sum(h.sequences for h in live if h is not handle)
        step = 1.0 / ledger.rate_at(max(1, len(live)))
        cut = time.monotonic()
        ledger.cut(handle, cut + step + ledger.relay_lag)
        with anyio.move_on_after(step + ledger.relay_lag):
            while True:
                await watch.scraped.wait()
                running = watch.running
                if watch.running_from >= cut and running is not None and running <= others:
                    return

    # --- plan --------------------------------------------------------------------------------

    async def plan(
        self, scope: Scope, request: GenerationRequest, payload: dict[str, Any], raw: bytes
    ) -> Plan:
        state = self.state
        known = await state.admission()
        if not known:
            problems = "; ".join(
                f"{u.name}: {u.discovery_error or 'not discovered'}" for u in state.upstreams
            )
            raise unavailable(f"no upstream is in service ({problems})")
        model = payload.get("model")
        render = {k: payload[k] for k in RENDER_FIELDS if k in payload}
        if request.messages is None:
            render = {}  # a prompt is not rendered
        counted = await self._count(
            known, request, model if isinstance(model, str) else None, render
        )
        prompt_tokens = counted.count
        # The most generous upstream decides "never": a request that fits one is retryable.
        roomiest = max(known, key=lambda k: k.ledger.usable_tokens)
        cap = admissible_cap(
            roomiest.ledger,
            prompt_tokens,
            request.max_tokens,
            context_window=state.window(known),
            param="messages" if request.messages is not None else "prompt",
        )
        plan = Plan(
            request=request,
            payload=payload,
            raw=raw,
            prompt_tokens=prompt_tokens,
            cap=cap,
            sequences=request.sequences,
            # Token ids key shared prefix blocks only for a prompt of text alone: an image's
            # placeholder tokens are the same whatever the image.
            token_ids=counted.ids if text_only(payload) else None,
            model=model if isinstance(model, str) else None,
            cache_salt=prefix_salt(payload),
            extra=_Forward(
                content=with_cap(raw, payload, cap),
                headers=request_headers(
                    scope["headers"], drop_credentials=state.config.api_key is not None
                ),
            ),
        )
        need = roomiest.ledger.need_tokens(*plan.held(roomiest))
        if state.config.fairness is not None:
            plan = self._tenant(scope, plan, known, need)
        if plan.sequences > 1:
            _refuse_never_fitting(plan, known)
        return plan

    def _tenant(self, scope: Scope, plan: Plan, known: list[Known], need: int) -> Plan:
        """``plan`` with its verified tenant and granted class (:func:`.tenancy.with_tenant`)."""
        return with_tenant(scope, plan, [k.queue.fair for k in known if k.queue.fair], need)

    async def _count(
        self,
        known: list[Known],
        request: GenerationRequest,
        model: str | None,
        render: dict[str, Any],
    ) -> Tokenized:
        """The prompt as the engine will see it, counted: by an upstream's own count (with the
        request's render fields, where it takes them; its token ids when it gives them), else
        by the configured counter. A request whose rendering cannot be counted is refused
        rather than under-counted."""
        state = self.state
        if state.config.counter is None:
            now = time.monotonic()
            for k in known:
                if k.upstream.health.in_service(now):
                    if render:
                        _refuse_uncounted(countable_render_fields(k.upstream.engine, render))
                    try:
                        counted = await k.upstream.count(request, model, render)
                    except UpstreamUnavailable:
                        continue
                    if counted is not None:
                        return counted
                    break
        if render:
            _refuse_uncounted(next(iter(render)))
        counter = state.fallback_counter
        if request.size_hint > THREAD_TOKENIZE_CHARS:
            return Tokenized(await anyio.to_thread.run_sync(count_prompt, request, counter))
        return Tokenized(count_prompt(request, counter))

    # --- route -------------------------------------------------------------------------------

    def route(self, plan: Plan, tried: Set[int]) -> Target:
        """Where the reservation fits with the most room; else the in-service upstream with the
        most room (its queue waits or refuses with its own Retry-After)."""
        now = time.monotonic()
        candidates = [k for k in self.state.known if id(k) not in tried]
        if not candidates:
            raise unavailable("every upstream failed this request")
        need = candidates[0].ledger.need_tokens(*plan.held(candidates[0]))
        chosen = pick([k.upstream.endpoint(now) for k in candidates], need)
        if chosen is None:
            raise unavailable("no upstream is in service")
        return candidates[chosen]

    # --- run ---------------------------------------------------------------------------------

    async def run(self, target: Target, handle: Handle, plan: Plan, send: Send) -> bool:
        """Send to the target's upstream and relay its answer. False when it failed before any
        byte of an answer (the endpoint tries another upstream)."""
        assert isinstance(target, Known)
        assert isinstance(plan.extra, _Forward)
        upstream = target.upstream
        started = time.monotonic()
        upstream.health.begin(started)
        forward = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in plan.extra.headers]
        # An engine that runs a request on after its connection is reset holds its KV until it
        # finishes: then so does the reservation. A plain request is asked as a stream where
        # the engine stops streams; else a client that leaves meanwhile is let go once the
        # engine's answer is in (and thrown away), not before.
        stream = plan.request.stream
        content = plan.extra.content
        chat = _ASSEMBLED.get(self.path)
        engine = upstream.engine
        # Under the peak rule the holder's progress is followed from the engine's stream (a
        # plain request goes as a stream, its answer assembled): see ``progress.py``.
        reader: ProgressReader | None = None
        # A plain request the engine would refuse as a stream stays plain, counted whole.
        streamable = stream or streams_as_asked(plan.payload)
        if handle.tracked and chat is not None and engine in PROGRESS_ENGINES and streamable:
            content, asked = as_stream(content, every_chunk=True)
            reader = ProgressReader(drop_usage_only=stream and not asked)
        elif handle.tracked:
            target.ledger.unfollow(handle)
        assembled = (
            not stream
            and chat is not None
            and (
                reader is not None
                or (
                    streamable
                    and runs_on_after_reset(engine, stream=False)
                    and not runs_on_after_reset(engine, stream=True)
                )
            )
        )
        if assembled and reader is None:
            content, _ = as_stream(content)
        holds = not assembled and runs_on_after_reset(engine, stream=stream)
        data: bytes | _Assembled | BaseException | None
        with anyio.CancelScope(shield=holds):
            try:
                response = await upstream.http.request(
                    "POST", self.path, content=content, headers=forward
                )
            except UPSTREAM_ERRORS as exc:
                upstream.failure()
                logger.warning(
                    "upstream %s: %s before any answer", upstream.name, type(exc).__name__
                )
                return False
            except BaseException:
                upstream.health.abandoned()
                raise
            if holds and response.status >= 200:
                data = await self._read_whole(response, upstream)
        # Closed in finally whatever happens: an unfinished answer resets its connection, and
        # engines abort a request whose connection is reset.
        try:
            if response.status < 200:
                await send_whole(_not_final(upstream, response.status), send)
                return True
            if response.status >= 400 or not stream:
                if assembled and response.status < 400:
                    data = await self._read_assembled(response, chat is True, target, handle)
                elif not holds:
                    data = await self._read_whole(response, upstream)
                return await self._whole(target, handle, response, data, send, started)
            await self._stream(target, response, send, started, handle, reader)
            return True
        finally:
            release(response)

    async def _read_whole(
        self, response: aiohttp.ClientResponse, upstream: Upstream
    ) -> bytes | BaseException | None:
        """The answer's body (None past the limit), or the error that broke it."""
        try:
            return await read_limited(response, self.state.config.max_answer_bytes)
        except UPSTREAM_ERRORS as exc:
            return exc

    async def _read_assembled(
        self, response: aiohttp.ClientResponse, chat: bool, known: Known, handle: Handle
    ) -> _Assembled | BaseException | None:
        """The plain answer of a stream read to its end (None past the answer limit), or the
        error that broke it; the holder's progress followed on the way when it is tracked."""
        assembler = Assembler(chat=chat)
        reader = ProgressReader(drop_usage_only=False) if handle.tracked else None
        limit = self.state.config.max_answer_bytes
        total = 0
        try:
            async for piece in response.content.iter_any():
                total += len(piece)
                if total > limit:
                    return None
                assembler.feed(_followed(piece, reader, known, handle))
            if reader is not None:
                assembler.feed(reader.end())
            answer = assembler.end()
            if reader is not None:
                known.ledger.ended(handle, by_itself=reader.finish_reason == "stop")
        except EngineError as error:
            return _Assembled(error.status, json.dumps(error.body).encode())
        except UPSTREAM_ERRORS as exc:
            return exc
        except BrokenStream as exc:
            return exc
        return _Assembled(200, json.dumps(answer).encode())

    async def _whole(
        self,
        known: Known,
        handle: Handle,
        response: aiohttp.ClientResponse,
        data: bytes | _Assembled | BaseException | None,
        send: Send,
        started: float,
    ) -> bool:
        """An answer read whole (bounded), then sent: an error, or a non-streamed completion
        (read as such, or assembled from a stream)."""
        upstream = known.upstream
        if isinstance(data, BaseException):
            # The engine had started answering: it did the work, so it is not sent elsewhere.
            upstream.failure()
            broken = APIError(
                502,
                f"upstream {upstream.name} broke its answer: {type(data).__name__}",
                type="upstream_error",
                code="upstream_answer_broken",
            )
            await send_whole(broken.response(), send)
            return True
        status = response.status
        headers = response_headers(response.raw_headers)
        if isinstance(data, _Assembled):
            status, headers, data = data.status, assembled_headers(headers), data.content
        if data is None:
            too_large = APIError(
                502,
                f"upstream {upstream.name} answered more than "
                f"{self.state.config.max_answer_bytes} bytes",
                type="upstream_error",
                code="upstream_answer_too_large",
            ).response()
            await send_whole(too_large, send)
            return True
        if status >= 400:
            # The engine answered: it is up, whatever it said. An error one request's content
            # caused must not set the upstream aside for everyone; only no answer does.
            upstream.health.succeeded()
            if status >= 500 and status != 503:
                upstream.errors += 1  # an engine failure: answered, never retried elsewhere
            await send_whole(_upstream_error(upstream, response, status, headers, data), send)
            return True
        upstream.health.succeeded()
        # No more than the cap it was sent with, whatever the answer claims.
        generated = min(completion_tokens(data), handle.output_cap)
        upstream.observe(generated, time.monotonic() - started)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *headers,
                    (b"content-length", str(len(data)).encode()),
                    *_room_headers(known, handle),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return True

    async def _stream(
        self,
        known: Known,
        response: aiohttp.ClientResponse,
        send: Send,
        started: float,
        handle: Handle,
        reader: ProgressReader | None = None,
    ) -> None:
        """Relay a stream piece by piece as it arrives; a break becomes an SSE error event (a
        shared ledger's lapsed lease does not end it: what it held is put back). With a
        ``reader`` the holder's progress is followed, and whole events are relayed (what the
        client did not ask for taken out)."""
        upstream = known.upstream
        cap = handle.output_cap
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    *response_headers(response.raw_headers),
                    *_room_headers(known, holder=handle),
                ],
            }
        )
        # The stream's last two pieces: its usage, when it has one, comes at the end (kept by
        # reference, nothing copied per piece; joined once, when the stream is done).
        before = last = b""
        try:
            async for piece in response.content.iter_any():
                before, last = last, piece
                events = _followed(piece, reader, known, handle)
                if events:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
        except UPSTREAM_ERRORS:
            upstream.failure()
            error = {
                "message": f"the upstream {upstream.name} broke the stream mid-answer",
                "type": "upstream_error",
                "param": None,
                "code": "upstream_stream_broken",
            }
            event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        upstream.health.succeeded()
        rest = reader.end() if reader is not None else b""
        if reader is not None:
            known.ledger.ended(handle, by_itself=reader.finish_reason == "stop")
        await send({"type": "http.response.body", "body": rest, "more_body": False})
        # Tokens by its usage (an event may carry several); no more than the cap it was sent
        # with, whatever the stream says. A stream without usage says nothing of its speed.
        generated = completion_tokens(before[-_USAGE_TAIL:] + last)
        if generated:
            upstream.observe(min(generated, cap), time.monotonic() - started)
