"""The clients: :class:`BaseClient` makes every decision, ``Client`` and ``AsyncClient`` do I/O.

A call goes: count the prompt locally, clamp ``max_tokens`` to the context window (refusing
locally a prompt that fills it), then send through one retry core (:class:`~kvclient._retry.
RetryCall`): hold while the client cools down after a 429, send, classify the answer, and let the
policy decide whether and how long to wait. The sync and async shells differ only in how they
send, read and sleep.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, TypeVar

import anyio
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
from ._pacing import Pacer, parse_ratelimit
from ._retry import Cooldown, RetryCall, RetryPolicy, SendWindow, parse_retry_after
from ._streaming import (
    AsyncLines,
    StreamAccumulator,
    aiter_events,
    event_limit,
    iter_events,
    iter_lines,
)
from ._tokens import Message, TiktokenCounter, TokenCounter, count_chat_request
from ._version import __version__

__all__ = ["AsyncClient", "AsyncStream", "BaseClient", "Client", "Stream"]

T = TypeVar("T")

#: LLM answers can take minutes; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
#: Extra share of the counted prompt assumed when clamping (0.1 = the server may count 10% more).
DEFAULT_SAFETY_MARGIN = 0.0
USER_AGENT = f"kvclient/{__version__}"
IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_COUNT_HEADER = "X-Retry-Count"

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
# Keys kvclient owns in a request body; passing them through **params would bypass the clamp.
_RESERVED = frozenset({"model", "prompt", "messages", "stream", "max_tokens"})
# A request always gets a little time, even when the deadline is all but spent.
_MIN_ATTEMPT_TIMEOUT = 0.001
# Bounds on finishing an abandoned async stream (see _finish_generators).
_DRAIN_EVENTS = 10_000
_DRAIN_SECONDS = 1.0
# How often a send waiting for a window slot re-checks (the window may reopen with time).
_WINDOW_POLL = 0.1
# Immediate re-sends of a request whose pooled keep-alive connection the server had closed.
_STALE_RESENDS = 2  # per call
# The request extension carrying the time (policy clock) by which its answer must have been read.
_DEADLINE = "kvclient.deadline"
# The request extension carrying its send as the pacer counted it (see RetryCall.paced).
_PACED = "kvclient.paced"


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
            await _finish_generators(self._chunks)
            raise
        return chunk


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


class BaseClient:
    """Everything a client decides without I/O: URLs, headers, bodies, clamping, errors.

    ``base_url`` and ``api_key`` not passed are read from ``KVCLIENT_BASE_URL`` /
    ``OPENAI_BASE_URL`` and ``KVCLIENT_API_KEY`` / ``OPENAI_API_KEY`` (the first set wins).
    """

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | None = None,
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
        self.base_url, self._credentials = _normalize_base_url(base_url)
        self.model = model
        self.context_window = context_window
        self.api_key = api_key
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.retry = retry if retry is not None else RetryPolicy()
        self.timeout = timeout
        self.safety_margin = float(safety_margin)
        self.safety_margin_tokens = safety_margin_tokens
        self.on_retry = on_retry
        self._extra_headers = dict(headers or {})
        self._cooldown = Cooldown()
        self._pacer = Pacer()
        self._window = SendWindow(reset=self.retry.window_reset)
        self._base_timeout = httpx.Timeout(timeout)
        # Built once: the headers every request carries (none left once an httpx client kvclient
        # creates has taken them as its defaults: see _take_constant_headers).
        self._base_headers = self._constant_headers()

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
            self._url(prepared.path),
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
        }

    def _note_room(self, response: httpx.Response) -> None:
        """Note the room ``response`` advertises, if any (see :class:`kvclient._pacing.Pacer`)."""
        if self.retry.pace and (hint := parse_ratelimit(response.headers)) is not None:
            own = response.request.extensions.get(_PACED)
            self._pacer.observe(self.retry.clock(), hint, own)

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
            self._url(probe.path),
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
        return RetryCall(
            self.retry, self._cooldown, size=size, on_retry=self.on_retry, pacer=self._pacer
        )

    def _window_busy(self, call: RetryCall) -> ServerBusyError:
        return ServerBusyError(
            f"the server refused requests and this client already has "
            f"{self._window.requests} in flight ({self._window.in_flight} KV tokens, window "
            f"{self._window.limit:.0f}); no room freed before the {self.retry.deadline:g}s "
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


class Stream(_StreamBase):
    """A streamed answer: ``with client.chat_stream(...) as stream: for chunk in stream: ...``.

    Opening it sends the request and waits for the first event, retrying as a plain call would;
    once an event arrived nothing is retried.
    """

    _client: Client

    def __init__(self, client: Client, prepared: _Prepared) -> None:
        super().__init__(prepared, chat=prepared.chat)
        self._client = client
        self._response: httpx.Response | None = None
        self._events: Any = None

    def __enter__(self) -> Stream:
        self._open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open(self) -> None:
        if self._call is not None:
            return
        client = self._client
        self._call = client._new_call(self._prepared)

        def attempt(call: RetryCall) -> tuple[httpx.Response, Any, dict[str, Any] | None]:
            response = client._send(self._prepared, call, stream=True)
            lines = iter_lines(response.iter_bytes())
            events = iter_events(lines, max_events=self._max_events())
            try:
                first = next(events)
            except StopIteration:
                response.close()
                raise APIResponseError(
                    "the stream ended before its first event", response=response
                ) from None
            except httpx.HTTPError as exc:
                response.close()
                # No event yet: nothing delivered, so this is as retryable as a refused connection.
                raise client._transport_error(exc, response.request, answered=False) from exc
            except BaseException:
                response.close()
                raise
            return response, events, first

        self._response, self._events, first = client._run(self._call, attempt, keep_slot=True)
        self._opened(self._response)
        self._feed(first)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> CompletionChunk:
        self._open()
        while not self._pending:
            if self._acc.done:
                self.close()
                raise StopIteration
            self._wait_for_event()
            try:
                payload = next(self._events)
            except StopIteration:
                self.close()
                self._end(saw_done=False)
                continue
            except httpx.HTTPError as exc:
                self.close()
                raise self._broken(exc, self._response.request if self._response else None) from exc
            except BaseException:
                self.close()
                raise
            self._feed(payload)
        return self._pending.popleft()

    def close(self) -> None:
        try:
            if self._response is not None:
                self._response.close()
            if self._events is not None:
                self._events.close()
        finally:
            self._give_back_slot()

    def __del__(self) -> None:
        # Dropped unclosed (``for chunk in client.chat_stream(...): break``): give the window
        # its room back and the connection its pool.
        if getattr(self, "_holds_slot", False):
            with contextlib.suppress(Exception):
                self.close()


async def _finish_generators(events: Any) -> None:
    """Run the generator chain under an abandoned stream to its end, the connection closed.

    httpx reads a stream through nested async generators; aclose() on ours leaves the inner ones
    suspended, and trio warns when it collects an unfinished one. With the response closed,
    resuming them ends at once (buffered lines, then the closed stream), so they finish cleanly.
    """
    with anyio.move_on_after(_DRAIN_SECONDS):
        try:
            for _ in range(_DRAIN_EVENTS):
                await events.__anext__()
        except Exception:  # StopAsyncIteration, the closed stream's error, a bad last event
            return


async def _close_chain(response: httpx.Response, events: Any, lines: Any) -> None:
    """Close a streamed response and finish both generators reading it (ours, then httpx's)."""
    try:
        await response.aclose()
        for generator in (events, lines):
            if generator is not None:
                await _finish_generators(generator)
    finally:
        for generator in (events, lines):
            if generator is not None:
                await generator.aclose()


class AsyncStream(_StreamBase):
    """Async :class:`Stream`: ``async with`` and ``async for``."""

    _client: AsyncClient

    def __init__(
        self, client: AsyncClient, prepare: Callable[[], Awaitable[_Prepared]], *, chat: bool
    ) -> None:
        super().__init__(None, chat=chat)
        self._prepare = prepare
        self._client = client
        self._response: httpx.Response | None = None
        self._events: Any = None
        # httpx's byte iterator under our line and event parsers: when the parser ends on an
        # error (a server's error event), the iterator is left suspended and must be finished.
        self._lines: Any = None

    async def __aenter__(self) -> AsyncStream:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _open(self) -> None:
        if self._call is not None:
            return
        client = self._client
        if self._prepared_value is None:
            # Discovery and counting happen here, so `async with client.chat_stream(...)` works.
            self._prepared_value = await self._prepare()
        self._call = client._new_call(self._prepared_value)

        async def attempt(
            call: RetryCall,
        ) -> tuple[httpx.Response, Any, Any, dict[str, Any] | None]:
            response = await client._send(self._prepared, call, stream=True)
            lines = response.aiter_bytes()
            events = aiter_events(AsyncLines(lines), max_events=self._max_events())
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                await _close_chain(response, events, lines)
                raise APIResponseError(
                    "the stream ended before its first event", response=response
                ) from None
            except httpx.HTTPError as exc:
                await _close_chain(response, events, lines)
                raise client._transport_error(exc, response.request, answered=False) from exc
            except BaseException:
                await _close_chain(response, events, lines)
                raise
            return response, events, lines, first

        opened = await client._run(self._call, attempt, keep_slot=True)
        self._response, self._events, self._lines, first = opened
        self._opened(self._response)
        self._feed(first)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> CompletionChunk:
        await self._open()
        while not self._pending:
            if self._acc.done:
                await self.aclose()
                raise StopAsyncIteration
            self._wait_for_event()
            try:
                payload = await self._events.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                self._end(saw_done=False)
                continue
            except httpx.HTTPError as exc:
                await self.aclose()
                raise self._broken(exc, self._response.request if self._response else None) from exc
            except BaseException:
                await self.aclose()
                raise
            self._feed(payload)
        return self._pending.popleft()

    async def aclose(self) -> None:
        events, self._events = self._events, None
        lines, self._lines = self._lines, None
        try:
            if self._response is not None:
                await _close_chain(self._response, events, lines)
        finally:
            self._give_back_slot()

    def __del__(self) -> None:
        # Dropped unclosed (``async for chunk in client.chat_stream(...): break``): nothing can
        # be awaited here, but the window gets its room back at once.
        if getattr(self, "_holds_slot", False):
            with contextlib.suppress(Exception):
                self._give_back_slot()


class Client(BaseClient):
    """Synchronous client. Thread-safe: share one per server so its cooldown is shared.

    >>> with Client(base_url="http://127.0.0.1:8000", model="m", context_window=8192) as c:
    ...     c.complete("Say hi", max_tokens=16).text  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | None = None,
        model: str | None = None,
        context_window: int | None = None,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.BaseTransport | None = None,
        safety_margin_tokens: int = 0,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            model=model,
            context_window=context_window,
            api_key=api_key,
            counter=counter,
            retry=retry,
            timeout=timeout,
            headers=headers,
            safety_margin=safety_margin,
            on_retry=on_retry,
            safety_margin_tokens=safety_margin_tokens,
        )
        if http_client is not None and transport is not None:
            raise ValueError("pass transport= or http_client=, not both")
        self._owns_http = http_client is None
        if http_client is None:
            http_client = httpx.Client(
                transport=transport, timeout=timeout, headers=self._take_constant_headers()
            )
        self._http = http_client
        self._discovery_lock = threading.Lock()
        self._window_changed = threading.Condition()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (not those of an ``http_client`` passed in)."""
        if self._owns_http:
            self._http.close()

    # --- I/O ---------------------------------------------------------------------------------

    def _hold(self, call: RetryCall) -> None:
        for _ in call.hold_rounds():
            wait = call.hold_time()
            if wait <= 0:
                return
            self.retry.sleep(wait)
            call.held(wait)
        raise self._stuck(call)

    def _acquire_slot(self, call: RetryCall) -> None:
        clock = self.retry.clock
        size = call.size
        if not self.retry.window or self._window.try_acquire(clock(), size):
            return
        started = time.monotonic()
        with self._window_changed:
            while not self._window.try_acquire(clock(), size):
                left = call.time_left()
                if left <= 0:
                    raise self._window_busy(call)
                self._window_changed.wait(timeout=min(left, _WINDOW_POLL))
        call.held(time.monotonic() - started)

    def _release_slot(self, outcome: str, call: RetryCall) -> None:
        if not self.retry.window:
            return
        with self._window_changed:
            self._window.release(outcome, self.retry.clock(), call.size)
            self._window_changed.notify_all()

    def _attempt(self, call: RetryCall, attempt: Callable[[RetryCall], T], keep_slot: bool) -> T:
        """One attempt: hold out the cooldown, take a send-window slot (kept past success when
        ``keep_slot``: a stream gives it back when it closes), send."""
        self._hold(call)
        self._acquire_slot(call)
        call.begin_attempt()
        try:
            result = attempt(call)
        except BaseException as exc:
            self._release_slot(_slot_outcome(exc), call)
            raise
        if not keep_slot:
            self._release_slot("ok", call)
        return result

    def _run(
        self, call: RetryCall, attempt: Callable[[RetryCall], T], *, keep_slot: bool = False
    ) -> T:
        """Attempts until one succeeds or the policy gives up.

        The first attempt runs outside tenacity: most calls succeed at once, and entering the
        retry loop costs more than the rest of the client's work. A failure is replayed as the
        loop's first outcome, so every decision is still the policy's.
        """
        try:
            result = self._attempt(call, attempt, keep_slot)
        except Exception as exc:
            first: Exception | None = exc
        else:
            call.decide(None)
            return result
        results: list[T] = []
        for manager in call.attempts_iter():
            with manager:
                if first is not None:
                    error, first = first, None
                    raise error
                results.append(self._attempt(call, attempt, keep_slot))
        return results[-1]

    def _send_request(
        self, request: httpx.Request, call: RetryCall, *, stream: bool
    ) -> httpx.Response:
        while True:
            try:
                response = self._http.send(request, stream=True)
                break
            except httpx.HTTPError as exc:
                if call.resends < _STALE_RESENDS and _stale_connection(exc):
                    call.resends += 1
                    continue
                raise self._transport_error(exc, request, answered=False) from exc
        self._bound(response)
        if stream and response.status_code < 400:
            return response
        try:
            response.read()
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, request, answered=True) from exc
        finally:
            response.close()
        if response.status_code >= 400:
            raise self._status_error(response)
        return response

    def _send(self, prepared: _Prepared, call: RetryCall, *, stream: bool) -> httpx.Response:
        request = self._build_request(self._http, prepared, call)
        return self._send_request(request, call, stream=stream)

    def _discover(self) -> None:
        if not self._needs_discovery():
            return
        with self._discovery_lock:
            if not self._needs_discovery():
                return

            driver = self._discovery()
            probe = next(driver)
            while True:
                answer = self._probe(probe)
                try:
                    probe = driver.send(answer)
                except StopIteration as stop:
                    self._adopt_discovery(stop.value)
                    return

    def _probe(self, probe: Probe) -> Answer:
        def attempt(call: RetryCall) -> httpx.Response:
            request = self._probe_request(self._http, probe, call)
            return self._send_request(request, call, stream=False)

        try:
            return self._probe_answer(self._run(self._new_call(), attempt), None)
        except KVClientError as error:
            return self._probe_answer(None, error)

    def _call(self, prepared: _Prepared) -> Completion:
        call = self._new_call(prepared)
        payload = self._run(call, lambda call: self._json(self._send(prepared, call, stream=False)))
        return self._completion(payload, prepared, call)

    # --- API ---------------------------------------------------------------------------------

    def complete(self, prompt: str, *, max_tokens: int | None = None, **params: Any) -> Completion:
        """``POST /v1/completions`` with an explicit, clamped ``max_tokens``."""
        self._discover()
        return self._call(self._prepare_completion(prompt, max_tokens, params, stream=False))

    def chat(
        self, messages: Sequence[Message], *, max_tokens: int | None = None, **params: Any
    ) -> Completion:
        """``POST /v1/chat/completions`` with an explicit, clamped ``max_tokens``."""
        self._discover()
        return self._call(self._prepare_chat(messages, max_tokens, params, stream=False))

    def complete_stream(
        self, prompt: str, *, max_tokens: int | None = None, **params: Any
    ) -> Stream:
        """Stream ``/v1/completions``; use as ``with ... as stream: for chunk in stream``."""
        self._discover()
        return Stream(self, self._prepare_completion(prompt, max_tokens, params, stream=True))

    def chat_stream(
        self, messages: Sequence[Message], *, max_tokens: int | None = None, **params: Any
    ) -> Stream:
        """Stream ``/v1/chat/completions``; use as ``with ... as stream: for chunk in stream``."""
        self._discover()
        return Stream(self, self._prepare_chat(messages, max_tokens, params, stream=True))


