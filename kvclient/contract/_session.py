"""A contract run's HTTP session with one server: requests, token counts, bursts (I/O only).

:class:`Session` holds the HTTP client, the options and what discovery learned, and sends what
the checks (:mod:`._checks`) ask for: plain requests, waits honouring Retry-After, prompt token
counts, bursts and their outcomes, ``/metrics`` readings. What to conclude from the answers
lives in :mod:`._judge`.

Nothing here imports a server: the suite must judge vLLM, TGI, llama.cpp or SGLang exactly as it
judges the reference server.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from .._exceptions import APIResponseError
from .._http import stale_connection
from ..engines.behaviour import run_to_cap_fields
from ..engines.budget import discover_budget
from ..engines.discovery import Answer as DialectAnswer
from ..engines.metrics import KVLosses, kv_losses_from_metrics
from ..sse import AsyncLines
from ._judge import (
    BurstOutcome,
    ErrorBody,
    classify_error_body,
    judge_retry_after,
    prometheus_value,
    usage_tokens,
)
from ._results import ContractOptions

__all__ = ["UNSET", "Answer", "Session"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: Local estimates of prompt tokens (no /tokenize, no usage) are padded by this much.
ESTIMATE_MARGIN = 0.2
#: Without Retry-After, capacity is polled this often.
POLL_INTERVAL = 0.25
#: How long /metrics is polled for kv_reserved_tokens to reach 0.
METRICS_WAIT = 2.0
#: A saturating burst asks, all requests together, for this many times the engine's KV pool (when
#: the pool is known): enough that no admission rule can fit it even when the burst's arrivals
#: spread over as long as one sequence lives (then only about half of it is live at once), yet
#: each request stays short, so that sequences made to run to their caps end in seconds on a fast
#: server.
OVERSUBSCRIPTION = 4.0
#: The least max_tokens a saturating request asks for, however large the burst.
MIN_BURST_CAP = 16
#: A field left out of a request (``None`` would be sent as ``null``).
UNSET: Any = object()


@dataclass(slots=True)
class Answer:
    """One non-streamed request's answer, or why there was none (``error``)."""

    status: int | None
    headers: httpx.Headers
    content: bytes = b""
    error: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.content)
        except (ValueError, UnicodeDecodeError):
            return None

    def error_body(self) -> ErrorBody:
        return classify_error_body(self.content)

    def describe(self) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        if self.status >= 400:
            return f"{self.status} ({self.error_body().describe()})"
        return str(self.status)


