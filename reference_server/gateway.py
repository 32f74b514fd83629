"""``kvclient gateway``: the reservation ledger in front of real engines.

The same admission core as the reference server (the ledger, the FIFO queue, the Retry-After
estimate, the error shapes, the metrics registry) over upstream engines instead of the simulated
one. Each request is counted (the upstream's own ``/tokenize`` when it has one, else the
configured counter), its ``max_tokens`` made explicit and clamped, admitted against the ledger of
the upstream where it fits best, and forwarded with only ``max_tokens`` changed; the reservation
is held until the answer (or the stream) ends and released in ``finally``. The engine can never
run past what was reserved, because the explicit cap is what it receives.

Upstream budgets and windows are discovered through :mod:`kvclient._dialects` (vLLM, llama.cpp,
TGI, SGLang), or given with ``kv_tokens``. Discovery runs on the first request (and again for an
upstream that failed to answer it), inside the serving event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvclient import TiktokenCounter, TokenCounter
from kvclient._dialects import (
    TOKENIZE_ENGINES,
    Answer,
    Budget,
    Discovery,
    Probe,
    count_by_tokenize,
    discover_budget,
    discover_context,
)
from kvclient._routing import Endpoint, Health, ranked

from ._admission import AdmissionQueue, Rejected, admissible_cap, room, too_busy
from ._errors import APIError, error_response
from ._front import DIRECT_EXTENSION
from ._requests import (
    GenerationRequest,
    Kind,
    check_content_type,
    count_prompt,
    parse_generation,
    parse_json_object,
)
from ._upstream_http import UpstreamError, UpstreamPool, UpstreamResponse
from .app import (
    APIKeyMiddleware,
    _ClientGone,
    _internal_error,
    _log_unexpected,
    _read_body,
    build_app,
    scope_header,
)
from .config import DEFAULT_MAX_BODY_BYTES, DEFAULT_SEND_TIMEOUT
from .ledger import DEFAULT_SAFETY_FRACTION, Handle, KVAdmissionController

__all__ = ["GatewayConfig", "GatewayState", "Upstream", "create_gateway_app"]

logger = logging.getLogger("kvclient.gateway")

T = TypeVar("T")

#: Per-sequence decode rate assumed for Retry-After estimates until the gateway has measured one.
DEFAULT_DECODE_RATE = 50.0
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_OUT_OF_SERVICE_SECONDS = 2.0
_THREAD_COUNT_CHARS = 32 * 1024
#: Tokens a chat template or special tokens may add to a body's own bytes, for the upper bound
#: under which a request is forwarded while its count is on the way (``overlap_count``).
_OVERLAP_MARGIN = 256
#: The longest a request that does not fit waits for counts on the way to land.
_OVERLAP_WAIT = 10.0
#: A request is admitted on the whole window only where that leaves this many windows free
#: before it: a window held for a count on the way then distorts little what others see (their
#: routing by free budget above all), and the overlap stops by itself as the room fills.
_OVERLAP_ROOM = 4
_MIN_RATE_TOKENS = 8
_RATE_WEIGHT = 0.2
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
    }
)
_RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"content-encoding",
     b"date", b"server", b"ratelimit", b"ratelimit-policy"}
)  # fmt: skip
_JSON_HEADERS = b"Content-Type: application/json\r\n"
# (An upstream's RateLimit fields describe its room as it sees it; the gateway's ledger for that
# upstream says what the gateway will admit, and is what its answers advertise.)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """What ``kvclient gateway`` is told. ``kv_tokens[i]`` overrides upstream ``i``'s budget."""

    upstreams: tuple[str, ...]
    kv_tokens: tuple[int | None, ...] = ()
    context_window: int | None = None
    safety_fraction: float = DEFAULT_SAFETY_FRACTION
    max_queue_wait: float = 0.0
    decode_rate: float = DEFAULT_DECODE_RATE
    #: A local counter (a model's tokenizer); None: the upstream's /tokenize, else tiktoken.
    counter: TokenCounter | None = None
    #: Counting by the upstream's /tokenize, forward a request with an explicit cap while its
    #: count is on the way, reserving the whole context window until the count lands (when
    #: that fits now): the count's round trip is off the request's path. False: count first.
    overlap_count: bool = True
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    #: A write to the client that waits longer than this ends the request (a stalled reader must
    #: not pin its reservation).
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    out_of_service_seconds: float = DEFAULT_OUT_OF_SERVICE_SECONDS

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream is needed")
        for url in self.upstreams:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"an upstream must be an http(s) URL, got {url!r}")
        if len(self.kv_tokens) > len(self.upstreams):
            raise ValueError("more --kv-tokens than --upstream")
        if not 0.0 < self.safety_fraction <= 1.0:
            raise ValueError(f"safety_fraction must be in (0, 1], got {self.safety_fraction}")


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or could not say what it has."""


@dataclass(eq=False)
class Upstream:
    """One engine behind the gateway: its ledger, queue, health and counters."""

    url: str
    kv_override: int | None
    config: GatewayConfig
    http: UpstreamPool | None = None
    ledger: KVAdmissionController | None = None
    queue: AdmissionQueue | None = None
    discovery: Discovery | None = None
    budget: Budget | None = None
    health: Health = field(default_factory=Health)
    #: Counts on the way for requests admitted here on the whole window (see
    #: ``GatewayConfig.overlap_count``): a request that does not fit waits for them to land.
    overlapping: set[asyncio.Future[int]] = field(default_factory=set)
    errors: int = 0
    relayed: int = 0
    discovery_error: str | None = None
    #: Measured per-sequence decode rate (tokens/s), an exponential average over answers.
    measured_rate: float | None = None

    def failure(self) -> None:
        """It failed a request (no answer, a broken one, an engine error): count it."""
        self.errors += 1
        self.health.failed(time.monotonic())

    def observe(self, tokens: int, seconds: float) -> None:
        """One answer's output tokens and duration: the Retry-After estimates follow the
        engine's real speed instead of the configured guess."""
        if tokens < _MIN_RATE_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        previous = self.measured_rate
        self.measured_rate = (
            rate if previous is None else previous + _RATE_WEIGHT * (rate - previous)
        )
        if self.ledger is not None:
            self.ledger.decode_rate = self.measured_rate

    @property
    def engine(self) -> str | None:
        return self.discovery.engine if self.discovery else None

    @property
    def window(self) -> int | None:
        return self.discovery.context_window if self.discovery else None

    def client(self) -> UpstreamPool:
        if self.http is None:
            # No cookie jar (the pool keeps none): one client serves every caller, and a
            # Set-Cookie meant for one must not ride along on everyone's next request (it
            # passes through to its caller).
            self.http = UpstreamPool(
                self.url,
                connect_timeout=self.config.connect_timeout,
                read_timeout=self.config.read_timeout,
                write_timeout=self.config.read_timeout,
            )
        return self.http

    async def call(
        self, method: str, path: str, body: bytes | None = None, headers: bytes = b""
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request answered whole: (status, headers, body)."""
        response = await self.client().request(method, path, headers=headers, body=body)
        try:
            return response.status, response.headers, await response.read()
        finally:
            response.close()

    async def _drive(self, driver: Generator[Probe, Answer, T], *, text: bool = False) -> T:
        """Run a dialect driver against this upstream."""
        probe = next(driver)
        while True:
            content = None if probe.json is None else json.dumps(probe.json).encode()
            try:
                status, _, data = await self.call(
                    probe.method, probe.path, content, _JSON_HEADERS if content else b""
                )
            except UpstreamError as exc:
                raise UpstreamUnavailable(f"{probe}: {type(exc).__name__}: {exc}") from exc
            payload: Any
            if text and probe.path == "/metrics":
                payload = data.decode("utf-8", "replace")
            else:
                try:
                    payload = json.loads(data)
                except ValueError:
                    payload = None
            try:
                probe = driver.send(Answer(status, payload))
            except StopIteration as stop:
                result: T = stop.value
                return result

    async def discover(self) -> None:
        """Learn the window, the model and the KV budget; build the ledger."""
        found = await self._drive(discover_context(None))
        window = self.config.context_window or found.context_window
        if window is None:
            raise UpstreamUnavailable(
                found.explain().replace("context_window=", "--context-window")
            )
        budget = await self._drive(discover_budget(), text=True)
        kv = self.kv_override if self.kv_override is not None else budget.kv_tokens
        if kv is None:
            tried = "; ".join(budget.tried)
            raise UpstreamUnavailable(f"no KV budget discovered (tried: {tried}); pass --kv-tokens")
        self.discovery, self.budget = found, budget
        self.ledger = KVAdmissionController(
            total_kv_tokens=kv,
            context_window=window,
            decode_rate=self.config.decode_rate,
            safety_fraction=self.config.safety_fraction,
            block_size=budget.block_size,
            max_concurrency=budget.max_concurrency,
            release_margin=0.05,
        )
        self.queue = AdmissionQueue(self.ledger, max_wait=self.config.max_queue_wait)
        logger.info(
            "upstream %s: %s, window %d (%s), KV %d tokens (%s), usable %d",
            self.url, found.engine, window, found.source, kv,
            "--kv-tokens" if self.kv_override is not None else budget.source,
            self.ledger.usable_tokens,
        )  # fmt: skip

    def endpoint(self, now: float) -> Endpoint:
        ledger = self.ledger
        if ledger is None:
            return Endpoint(free=0, in_service=False)
        reserved, inflight = ledger.load()
        full = ledger.max_concurrency is not None and inflight >= ledger.max_concurrency
        assert self.queue is not None
        return Endpoint(
            free=-1 if full or self.queue.waiting else ledger.usable_tokens - reserved,
            in_flight=inflight,
            in_service=self.health.in_service(now),
        )

    async def count(self, request: GenerationRequest, model: str | None) -> int | None:
        """The upstream's own count, or None when its /tokenize cannot give one."""
        if self.engine not in TOKENIZE_ENGINES or request.token_ids is not None:
            return None
        driver = count_by_tokenize(
            self.engine,
            prompt=request.prompt,
            messages=request.messages,
            model=model,
            tools=request.tools,
        )
        return await self._drive(driver)


class GatewayState:
    """Everything one gateway owns; ``app.state.gateway``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        overrides = list(config.kv_tokens) + [None] * (
            len(config.upstreams) - len(config.kv_tokens)
        )
        self.upstreams = [
            Upstream(
                url=url.rstrip("/"),
                kv_override=kv,
                config=config,
                health=Health(
                    threshold=config.failure_threshold, cooldown=config.out_of_service_seconds
                ),
            )
            for url, kv in zip(config.upstreams, overrides, strict=True)
        ]
        self.fallback_counter: TokenCounter = config.counter or TiktokenCounter()
        self._discovery_lock: anyio.Lock | None = None
        #: Once every upstream is discovered: (them, the largest admissible request, the
        #: roomiest), computed once instead of per request.
        self._all_known: tuple[list[Upstream], int, Upstream] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_GatewayCollector(self))

    # --- discovery --------------------------------------------------------------------------

    async def admission(self) -> tuple[list[Upstream], int, Upstream | None]:
        """(the upstreams known, the largest request admissible, the upstream with the largest
        usable budget: the one that decides whether a request can ever be admitted)."""
        if self._all_known is not None:
            return self._all_known
        known = await self.ready()
        if not known:
            return known, 0, None
        roomiest = max(known, key=lambda u: u.ledger.usable_tokens if u.ledger else 0)
        result = (known, self.window(known), roomiest)
        if len(known) == len(self.upstreams):
            self._all_known = result
        return result

    async def ready(self) -> list[Upstream]:
        """The upstreams known to the gateway, discovering (again) those not yet known."""
        missing = [u for u in self.upstreams if u.ledger is None]
        if missing:
            if self._discovery_lock is None:
                self._discovery_lock = anyio.Lock()
            async with self._discovery_lock:
                now = time.monotonic()
                for upstream in (u for u in missing if u.ledger is None):
                    if not upstream.health.in_service(now):
                        continue
                    try:
                        await upstream.discover()
                        upstream.discovery_error = None
                        upstream.health.succeeded()
                    except UpstreamUnavailable as exc:
                        upstream.discovery_error = str(exc)
                        upstream.health.failed(now, at_once=True)  # it never answered
                        logger.warning("upstream %s: %s", upstream.url, exc)
        return [u for u in self.upstreams if u.ledger is not None]

    def window(self, known: Sequence[Upstream]) -> int:
        """The largest request the gateway can ever admit: each upstream's context window, or
        its usable budget (whole blocks) where that is smaller, as ``/v1/models`` reports it.
        So an unset ``max_tokens`` is clamped to what can really be reserved, never refused."""
        sizes = []
        for u in known:
            if u.ledger is not None:
                ledger = u.ledger
                whole = ledger.usable_tokens // ledger.block_size * ledger.block_size
                sizes.append(min(ledger.context_window, whole))
        return min(sizes)

    def model(self, known: Sequence[Upstream]) -> str | None:
        for upstream in known:
            if upstream.discovery is not None and upstream.discovery.model is not None:
                return upstream.discovery.model
        return None

    async def aclose(self) -> None:
        counting = [task for upstream in self.upstreams for task in upstream.overlapping]
        for task in counting:  # counts still on the way for answers already given
            task.cancel()
        await asyncio.gather(*counting, return_exceptions=True)
        for upstream in self.upstreams:
            if upstream.http is not None:
                upstream.http.close()


def _gateway(scope: Scope) -> GatewayState:
    state: GatewayState = scope["app"].state.gateway
    return state


def _unavailable(message: str, retry_after: float = 1.0) -> APIError:
    seconds = str(max(1, math.ceil(retry_after)))
    return APIError(
        503,
        message,
        type="server_error",
        code="upstream_unavailable",
        headers={"Retry-After": seconds, "retry-after-ms": str(int(retry_after * 1000))},
    )


def _forward_headers(scope: Scope) -> bytes:
    """The client's headers as the block of lines that goes upstream, built once a request."""
    return b"".join(
        b"%s: %s\r\n" % (name, value)
        for name, value in scope["headers"]
        if name.lower() not in _HOP_HEADERS
    )


def _response_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in response.headers if name not in _RESPONSE_DROP]


