"""One engine behind the gateway: its pooled HTTP client, what discovery learnt of it, its
ledger and queue once known, its health and counters.

The HTTP client (:class:`UpstreamHTTP`) is one pooled aiohttp session per upstream, closed with
the app's lifespan: connection limits, timeouts, TLS settings, proxies from the environment
(``HTTP(S)_PROXY``, ``NO_PROXY``), and a user and password in the URL sent as Basic auth. It
keeps no cookies (one client serves every caller).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import socket
import ssl
import statistics
import struct
import time
import urllib.request
from collections import deque
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import yarl

from kvclient.engines.behaviour import PROGRESS_ENGINES, PROMPT_SHARING_ENGINES
from kvclient.engines.budget import Budget, discover_budget
from kvclient.engines.discovery import Answer, Discovery, Probe, discover_context
from kvclient.engines.tokenize import TOKENIZE_ENGINES, Tokenized, tokenize
from kvclient.routing import Endpoint, Health

from ..admission.fair_queue import FairQueue
from ..admission.ledger import DEFAULT_SAFETY_FRACTION, KVAdmissionController
from ..admission.queue import AdmissionQueue
from ..http.requests import GenerationRequest
from .config import DEFAULT_PREEMPTION_BUDGET, GatewayConfig, public_url
from .errors import UPSTREAM_ERRORS, UpstreamUnavailable
from .redis_ledgers import SharedLedgers
from .speed import Speed
from .watch import EngineWatch, speculative_reason

__all__ = [
    "UPSTREAM_ERRORS",
    "Known",
    "Upstream",
    "UpstreamHTTP",
    "UpstreamUnavailable",
    "parse_json",
    "read_limited",
    "release",
]

logger = logging.getLogger("kvclient.gateway")

T = TypeVar("T")

#: Seconds an idle pooled connection to an upstream is kept: under uvicorn's default 5.
_KEEPALIVE_SECONDS = 4.0
#: A discovery or /tokenize answer larger than this is not read (it is not what it claims).
_MAX_PROBE_BYTES = 4 * 1024 * 1024
_MIN_RATE_TOKENS = 8
#: Answers the decode rate is the median of.
_RATE_WINDOW = 31


def _proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTP(S)_PROXY``, ``NO_PROXY``), if any."""
    parsed = yarl.URL(url)
    if parsed.host is None or urllib.request.proxy_bypass(parsed.host):
        return None
    return urllib.request.getproxies().get(parsed.scheme)


