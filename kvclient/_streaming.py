"""Server-sent events for ``stream=True``: a pure line parser, then sync and async iterators.

The parser knows nothing of HTTP: it takes decoded lines and yields the ``data`` of each event.
``data: [DONE]`` ends the stream. A stream that ends without ``[DONE]`` and without any
``finish_reason`` was cut off: :class:`~kvclient.APIResponseError`, never a silent short answer.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import APIResponseError
from ._models import Completion, CompletionChunk, RetryEvent, Usage

__all__ = ["DONE", "SSEDecoder", "StreamAccumulator", "aiter_events", "iter_events"]

DONE = "[DONE]"
# One event larger than this is not a token delta; refuse instead of buffering without bound.
_MAX_EVENT_CHARS = 16 * 1024 * 1024
_MAX_LINES_AFTER_DONE = 100


class SSEDecoder:
    """Feed lines (without their line ending); get each complete event's data string.

    Follows the WHATWG rules kvclient needs: ``data:`` lines of one event join with ``\\n``, a
    blank line dispatches, ``:`` lines are comments, other fields (``event``, ``id``, ``retry``)
    are ignored.
    """

    __slots__ = ("_data", "_size")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._size = 0

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._size += len(value) + 1
            if self._size > _MAX_EVENT_CHARS:
                raise APIResponseError(f"stream event larger than {_MAX_EVENT_CHARS} characters")
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        """The pending event at a blank line or at end of stream, if any."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        self._size = 0
        return data


def _decode(data: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except ValueError:
        raise APIResponseError(f"stream event is not JSON: {data[:200]!r}") from None
    if not isinstance(payload, dict):
        raise APIResponseError(f"stream event is not a JSON object: {data[:200]!r}")
    error = payload.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        raise APIResponseError(f"server reported an error mid-stream: {message}")
    return payload


def iter_events(lines: Iterable[str]) -> Iterator[dict[str, Any] | None]:
    """The JSON payload of each event until the end of ``lines``; ``None`` last for ``[DONE]``."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is None:
            continue
        if data.strip() == DONE:
            # Read the few bytes after [DONE] so the response ends cleanly (bounded: a server
            # that keeps talking after [DONE] is cut off).
            for _line in itertools.islice(lines, _MAX_LINES_AFTER_DONE):
                pass
            yield None
            return
        yield _decode(data)
    data = decoder.flush()
    if data is not None:
        yield None if data.strip() == DONE else _decode(data)


async def aiter_events(lines: AsyncIterator[str]) -> AsyncGenerator[dict[str, Any] | None]:
    """Async :func:`iter_events`."""
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is None:
            continue
        if data.strip() == DONE:
            # Exhaust the line iterator: an abandoned httpx async generator warns under trio.
            drained = 0
            async for _line in lines:
                drained += 1
                if drained >= _MAX_LINES_AFTER_DONE:
                    break
            yield None
            return
        yield _decode(data)
    data = decoder.flush()
    if data is not None:
        yield None if data.strip() == DONE else _decode(data)


@dataclass(slots=True)
class StreamAccumulator:
    """Turns event payloads into chunks and, at the end, one aggregated :class:`Completion`."""

    chat: bool
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str | None = None
    id: str | None = None
    events: int = 0
    done: bool = False

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
            if self.chat:
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
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
            chunks.append(CompletionChunk(text, finish, index, payload))
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
        return Completion(
            text="".join(self.text_parts),
            finish_reason=self.finish_reason,
            usage=self.usage,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            attempts=attempts,
            retry_wait=retry_wait,
            history=history,
            model=self.model,
            id=self.id,
        )