def _room_headers(upstream: Upstream, releasing: Handle | None = None) -> list[tuple[bytes, bytes]]:
    if upstream.ledger is None:
        return []
    headers = room(upstream.ledger, upstream.queue, releasing)
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _with_cap(raw: bytes, body: dict[str, Any], cap: int) -> bytes:
    """The body that goes upstream: the client's own bytes with ``max_tokens`` the reserved cap.

    - no ``max_tokens`` (nor ``max_completion_tokens``) at all: the field appended to the
      client's bytes (no key of the object decodes to it, so the appended one is the only one);
    - ``max_tokens`` already the cap, written once and without escapes: the bytes unchanged (a
      key spelled with ``\\u`` escapes or given twice could be read otherwise by another parser);
    - anything else: the parsed body re-encoded with the cap.
    """
    if "max_completion_tokens" not in body:
        if "max_tokens" not in body:
            end = raw.rstrip()
            if end.endswith(b"}"):
                inner = end[:-1].rstrip()
                comma = b"" if inner.endswith(b"{") else b","
                return b'%s%s"max_tokens":%d}' % (inner, comma, cap)
        elif (
            body["max_tokens"] == cap
            and type(body["max_tokens"]) is int
            and b"\\u" not in raw
            and raw.count(b'"max_tokens"') == 1
        ):
            return raw
    body["max_tokens"] = cap
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = cap
    return json.dumps(body).encode()


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def _completion_tokens(content: bytes) -> int:
    """``usage.completion_tokens`` of an answer, found without parsing the whole answer again
    (in JSON text a key is always a quoted string; inside generated text its quotes are
    escaped, so the pattern cannot match there). The last one counts: usage comes last."""
    at = content.rfind(b'"completion_tokens"')
    if at < 0:
        return 0
    found = _COMPLETION_TOKENS.match(content, at)
    return int(found.group(1)) if found else 0


