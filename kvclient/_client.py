"""The clients' core: :class:`BaseClient` makes every decision, the shells do I/O.

A call goes: discover the model and context window (once), plan (count the prompt locally,
clamp ``max_tokens`` to the window, refuse locally a prompt that fills it), then the one send
path: route the attempt to the replica where its reservation fits best (:mod:`kvclient._replicas`),
hold while that replica cools down or has no room, take a send-window slot, send, re-send at
once on a fresh connection when the server had closed the pooled one, classify the answer, fail
over or let the retry policy (:class:`~kvclient._retry.RetryCall`) decide, note the room the
answer advertises, release the slot. ``AsyncClient`` (``_async_client.py``) and ``Client``
(generated from it, ``scripts/unasync.py``) differ only in how they send, read and sleep.

The send path is declared for kvclient's own adapters (``kvclient.openai``,
``kvclient.loadgen``), which use nothing else of a client's:

- ``client.discover(verify=False)``: learn the model and context window once;
- ``client.clamp(requested, counted)``: the output cap to send, or :class:`PromptTooLongError`;
- ``client.new_call(size)``: a :class:`~kvclient._replicas.Call` of ``size`` KV tokens;
- ``client.send(call, build, stream=...)``: ``build(call)`` makes each attempt's
  ``httpx.Request`` for ``call.replica``; the answer comes back admitted (status < 400) or the
  call's final :class:`KVClientError` is raised. A streamed answer holds its send-window slot
  until its body is closed;
- ``client.headers``: headers sent on every request the client builds itself.

It is not public API: names may change with kvclient's adapters.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import httpx

from ._accounting import effective_output_cap
from ._exceptions import (
    APIResponseError,
    APIStatusError,
    KVClientError,
    PromptTooLongError,
    ServerBusyError,
)
from ._http import MIN_ATTEMPT_TIMEOUT, Body, Bounded
from ._models import Completion, RetryEvent
from ._policy import RetryPolicy
from ._replicas import Call, Replica, Replicas, base_urls
from ._tiktoken import TiktokenCounter
from ._tokens import Message, TokenCounter, count_chat_request
from ._version import __version__
from .engines.discovery import Answer, Discovery, Probe, discover_context
from .engines.errors import classify_error
from .headers import PRIORITY_HEADER, parse_retry_after

__all__ = ["BaseClient", "Prepared", "from_env"]

#: LLM answers can take minutes; connecting should not.
DEFAULT_TIMEOUT: httpx.Timeout = httpx.Timeout(600.0, connect=10.0)
#: Extra share of the counted prompt assumed when clamping (0.1 = the server may count 10% more).
DEFAULT_SAFETY_MARGIN: float = 0.0
USER_AGENT = f"kvclient/{__version__}"
IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_COUNT_HEADER = "X-Retry-Count"
#: RFC 7240's request header; ``wait=N``: how long this attempt will wait for an answer.
PREFER_HEADER = "Prefer"
#: Seconds ``Prefer: wait`` leaves between the server's answer and the attempt's timeout.
PREFER_WAIT_MARGIN = 1.0
#: Read when ``base_url`` / ``api_key`` are not passed; the first one set wins.
BASE_URL_ENV = ("KVCLIENT_BASE_URL", "OPENAI_BASE_URL")
API_KEY_ENV = ("KVCLIENT_API_KEY", "OPENAI_API_KEY")
#: Immediate re-sends of a call's requests whose pooled connection the server had closed.
STALE_RESENDS = 2
#: How often a send waiting for a send-window slot re-checks (the window may reopen with time).
WINDOW_POLL = 0.1

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
# Keys kvclient owns in a request body; passing them through **params would bypass the clamp.
_RESERVED = frozenset({"model", "prompt", "messages", "stream", "max_tokens"})
# The request extension carrying the time (policy clock) by which its answer must have been read.
_DEADLINE = "kvclient.deadline"

# tests/e2e/test_chaos.py checks the body type from here.
_Body = Body


def from_env(names: Sequence[str]) -> str | None:
    """The first of the environment variables ``names`` that is set and not blank."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


class Prepared:
    """One call's request, planned once and sent by every attempt."""

    __slots__ = ("body", "chat", "max_tokens", "path", "priority", "prompt_tokens")

    def __init__(
        self,
        *,
        path: str,
        body: dict[str, Any],
        max_tokens: int,
        prompt_tokens: int,
        chat: bool,
        priority: int | None = None,
    ) -> None:
        self.path = path
        self.body = body
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.chat = chat
        self.priority = priority

    @property
    def size(self) -> int:
        """KV tokens the request may reserve: prompt + output cap."""
        return self.prompt_tokens + self.max_tokens


def _check_window(context_window: int | None) -> None:
    if context_window is not None and (
        isinstance(context_window, bool)
        or not isinstance(context_window, int)
        or context_window < 1
    ):
        raise ValueError(f"context_window must be a positive integer, got {context_window!r}")