class Session:
    """One run against one server: the HTTP client, the options, what discovery learned."""

    def __init__(self, http: httpx.AsyncClient, options: ContractOptions) -> None:
        self.http = http
        self.options = options
        self.model: str | None = options.model
        self.context_window: int | None = options.context_window
        self.reachable = True
        self.deadline = math.inf
        self._counts: dict[str, tuple[int, str]] = {}
        self._tokenize_works: bool | None = None
        #: The engine whose dialect discovery heard (``"vllm"`` for ours too), when known.
        self.engine: str | None = None
        self._pool: tuple[int | None, str] | None = None
        self.chat = options.api == "chat"
        #: Where generation requests go.
        self.path = ENDPOINTS[options.api]

    # --- time ---------------------------------------------------------------------------------

    def remaining(self) -> float:
        return max(0.0, self.deadline - anyio.current_time())

    # --- requests -----------------------------------------------------------------------------

    def body(
        self,
        prompt: Any,
        *,
        max_tokens: Any = UNSET,
        stream: bool = False,
        run_to_cap: bool = False,
    ) -> dict[str, Any]:
        """A generation request's body; ``run_to_cap``: with the fields that make the engine
        generate all of ``max_tokens`` (``ignore_eos``, ``min_tokens``: see
        :func:`~kvclient.engines.behaviour.run_to_cap_fields`), so that admitted requests really
        hold their KV to the end."""
        body: dict[str, Any] = {}
        if self.model is not None:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if max_tokens is not UNSET:
            body["max_tokens"] = max_tokens
        if stream:
            body["stream"] = True
        if run_to_cap and isinstance(max_tokens, int):
            body.update(run_to_cap_fields(self.engine, max_tokens))
        return body

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = UNSET,
        content: bytes | None = None,
    ) -> Answer:
        kwargs: dict[str, Any] = {}
        if json_body is not UNSET:
            kwargs["json"] = json_body
        if content is not None:
            kwargs["content"] = content
            kwargs["headers"] = {"content-type": "application/json"}
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            return Answer(None, httpx.Headers(), error=type(exc).__name__)
        return Answer(response.status_code, response.headers, response.content)

    async def admitted(self, body: dict[str, Any], *, attempts: int = 5) -> tuple[Answer, int]:
        """POST a completion, waiting out 429/503 as advised; ``(last answer, attempts made)``."""
        answer = Answer(None, httpx.Headers(), error="not sent")
        for attempt in range(1, attempts + 1):
            answer = await self.request("POST", self.path, json_body=body)
            if answer.status not in (429, 503):
                return answer, attempt
            advice = judge_retry_after(
                answer.headers.get("retry-after"),
                millis=answer.headers.get("retry-after-ms"),
                now=_unix_now(),
            )
            wait = advice.seconds if advice.seconds is not None else POLL_INTERVAL * attempt
            if attempt == attempts or wait >= self.remaining():
                return answer, attempt
            await anyio.sleep(wait)
        return answer, attempts

    # --- tokens -------------------------------------------------------------------------------

    async def count_prompt(self, prompt: str) -> tuple[int, str]:
        """``(prompt tokens, how they were counted)``: the server's ``/tokenize``, else the
        ``usage`` of a one-token completion, else a padded local tiktoken estimate."""
        cached = self._counts.get(prompt)
        if cached is not None:
            return cached
        result = await self.tokenize(prompt)
        if result is None:
            answer, _ = await self.admitted(self.body(prompt, max_tokens=1), attempts=3)
            prompt_tokens, _ = usage_tokens(answer.json()) if answer.status == 200 else (None, 0)
            if prompt_tokens is not None:
                result = (prompt_tokens, "usage")
        if result is None:
            estimate = await anyio.to_thread.run_sync(_estimate_tokens, prompt)
            result = (math.ceil(estimate * (1 + ESTIMATE_MARGIN)) + 8, "estimate")
        self._counts[prompt] = result
        return result

    async def tokenize(self, prompt: str) -> tuple[int, str] | None:
        if self._tokenize_works is False:
            return None
        # vLLM and SGLang read "prompt" (or "messages", applying the chat template), llama.cpp
        # reads "content"; TGI wants "inputs" (and answers 422 here: then usage or the estimate
        # counts instead).
        body: dict[str, Any] = {"prompt": prompt, "content": prompt}
        if self.chat:
            body = {"messages": [{"role": "user", "content": prompt}]}
        if self.model is not None:
            body["model"] = self.model
        answer = await self.request("POST", "/tokenize", json_body=body)
        data = answer.json() if answer.status == 200 else None
        count: int | None = None
        if isinstance(data, dict):
            if isinstance(data.get("count"), int) and not isinstance(data["count"], bool):
                count = data["count"]
            elif isinstance(data.get("tokens"), list):
                count = len(data["tokens"])
        elif isinstance(data, list):  # TGI answers a list of tokens
            count = len(data)
        if count is not None and count < 1 <= len(prompt.strip()):
            count = None  # an endpoint that read another field than the one we sent
        self._tokenize_works = count is not None
        return (count, "/tokenize") if count is not None else None

    async def burst_cap(self, prompt_tokens: int) -> tuple[int, str]:
        """The burst's max_tokens and why: ``--burst-max-tokens`` when given; else sized so that
        the burst asks for :data:`OVERSUBSCRIPTION` times the engine's KV pool (each request at
        least :data:`MIN_BURST_CAP`); else, the pool unknown, the whole remaining context.
        Never more than the room the context leaves."""
        assert self.context_window is not None
        room = max(1, self.context_window - prompt_tokens)
        cap = self.options.burst_max_tokens
        if cap is not None:
            return min(cap, room), "--burst-max-tokens"
        pool, source = await self.kv_pool()
        if pool is None:
            return room, "the whole context (KV pool unknown)"
        each = math.ceil(OVERSUBSCRIPTION * pool / self.options.burst) - prompt_tokens
        sized = min(room, max(MIN_BURST_CAP, each))
        burst = self.options.burst
        return (
            sized,
            f"{burst} x {sized + prompt_tokens} ~ {OVERSUBSCRIPTION:g} x {pool} ({source})",
        )

    async def kv_pool(self) -> tuple[int | None, str]:
        """The engine's KV pool in tokens as its dialect tells it (``/metrics``, ``/props``,
        ``/get_server_info``), else a gateway's usable budget (``kv_usable_tokens``); with where
        it came from. Asked once."""
        if self._pool is not None:
            return self._pool
        driver = discover_budget()
        probe = next(driver)
        metrics_text: str | None = None
        while True:
            answer = await self.request(probe.method, probe.path)
            if probe.path == "/metrics":
                text = answer.content.decode("utf-8", "replace") if answer.status == 200 else None
                metrics_text = text
                payload: Any = text
            else:
                payload = answer.json() if answer.status == 200 else None
            try:
                probe = driver.send(DialectAnswer(answer.status or 0, payload))
            except StopIteration as stop:
                budget = stop.value
                break
        pool: int | None = budget.kv_tokens
        source = budget.source or ""
        if pool is not None and budget.max_concurrency is not None:
            # llama.cpp: one window per slot unless unified; the burst must outgrow them all.
            pool *= budget.max_concurrency
            source += " x slots"
        if pool is None and metrics_text is not None:
            usable = prometheus_value(metrics_text, "kv_usable_tokens")
            if usable is not None and usable >= 1:
                pool, source = int(usable), "/metrics kv_usable_tokens"
        self._pool = (pool, source)
        return self._pool

    # --- bursts -------------------------------------------------------------------------------

    async def send_one(
        self,
        body: dict[str, Any],
        outcome: BurstOutcome,
        *,
        drop_after_first: bool = False,
        on_answer: Callable[[], None] | None = None,
    ) -> None:
        """Send one burst request and record what happened in ``outcome``.

        With ``drop_after_first`` an admitted stream is closed after its first event: the client
        walks away mid-generation. ``on_answer`` is called once the status (or the failure to
        get one) is known, while a stream may still be running.
        """
        outcome.unfinished = True  # until proven otherwise: the deadline may cut us here
        told = False

        def tell() -> None:  # once, when the status (or the failure to get one) is known
            nonlocal told
            if on_answer is not None and not told:
                told = True
                on_answer()

        for attempt in (1, 2):
            try:
                await self._send(body, outcome, drop_after_first, tell)
            except httpx.TransportError as exc:
                # A pooled connection the server closed as it went idle, reused in that instant:
                # nothing reached the server; sent again at once on a new connection.
                if attempt == 1 and outcome.status is None and stale_connection(exc):
                    continue
                outcome.transport_error = type(exc).__name__
                if outcome.status is not None:  # the answer began, then the connection broke
                    outcome.problem = f"connection broke mid-answer ({type(exc).__name__})"
            break
        outcome.unfinished = False
        tell()

    async def _send(
        self,
        body: dict[str, Any],
        outcome: BurstOutcome,
        drop_after_first: bool,
        tell: Callable[[], None],
    ) -> None:
        """One try of :meth:`send_one` (``tell``: the status is known); a transport failure is
        raised."""
        if outcome.streamed:
            async with self.http.stream("POST", self.path, json={**body, "stream": True}) as r:
                outcome.status = r.status_code
                tell()
                if r.status_code >= 300:
                    await r.aread()
                    self._refusal(outcome, r.status_code, r.headers, r.content)
                elif drop_after_first:
                    await _first_event(r)
                else:
                    outcome.completed, outcome.problem, error = await _consume(r)
                    if error is not None:
                        outcome.error_code = error.code or error.type or "error"
                        outcome.error_message = error.message
        else:
            response = await self.http.post(self.path, json=body)
            outcome.status = response.status_code
            if response.status_code >= 300:
                self._refusal(outcome, response.status_code, response.headers, response.content)
            else:
                outcome.completed, outcome.problem = _complete_body(response.content)
                if not outcome.completed:
                    error = classify_error_body(response.content)
                    outcome.error_code, outcome.error_message = error.code, error.message

    def _refusal(
        self, outcome: BurstOutcome, status: int, headers: httpx.Headers, content: bytes
    ) -> None:
        error = classify_error_body(content)
        outcome.error_code, outcome.error_message = error.code, error.message
        if status in (429, 503):
            outcome.retry_after = judge_retry_after(
                headers.get("retry-after"), millis=headers.get("retry-after-ms"), now=_unix_now()
            )

    async def burst(
        self,
        body: dict[str, Any],
        count: int,
        *,
        budget: float,
        drop_after_first: bool = False,
        stream_every: int = 2,
    ) -> list[BurstOutcome]:
        """``count`` concurrent requests (every ``stream_every``-th one streamed), cut at
        ``budget`` seconds."""
        outcomes = [BurstOutcome(streamed=i % stream_every == 0) for i in range(count)]
        with anyio.move_on_after(max(0.0, budget)):
            async with anyio.create_task_group() as group:
                for outcome in outcomes:
                    send = functools.partial(
                        self.send_one, body, outcome, drop_after_first=drop_after_first
                    )
                    group.start_soon(send)
        return outcomes

    async def largest_admitted(
        self, prompt: str, max_tokens: int, *, patience: float
    ) -> tuple[bool, int, float, Counter[str]]:
        """Send the largest admissible request (streamed, dropped after its first event) until it
        is admitted, honouring Retry-After, for at most ``patience`` seconds.

        ``(admitted, tries, seconds waited, statuses seen)``.
        """
        statuses: Counter[str] = Counter()
        start = anyio.current_time()
        tries = 0
        while True:
            tries += 1
            outcome = BurstOutcome(streamed=True)
            await self.send_one(
                self.body(prompt, max_tokens=max_tokens), outcome, drop_after_first=True
            )
            if outcome.status is not None:
                statuses[str(outcome.status)] += 1
            else:  # the transport error says why
                statuses[f"no answer ({outcome.transport_error or 'cut'})"] += 1
            waited = anyio.current_time() - start
            if outcome.status is not None and 200 <= outcome.status < 300:
                return True, tries, waited, statuses
            if outcome.status not in (429, 503):
                return False, tries, waited, statuses
            advice = outcome.retry_after
            wait = advice.seconds if advice is not None and advice.seconds else POLL_INTERVAL
            if waited + wait > patience or wait >= self.remaining():
                return False, tries, waited, statuses
            await anyio.sleep(wait)

    async def kv_losses(self) -> KVLosses | None:
        """The engine's count so far of requests preempted, retracted or failed for lack of KV
        (``/metrics``, in its dialect); None when it exposes none."""
        answer = await self.request("GET", "/metrics")
        if answer.status != 200:
            return None
        return kv_losses_from_metrics(answer.content.decode("utf-8", "replace"))

    async def reserved_tokens(self) -> float | None:
        """``kv_reserved_tokens`` from ``/metrics`` after it settles, None when not exposed."""
        value: float | None = None
        stop = anyio.current_time() + min(METRICS_WAIT, self.remaining())
        while True:
            answer = await self.request("GET", "/metrics")
            if answer.status != 200:
                return None
            value = prometheus_value(
                answer.content.decode("utf-8", "replace"), "kv_reserved_tokens"
            )
            if value is None or value == 0 or anyio.current_time() >= stop:
                return value
            await anyio.sleep(0.1)