def _upstream_error(upstream: Upstream, response: UpstreamResponse, content: bytes) -> Response:
    """An upstream's error answer: 4xx and 429/503 pass through as the engine sent them (a 429 or
    503 without Retry-After gets the gateway's); any other 5xx becomes our shape, same status."""
    status = response.status
    if status < 500 or status == 503:
        passed = Response(content, status_code=status)
        passed.raw_headers = [
            *_response_headers(response),
            (b"content-length", str(len(content)).encode()),
        ]
        if status in (429, 503) and response.header(b"retry-after") is None:
            passed.raw_headers += [(b"retry-after", b"1"), (b"retry-after-ms", b"1000")]
        return passed
    try:
        detail = json.loads(content).get("error", {})
        message = detail.get("message") if isinstance(detail, dict) else str(detail)
        code = detail.get("type") or detail.get("code") if isinstance(detail, dict) else None
    except (ValueError, AttributeError):
        message, code = content[:300].decode("utf-8", "replace"), None
    return error_response(
        status,
        f"upstream {upstream.url} answered {status}: {message}",
        type="upstream_error",
        code=str(code) if code is not None else None,
    )


class _ClientWatch:
    """One request's client, watched without a task group: a disconnect (a task awaiting
    ``receive``) or a write not taken within ``send_timeout`` (one timer for the request,
    re-armed only while a write waits) cancels the forwarding task, whose ``finally`` blocks
    release its reservation and abort its upstream connection. Plain asyncio: an anyio task
    group, a watcher task and a ``move_on_after`` per write cost about 150 µs a request and 13 µs
    an event here. ``started``: the answer has begun (an unexpected error then cuts it).

    On the gateway's own front (``direct``, its cycle) neither the task nor the timer is needed:
    the front calls back when the client goes away and cuts a write that waits too long
    itself; only a spliced stream held back by a full socket (:meth:`blocked`) is timed here."""

    __slots__ = (
        "_loop",
        "_send",
        "_since",
        "_task",
        "_timer",
        "_watcher",
        "cancelled",
        "direct",
        "done",
        "limit",
        "started",
    )  # fmt: skip

    def __init__(
        self,
        receive: Receive,
        task: asyncio.Task[Any],
        send: Send,
        limit: float,
        direct: Any = None,
    ):
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._send = send
        self.limit = limit
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.cancelled = False
        self.done = False
        self.started = False
        self.direct = direct
        self._watcher: asyncio.Task[None] | None = None
        if direct is not None:
            direct.watch_disconnect(self._cancel)
        else:
            self._watcher = self._loop.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self._cancel()
                return

    def _cancel(self) -> None:
        if not self.cancelled and not self.done:
            self.cancelled = True
            self._task.cancel()

    async def send(self, message: Message) -> None:
        self.started = True  # the first message is always http.response.start
        if self.direct is not None:
            await self._send(message)  # the front times a write that waits
            return
        self.blocked()
        try:
            await self._send(message)
        finally:
            self._since = None

    def blocked(self) -> None:
        """A write waits for the client from now (until :meth:`unblocked`)."""
        if self._since is None:
            since = self._since = self._loop.time()
            if self._timer is None:
                self._timer = self._loop.call_at(since + self.limit, self._check)

    def unblocked(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is None:
            return  # no write waits; the next one re-arms
        if self._loop.time() >= since + self.limit:
            logger.warning("an answer was cut: not read within the send timeout")
            self._cancel()
        else:
            self._timer = self._loop.call_at(since + self.limit, self._check)

    def finish(self) -> None:
        """The answer is complete (or abandoned): stop watching. After the answer the watcher
        sees the server's ``http.disconnect`` and ends by itself; cancelled only if it waits."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.direct is not None:
            self.direct.watch_disconnect(None)
        elif self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()


@dataclass(eq=False)
class _Prepared:
    """A request read and parsed, on its way to admission: its cap and the body that carries it
    once counted (``prompt_tokens``), or its count on the way (``counting``)."""

    known: Sequence[Upstream]
    request: GenerationRequest
    raw: bytes
    body: dict[str, Any]
    window: int
    roomiest: Upstream
    prompt_tokens: int | None = None
    cap: int = 0
    content: bytes = b""
    counting: asyncio.Future[int] | None = None
    #: Upstreams that failed this request before any byte of an answer.
    tried: set[int] = field(default_factory=set)


class GatewayGeneration:
    """``/v1/completions`` and ``/v1/chat/completions`` through the ledger to an upstream.

    On the gateway's fast lane (no Starlette router or middleware around it), so it is its own
    guard against unexpected errors, as :class:`~reference_server.app.UnexpectedErrorMiddleware`
    is elsewhere: a generic 500 and the error's type logged, or a cut answer once it started."""

    def __init__(self, kind: Kind, path: str, state: GatewayState) -> None:
        self.kind = kind
        self.path = path
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch: _ClientWatch | None = None
        try:
            prepared = await self._prepare(scope, receive, send)
            if prepared is None:
                return
            task = asyncio.current_task()
            assert task is not None
            direct = scope.get("extensions", {}).get(DIRECT_EXTENSION)
            watch = _ClientWatch(receive, task, send, self.state.config.send_timeout, direct)
            try:
                if prepared.counting is not None:
                    if await self._forward_on_bound(prepared, scope, receive, watch):
                        return
                    if not await self._counted(prepared, scope, receive, watch.send):
                        return
                await self._admit_and_forward(prepared, scope, receive, watch)
            except asyncio.CancelledError:
                if not watch.cancelled:
                    raise
                # The client went away or stopped reading: everything was released on the way.
            finally:
                watch.finish()
        except Exception as exc:
            _log_unexpected(exc, scope["path"])
            if watch is None or not watch.started:
                await _internal_error()(scope, receive, send)
        # A count still on the way is left to land (bounded by the read timeout): cancelling it
        # would abort its pooled connection, and each request would then open a new one.

    async def _prepare(self, scope: Scope, receive: Receive, send: Send) -> _Prepared | None:
        """Read, parse, count and cap the request; None when it was answered already (an error)
        or its client went away. With ``overlap_count``, a request that may go before its count
        lands comes back with the count on the way (``counting``) instead."""
        state = self.state
        try:
            check_content_type(scope_header(scope, b"content-type"))
            raw = await _read_body(scope, receive, state.config.max_body_bytes)
            body = parse_json_object(raw)
            request = parse_generation(self.kind, body)
            known, window, roomiest = await state.admission()
            if roomiest is None:
                problems = "; ".join(
                    f"{u.url}: {u.discovery_error or 'not discovered'}" for u in state.upstreams
                )
                raise _unavailable(f"no upstream is in service ({problems})")
            model = body.get("model")
            prepared = _Prepared(known, request, raw, body, window, roomiest)
            count = self._count(state, known, request, model if isinstance(model, str) else None)
            if self._may_overlap(prepared):
                assert request.max_tokens is not None
                prepared.cap = request.max_tokens
                prepared.content = _with_cap(raw, body, request.max_tokens)
                prepared.counting = asyncio.ensure_future(count)
                return prepared
            self._cap(prepared, await count)
        except _ClientGone:
            return None
        except APIError as error:
            await error.response()(scope, receive, send)
            return None
        return prepared

    def _cap(self, prepared: _Prepared, prompt_tokens: int) -> None:
        """The cap the request is reserved and forwarded with, and the body that carries it."""
        request = prepared.request
        # The most generous upstream decides "never": a request that fits one is retryable.
        assert prepared.roomiest.ledger is not None
        prepared.prompt_tokens = prompt_tokens
        prepared.cap = admissible_cap(
            prepared.roomiest.ledger,
            prompt_tokens,
            request.max_tokens,
            context_window=prepared.window,
            param="messages" if request.messages is not None else "prompt",
        )
        prepared.content = _with_cap(prepared.raw, prepared.body, prepared.cap)

    def _may_overlap(self, prepared: _Prepared) -> bool:
        """Whether the request may be forwarded while the upstream counts it: counting by an
        upstream's /tokenize, an explicit cap, and a body whose bytes (a prompt never has more
        tokens than bytes, a template adds a few) leave the cap room in the window, so the
        count will not change the cap. Whether the whole window fits is decided at admission."""
        state, request = self.state, prepared.request
        if not state.config.overlap_count or state.config.counter is not None:
            return False
        if request.max_tokens is None or request.token_ids is not None:
            return False
        if len(prepared.raw) + _OVERLAP_MARGIN + request.max_tokens > prepared.window:
            return False
        now = time.monotonic()
        counting = next((u for u in prepared.known if u.health.in_service(now)), None)
        return counting is not None and counting.engine in TOKENIZE_ENGINES

    async def _forward_on_bound(
        self, prepared: _Prepared, scope: Scope, receive: Receive, watch: _ClientWatch
    ) -> bool:
        """Admit on the whole context window (what no request can outgrow) where that fits now
        with room for ``_OVERLAP_ROOM`` windows, nobody queued, and forward while the count is
        on the way; the reservation shrinks
        to the exact need when the count lands. False when it did not fit, or the upstream
        failed before any byte of an answer: the caller counts, then admits as usual."""
        counting, cap, window = prepared.counting, prepared.cap, prepared.window
        assert counting is not None
        known = prepared.known
        bound = window - cap
        need = known[0].ledger.need_tokens(bound, cap) if known[0].ledger else 0
        upstream = self._route(known, need, prepared.tried)
        if upstream is None or upstream.queue is None or upstream.queue.waiting:
            return False
        ledger, queue = upstream.ledger, upstream.queue
        assert ledger is not None
        if ledger.usable_tokens - ledger.load()[0] < _OVERLAP_ROOM * need:
            return False
        handle = ledger.try_admit(bound, cap, now=queue.now(), count_rejection=False, need=need)
        if handle is None:
            return False

        def landed(task: asyncio.Future[int]) -> None:
            upstream.overlapping.discard(task)
            if task.cancelled():
                return  # the request ended first
            error = task.exception()
            if error is not None:  # the whole window stays reserved until the request ends
                _log_unexpected(error, self.path)
                return
            prompt_tokens = task.result()
            if prompt_tokens + cap <= window and ledger.shrink(handle, prompt_tokens):
                queue.notify()

        upstream.overlapping.add(counting)
        counting.add_done_callback(landed)
        try:
            sent = await self._forward(
                upstream,
                handle,
                prepared.request,
                prepared.content,
                _forward_headers(scope),
                scope,
                receive,
                watch,
            )
        finally:
            ledger.release(handle)
            queue.notify()
        if sent:
            return True
        prepared.tried.add(id(upstream))  # failed before any byte: the others, once counted
        return False

    async def _counted(
        self, prepared: _Prepared, scope: Scope, receive: Receive, send: Send
    ) -> bool:
        """Wait for the count on the way and cap the request by it; False when that answered
        the request already (an error)."""
        assert prepared.counting is not None
        prompt_tokens = await prepared.counting
        try:
            self._cap(prepared, prompt_tokens)
        except APIError as error:
            await error.response()(scope, receive, send)
            return False
        return True

    async def _count(
        self,
        state: GatewayState,
        known: Sequence[Upstream],
        request: GenerationRequest,
        model: str | None,
    ) -> int:
        if state.config.counter is None:
            for upstream in known:
                if upstream.health.in_service(time.monotonic()):
                    try:
                        counted = await upstream.count(request, model)
                    except UpstreamUnavailable:
                        continue
                    if counted is not None:
                        return counted
                    break
        counter = state.fallback_counter
        if request.size_hint > _THREAD_COUNT_CHARS:  # the reference server's rule
            return await anyio.to_thread.run_sync(count_prompt, request, counter)
        return count_prompt(request, counter)

    async def _admit_and_forward(
        self, prepared: _Prepared, scope: Scope, receive: Receive, watch: _ClientWatch
    ) -> None:
        known, request, content = prepared.known, prepared.request, prepared.content
        prompt_tokens, cap, tried = prepared.prompt_tokens, prepared.cap, prepared.tried
        assert prompt_tokens is not None
        headers = _forward_headers(scope)
        client = scope.get("client")  # (host, port): staggered advice per connection
        # Every upstream prices a request alike (prompt + cap in its blocks); priced once.
        need = known[0].ledger.need_tokens(prompt_tokens, cap) if known[0].ledger else 0
        send = watch.send
        while True:
            upstream = self._route(known, need, tried)
            if upstream is None:
                error = _unavailable("every upstream failed this request")
                await error.response()(scope, receive, send)
                return
            assert upstream.queue is not None
            assert upstream.ledger is not None
            if upstream.overlapping and upstream.ledger.load()[0] + need > (
                upstream.ledger.usable_tokens
            ):
                # Some of what is held is a whole window for a count on the way: once they
                # land, it may fit after all. No refusal on a reservation about to shrink.
                await asyncio.wait(list(upstream.overlapping), timeout=_OVERLAP_WAIT)
            try:
                handle = await upstream.queue.acquire(
                    prompt_tokens, cap, client=tuple(client) if client else None
                )
            except Rejected as rejected:
                busy = too_busy(upstream.ledger, rejected, prompt_tokens, cap, upstream.queue)
                await busy(scope, receive, send)
                return
            try:
                sent = await self._forward(
                    upstream, handle, request, content, headers, scope, receive, watch
                )
            finally:
                upstream.ledger.release(handle)
                upstream.queue.notify()
            if sent:
                return
            tried.add(id(upstream))  # failed before any byte: try another upstream

    def _route(self, known: Sequence[Upstream], need: int, tried: set[int]) -> Upstream | None:
        """Where the reservation fits with the most room; else the in-service upstream with the
        most room (its queue waits or refuses with its own Retry-After); else None."""
        now = time.monotonic()
        if len(known) == 1:  # where it fits or where it waits: the only one, when in service
            only = known[0]
            return only if not tried and only.health.in_service(now) else None
        candidates = [u for u in known if id(u) not in tried] if tried else known
        if not candidates:
            return None
        views = [u.endpoint(now) for u in candidates]
        order = ranked(views, need)
        if order:
            return candidates[order[0]]
        serving = [i for i, v in enumerate(views) if v.in_service]
        if not serving:
            return None
        return candidates[max(serving, key=lambda i: views[i].free or 0)]

    async def _forward(
        self,
        upstream: Upstream,
        handle: Handle,
        request: GenerationRequest,
        content: bytes,
        headers: bytes,
        scope: Scope,
        receive: Receive,
        watch: _ClientWatch,
    ) -> bool:
        """Send to ``upstream`` and relay its answer. False when it failed before any byte of an
        answer (the caller tries another upstream); True once something was answered."""
        send = watch.send
        started = time.monotonic()
        upstream.health.begin(started)
        try:
            response = await upstream.client().request(
                "POST", self.path, headers=headers, body=content
            )
        except UpstreamError as exc:
            upstream.failure()
            logger.warning("upstream %s: %s before any answer", upstream.url, type(exc).__name__)
            return False
        # Closed in finally whatever happens: when the client went away (this runs cancelled)
        # the connection is aborted at once, and engines abort a request on disconnect.
        try:
            if response.status >= 400:
                try:
                    data = await response.read()
                except UpstreamError:
                    upstream.failure()
                    return False
                if response.status >= 500 and response.status != 503:
                    upstream.failure()  # an engine failure: answered, never retried elsewhere
                else:
                    upstream.health.succeeded()
                await _upstream_error(upstream, response, data)(scope, receive, send)
                return True
            if not request.stream:
                try:
                    data = await response.read()
                except UpstreamError:
                    upstream.failure()
                    return False
                upstream.health.succeeded()
                upstream.observe(_completion_tokens(data), time.monotonic() - started)
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": [*_response_headers(response), (b"content-length",
                                    str(len(data)).encode()),
                                    *_room_headers(upstream, handle)],
                    }
                )  # fmt: skip
                await send({"type": "http.response.body", "body": data, "more_body": False})
                upstream.relayed += 1
                return True
            events = await self._relay(upstream, response, watch, watch.direct)
            upstream.observe(events - 2, time.monotonic() - started)  # less role and [DONE]
            return True
        finally:
            response.close()

    async def _relay(
        self,
        upstream: Upstream,
        response: UpstreamResponse,
        watch: _ClientWatch,
        direct: Any = None,
    ) -> int:
        """Relay a stream piece by piece as it arrives (what arrived together goes in one write);
        a break becomes an SSE error event. Returns how many events it relayed (0 after a
        break). ``direct``: the gateway's front's cycle (see ``_front.DIRECT_EXTENSION``), so
        that after the first piece the rest is spliced: written to the client from the
        upstream connection's own callback, with no task woken and no ASGI message per event
        (about 20 of the 50 µs an event cost)."""
        send = watch.send
        first: bytes | None
        try:
            first = await response.piece()
        except UpstreamError:
            first = None
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*_response_headers(response), *_room_headers(upstream)],
            }
        )
        upstream.health.succeeded()
        if first is None:
            await self._stream_broke(upstream, send)
            return 0
        events = 0
        piece = first
        try:
            if direct is not None and piece:
                events = piece.count(b"data:")
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                events += await _splice(response, direct, watch)
            while piece and direct is None:
                events += piece.count(b"data:")
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                piece = await response.piece()
        except UpstreamError:
            await self._stream_broke(upstream, send)
            return 0
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        upstream.relayed += 1
        return events

    @staticmethod
    async def _stream_broke(upstream: Upstream, send: Send) -> None:
        upstream.failure()
        error = {
            "message": f"the upstream {upstream.url} broke the stream mid-answer",
            "type": "upstream_error",
            "param": None,
            "code": "upstream_stream_broken",
        }
        event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": False})


