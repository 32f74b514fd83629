"""The clients' pure core: :class:`BaseClient` makes every decision, the shells do I/O.

A call goes: count the prompt locally, clamp ``max_tokens`` to the context window (refusing
locally a prompt that fills it), then send through one retry core (:class:`~kvclient._retry.
RetryCall`): pick the replica where the request fits best (see :mod:`kvclient._routing`), hold
while that replica cools down after a 429, send, classify the answer, and let the policy decide
whether and how long to wait. The shells, ``AsyncClient``/``AsyncStream`` in
``_async_client.py`` and ``Client``/``Stream`` generated from them in ``_sync_client.py``
(``scripts/unasync.py``), differ only in how they send, read and sleep.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import httpx

from ._accounting import effective_output_cap
from ._dialects import Answer, Discovery, Probe, classify_error, discover_context
from ._exceptions import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    InsufficientQuotaError,
    KVClientError,
    PromptTooLongError,
    ServerBusyError,
)
from ._models import Completion, CompletionChunk, RetryEvent, ToolCall, Usage
from ._pacing import DEFAULT_PACE_MAX_AGE, PACE_LAG, Pacer, parse_ratelimit
from ._retry import Cooldown, RetryCall, RetryPolicy, SendWindow, parse_retry_after
from ._routing import Endpoint, Health, pick
from ._shims import finish_generators
from ._streaming import StreamAccumulator, event_limit
from ._tokens import Message, TiktokenCounter, TokenCounter, count_chat_request
from ._version import __version__

__all__ = ["AsyncClient", "AsyncStream", "BaseClient", "Client", "Stream"]

#: LLM answers can take minutes; connecting should not.
DEFAULT_TIMEOUT: httpx.Timeout = httpx.Timeout(600.0, connect=10.0)
#: Extra share of the counted prompt assumed when clamping (0.1 = the server may count 10% more).
DEFAULT_SAFETY_MARGIN: float = 0.0
USER_AGENT = f"kvclient/{__version__}"
IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_COUNT_HEADER = "X-Retry-Count"

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
# Keys kvclient owns in a request body; passing them through **params would bypass the clamp.
_RESERVED = frozenset({"model", "prompt", "messages", "stream", "max_tokens"})
# A request always gets a little time, even when the deadline is all but spent.
_MIN_ATTEMPT_TIMEOUT = 0.001
# How often a send waiting for a window slot re-checks (the window may reopen with time).
_WINDOW_POLL = 0.1
# Immediate re-sends of a request whose pooled keep-alive connection the server had closed.
_STALE_RESENDS = 2  # per call
# The request extension carrying the time (policy clock) by which its answer must have been read.
_DEADLINE = "kvclient.deadline"
# The request extension carrying its send as the pacer counted it (see RetryCall.paced).
_PACED = "kvclient.paced"
# The request extension carrying the replica it was sent to.
_REPLICA = "kvclient.replica"


class _Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A request body that iterates without a generator.

    httpx's own body for ``content=bytes`` is an async generator; a call cancelled while
    httpcore writes it leaves that generator suspended, and trio warns when it collects it.
    This one has nothing to leave unfinished. (Content-Length stays as httpx computed it.)
    """

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __iter__(self) -> Iterator[bytes]:
        return iter((self._data,))

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _OneChunk(self._data)


class _OneChunk:
    __slots__ = ("_data",)

    def __init__(self, data: bytes | None) -> None:
        self._data = data

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data


def _stale_connection(exc: httpx.HTTPError) -> bool:
    """The peer closed the (pooled, idle) connection before any byte of the answer.

    llama.cpp advertises keep-alive but closes the connection after each streamed answer; a
    request sent on it in that instant fails this way. Nothing reached the engine and nothing
    says it is in trouble, so the request goes again at once on a fresh connection (httpcore
    drops the closed one), as Go's net/http does for a reused connection. Anything else a
    transport raises (refused, reset mid-answer, timed out) takes the retry policy's path.
    """
    return isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)