def _check_priority(priority: int | None) -> int | None:
    """``priority`` when it is None or an integer (not a bool), else a ``ValueError``."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")
    return priority


def _check_margins(safety_margin: float, safety_margin_tokens: int) -> None:
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


class BaseClient:
    """Everything a client decides without I/O: configuration, planning, requests, answers.

    ``base_url`` and ``api_key`` not passed are read from ``KVCLIENT_BASE_URL`` /
    ``OPENAI_BASE_URL`` and ``KVCLIENT_API_KEY`` / ``OPENAI_API_KEY`` (the first set wins).

    ``base_url`` may list several replicas of one model: each has its own cooldown, send window,
    pacing hints and health, and each request goes where its reservation fits best (see
    :mod:`kvclient._replicas`); discovery asks each replica for its context window and clamps to
    the smallest.

    ``priority`` (an integer, lower served first, as vLLM's own ``priority``; None sends none,
    which a server takes as 0) goes with each completion and chat request as the
    ``X-Priority`` header (:data:`kvclient.headers.PRIORITY_HEADER`), for a server that serves
    priority classes, as the gateway's tenant fairness does; a call's own ``priority=`` wins.
    """

    _http: httpx.Client | httpx.AsyncClient

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
        priority: int | None = None,
    ) -> None:
        _check_window(context_window)
        _check_margins(safety_margin, safety_margin_tokens)
        self.priority = _check_priority(priority)
        if base_url is None:
            base_url = from_env(BASE_URL_ENV)
            if base_url is None:
                raise ValueError(f"pass base_url= or set {' or '.join(BASE_URL_ENV)}")
        if api_key is None:
            api_key = from_env(API_KEY_ENV)
        self.retry = retry if retry is not None else RetryPolicy()
        urls, self._credentials = base_urls(base_url)
        self._replicas = Replicas(urls, self.retry)
        self.model = model
        self.context_window = context_window
        self.api_key = api_key
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.timeout = timeout
        self.safety_margin = float(safety_margin)
        self.safety_margin_tokens = safety_margin_tokens
        self.on_retry = on_retry
        #: Sent on every request the client builds (they win over the defaults it sets).
        self.headers: dict[str, str] = dict(headers or {})
        # The first replica's (the only one's, usually): what single-server code looks at.
        first = self._replicas[0]
        self._cooldown = first.cooldown
        self._pacer = first.pacer
        self._window = first.window
        self._base_timeout = httpx.Timeout(timeout)

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

    # --- the send path's pure half -----------------------------------------------------------

    def new_call(self, size: int | None) -> Call:
        """A call of ``size`` KV tokens (prompt + output cap; None: unknown, as a probe's),
        routed over the replicas, retried by :attr:`retry`."""
        return self._replicas.new_call(size, self.on_retry)

    def clamp(self, requested: int | None, counted: int) -> int:
        """The output cap to send for a prompt of ``counted`` tokens when the caller asked for
        ``requested`` (None: as much as fits). Raises :class:`PromptTooLongError` when the
        prompt leaves no room."""
        window = self.context_window
        if window is None:
            raise KVClientError("the context window is unknown: discover it before clamping")
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

    def _stamp(self, request: httpx.Request, call: Call) -> httpx.Request:
        """An attempt's request as it leaves: its timeouts none longer than the time left before
        the call's deadline (for a stream the read timeout bounds each wait for the next chunk,
        not the whole stream), the call's idempotency key and attempt number, and what ties
        its answer back to the call."""
        given = request.extensions.get("timeout")
        timeout: dict[str, float | None] = (
            given if isinstance(given, dict) else self._base_timeout.as_dict()
        )
        left = max(call.time_left(), MIN_ATTEMPT_TIMEOUT)
        capped: dict[str, float] = {}
        for key in ("connect", "read", "write", "pool"):
            value = timeout.get(key)
            capped[key] = left if value is None else min(value, left)
        request.extensions = {
            **request.extensions,
            "timeout": capped,
            _DEADLINE: call.started + self.retry.deadline,
            **call.extensions(),
        }
        if request.method == "POST":
            request.headers.setdefault(IDEMPOTENCY_HEADER, call.idempotency_key)
            # RFC 7240: a server that queues (kvclient gateway) answers 429 before this attempt
            # would time out waiting for it, rather than keep it in line for nobody.
            patience = math.floor(min(left, capped["read"]) - PREFER_WAIT_MARGIN)
            request.headers.setdefault(PREFER_HEADER, f"wait={max(0, patience)}")
        request.headers[RETRY_COUNT_HEADER] = str(call.attempts - 1)
        if isinstance(request.stream, httpx.ByteStream):
            request.stream = Body(request.content)
        return request

    def _bound(self, response: httpx.Response) -> None:
        """Note the room ``response`` advertises, if any; read its body against its call's
        deadline (see :class:`~kvclient._http.Bounded`)."""
        self._replicas.note_room(response)
        deadline = response.request.extensions.get(_DEADLINE)
        if isinstance(deadline, (int, float)):  # an injected clock may count in integers
            why = f"the call's {self.retry.deadline:g}s deadline passed while reading the answer"
            response.stream = Bounded(
                response.stream, response.request, self.retry.clock, float(deadline), why
            )

    def _window_busy(self, call: Call) -> ServerBusyError:
        window = call.replica.window
        return ServerBusyError(
            f"the server refused requests and this client already has "
            f"{window.requests} in flight ({window.in_flight} KV tokens, window "
            f"{window.limit:.0f}); no room freed before the {self.retry.deadline:g}s "
            f"deadline",
            retry_after=call.cooldown.advice,
            attempts=call.attempts,
        )

    @staticmethod
    def _stuck(call: Call) -> ServerBusyError:
        return ServerBusyError(
            "the cooldown never ended: the injected clock does not advance while sleeping",
            retry_after=call.cooldown.advice,
            attempts=call.attempts,
        )

    # --- requests ----------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self._credentials is not None:
            # What httpx sends for a URL's userinfo (it then wins over the API key too).
            token = base64.b64encode(":".join(self._credentials).encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        headers.update(self.headers)
        return headers

    def _request(self, prepared: Prepared, call: Call) -> httpx.Request:
        headers = self._headers()
        headers["Content-Type"] = "application/json"
        if prepared.body.get("stream"):
            headers["Accept"] = "text/event-stream"
        if prepared.priority is not None:
            headers[PRIORITY_HEADER] = str(prepared.priority)
        return self._http.build_request(
            "POST",
            call.replica.base_url + prepared.path,
            content=json.dumps(prepared.body).encode(),
            headers=headers,
        )

    def _probe_request(self, probe: Probe, call: Call) -> httpx.Request:
        return self._http.build_request(
            probe.method,
            call.replica.base_url + probe.path,
            json=probe.json,
            headers=self._headers(),
        )

    # --- planning ----------------------------------------------------------------------------

    def _check_params(self, params: Mapping[str, Any]) -> None:
        bad = sorted(_RESERVED.intersection(params))
        if bad:
            raise TypeError(f"kvclient sets {', '.join(bad)} itself; do not pass them in **params")

    def _prepare_completion(
        self,
        prompt: str,
        max_tokens: int | None,
        params: dict[str, Any],
        *,
        stream: bool,
        priority: int | None = None,
    ) -> Prepared:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        self._check_params(params)
        priority = self._priority(priority)
        counted = self.counter.count(prompt)
        cap = self.clamp(max_tokens, counted)
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, **params, "max_tokens": cap}
        self._stream_options(body, stream)
        return Prepared(
            path=_COMPLETIONS,
            body=body,
            max_tokens=cap,
            prompt_tokens=counted,
            chat=False,
            priority=priority,
        )

    def _prepare_chat(
        self,
        messages: Sequence[Message],
        max_tokens: int | None,
        params: dict[str, Any],
        *,
        stream: bool,
        priority: int | None = None,
    ) -> Prepared:
        self._check_params(params)
        priority = self._priority(priority)
        if max_tokens is None and "max_completion_tokens" in params:
            max_tokens = params.pop("max_completion_tokens")
        else:
            params.pop("max_completion_tokens", None)
        counted = count_chat_request(self.counter, messages, params.get("tools"))
        cap = self.clamp(max_tokens, counted)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(message) for message in messages],
            **params,
            "max_tokens": cap,
        }
        self._stream_options(body, stream)
        return Prepared(
            path=_CHAT,
            body=body,
            max_tokens=cap,
            prompt_tokens=counted,
            chat=True,
            priority=priority,
        )

    def _priority(self, given: int | None) -> int | None:
        """A call's priority: its own, else the client's."""
        return self.priority if given is None else _check_priority(given)

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
                prompt_tokens_lower_bound=details.prompt_tokens_lower_bound,
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
    def _completion(payload: dict[str, Any], prepared: Prepared, call: Call) -> Completion:
        return Completion.from_answer(
            payload,
            chat=prepared.chat,
            max_tokens=prepared.max_tokens,
            prompt_tokens=prepared.prompt_tokens,
            attempts=call.attempts,
            retry_wait=call.waited,
            history=tuple(call.history),
        )

    # --- discovery ---------------------------------------------------------------------------

    def _needs_discovery(self) -> bool:
        return self.context_window is None or self.model is None

    def _discovery(self) -> Generator[Probe, Answer, Discovery]:
        return discover_context(self.model, need_window=self.context_window is None)

    def _probe_call(self, replica: Replica | None) -> Call:
        """A discovery probe's call: routed as any request (``replica`` None), or pinned to one
        replica and tried once."""
        if replica is None:
            return self.new_call(None)
        return self._replicas.probe_call(replica, self.on_retry)

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

    def _adopt_replica_discovery(self, replica: Replica, found: Discovery | KVClientError) -> None:
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

    def _adopt_discovery(self, found: Discovery, *, verify: bool = False) -> None:
        """Take the model (if unset) and the context window (if unset) that discovery found;
        ``verify``: a problem is an error even when both were given."""
        if found.problem is not None:
            if not verify and self.context_window is not None and self.model is not None:
                return
            hint = "" if verify else "; pass model= and context_window= to skip discovery"
            raise KVClientError(f"{self.base_url}: {found.problem}{hint}")
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