async def _splice(response: UpstreamResponse, direct: Any, watch: _ClientWatch) -> int:
    """The rest of a stream, from the upstream's callback straight to the client's socket;
    while the client's socket is full, the upstream is not read (its engine waits) and the
    watch's send timeout runs. Returns how many events went through."""
    events = 0
    held: asyncio.Future[None] | None = None

    def go_on(_: asyncio.Future[None]) -> None:
        watch.unblocked()
        response.resume()

    def sink(data: bytes) -> None:
        nonlocal events, held
        events += data.count(b"data:")
        direct.write_chunk(data)
        paused = direct.write_paused()
        if paused is not None and paused is not held:
            held = paused
            response.pause()
            watch.blocked()
            paused.add_done_callback(go_on)

    try:
        await response.splice(sink)
    finally:
        if held is not None:
            held.remove_done_callback(go_on)
    return events


# --- small endpoints ---------------------------------------------------------------------------


async def _models(request: Request) -> Response:
    """The first upstream's model list, each entry with the gateway's ``max_model_len``."""
    state: GatewayState = request.app.state.gateway
    known = await state.ready()
    if not known:
        return _unavailable("no upstream is in service").response()
    upstream = known[0]
    try:
        _, _, listed = await upstream.call("GET", "/v1/models")
        payload = json.loads(listed)
    except (UpstreamError, ValueError):
        payload = None
    window = state.window(known)
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or not data:
        model = state.model(known) or "upstream"
        data = [{"id": model, "object": "model", "owned_by": "kvclient-gateway"}]
    for entry in data:
        if isinstance(entry, dict):
            entry["max_model_len"] = window
    return JSONResponse({"object": "list", "data": data})