class AsyncClient(BaseClient):
    """Asynchronous client, on asyncio or trio (anyio underneath). Share one per server.

    >>> async with AsyncClient(base_url="http://127.0.0.1:8000") as c:  # doctest: +SKIP
    ...     (await c.chat([{"role": "user", "content": "hi"}])).text
    """

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | None = None,
        model: str | None = None,
        context_window: int | None = None,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        safety_margin_tokens: int = 0,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            model=model,
            context_window=context_window,
            api_key=api_key,
            counter=counter,
            retry=retry,
            timeout=timeout,
            headers=headers,
            safety_margin=safety_margin,
            on_retry=on_retry,
            safety_margin_tokens=safety_margin_tokens,
        )
        if http_client is not None and transport is not None:
            raise ValueError("pass transport= or http_client=, not both")
        self._owns_http = http_client is None
        if http_client is None:
            http_client = httpx.AsyncClient(
                transport=transport, timeout=timeout, headers=self._take_constant_headers()
            )
        self._http = http_client
        # anyio locks bind to the event loop that first uses them: create it inside one.
        self._discovery_lock: anyio.Lock | None = None
        # Tasks waiting for a send-window slot; every release wakes them all to re-check.
        self._slot_waiters: list[anyio.Event] = []

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (not those of an ``http_client`` passed in)."""
        if self._owns_http:
            await self._http.aclose()

    # --- I/O ---------------------------------------------------------------------------------

    async def _hold(self, call: RetryCall) -> None:
        for _ in call.hold_rounds():
            wait = call.hold_time()
            if wait <= 0:
                return
            await self.retry.async_sleep(wait)
            call.held(wait)
        raise self._stuck(call)

    async def _acquire_slot(self, call: RetryCall) -> None:
        clock = self.retry.clock
        size = call.size
        if not self.retry.window or self._window.try_acquire(clock(), size):
            return
        started = time.monotonic()
        while not self._window.try_acquire(clock(), size):
            left = call.time_left()
            if left <= 0:
                raise self._window_busy(call)
            event = anyio.Event()
            self._slot_waiters.append(event)
            try:
                with anyio.move_on_after(min(left, _WINDOW_POLL)):
                    await event.wait()
            finally:
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(event)
        call.held(time.monotonic() - started)

    def _release_slot(self, outcome: str, call: RetryCall) -> None:
        if not self.retry.window:
            return
        self._window.release(outcome, self.retry.clock(), call.size)
        waiters, self._slot_waiters = self._slot_waiters, []
        for event in waiters:
            event.set()

    async def _attempt(
        self, call: RetryCall, attempt: Callable[[RetryCall], Any], keep_slot: bool
    ) -> Any:
        """As :meth:`Client._attempt`."""
        await self._hold(call)
        await self._acquire_slot(call)
        call.begin_attempt()
        try:
            result = await attempt(call)
        except BaseException as exc:
            self._release_slot(_slot_outcome(exc), call)
            raise
        if not keep_slot:
            self._release_slot("ok", call)
        return result

    async def _run(
        self, call: RetryCall, attempt: Callable[[RetryCall], Any], *, keep_slot: bool = False
    ) -> Any:
        """As :meth:`Client._run`: the first attempt outside tenacity, a failure replayed."""
        try:
            result = await self._attempt(call, attempt, keep_slot)
        except Exception as exc:
            first: Exception | None = exc
        else:
            call.decide(None)
            return result
        results: list[Any] = []
        async for manager in call.async_attempts():
            with manager:
                if first is not None:
                    error, first = first, None
                    raise error
                results.append(await self._attempt(call, attempt, keep_slot))
        return results[-1]

    async def _send_request(
        self, request: httpx.Request, call: RetryCall, *, stream: bool
    ) -> httpx.Response:
        while True:
            try:
                response = await self._http.send(request, stream=True)
                break
            except httpx.HTTPError as exc:
                if call.resends < _STALE_RESENDS and _stale_connection(exc):
                    call.resends += 1
                    continue
                raise self._transport_error(exc, request, answered=False) from exc
        self._bound(response)
        if stream and response.status_code < 400:
            return response
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, request, answered=True) from exc
        finally:
            await response.aclose()
        if response.status_code >= 400:
            raise self._status_error(response)
        return response

    async def _send(self, prepared: _Prepared, call: RetryCall, *, stream: bool) -> httpx.Response:
        request = self._build_request(self._http, prepared, call)
        return await self._send_request(request, call, stream=stream)

    async def _discover(self) -> None:
        if not self._needs_discovery():
            return
        if self._discovery_lock is None:
            self._discovery_lock = anyio.Lock()
        async with self._discovery_lock:
            if not self._needs_discovery():
                return

            driver = self._discovery()
            probe = next(driver)
            while True:
                answer = await self._probe(probe)
                try:
                    probe = driver.send(answer)
                except StopIteration as stop:
                    self._adopt_discovery(stop.value)
                    return

    async def _probe(self, probe: Probe) -> Answer:
        async def attempt(call: RetryCall) -> httpx.Response:
            request = self._probe_request(self._http, probe, call)
            return await self._send_request(request, call, stream=False)

        try:
            return self._probe_answer(await self._run(self._new_call(), attempt), None)
        except KVClientError as error:
            return self._probe_answer(None, error)

    async def _call(self, prepared: _Prepared) -> Completion:
        call = self._new_call(prepared)

        async def attempt(call: RetryCall) -> dict[str, Any]:
            return self._json(await self._send(prepared, call, stream=False))

        payload = await self._run(call, attempt)
        return self._completion(payload, prepared, call)

    # --- API ---------------------------------------------------------------------------------

    async def complete(
        self, prompt: str, *, max_tokens: int | None = None, **params: Any
    ) -> Completion:
        """``POST /v1/completions`` with an explicit, clamped ``max_tokens``."""
        await self._discover()
        return await self._call(self._prepare_completion(prompt, max_tokens, params, stream=False))

    async def chat(
        self, messages: Sequence[Message], *, max_tokens: int | None = None, **params: Any
    ) -> Completion:
        """``POST /v1/chat/completions`` with an explicit, clamped ``max_tokens``."""
        await self._discover()
        return await self._call(self._prepare_chat(messages, max_tokens, params, stream=False))

    def complete_stream(
        self, prompt: str, *, max_tokens: int | None = None, **params: Any
    ) -> AsyncStream:
        """Stream ``/v1/completions``: ``async with client.complete_stream(...) as stream``.

        The request is counted, clamped and sent when the stream is entered (or first iterated).
        """

        async def prepare() -> _Prepared:
            await self._discover()
            return self._prepare_completion(prompt, max_tokens, params, stream=True)

        return AsyncStream(self, prepare, chat=False)

    def chat_stream(
        self, messages: Sequence[Message], *, max_tokens: int | None = None, **params: Any
    ) -> AsyncStream:
        """Stream ``/v1/chat/completions``: ``async with client.chat_stream(...) as stream``.

        The request is counted, clamped and sent when the stream is entered (or first iterated).
        """

        async def prepare() -> _Prepared:
            await self._discover()
            return self._prepare_chat(messages, max_tokens, params, stream=True)

        return AsyncStream(self, prepare, chat=True)