class _Bounded(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body read against a deadline (``deadline``, on ``clock``; None: unbounded).

    httpx's read timeout bounds each wait for a chunk, so a body trickled a byte at a time never
    trips it. This checks the deadline as each chunk arrives, and before the body's first read
    lowers the read timeout to the time left (httpcore takes it once per body), so one read can
    overrun the deadline by at most that. A stream moves ``deadline`` after its first event.
    """

    __slots__ = ("_clock", "_request", "_stream", "deadline", "why")

    def __init__(
        self,
        stream: Any,
        request: httpx.Request,
        clock: Callable[[], float],
        deadline: float | None,
        why: str,
    ) -> None:
        self._stream = stream
        self._request = request
        self._clock = clock
        self.deadline = deadline
        self.why = why

    def check(self) -> None:
        if self.deadline is not None and self._clock() >= self.deadline:
            raise httpx.ReadTimeout(self.why, request=self._request)

    def _tighten(self) -> None:
        timeout = self._request.extensions.get("timeout")
        if self.deadline is None or not isinstance(timeout, dict):
            return
        left = max(self.deadline - self._clock(), _MIN_ATTEMPT_TIMEOUT)
        read = timeout.get("read")
        timeout["read"] = left if read is None else min(read, left)

    def __iter__(self) -> Iterator[bytes]:
        if not isinstance(self._stream, httpx.SyncByteStream):
            raise RuntimeError("Attempted to call a sync iterator on an async stream.")
        self.check()
        self._tighten()
        for chunk in self._stream:
            self.check()
            yield chunk

    def __aiter__(self) -> AsyncIterator[bytes]:
        if not isinstance(self._stream, httpx.AsyncByteStream):
            raise RuntimeError("Attempted to call an async iterator on a sync stream.")
        self.check()
        self._tighten()
        return _AsyncBounded(self, self._stream.__aiter__())

    def close(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()

    async def aclose(self) -> None:
        if isinstance(self._stream, httpx.AsyncByteStream):
            await self._stream.aclose()


class _AsyncBounded:
    """The async iteration of :class:`_Bounded`: a plain iterator, nothing left suspended."""

    __slots__ = ("_chunks", "_owner")

    def __init__(self, owner: _Bounded, chunks: AsyncIterator[bytes]) -> None:
        self._owner = owner
        self._chunks = chunks

    def __aiter__(self) -> _AsyncBounded:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._chunks.__anext__()
        try:
            self._owner.check()
        except httpx.ReadTimeout:
            # Close the connection, then run httpx's generators under us to their end rather
            # than leave them suspended (trio warns when it collects them).
            await self._owner.aclose()
            await finish_generators(self._chunks)
            raise
        return chunk


def _unreachable(error: BaseException) -> bool:
    """The replica never answered (a connection failure or timeout before any byte) or said it
    cannot serve (502/503/504): the request may go elsewhere at once."""
    if isinstance(error, APIConnectionError):
        return error.retryable
    return (
        isinstance(error, APIStatusError)
        and error.status_code in (502, 503, 504)
        and not isinstance(error, InsufficientQuotaError)
    )


def _full(error: BaseException) -> bool:
    """A 429 that another replica may not give (not an exhausted quota)."""
    return (
        isinstance(error, APIStatusError)
        and error.status_code == 429
        and not isinstance(error, InsufficientQuotaError)
    )


def _slot_outcome(error: BaseException) -> str:
    """How a failed attempt counts for the send window: a refusal narrows it."""
    if (
        isinstance(error, APIStatusError)
        and error.status_code in (429, 503)
        and not isinstance(error, InsufficientQuotaError)
    ):
        return "refused"
    return "other"


class _Prepared:
    """One call's request, built once and reused by every attempt."""

    __slots__ = ("body", "chat", "idempotency_key", "max_tokens", "path", "prompt_tokens")

    def __init__(
        self, *, path: str, body: dict[str, Any], max_tokens: int, prompt_tokens: int, chat: bool
    ) -> None:
        self.path = path
        self.body = body
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.chat = chat
        # One key for every attempt of the call, so a server that dedupes can.
        self.idempotency_key = str(uuid.uuid4())


@functools.lru_cache(maxsize=64)
def _parsed_url(url: str) -> httpx.URL:
    """``url`` parsed once: httpx parses a str URL on every request, a third of its own cost of
    building one. (``httpx.URL`` is immutable, so one can serve every request.)"""
    return httpx.URL(url)


#: Read when ``base_url`` / ``api_key`` are not passed; the first one set wins.
BASE_URL_ENV = ("KVCLIENT_BASE_URL", "OPENAI_BASE_URL")
API_KEY_ENV = ("KVCLIENT_API_KEY", "OPENAI_API_KEY")


def _from_env(names: Sequence[str]) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _redact_url(url: str) -> str:
    """``url`` with any password in its userinfo replaced by ``[secure]`` (as httpx's repr)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _password = userinfo.partition(":")
    return f"{scheme}://{user}{':[secure]' if colon else ''}@{host}{slash}{path}"


def _normalize_base_url(base_url: str | httpx.URL) -> tuple[str, tuple[str, str] | None]:
    """The base URL without userinfo or ``/v1``, and the user and password it carried.

    The credentials leave the URL so that no error message, log line or ``RetryEvent`` can show
    them; they are sent as HTTP Basic auth, as httpx sends a URL's userinfo.
    """
    text = str(base_url).strip().rstrip("/")
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {_redact_url(text)!r}")
    credentials: tuple[str, str] | None = None
    parsed = httpx.URL(text)
    if parsed.userinfo:
        credentials = (parsed.username, parsed.password)
        text = str(parsed.copy_with(username=None, password=None)).rstrip("/")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    return text, credentials


class _Replica:
    """One server of a client: its URL and what kvclient keeps per server (cooldown, send
    window, pacing hints, health, what is in flight there)."""

    __slots__ = (
        "base_url", "context_window", "cooldown", "health", "hint_free", "hint_until", "index",
        "pacer", "quota", "requests", "sent_since", "tokens", "window",
    )  # fmt: skip

    def __init__(self, index: int, base_url: str, *, window_reset: float) -> None:
        self.index = index
        self.base_url = base_url
        self.cooldown = Cooldown()
        self.pacer = Pacer()
        self.window = SendWindow(reset=window_reset)
        self.health = Health(threshold=REPLICA_FAILURES, cooldown=REPLICA_SET_ASIDE)
        self.requests = 0  # in flight
        self.tokens = 0  # KV tokens in flight (prompt + output cap)
        # The free budget it last advertised, until when that is trusted, what went since.
        self.hint_free = 0
        self.hint_until = -math.inf
        self.sent_since = 0
        self.quota: int | None = None
        # The context window it reported (discovery; None: not asked, or it did not say).
        self.context_window: int | None = None

    def __repr__(self) -> str:
        return f"_Replica({self.base_url!r}, requests={self.requests}, tokens={self.tokens})"

    def view(self, now: float, *, in_service: bool) -> Endpoint:
        """The replica as the router sees it: the room it advertised less what went since,
        else its whole budget (or its send window) less what is in flight there."""
        free: int | None = None
        if now < self.hint_until:
            free = self.hint_free - self.sent_since
        elif self.quota is not None:
            free = self.quota - self.tokens
        elif self.window.limit != math.inf:
            free = int(self.window.limit) - self.window.in_flight
        if self.cooldown.remaining(now) > 0:
            free = min(free, 0) if free is not None else 0  # it said to wait: nothing fits now
        return Endpoint(
            free=free, in_flight=self.requests, in_service=in_service, in_flight_tokens=self.tokens
        )


class _Call(RetryCall):
    """A call with the replica its current attempt goes to, and those it already tried."""

    def __init__(self, *args: Any, replica: _Replica, pinned: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replica = replica
        # A probe of one replica's discovery stays there (no routing, no fail-over).
        self.pinned = pinned
        self.tried: set[int] = set()
        self.sending = False
        # Whether the call paces (sized, pacing on): the pacer follows the replica.
        self.paces = self.pacer is not None


def _base_urls(
    base_url: str | httpx.URL | Sequence[str | httpx.URL],
) -> tuple[list[str], tuple[str, str] | None]:
    """The replicas' normalized URLs, and the credentials they carry (the same for all)."""
    given = [base_url] if isinstance(base_url, (str, httpx.URL)) else list(base_url)
    if not given:
        raise ValueError("base_url must be a URL or a non-empty list of URLs")
    urls: list[str] = []
    found: list[tuple[str, str] | None] = []
    for url in given:
        if not isinstance(url, (str, httpx.URL)):
            raise TypeError(f"base_url entries must be str or httpx.URL, got {type(url).__name__}")
        text, credentials = _normalize_base_url(url)
        if text in urls:
            raise ValueError(f"base_url lists {_redact_url(text)!r} twice")
        urls.append(text)
        found.append(credentials)
    if any(c != found[0] for c in found):
        raise ValueError("the base_url replicas carry different credentials; pass api_key= instead")
    return urls, found[0]


#: A replica that failed this many sends in a row (a connection refused: at once) is set aside
#: for this many seconds; then one request probes it.
REPLICA_FAILURES = 3
REPLICA_SET_ASIDE = 2.0


class BaseClient:
    """Everything a client decides without I/O: URLs, headers, bodies, clamping, errors.

    ``base_url`` and ``api_key`` not passed are read from ``KVCLIENT_BASE_URL`` /
    ``OPENAI_BASE_URL`` and ``KVCLIENT_API_KEY`` / ``OPENAI_API_KEY`` (the first set wins).

    ``base_url`` may list several replicas of one model: each has its own cooldown, send window,
    pacing hints and health, and each request goes where its reservation fits best (see
    :mod:`kvclient._routing`); discovery asks each replica for its context window and clamps to
    the smallest.
    """

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | Sequence[str | httpx.URL] | None = None,
        model: str | None = None,
        context_window: int | None = None,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        on_retry: Callable[[RetryEvent], None] | None = None,
        safety_margin_tokens: int = 0,
    ) -> None:
        if context_window is not None and (
            isinstance(context_window, bool)
            or not isinstance(context_window, int)
            or context_window < 1
        ):
            raise ValueError(f"context_window must be a positive integer, got {context_window!r}")
        # Above 1.0 is allowed: cl100k undercounts some models' digits and whitespace 3-5x.
        if not (
            isinstance(safety_margin, (int, float))
            and not isinstance(safety_margin, bool)
            and 0 <= safety_margin < math.inf
        ):
            raise ValueError(f"safety_margin must be a finite number >= 0, got {safety_margin!r}")
        if (
            isinstance(safety_margin_tokens, bool)
            or not isinstance(safety_margin_tokens, int)
            or safety_margin_tokens < 0
        ):
            raise ValueError(
                f"safety_margin_tokens must be an integer >= 0, got {safety_margin_tokens!r}"
            )
        if base_url is None:
            base_url = _from_env(BASE_URL_ENV)
            if base_url is None:
                raise ValueError(f"pass base_url= or set {' or '.join(BASE_URL_ENV)}")
        if api_key is None:
            api_key = _from_env(API_KEY_ENV)
        self.retry = retry if retry is not None else RetryPolicy()
        urls, self._credentials = _base_urls(base_url)
        self._replicas = tuple(
            _Replica(i, url, window_reset=self.retry.window_reset) for i, url in enumerate(urls)
        )
        self._replica_lock = threading.Lock()
        self.model = model
        self.context_window = context_window
        self.api_key = api_key
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.timeout = timeout
        self.safety_margin = float(safety_margin)
        self.safety_margin_tokens = safety_margin_tokens
        self.on_retry = on_retry
        self._extra_headers = dict(headers or {})
        # The first replica's (the only one's, usually): what single-server code looks at.
        first = self._replicas[0]
        self._cooldown = first.cooldown
        self._pacer = first.pacer
        self._window = first.window
        self._base_timeout = httpx.Timeout(timeout)
        # Built once: the headers every request carries (none left once an httpx client kvclient
        # creates has taken them as its defaults: see _take_constant_headers).
        self._base_headers = self._constant_headers()

    @property
    def base_url(self) -> str:
        """The (first) replica's base URL, without ``/v1``."""
        return self._replicas[0].base_url

    @base_url.setter
    def base_url(self, value: str) -> None:
        self._replicas[0].base_url = value

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Every replica's base URL, in the order given."""
        return tuple(r.base_url for r in self._replicas)

    # --- replicas ----------------------------------------------------------------------------

    def _replica_of(self, call: RetryCall) -> _Replica:
        return call.replica if isinstance(call, _Call) else self._replicas[0]

    def _window_of(self, call: RetryCall) -> SendWindow:
        return self._replica_of(call).window

    def _route(self, call: RetryCall, *, again: bool = False) -> None:
        """Send ``call``'s next try where its reservation fits best among the replicas in
        service that it has not tried in this attempt (``again``: a fail-over within it; else
        a new attempt, which may go anywhere) (see :func:`kvclient._routing.pick`); its
        cooldown and pacing become that replica's."""
        replicas = self._replicas
        if len(replicas) == 1 or not isinstance(call, _Call) or call.pinned:
            return
        if not again:
            call.tried.clear()
        now = self.retry.clock()
        with self._replica_lock:
            views = [
                r.view(now, in_service=r.index not in call.tried and r.health.in_service(now))
                for r in replicas
            ]
            index = pick(views, call.size)
            if index is None:  # every untried replica is set aside: try one anyway
                untried = [r for r in replicas if r.index not in call.tried] or list(replicas)
                index = min(untried, key=lambda r: (r.health.out_until or 0.0, r.index)).index
        replica = replicas[index]
        call.replica = replica
        call.cooldown = replica.cooldown
        call.pacer = replica.pacer if call.paces else None

    def _sending(self, call: RetryCall) -> None:
        """``call`` goes to its replica now: count it in flight there."""
        if len(self._replicas) == 1 or not isinstance(call, _Call):
            return
        replica = call.replica
        with self._replica_lock:
            replica.requests += 1
            replica.tokens += call.size
            replica.sent_since += call.size
            replica.health.begin(self.retry.clock())
        call.tried.add(replica.index)
        call.sending = True

    def _answered(self, call: RetryCall) -> None:
        """``call``'s replica answered (a stream: its first event came)."""
        if isinstance(call, _Call) and len(self._replicas) > 1:
            with self._replica_lock:
                call.replica.health.succeeded()

    def _released(self, outcome: str, call: RetryCall) -> bool:
        """``call``'s send ended (``outcome`` as :meth:`SendWindow.release` takes it): no longer
        in flight. True when the send window changed (waiting sends should look again)."""
        if isinstance(call, _Call) and call.sending:
            call.sending = False
            replica = call.replica
            with self._replica_lock:
                replica.requests -= 1
                replica.tokens -= call.size
        if not self.retry.window:
            return False
        self._window_of(call).release(outcome, self.retry.clock(), call.size)
        return True

    def _fail_over(self, call: RetryCall, error: BaseException) -> bool:
        """After a failed send: note it in the replica's health; True when the call goes again
        at once to another replica: the replica never answered, answered 502/503/504, or is
        full (429), and another one in service (and, after a 429, not cooling down) has not
        been tried in this attempt. Not a retry: the attempt count stays."""
        if len(self._replicas) == 1 or not isinstance(call, _Call):
            return False
        now = self.retry.clock()
        replica = call.replica
        down = _unreachable(error)
        full = _full(error)
        with self._replica_lock:
            if down:
                refused = isinstance(error, APIConnectionError) and not isinstance(
                    error, APITimeoutError
                )
                replica.health.failed(now, at_once=refused)
            elif isinstance(error, APIStatusError):
                replica.health.succeeded()  # it answered: a 429 or a 400 says nothing against it
            else:
                replica.health.abandoned()  # cancelled or a bad answer: no verdict
            if not (down or full) or call.pinned or call.time_left() <= 0:
                return False
            others = [
                r
                for r in self._replicas
                if r.index not in call.tried
                and r.health.in_service(now)
                and not (full and r.cooldown.remaining(now) > 0)
            ]
            if not others:
                return False
        if full and isinstance(error, APIStatusError) and error.retry_after:
            # What the retry policy would have done with the 429: that replica cools down.
            size = call.size if self.retry.cooldown_by_size else None
            replica.cooldown.extend(now, error.retry_after, size)
        return True

    # --- requests ----------------------------------------------------------------------------

    def _url(self, path: str) -> httpx.URL:
        return _parsed_url(self.base_url + path)

    def _constant_headers(self) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self._credentials is not None:
            # What httpx sends for a URL's userinfo (it then wins over the API key too).
            token = base64.b64encode(":".join(self._credentials).encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        headers.update(self._extra_headers)
        return headers

    def _take_constant_headers(self) -> dict[str, str]:
        """The constant headers, handed to an httpx client that kvclient creates as its defaults.

        httpx merges a request's headers into its client's one by one, on every request; as the
        client's defaults they are merged once. The wire carries the same headers either way.
        """
        headers, self._base_headers = self._base_headers, {}
        return headers

    @staticmethod
    def _set_attempt_headers(
        request: httpx.Request, prepared: _Prepared | None, attempt: int
    ) -> None:
        """Set the headers of this call and attempt on a built request (replacing any namesake).

        Set one by one rather than passed to ``build_request``, which merges them into its
        client's headers at a cost of microseconds a header.
        """
        headers = request.headers
        if prepared is not None:
            headers[IDEMPOTENCY_HEADER] = prepared.idempotency_key
            headers["Content-Type"] = "application/json"
            if prepared.body.get("stream"):
                headers["Accept"] = "text/event-stream"
        headers[RETRY_COUNT_HEADER] = str(attempt - 1)

    def _build_request(
        self, http: httpx.Client | httpx.AsyncClient, prepared: _Prepared, call: RetryCall
    ) -> httpx.Request:
        request = http.build_request(
            "POST",
            _parsed_url(self._replica_of(call).base_url + prepared.path),
            content=json.dumps(prepared.body).encode(),
            headers=self._base_headers,
            extensions=self._attempt_extensions(call),
        )
        self._set_attempt_headers(request, prepared, call.attempts)
        request.stream = _Body(request.content)
        return request

    def _attempt_extensions(self, call: RetryCall) -> dict[str, Any]:
        """httpx's request extensions: the configured timeouts, none longer than the time left
        before the call's deadline.

        For a stream the read timeout bounds each wait for the next chunk, not the whole stream.
        Given as the ``timeout`` extension, they skip the ``httpx.Timeout`` that httpx would
        build and take apart again on every request.
        """
        base = self._base_timeout
        left = max(call.time_left(), _MIN_ATTEMPT_TIMEOUT)

        def cap(value: float | None) -> float:
            return left if value is None else min(value, left)

        timeout = {
            "connect": cap(base.connect),
            "read": cap(base.read),
            "write": cap(base.write),
            "pool": cap(base.pool),
        }
        return {
            "timeout": timeout,
            _DEADLINE: call.started + self.retry.deadline,
            _PACED: call.paced,
            _REPLICA: self._replica_of(call),
        }

    def _note_room(self, response: httpx.Response) -> None:
        """Note the room ``response`` advertises, if any (see :class:`kvclient._pacing.Pacer`),
        for its replica's pacing and for routing."""
        several = len(self._replicas) > 1
        if not (self.retry.pace or several):
            return
        hint = parse_ratelimit(response.headers)
        if hint is None:
            return
        extensions = response.request.extensions
        replica = extensions.get(_REPLICA)
        if not isinstance(replica, _Replica):
            replica = self._replicas[0]
        now = self.retry.clock()
        if self.retry.pace:
            refused = response.status_code == 429  # its round trip times the way in
            replica.pacer.observe(now, hint, extensions.get(_PACED), refused=refused)
        if several:
            with self._replica_lock:
                replica.hint_free = hint.remaining
                replica.hint_until = now + min(
                    DEFAULT_PACE_MAX_AGE, (hint.reset or math.inf) + PACE_LAG
                )
                replica.sent_since = 0
                if hint.quota is not None:
                    replica.quota = hint.quota

    def _bound(self, response: httpx.Response) -> None:
        """Read ``response``'s body against its call's deadline (see :class:`_Bounded`); note
        the room it advertises, if any."""
        self._note_room(response)
        deadline = response.request.extensions.get(_DEADLINE)
        if isinstance(deadline, (int, float)):  # an injected clock may count in integers
            why = f"the call's {self.retry.deadline:g}s deadline passed while reading the answer"
            response.stream = _Bounded(
                response.stream, response.request, self.retry.clock, float(deadline), why
            )

    def _probe_request(
        self, http: httpx.Client | httpx.AsyncClient, probe: Probe, call: RetryCall
    ) -> httpx.Request:
        request = http.build_request(
            probe.method,
            _parsed_url(self._replica_of(call).base_url + probe.path),
            json=probe.json,
            headers=self._base_headers,
            extensions=self._attempt_extensions(call),
        )
        self._set_attempt_headers(request, None, call.attempts)
        return request

    def _needs_discovery(self) -> bool:
        return self.context_window is None or self.model is None

    def _discovery(self) -> Generator[Probe, Answer, Discovery]:
        return discover_context(self.model, need_window=self.context_window is None)

    @staticmethod
    def _probe_answer(response: httpx.Response | None, error: KVClientError | None) -> Answer:
        """A probe's outcome as the discovery driver takes it: another engine's 404 (or any
        answer a retry could not fix) is an answer; unauthorised and unreachable are errors."""
        if error is not None:
            if not isinstance(error, APIStatusError) or error.status_code in (401, 403):
                raise error
            return Answer(error.status_code or 0)
        assert response is not None
        try:
            payload = json.loads(response.content)
        except ValueError:
            payload = None
        return Answer(response.status_code, payload)

    def _probe_call(self, replica: _Replica | None) -> RetryCall:
        """A discovery probe's call: routed as any request (``replica`` None), or pinned to one
        replica and tried once (a replica that does not answer is asked no further)."""
        if replica is None:
            return self._new_call()
        once = dataclasses.replace(self.retry, max_attempts=1)
        return _Call(once, replica.cooldown, on_retry=self.on_retry, replica=replica, pinned=True)

    def _discovered_enough(self) -> bool:
        """Several replicas: with the window given, one that names the model is enough;
        otherwise every replica is asked for its window."""
        return self.context_window is not None and self.model is not None

    def _adopt_replica_discovery(self, replica: _Replica, found: Discovery | KVClientError) -> None:
        """One replica's discovery: its window, and the model (the first one found: the later
        replicas are asked for that one)."""
        if isinstance(found, Discovery) and found.problem is None:
            if self.model is None and found.model is not None:
                self.model = found.model
            replica.context_window = found.context_window

    def _adopt_discoveries(self, found: Sequence[Discovery | KVClientError]) -> bool:
        """The replicas' discoveries: the model, and the smallest window any replica reported
        (a request clamped to it fits wherever it goes). False when no replica answered: then
        discovery runs as a request would (routed, retried)."""
        answers = [f for f in found if isinstance(f, Discovery)]
        if not answers:
            return False
        windows = [r.context_window for r in self._replicas if r.context_window is not None]
        if self.model is not None and (self.context_window is not None or windows):
            if self.context_window is None:
                self.context_window = min(windows)
            return True
        self._adopt_discovery(answers[0])  # raises what the first answer says is missing
        return True

    def _adopt_discovery(self, found: Discovery) -> None:
        """Take the model (if unset) and the context window (if unset) that discovery found."""
        if found.problem is not None:
            if self.context_window is not None and self.model is not None:
                return
            raise KVClientError(
                f"{self.base_url}: {found.problem}; pass model= and context_window= to skip "
                "discovery"
            )
        if self.model is None:
            if found.model is None:
                raise KVClientError(
                    f"{self.base_url}: no model discovered ({'; '.join(found.tried)}); pass model="
                )
            self.model = found.model
        if self.context_window is None:
            if found.context_window is None:
                raise KVClientError(f"{self.base_url}: {found.explain()}")
            self.context_window = found.context_window

    def _check_params(self, params: Mapping[str, Any]) -> None:
        bad = sorted(_RESERVED.intersection(params))
        if bad:
            raise TypeError(f"kvclient sets {', '.join(bad)} itself; do not pass them in **params")

    def _clamp(self, requested: int | None, counted: int) -> int:
        window = self.context_window
        assert window is not None, "context window must be known before clamping"
        # The counter may count fewer tokens than the server will: assume the margins on top
        # (the additive one covers what no ratio does, like the BOS of an empty prompt).
        assumed = math.ceil(counted * (1.0 + self.safety_margin)) + self.safety_margin_tokens
        cap = effective_output_cap(requested, assumed, window)
        if cap is None:
            margin = f" (counted {counted}, {assumed} with the safety margins)" * (
                assumed != counted
            )
            raise PromptTooLongError(
                f"prompt of {counted} tokens{margin} leaves no room for output in the context "
                f"window of {window} tokens; nothing was sent",
                prompt_tokens=counted,
                context_window=window,
            )
        return cap

    def _prepare_completion(
        self, prompt: str, max_tokens: int | None, params: dict[str, Any], *, stream: bool
    ) -> _Prepared:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        self._check_params(params)
        counted = self.counter.count(prompt)
        cap = self._clamp(max_tokens, counted)
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, **params, "max_tokens": cap}
        self._stream_options(body, stream)
        return _Prepared(
            path=_COMPLETIONS, body=body, max_tokens=cap, prompt_tokens=counted, chat=False
        )

    def _prepare_chat(
        self,
        messages: Sequence[Message],
        max_tokens: int | None,
        params: dict[str, Any],
        *,
        stream: bool,
    ) -> _Prepared:
        self._check_params(params)
        if max_tokens is None and "max_completion_tokens" in params:
            max_tokens = params.pop("max_completion_tokens")
        else:
            params.pop("max_completion_tokens", None)
        counted = count_chat_request(self.counter, messages, params.get("tools"))
        cap = self._clamp(max_tokens, counted)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(message) for message in messages],
            **params,
            "max_tokens": cap,
        }
        self._stream_options(body, stream)
        return _Prepared(path=_CHAT, body=body, max_tokens=cap, prompt_tokens=counted, chat=True)

    @staticmethod
    def _stream_options(body: dict[str, Any], stream: bool) -> None:
        if stream:
            body["stream"] = True
            # Usage arrives in a last chunk only when asked for.
            body.setdefault("stream_options", {"include_usage": True})

    # --- answers -----------------------------------------------------------------------------

    def _status_error(self, response: httpx.Response) -> KVClientError:
        """The one factory from an error answer to an exception."""
        verdict = classify_error(response.status_code, response.content)
        details = verdict.details
        where = f"{response.request.method} {response.request.url.path}"
        message = f"{where} -> {response.status_code}: {details.message}"
        if verdict.exception is PromptTooLongError:
            return PromptTooLongError(
                f"server refused the prompt as too long for the context: {message}",
                prompt_tokens=details.prompt_tokens,
                context_window=details.context_window,
                response=response,
                body=details.body,
                code=details.code,
            )
        assert issubclass(verdict.exception, APIStatusError)
        return verdict.exception(
            message,
            response=response,
            body=details.body,
            code=details.code,
            error_type=details.error_type,
            retry_after=parse_retry_after(response.headers, now=self.retry.wall_clock()),
            retryable=verdict.retryable,
        )

    @staticmethod
    def _transport_error(
        exc: httpx.HTTPError, request: httpx.Request | None, *, answered: bool
    ) -> APIConnectionError:
        """A transport failure; retryable only when no answer had started to arrive."""
        target = (
            f"{request.method} {_redact_url(str(request.url))}"
            if request is not None
            else "request"
        )
        when = "while reading the answer" if answered else "before any answer"
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # A wrong URL scheme is not a network accident: no retry can fix it.
        retryable = not answered and not isinstance(exc, httpx.UnsupportedProtocol)
        if isinstance(exc, httpx.TimeoutException):
            return APITimeoutError(
                f"{target} timed out {when} ({detail})", request=request, retryable=retryable
            )
        return APIConnectionError(
            f"{target} failed {when} ({detail})", request=request, retryable=retryable
        )

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        try:
            payload = json.loads(response.content)
        except ValueError:
            snippet = response.content[:200].decode("utf-8", "replace")
            raise APIResponseError(
                f"{response.request.method} {response.request.url.path} answered "
                f"{response.status_code} with a body that is not JSON: {snippet!r}",
                response=response,
            ) from None
        if not isinstance(payload, dict):
            raise APIResponseError(
                f"{response.request.url.path} answered JSON that is not an object",
                response=response,
            )
        return payload

    @staticmethod
    def _completion(payload: dict[str, Any], prepared: _Prepared, call: RetryCall) -> Completion:
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise APIResponseError(f"answer has no choices: {json.dumps(payload)[:200]}")
        choice = choices[0]
        message: dict[str, Any] | None = None
        if prepared.chat:
            raw_message = choice.get("message")
            message = raw_message if isinstance(raw_message, dict) else {}
            text = message.get("content")
        else:
            text = choice.get("text")
        finish = choice.get("finish_reason")
        model = payload.get("model")
        ident = payload.get("id")
        return Completion(
            text=text if isinstance(text, str) else "",
            finish_reason=finish if isinstance(finish, str) else None,
            usage=Usage.from_json(payload.get("usage")),
            max_tokens=prepared.max_tokens,
            prompt_tokens=prepared.prompt_tokens,
            attempts=call.attempts,
            retry_wait=call.waited,
            history=tuple(call.history),
            model=model if isinstance(model, str) else None,
            id=ident if isinstance(ident, str) else None,
            raw=payload,
            message=message,
            tool_calls=ToolCall.from_message(message),
        )

    def _new_call(self, prepared: _Prepared | None = None) -> RetryCall:
        size = None if prepared is None else prepared.prompt_tokens + prepared.max_tokens
        first = self._replicas[0]
        call = _Call(
            self.retry,
            first.cooldown,
            size=size,
            on_retry=self.on_retry,
            pacer=first.pacer,
            replica=first,
        )
        call.hold_refusals = len(self._replicas) == 1  # several: route the retry afresh
        return call

    def _window_busy(self, call: RetryCall) -> ServerBusyError:
        window = self._window_of(call)
        return ServerBusyError(
            f"the server refused requests and this client already has "
            f"{window.requests} in flight ({window.in_flight} KV tokens, window "
            f"{window.limit:.0f}); no room freed before the {self.retry.deadline:g}s "
            f"deadline",
            retry_after=call.cooldown.advice,
            attempts=call.attempts,
        )

    @staticmethod
    def _stuck(call: RetryCall) -> ServerBusyError:
        return ServerBusyError(
            "the cooldown never ended: the injected clock does not advance while sleeping",
            retry_after=call.cooldown.advice,
            attempts=call.attempts,
        )


