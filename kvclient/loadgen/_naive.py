"""The baseline the demo and the benchmarks compare against: a client as many are written today.

It sends the caller's ``max_tokens`` as given (none when unset), and when the server says 429 or
503 it retries at once, ignoring Retry-After, up to ``max_attempts``. Nothing else: no local count,
no clamp, no backoff, no coordination. It exists to be measured, not used.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import httpx

from ..engines.errors import is_kv_exhaustion
from ._metrics import RecordTimer
from ._workload import WorkItem

__all__ = ["NaiveSender"]

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class NaiveSender:
    """Send one work item the naive way, recording what happened."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        model: str | None = None,
        max_attempts: int = 20,
        deadline: float = 60.0,
    ) -> None:
        self._http = http
        self._model = model
        self._max_attempts = max_attempts
        self._deadline = deadline

    def _body(self, item: WorkItem) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self._model} if self._model else {}
        if item.max_tokens is not None:
            body["max_tokens"] = item.max_tokens
        if item.is_chat:
            body["messages"] = item.messages
            return "/v1/chat/completions", body
        body["prompt"] = item.prompt
        return "/v1/completions", body

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        path, body = self._body(item)
        r = timer.record
        timer.mark_sent()
        with anyio.move_on_after(self._deadline) as scope:
            while r.attempts < self._max_attempts:
                r.attempts += 1
                try:
                    response = await self._http.post(path, json=body)
                except httpx.TransportError as exc:
                    r.error = f"connection:{type(exc).__name__}"
                    r.message = f"{type(exc).__name__}: {exc}"
                    continue  # straight back in: no backoff is the point
                if response.status_code == 429:
                    r.http_429 += 1
                if response.status_code == 503:
                    r.http_503 += 1
                if response.status_code in RETRY_STATUSES:
                    r.error = f"http_{response.status_code}"
                    r.message = _message(response)
                    await anyio.lowlevel.checkpoint()  # yield to the loop, and nothing more
                    continue
                if response.status_code >= 400:
                    r.error = _cause(response)
                    r.message = _message(response)
                    r.admitted = response.status_code >= 500
                    timer.mark_end()
                    return
                try:
                    data = response.json()
                    choice = data["choices"][0]
                    r.output_tokens = int(data["usage"]["completion_tokens"])
                    r.finish_reason = choice.get("finish_reason")
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    r.error = f"bad_response:{type(exc).__name__}"
                    r.message = f"{path} answered 200 with a body it could not read: {exc!r}"
                    timer.mark_end()
                    return
                r.ok = True
                r.admitted = True
                r.error = None
                r.message = None
                timer.mark_end()  # not streamed: no first token to time
                return
        if scope.cancelled_caught:
            r.error = "deadline"
            r.message = f"no answer within the {self._deadline:g} s deadline"
        elif not r.ok and r.error is None:
            r.error = "gave_up"
        else:
            r.error = f"gave_up:{r.error}"
            r.message = f"gave up after {r.attempts} attempts; the last: {r.message}"
        timer.mark_end()


def _cause(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        code = error.get("code") if isinstance(error, dict) else None
        text = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        code = text = None
    code = None if code is None else str(code)
    if is_kv_exhaustion(code, text if isinstance(text, str) else None):
        return "oom"
    return f"http_{response.status_code}" + (f":{code}" if code else "")


def _message(response: httpx.Response) -> str:
    """``POST /path -> 429: the server's message`` (the body's start when it is not OpenAI's)."""
    where = f"{response.request.method} {response.request.url.path} -> {response.status_code}"
    try:
        error = response.json().get("error")
        text = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        text = None
    if not isinstance(text, str):
        text = response.text[:200]
    return f"{where}: {text}"