def _estimate_tokens(prompt: str) -> int:
    # Last resort only (no /tokenize, no usage): loading the encoding takes a moment.
    from .._tiktoken import TiktokenCounter

    return TiktokenCounter().count(prompt)


def _unix_now() -> float:
    # Wall-clock time: an HTTP-date Retry-After is judged against it (the loop's clock is not).
    return time.time()


async def _first_event(response: httpx.Response) -> None:
    """Read up to the first generated text, then walk away: close the connection mid-stream.

    (A chat stream opens with a role-only event: generation has not started yet.)
    """
    body = response.aiter_bytes()
    with contextlib.suppress(APIResponseError):  # a line past the bound: stop reading too
        async for line in AsyncLines(body):
            if line.startswith("data:") and _has_text(line[5:].strip()):
                break
    await _abandon(response, body)


def _has_text(data: str) -> bool:
    """Whether an SSE event carries generated text, or ends the stream (then stop reading)."""
    try:
        event = json.loads(data)
    except ValueError:
        return True
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list):
        return True  # [DONE], an error event, a usage-only event: nothing more to wait for
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
        if text or choice.get("finish_reason"):
            return True
    return False


async def _abandon(response: httpx.Response, body: AsyncIterator[bytes]) -> None:
    """Close a stream left early, then run httpx's generator chain under it to its end.

    Leaving ``async for`` early suspends httpx's nested generators, and trio warns when it
    collects an unfinished one; with the connection closed, resuming them ends at once.
    """
    await response.aclose()
    with anyio.move_on_after(1.0), contextlib.suppress(Exception):
        async for _ in body:
            pass