async def _tokenize(request: Request) -> Response:
    """Passed to an upstream as it is."""
    state: GatewayState = request.app.state.gateway
    known = await state.ready()
    if not known:
        return _unavailable("no upstream is in service").response()
    body = await request.body()
    try:
        status, headers, data = await known[0].call("POST", "/tokenize", body, _JSON_HEADERS)
    except UpstreamError as exc:
        return _unavailable(f"upstream {known[0].url}: {type(exc).__name__}").response()
    media = dict(headers).get(b"content-type", b"application/json").decode("latin-1")
    return Response(data, status_code=status, media_type=media)


async def _health(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    known = await state.ready()
    now = time.monotonic()
    upstreams = []
    for u in state.upstreams:
        stats = u.ledger.stats() if u.ledger is not None else None
        upstreams.append(
            {
                "url": u.url,
                "engine": u.engine,
                "in_service": u.ledger is not None and u.health.in_service(now),
                "usable_tokens": stats.usable_tokens if stats else None,
                "reserved_tokens": stats.reserved_tokens if stats else None,
                "inflight": stats.inflight if stats else None,
                "problem": u.discovery_error,
            }
        )
    ok = any(entry["in_service"] for entry in upstreams) and bool(known)
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "upstreams": upstreams},
        status_code=200 if ok else 503,
    )


