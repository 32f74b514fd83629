"""Send work items through :class:`kvclient.AsyncClient`, recording what happened (I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._async_client import AsyncClient
from .._exceptions import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    KVClientError,
    PromptTooLongError,
    ServerBusyError,
)
from .._models import Completion, RetryEvent
from ..engines.errors import is_kv_exhaustion
from ._metrics import RecordTimer, RequestRecord
from ._workload import WorkItem

__all__ = ["KVClientSender", "failure_cause"]


def _count_statuses(record: RequestRecord, history: Sequence[RetryEvent]) -> None:
    for event in history:
        if event.status_code == 429:
            record.http_429 += 1
        elif event.status_code == 503:
            record.http_503 += 1


def failure_cause(error: KVClientError) -> str:
    """A short, stable name for why a request failed (the keys of ``failed_by_cause``).

    ``oom``: the engine ran out of KV cache, whether an error status said so or, streamed, an
    error event mid-stream (the stream's 200 had gone out before the pool overflowed)."""
    if isinstance(error, PromptTooLongError):
        return "prompt_too_long"
    if isinstance(error, ServerBusyError):
        return "server_busy"
    if isinstance(error, APIStatusError):
        if is_kv_exhaustion(error.code, error.message):
            return "oom"
        return f"http_{error.status_code}" + (f":{error.code}" if error.code else "")
    if isinstance(error, APIResponseError) and is_kv_exhaustion(None, error.message):
        return "oom"
    if isinstance(error, APITimeoutError):
        return "timeout"
    if isinstance(error, APIConnectionError):
        return "connection"
    if isinstance(error, APIResponseError):
        return "bad_response"
    return type(error).__name__


class KVClientSender:
    """The well-behaved sender: kvclient's clamp, cooldown and Retry-After pacing.

    With ``stream=True`` (the default) every chunk is time-stamped, which gives TTFT and
    inter-token latencies; otherwise only end-to-end latency is measured.
    """

    def __init__(self, client: AsyncClient, *, stream: bool = True) -> None:
        self._client = client
        self._stream = stream

    async def _call(self, item: WorkItem, timer: RecordTimer) -> Completion:
        params: dict[str, Any] = {"max_tokens": item.max_tokens}
        if not self._stream:
            if item.messages is not None:
                result = await self._client.chat(item.messages, **params)
            else:
                result = await self._client.complete(item.prompt or "", **params)
            return result  # no first token to time: TTFT and TPOT stay unknown, not zero
        if item.messages is not None:
            stream = self._client.chat_stream(item.messages, **params)
        else:
            stream = self._client.complete_stream(item.prompt or "", **params)
        async with stream:
            async for chunk in stream:
                if chunk.text:
                    timer.mark_token()
        completion = stream.completion
        if completion is None:  # pragma: no cover - a finished stream always has one
            raise APIResponseError("the stream ended without a result")
        return completion

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        record = timer.record
        timer.mark_sent()
        try:
            completion = await self._call(item, timer)
        except KVClientError as exc:
            record.error = failure_cause(exc)
            record.message = str(exc)
            record.attempts = max(1, int(getattr(exc, "attempts", 0) or 0))
            if isinstance(exc, PromptTooLongError) and exc.response is None:
                record.attempts = 0  # refused locally: nothing was sent
                record.refused_locally = True
            code = getattr(exc, "status_code", None)
            # A server error other than a gateway's or an overload's came after it took the work.
            record.admitted = record.first_token is not None or (
                isinstance(code, int) and code >= 500 and code not in (502, 503, 504)
            )
            history: Sequence[RetryEvent] = getattr(exc, "history", ()) or ()
            _count_statuses(record, history)
            record.backoff = sum(e.wait for e in history)
            status = getattr(exc, "status_code", None)
            last_error = getattr(exc, "last_error", None)
            status = status or getattr(last_error, "status_code", None)
            if status == 429:
                record.http_429 += 1
            elif status == 503:
                record.http_503 += 1
        else:
            record.ok = True
            record.admitted = True
            record.attempts = completion.attempts
            record.backoff = completion.retry_wait
            record.max_tokens_sent = completion.max_tokens
            record.finish_reason = completion.finish_reason
            _count_statuses(record, completion.history)
            if completion.usage is not None:
                record.output_tokens = completion.usage.completion_tokens
                record.server_prompt_tokens = completion.usage.prompt_tokens
            else:
                record.output_tokens = len(record.token_times)
        timer.mark_end()
