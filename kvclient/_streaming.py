"""A client's ``stream=True``: event payloads into chunks and one aggregated completion.

The lines and events come from :mod:`kvclient.sse`; here they become
:class:`~kvclient.CompletionChunk` objects and, at the end, a :class:`~kvclient.Completion`.
A stream that ends without ``[DONE]`` and without any ``finish_reason`` was cut off:
:class:`~kvclient.APIResponseError`, never a silent short answer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from ._exceptions import APIConnectionError, APIResponseError
from ._http import Bounded, transport_error
from ._models import Completion, CompletionChunk, RetryEvent, ToolCall, Usage
from .sse import event_limit, merge_delta

if TYPE_CHECKING:
    from ._client import Prepared
    from ._replicas import Call

__all__ = ["StreamAccumulator", "StreamBase"]


def _call_index(call: dict[str, Any]) -> int:
    index = call.get("index")
    return index if isinstance(index, int) else 0


def _tool_call_fragments(delta: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return ()
    return tuple(call for call in calls if isinstance(call, dict))


@dataclass(slots=True)
class StreamAccumulator:
    """Turns event payloads into chunks and, at the end, one aggregated :class:`Completion`.

    For chat streams, the deltas of choice 0 other than its text (``role``, ``tool_calls``,
    ``reasoning_content``, ...) merge into ``message`` (see :func:`merge_delta`), so the
    completion carries what the non-streamed answer's ``message`` would.
    """

    chat: bool
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str | None = None
    id: str | None = None
    events: int = 0
    done: bool = False
    message: dict[str, Any] = field(default_factory=dict)

    def feed(self, payload: dict[str, Any]) -> list[CompletionChunk]:
        self.events += 1
        if isinstance(payload.get("model"), str):
            self.model = payload["model"]
        if isinstance(payload.get("id"), str):
            self.id = payload["id"]
        usage = Usage.from_json(payload.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return []
        chunks = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta: dict[str, Any] = {}
            if self.chat:
                raw_delta = choice.get("delta")
                delta = raw_delta if isinstance(raw_delta, dict) else {}
                text = delta.get("content")
            else:
                text = choice.get("text")
            text = text if isinstance(text, str) else ""
            index = choice.get("index")
            index = index if isinstance(index, int) else 0
            finish = choice.get("finish_reason")
            finish = finish if isinstance(finish, str) else None
            if index == 0:
                self.text_parts.append(text)
                if finish is not None:
                    self.finish_reason = finish
                if delta:
                    merge_delta(self.message, {k: v for k, v in delta.items() if k != "content"})
            chunks.append(
                CompletionChunk(
                    text,
                    finish,
                    index,
                    payload,
                    delta=delta,
                    tool_calls=_tool_call_fragments(delta),
                )
            )
        return chunks

    def end(self, *, saw_done: bool) -> None:
        """The stream ended; raise if it was cut off."""
        self.done = True
        if not saw_done and self.finish_reason is None:
            raise APIResponseError(
                f"stream ended after {self.events} events without [DONE] or a finish_reason: "
                "the connection was cut or the server failed mid-answer"
            )

    def completion(
        self,
        *,
        max_tokens: int,
        prompt_tokens: int,
        attempts: int,
        retry_wait: float,
        history: tuple[RetryEvent, ...],
    ) -> Completion:
        text = "".join(self.text_parts)
        message: dict[str, Any] | None = None
        if self.chat:
            message = {"role": "assistant", **self.message}
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                # In the order of their index, without it: as the non-streamed message has them.
                message["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"}
                    for call in sorted(
                        (call for call in calls if isinstance(call, dict)), key=_call_index
                    )
                ]
            message["content"] = text if text or not message.get("tool_calls") else None
        return Completion(
            text=text,
            finish_reason=self.finish_reason,
            usage=self.usage,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            attempts=attempts,
            retry_wait=retry_wait,
            history=history,
            model=self.model,
            id=self.id,
            message=message,
            tool_calls=ToolCall.from_message(message),
        )


class StreamBase:
    """The pure half of a client's stream: events in, chunks out, the aggregated completion at
    the end (``AsyncStream`` and ``Stream`` add the I/O).

    Time: the call's deadline bounds the stream up to its first event (comments such as
    ``: ping`` do not count); after it, each next event must come within ``read_timeout``.
    The stream holds its call's send-window slot until its body is closed.
    """

    def __init__(
        self,
        prepared: Prepared | None,
        *,
        chat: bool,
        read_timeout: float | None,
        clock: Callable[[], float],
    ) -> None:
        self._prepared_value = prepared
        self._acc = StreamAccumulator(chat=chat)
        self._pending: deque[CompletionChunk] = deque()
        self._call: Call | None = None
        self._completion: Completion | None = None
        self._read_timeout = read_timeout
        self._clock = clock
        # The open body: its deadline moves after each event; closing it gives the slot back.
        self._bounded: Bounded | None = None

    def _opened(self, response: httpx.Response) -> None:
        stream = response.stream
        self._bounded = stream if isinstance(stream, Bounded) else None

    def _max_events(self) -> int:
        """How many events this stream may send (see :func:`event_limit`)."""
        prepared = self._prepared
        n = prepared.body.get("n")
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        return event_limit(prepared.max_tokens, choices)

    def _wait_for_event(self) -> None:
        """Before waiting for the next event: it must come within the read timeout."""
        bounded = self._bounded
        if bounded is None:
            return
        read = self._read_timeout
        bounded.deadline = None if read is None else self._clock() + read
        bounded.why = f"no stream event within the read timeout of {read}s"

    def _give_back_slot(self) -> None:
        if self._bounded is not None:
            self._bounded.release()

    def _feed(self, payload: dict[str, Any] | None) -> None:
        if payload is None:
            self._end(saw_done=True)
        else:
            self._pending.extend(self._acc.feed(payload))

    @property
    def _prepared(self) -> Prepared:
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
        error = transport_error(exc, request, answered=True)
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