class _StreamBase:
    """The pure half of a stream: events in, chunks out, the aggregated completion at the end.

    Time: the call's deadline bounds the stream up to its first event (comments such as
    ``: ping`` do not count); after it, each next event must come within the read timeout.
    """

    _client: Client | AsyncClient

    def __init__(self, prepared: _Prepared | None, *, chat: bool) -> None:
        self._prepared_value = prepared
        self._acc = StreamAccumulator(chat=chat)
        self._pending: deque[CompletionChunk] = deque()
        self._call: RetryCall | None = None
        self._completion: Completion | None = None
        # True while this stream holds one of its client's send-window slots.
        self._holds_slot = False
        # The body's deadline, moved after each event (see _wait_for_event).
        self._bounded: _Bounded | None = None

    def _max_events(self) -> int:
        """How many events this stream may send (see :func:`~kvclient._streaming.event_limit`)."""
        prepared = self._prepared
        n = prepared.body.get("n")
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        return event_limit(prepared.max_tokens, choices)

    def _opened(self, response: httpx.Response) -> None:
        stream = response.stream
        self._bounded = stream if isinstance(stream, _Bounded) else None
        self._holds_slot = True

    def _wait_for_event(self) -> None:
        """Before waiting for the next event: it must come within the read timeout."""
        bounded = self._bounded
        if bounded is None:
            return
        read = self._client._base_timeout.read
        bounded.deadline = None if read is None else self._client.retry.clock() + read
        bounded.why = f"no stream event within the read timeout of {read}s"

    def _give_back_slot(self) -> None:
        if self._holds_slot and self._call is not None:
            self._holds_slot = False
            self._client._release_slot("ok", self._call)

    def _feed(self, payload: dict[str, Any] | None) -> None:
        if payload is None:
            self._end(saw_done=True)
        else:
            self._pending.extend(self._acc.feed(payload))

    @property
    def _prepared(self) -> _Prepared:
        prepared = self._prepared_value
        if prepared is None:
            raise RuntimeError("the stream is not open yet: use it in a `with` block or iterate")
        return prepared

    def _end(self, *, saw_done: bool) -> None:
        call = self._call
        assert call is not None
        self._acc.end(saw_done=saw_done)
        self._completion = self._acc.completion(
            max_tokens=self._prepared.max_tokens,
            prompt_tokens=self._prepared.prompt_tokens,
            attempts=call.attempts,
            retry_wait=call.waited,
            history=tuple(call.history),
        )

    def _broken(self, exc: httpx.HTTPError, request: httpx.Request | None) -> APIConnectionError:
        error = BaseClient._transport_error(exc, request, answered=True)
        error.message = (
            f"{error.message}; the stream broke after {self._acc.events} events and is not "
            "retried because output was already delivered"
        )
        error.args = (error.message,)
        return error

    @property
    def max_tokens(self) -> int:
        """The ``max_tokens`` sent."""
        return self._prepared.max_tokens

    @property
    def completion(self) -> Completion:
        """The whole answer, once the stream has been read to its end."""
        if self._completion is None:
            raise RuntimeError("the stream is not finished: iterate it to the end first")
        return self._completion


# The shells, importable from here as before (they import the core above).
from ._async_client import AsyncClient, AsyncStream  # noqa: E402
from ._sync_client import Client, Stream  # noqa: E402