class UpstreamHTTP:
    """The pooled HTTP client of one upstream: an ``aiohttp.ClientSession`` created in the
    serving loop on first use, with connection limits, timeouts, TLS settings, proxies from the
    environment, no cookie jar, and no decoding (answers are relayed as they come).

    aiohttp rather than httpx: measured with ``bench/gateway_overhead.py``, and an upstream that
    writes an answer nobody asked for on a kept-alive connection has that connection closed by
    aiohttp, where httpx's pool hands the stray answer to the next request (another client).
    """

    def __init__(self, url: str, config: GatewayConfig) -> None:
        parsed = yarl.URL(url)
        self._origin = str(parsed.with_user(None)).rstrip("/")
        self._headers = {"Accept-Encoding": "identity"}
        if parsed.user is not None:  # the URL's user and password, as Basic auth (RFC 7617)
            pair = f"{parsed.user}:{parsed.password or ''}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        elif config.upstream_api_key:
            self._headers["Authorization"] = f"Bearer {config.upstream_api_key}"
        self._config = config
        self._session: aiohttp.ClientSession | None = None
        #: For a request sent again: a new connection each time, never one from the pool.
        self._fresh: aiohttp.ClientSession | None = None
        self._proxy = _proxy_for(self._origin)

    def _open_session(self, *, pooled: bool = True) -> aiohttp.ClientSession:
        config = self._config
        tls: ssl.SSLContext | bool = True
        if config.upstream_ca_bundle or config.upstream_client_cert:
            tls = ssl.create_default_context(cafile=config.upstream_ca_bundle)
            if config.upstream_client_cert:
                tls.load_cert_chain(config.upstream_client_cert, config.upstream_client_key)
        return aiohttp.ClientSession(
            headers=self._headers,
            cookie_jar=aiohttp.DummyCookieJar(),
            # Idle connections are closed before the engine's server would (uvicorn: 5 s), so
            # that the pool seldom hands out one the engine is closing.
            connector=aiohttp.TCPConnector(
                limit=config.max_connections,
                ssl=tls,
                keepalive_timeout=_KEEPALIVE_SECONDS if pooled else None,
                force_close=not pooled,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=config.connect_timeout, sock_read=config.read_timeout
            ),
            # Proxies come from the environment once (_proxy_for), not per request: aiohttp's
            # trust_env reads ~/.netrc in a worker thread for every request.
            trust_env=False,
            auto_decompress=False,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        json_body: Any = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request; the answer's body is read by the caller, who releases it.

        Sent again, once, when the connection broke before any answer and it was not a new
        connection failing to open: a kept-alive connection that the engine's server closed as
        it went idle (uvicorn's keep-alive is 5 s) while the pool handed it out. The engine had
        not read the request; a new connection carries it, opened for it alone (the pool may
        hold other connections the engine closed at the same moment, after a burst).
        """
        if self._session is None:
            self._session = self._open_session()
        for attempt in (1, 2):
            if attempt == 2 and self._fresh is None:
                self._fresh = self._open_session(pooled=False)
            session = self._session if attempt == 1 else self._fresh
            assert session is not None
            try:
                return await session.request(
                    method,
                    self._origin + path,
                    data=content,
                    json=json_body,
                    headers=headers,
                    proxy=self._proxy,
                    allow_redirects=False,
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2 or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                logger.info("upstream %s: a kept-alive connection was closed; sent again", path)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None


def release(response: aiohttp.ClientResponse) -> None:
    """Give the connection back to the pool when the answer was read whole; else reset it: an
    unfinished answer is abandoned, and an engine that keeps half-closed connections open
    (reading on after a FIN) takes only a reset as the client gone."""
    if response.content.at_eof():
        response.release()
        return
    connection = response.connection
    transport = connection.transport if connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    response.close()


async def read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """An answer's body, or None once it passes ``limit`` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.content.iter_any():
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(data: bytes) -> Any:
    """A JSON value, or None when ``data`` is not JSON (or nests past the parser's limit)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


@dataclass(eq=False, slots=True)
class Known:
    """An upstream the gateway has discovered: where its reservations are held."""

    upstream: Upstream
    ledger: KVAdmissionController
    queue: AdmissionQueue

    @property
    def shares_prompt(self) -> bool:
        """Whether the sequences of one request share the prompt's full blocks: an engine that
        forks them from one prompt, with its prefix cache on (vLLM's ``n`` children share
        nothing without it)."""
        return self.upstream.engine in PROMPT_SHARING_ENGINES and self.ledger.shares_prefixes


class Upstream:
    """One engine behind the gateway."""

    def __init__(
        self,
        url: str,
        kv_override: int | None,
        config: GatewayConfig,
        max_running: int | None = None,
        preemption_budget: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        #: How many sequences it runs at once, when told (``--max-running``).
        self.max_running = max_running
        #: Preemptions per 1,000 requests its forecast may cost, when told
        #: (``--preemption-budget``).
        self.preemption_budget = preemption_budget
        #: What its usable budget is made of, for ``/health``.
        self.pool_basis: str | None = None
        #: Times the peak rule fell back to whole caps for what its engine did or hid (until
        #: the holders live then had gone).
        self.lockstep_breaks = 0
        #: The URL as it may be shown: without user and password.
        self.name = public_url(self.url)
        self.kv_override = kv_override
        self.config = config
        self.health = Health(
            threshold=config.failure_threshold, cooldown=config.out_of_service_seconds
        )
        self.known: Known | None = None
        self.discovery: Discovery | None = None
        self.budget: Budget | None = None
        self.discovery_error: str | None = None
        self.errors = 0
        #: Measured per-sequence decode rate (tokens/s): the median of the recent answers'.
        self.measured_rate: float | None = None
        self._rates: deque[float] = deque(maxlen=_RATE_WINDOW)
        #: The speed measured from the engine's own counters (see ``watch.py``), when it
        #: exports them: then the answers' rates are not used.
        self.speed: Speed | None = None
        #: What the gateway sees of the engine, through its ``/metrics``.
        self.watch = EngineWatch(self)
        self.http = UpstreamHTTP(self.url, config)
        #: Set by the gateway when its ledger is shared: where reservations are kept.
        self.shared: SharedLedgers | None = None

    async def aclose(self) -> None:
        await self.http.aclose()

    @property
    def engine(self) -> str | None:
        return self.discovery.engine if self.discovery else None

    def failure(self) -> None:
        """It failed a request (no answer, a broken one): count it."""
        self.errors += 1
        self.health.failed(time.monotonic())

    def observe(self, tokens: int, seconds: float) -> None:
        """One answer's output tokens and duration: the Retry-After estimates follow the
        engine's real speed instead of the configured guess. The median of the recent answers,
        so that one answer (a lying usage figure, a stall) moves it little."""
        if tokens < _MIN_RATE_TOKENS or not 0 < seconds < math.inf or self.known is None:
            return
        self._rates.append(tokens / seconds)
        self.measured_rate = statistics.median(self._rates)
        if self.speed is None:
            self.known.ledger.set_speed(self.measured_rate, None, time.monotonic())

    async def fetch(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        limit: int = _MAX_PROBE_BYTES,
    ) -> tuple[int, str | None, bytes | None]:
        """One request answered whole: (status, content type, body read up to ``limit`` bytes,
        None past it). ``content`` is sent as JSON."""
        headers = [("Content-Type", "application/json")] if content is not None else None
        response = await self.http.request(
            method, path, json_body=json_body, content=content, headers=headers
        )
        try:
            data = await read_limited(response, limit)
            return response.status, response.headers.get("Content-Type"), data
        finally:
            release(response)

    async def _drive(self, driver: Generator[Probe, Answer, T], *, text: bool = False) -> T:
        """Run a dialect driver against this upstream."""
        probe = next(driver)
        while True:
            try:
                status, _, data = await self.fetch(probe.method, probe.path, json_body=probe.json)
            except UPSTREAM_ERRORS as exc:
                raise UpstreamUnavailable(f"{probe}: {type(exc).__name__}") from exc
            payload: Any = None
            if data is not None:
                if text and probe.path == "/metrics":
                    payload = data.decode("utf-8", "replace")
                else:
                    payload = parse_json(data)
            try:
                probe = driver.send(Answer(status, payload))
            except StopIteration as stop:
                result: T = stop.value
                return result

    async def discover(self) -> None:
        """Learn the window, the model and the KV budget; build the ledger and queue."""
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
        running = self.max_running if self.max_running is not None else budget.max_concurrency
        engine = found.engine or budget.engine
        pool, fraction, self.pool_basis = self._pool(kv, budget)
        try:
            ledger = KVAdmissionController(
                total_kv_tokens=pool,
                context_window=window,
                decode_rate=self.config.decode_rate,
                relay_lag=self.config.relay_lag,
                safety_fraction=fraction,
                block_size=budget.block_size,
                max_concurrency=running,
                release_margin=0.05,
                rule=self.config.admission_rule,
                # Shared or not: every gateway counts a holder as its own gateway forecast it
                # (its record says), and a newcomer by its own forecast of now.
                preemption_budget=self._preemption_budget(budget),
                forecast_quantile=self.config.forecast_quantile,
                start_clock=engine in PROGRESS_ENGINES,
            )
        except ValueError as exc:
            raise UpstreamUnavailable(f"unusable budget (KV {kv} tokens): {exc}") from None
        unbounded = running is None and budget.runs_all
        ledger.set_caps_for_good(self._caps_reason(engine, running, budget, unbounded))
        ledger.shares_prefixes = budget.prefix_caching is True
        if ledger.caps_reason is not None:
            logger.warning(
                "upstream %s: admission counts whole caps: %s", self.name, ledger.caps_reason
            )
        if ledger.usable_tokens < ledger.block_size:
            raise UpstreamUnavailable(
                f"its KV budget ({kv} tokens, {ledger.usable_tokens} usable) is under one block "
                f"of {ledger.block_size} tokens: no request could ever be admitted"
            )
        queue = AdmissionQueue(ledger, max_wait=self.config.max_queue_wait)
        if self.config.fairness is not None:
            queue = FairQueue(
                ledger, policy=self.config.fairness, max_wait=self.config.max_queue_wait
            )
        if self.shared is not None:
            queue = await self.shared.queue_for(
                self.name, ledger, self.config.max_queue_wait, self.config.fairness
            )
            self.watch.books = self.shared.books_for(self.name, ttl=self.watch.claim_seconds)
        self.discovery, self.budget = found, budget
        self.watch.discovered(time.monotonic())
        self.known = Known(upstream=self, ledger=ledger, queue=queue)
        logger.info(
            "upstream %s: %s, window %d (%s), KV %d tokens (%s), usable %d",
            self.name, found.engine, window, found.source, kv,
            "--kv-tokens" if self.kv_override is not None else budget.source,
            ledger.usable_tokens,
        )  # fmt: skip

    def _pool(self, kv: int, budget: Budget) -> tuple[int, float, str]:
        """The KV pool admitted into, the share of it, and what they are made of: the share
        ``--safety-fraction`` says; else, where the engine counts its pool in blocks, the pool
        less the blocks it keeps for itself, whole; else the seed's safety fraction (memory not
        managed in blocks loses some to fragmentation and activations)."""
        fraction = self.config.safety_fraction
        if fraction is not None:
            return kv, fraction, f"{fraction:g} of {kv} tokens (--safety-fraction)"
        exact = budget.exact_pool
        if self.kv_override is None and exact is not None and exact > 0:
            kept = budget.kept_blocks or 0
            return exact, 1.0, (
                f"the engine's pool of {kv} tokens less the {kept} blocks of {budget.block_size} "
                "it keeps for itself"
            )  # fmt: skip
        source = "--kv-tokens" if self.kv_override is not None else "a pool not counted in blocks"
        return kv, DEFAULT_SAFETY_FRACTION, (
            f"{DEFAULT_SAFETY_FRACTION:g} of {kv} tokens ({source})"
        )  # fmt: skip

    def _preemption_budget(self, budget: Budget) -> float:
        """The preemption budget of this upstream's forecast: ``--preemption-budget``, else the
        default for an engine that preempts; 0 (the exact rule), always, for one whose overflow
        fails requests."""
        wanted = self.preemption_budget
        if not budget.preempts:
            if wanted:
                logger.warning(
                    "upstream %s: --preemption-budget %g ignored: its overflow fails requests, "
                    "so it keeps the exact rule",
                    self.name, wanted,
                )  # fmt: skip
            return 0.0
        return DEFAULT_PREEMPTION_BUDGET if wanted is None else wanted

    def _caps_reason(
        self, engine: str | None, running: int | None, budget: Budget, unbounded: bool = False
    ) -> str | None:
        """Why this upstream's holders count at their whole caps under ``--admission-rule peak``,
        or None when the peak rule may run (``unbounded``: the engine runs every request it is
        sent at each step)."""
        if engine not in PROGRESS_ENGINES:
            return f"{engine or 'this engine'} does not report each stream's progress exactly"
        if budget.speculative:
            return speculative_reason()
        if not budget.block_known:
            return (
                f"{engine}'s KV block size is not known (its /metrics did not say it): the peak "
                "is counted in its blocks"
            )
        if running is None and not unbounded:
            return (
                f"how many sequences {engine} runs at once is not known: give --max-running "
                "(vLLM's --max-num-seqs)"
            )
        return None

    def endpoint(self, now: float) -> Endpoint:
        """How the router sees it now."""
        known = self.known
        if known is None:
            return Endpoint(free=0, in_service=False)
        ledger = known.ledger
        free, inflight = known.queue.room()
        full = ledger.max_concurrency is not None and inflight >= ledger.max_concurrency
        return Endpoint(
            free=-1 if full or known.queue.waiting else free,
            in_flight=inflight,
            in_service=self.health.in_service(now),
        )

    async def count(
        self,
        request: GenerationRequest,
        model: str | None,
        render: Mapping[str, Any] | None = None,
    ) -> Tokenized | None:
        """The upstream's own tokenization, or None when its /tokenize cannot give one."""
        if self.engine not in TOKENIZE_ENGINES or request.token_ids is not None:
            return None
        driver = tokenize(
            self.engine,
            prompt=request.prompt,
            messages=request.messages,
            model=model,
            tools=request.tools,
            render=render,
        )
        return await self._drive(driver)