async def _metrics(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


class _GatewayCollector:
    """The reference server's ledger metrics summed over upstreams, and each one labelled."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        now = time.monotonic()
        rows = []
        for u in self.state.upstreams:
            stats = u.ledger.stats() if u.ledger is not None else None
            rows.append((u, stats))
        total = {
            "kv_usable_tokens": sum(s.usable_tokens for _, s in rows if s),
            "kv_reserved_tokens": sum(s.reserved_tokens for _, s in rows if s),
            "kv_inflight_requests": sum(s.inflight for _, s in rows if s),
        }
        for name, value in total.items():
            yield GaugeMetricFamily(name, f"{name} summed over upstreams", value=value)
        yield CounterMetricFamily(
            "kv_admitted_total",
            "Requests admitted.",
            value=sum(s.admitted_total for _, s in rows if s),
        )
        yield CounterMetricFamily(
            "kv_rejected_total",
            "Requests refused with 429.",
            value=sum(s.rejected_total for _, s in rows if s),
        )
        gauges: dict[str, list[float]] = {
            "kv_upstream_usable_tokens": [s.usable_tokens if s else 0 for _, s in rows],
            "kv_upstream_reserved_tokens": [s.reserved_tokens if s else 0 for _, s in rows],
            "kv_upstream_inflight_requests": [s.inflight if s else 0 for _, s in rows],
            "kv_upstream_out_of_service": [
                0 if s is not None and u.health.in_service(now) else 1 for u, s in rows
            ],
        }
        counters: dict[str, list[float]] = {
            "kv_upstream_admitted": [s.admitted_total if s else 0 for _, s in rows],
            "kv_upstream_rejected": [s.rejected_total if s else 0 for _, s in rows],
            "kv_upstream_errors": [u.errors for u, _ in rows],
        }
        for name, values in gauges.items():
            gauge = GaugeMetricFamily(name, name.replace("_", " "), labels=["upstream"])
            for (u, _), amount in zip(rows, values, strict=True):
                gauge.add_metric([u.url], amount)
            yield gauge
        for name, values in counters.items():
            counter = CounterMetricFamily(name, name.replace("_", " "), labels=["upstream"])
            for (u, _), amount in zip(rows, values, strict=True):
                counter.add_metric([u.url], amount)
            yield counter


def create_gateway_app(config: GatewayConfig) -> Starlette:
    """The gateway as an ASGI app; ``app.state.gateway`` is its :class:`GatewayState`."""
    state = GatewayState(config)
    completions = GatewayGeneration("completions", "/v1/completions", state)
    chat = GatewayGeneration("chat", "/v1/chat/completions", state)
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/tokenize", _tokenize, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The upstream connections are opened in the serving loop; closed before it ends.
        try:
            yield
        finally:
            await state.aclose()

    app = build_app(routes, api_key=config.api_key, lifespan=lifespan)
    app.state.gateway = state
    # The two generation routes skip Starlette's router and its exception middlewares (wrappers
    # of every write, one per relayed event): the same key check, their own guard against
    # unexpected errors (GatewayGeneration), one dictionary lookup. The rest goes the usual way.
    lanes: dict[str, ASGIApp] = {}
    for path, handler in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        lane: ASGIApp = handler
        if config.api_key is not None:
            lane = APIKeyMiddleware(lane, api_key=config.api_key)
        lanes[path] = lane
    app.middleware_stack = _FastLane(app.build_middleware_stack(), lanes)
    return app


class _FastLane:
    """POST to one of ``lanes`` goes straight there; anything else to ``stack``."""

    def __init__(self, stack: ASGIApp, lanes: dict[str, ASGIApp]) -> None:
        self.stack = stack
        self.lanes = lanes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            lane = self.lanes.get(scope["path"])
            if lane is not None:
                await lane(scope, receive, send)
                return
        await self.stack(scope, receive, send)