async def _consume(response: httpx.Response) -> tuple[bool, str | None, ErrorBody | None]:
    """Read an SSE completion stream to its end: ``(completed, problem, the error event)``."""
    finished = False
    verdict: tuple[bool, str | None, ErrorBody | None] | None = None
    chunks = response.aiter_bytes()
    lines = AsyncLines(chunks)
    while verdict is None:
        # SSE lines end at CR, LF or CRLF only (not at U+2028 and the like, as httpx's do).
        try:
            line = await lines.__anext__()
        except StopAsyncIteration:
            break
        except APIResponseError as exc:
            verdict = (False, f"unreadable stream: {exc}", None)
            break
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            verdict = (True, None, None)
            break
        try:
            event = json.loads(data)
        except ValueError:
            verdict = (False, "unreadable stream event", None)
            break
        if isinstance(event, dict) and event.get("error") is not None:
            verdict = (False, "error event mid-stream", classify_error_body(data.encode()))
            break
        choices = event.get("choices") if isinstance(event, dict) else None
        if isinstance(choices, list):
            finished = finished or any(
                isinstance(c, dict) and c.get("finish_reason") for c in choices
            )
    if verdict is not None:
        await _abandon(response, chunks)
        return verdict
    if finished:
        return True, None, None
    return False, "stream ended without [DONE] or finish_reason", None


def _complete_body(content: bytes) -> tuple[bool, str | None]:
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return False, "unreadable body"
    if isinstance(data, dict) and data.get("error") is not None:
        return False, "an error body in a 2xx answer"
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return False, "no choices in the body"
    return True, None
