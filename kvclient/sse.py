"""Server-sent events as OpenAI-compatible servers stream them: lines, events, deltas (pure).

Nothing here knows HTTP. :class:`LineSplitter` turns a body's bytes into lines, ending them only
at CR, LF or CRLF as SSE requires (``str.splitlines`` and httpx's line iterator also end lines
at U+0085, U+2028, U+2029 and other Unicode breaks, which token text may contain), and refuses a
line longer than :data:`MAX_LINE_BYTES` as soon as it has buffered that much.
:class:`SSEDecoder` takes those lines and yields the ``data`` of each event; :func:`iter_events`
and :func:`aiter_events` decode each as JSON until ``data: [DONE]`` (:data:`DONE`) ends the
stream. :func:`merge_delta` builds a chat message from its streamed deltas, as OpenAI's SDK
does. The client's streams (``kvclient._streaming``) and the gateway's assembler of a plain
answer from an upstream stream both read through these.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

from ._exceptions import APIResponseError

__all__ = [
    "DONE",
    "MAX_LINE_BYTES",
    "AsyncLines",
    "LineSplitter",
    "SSEDecoder",
    "aiter_events",
    "event_limit",
    "iter_events",
    "iter_lines",
    "merge_delta",
]

DONE = "[DONE]"
# One event larger than this is not a token delta; refuse instead of buffering without bound.
_MAX_EVENT_CHARS = 16 * 1024 * 1024
#: Longest line kvclient buffers, in bytes: one event's bound plus room for its field name.
MAX_LINE_BYTES = _MAX_EVENT_CHARS + 1024
_MAX_LINES_AFTER_DONE = 100
# A stream may send at most this many events per token it may generate (per choice), plus
# _EVENT_SLACK: servers send one event per token, plus role, usage and finish events.
_EVENTS_PER_TOKEN = 4
_EVENT_SLACK = 64
# ... and at most this many lines per event allowed (comments, blank lines, other fields).
_LINES_PER_EVENT = 16
_BOM = "\ufeff"


def event_limit(max_tokens: int, choices: int = 1) -> int:
    """The most events a stream of ``choices`` answers capped at ``max_tokens`` may send.

    ``4 x max_tokens x choices + 64``: a wide margin over one event per token, so only a
    server that never stops (or repeats itself) reaches it.
    """
    return _EVENTS_PER_TOKEN * max(max_tokens, 0) * max(choices, 1) + _EVENT_SLACK


class LineSplitter:
    """Feed the body's bytes in chunks of any size; get its complete lines, without endings.

    A line ends at CR, LF or CRLF only, also when the CR ends one chunk and the LF starts the
    next. Lines are decoded as UTF-8 (bad bytes replaced, a leading BOM dropped); since CR and LF
    never occur inside a UTF-8 sequence, splitting bytes first is splitting text. A line that
    grows past ``max_line`` bytes raises :class:`~kvclient.APIResponseError` before it is
    buffered: ``peak`` (the most bytes ever held) never exceeds ``max_line``.

    >>> splitter = LineSplitter()
    >>> splitter.feed("data: a\\u2028b\\r".encode()), splitter.feed(b"\\ndata: c"), splitter.flush()
    (['data: a\\u2028b'], [], ['data: c'])
    """

    __slots__ = ("_after_cr", "_buffer", "_started", "max_line", "peak")

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self.peak = 0
        self._buffer = bytearray()
        self._after_cr = False
        self._started = False

    def feed(self, chunk: bytes) -> list[str]:
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[:1] == b"\n":  # the LF of a CRLF split across chunks
                chunk = chunk[1:]
        if not chunk:
            return []
        # bytes.splitlines ends lines at \r, \n and \r\n only (str.splitlines does not).
        pieces = chunk.splitlines(keepends=True)
        tail = b"" if pieces[-1][-1:] in (b"\n", b"\r") else pieces.pop()
        lines = []
        buffer = self._buffer
        for piece in pieces:
            if buffer:
                self._check(len(buffer) + len(piece))
                piece = bytes(buffer) + piece
                buffer.clear()
            else:
                self._check(len(piece))
            lines.append(self._decode(piece.rstrip(b"\r\n")))
        if chunk[-1:] == b"\r":
            self._after_cr = True
        if tail:
            self._check(len(buffer) + len(tail))
            buffer += tail
            self.peak = max(self.peak, len(buffer))
        return lines

    def flush(self) -> list[str]:
        """The last line, when the body ended without a line ending."""
        if not self._buffer:
            return []
        line = self._decode(bytes(self._buffer))
        self._buffer.clear()
        return [line]

    def _check(self, size: int) -> None:
        if size > self.max_line:
            raise APIResponseError(
                f"stream line longer than {self.max_line} bytes without a line ending: "
                "not a token delta; refusing to buffer more"
            )

    def _decode(self, data: bytes) -> str:
        line = data.decode("utf-8", "replace")
        if not self._started:
            self._started = True
            line = line.removeprefix(_BOM)
        return line


def iter_lines(chunks: Iterable[bytes], *, max_line: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The SSE lines of a body given as byte chunks (see :class:`LineSplitter`)."""
    splitter = LineSplitter(max_line)
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.flush()


class AsyncLines:
    """Async :func:`iter_lines`, as a plain iterator rather than an async generator.

    An async generator left suspended when a stream is abandoned makes trio warn when it is
    collected; this object has nothing to leave unfinished (the byte iterator under it is the
    caller's to finish).
    """

    __slots__ = ("_chunks", "_ended", "_pending", "_splitter")

    def __init__(self, chunks: AsyncIterator[bytes], *, max_line: int = MAX_LINE_BYTES) -> None:
        self._chunks = chunks
        self._splitter = LineSplitter(max_line)
        self._pending: deque[str] = deque()
        self._ended = False

    def __aiter__(self) -> AsyncLines:
        return self

    async def __anext__(self) -> str:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._ended = True
                self._pending.extend(self._splitter.flush())
                continue
            self._pending.extend(self._splitter.feed(chunk))
        return self._pending.popleft()


class SSEDecoder:
    """Feed lines (without their line ending); get each complete event's data string.

    Follows the WHATWG rules kvclient needs: ``data:`` lines of one event join with ``\\n``, a
    blank line dispatches, ``:`` lines are comments, other fields (``event``, ``id``, ``retry``)
    are ignored. With ``max_events``, more events than that (or more than 16 lines per event
    allowed) raise :class:`~kvclient.APIResponseError`: see :func:`event_limit`.
    """

    __slots__ = ("_data", "_events", "_lines", "_size", "max_events")

    def __init__(self, *, max_events: int | None = None) -> None:
        self._data: list[str] = []
        self._size = 0
        self._events = 0
        self._lines = 0
        self.max_events = max_events

    def feed(self, line: str) -> str | None:
        limit = self.max_events
        if limit is not None:
            self._lines += 1
            if self._lines > _LINES_PER_EVENT * limit:
                raise APIResponseError(
                    f"stream sent more than {_LINES_PER_EVENT * limit} lines, more than "
                    f"{_LINES_PER_EVENT} per event its max_tokens allows ({limit}); cut off"
                )
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
        self._events += 1
        limit = self.max_events
        if limit is not None and self._events > limit and data.strip() != DONE:
            raise APIResponseError(
                f"stream sent more than {limit} events, far more than its max_tokens allows "
                f"(at most {_EVENTS_PER_TOKEN} per token per choice + {_EVENT_SLACK}); cut off"
            )
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


class _Events:
    """What :func:`iter_events` and :func:`aiter_events` share: the payloads each line
    completes, and whether ``[DONE]`` has come (``done``)."""

    __slots__ = ("_decoder", "done")

    def __init__(self, max_events: int | None) -> None:
        self._decoder = SSEDecoder(max_events=max_events)
        self.done = False

    def feed(self, line: str) -> list[dict[str, Any]]:
        return self._payloads(self._decoder.feed(line))

    def flush(self) -> Sequence[dict[str, Any] | None]:
        """The last event at end of stream: ``None`` for a ``[DONE]`` without a blank line."""
        payloads = self._payloads(self._decoder.flush())
        return [None] if self.done else payloads

    def _payloads(self, data: str | None) -> list[dict[str, Any]]:
        if data is None:
            return []
        if data.strip() == DONE:
            self.done = True
            return []
        return [_decode(data)]


def iter_events(
    lines: Iterable[str], *, max_events: int | None = None
) -> Iterator[dict[str, Any] | None]:
    """The JSON payload of each event until the end of ``lines``; ``None`` last for ``[DONE]``.

    ``max_events`` (see :func:`event_limit`) cuts off a stream that would never end.
    """
    events = _Events(max_events)
    for line in lines:
        yield from events.feed(line)
        if events.done:
            # Read the few bytes after [DONE] so the response ends cleanly (bounded: a server
            # that keeps talking after [DONE] is cut off).
            for _line in itertools.islice(lines, _MAX_LINES_AFTER_DONE):
                pass
            yield None
            return
    yield from events.flush()


async def aiter_events(
    lines: AsyncIterator[str], *, max_events: int | None = None
) -> AsyncGenerator[dict[str, Any] | None]:
    """Async :func:`iter_events`."""
    events = _Events(max_events)
    async for line in lines:
        for payload in events.feed(line):
            yield payload
        if events.done:
            # Exhaust the line iterator: an abandoned httpx async generator warns under trio.
            drained = 0
            async for _line in lines:
                drained += 1
                if drained >= _MAX_LINES_AFTER_DONE:
                    break
            yield None
            return
    for last in events.flush():
        yield last


# Delta keys whose value names something (replaced by a later value, never concatenated).
_REPLACED_KEYS = frozenset({"index", "id", "type", "role"})


def merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """Merge one streamed ``delta`` into the message built so far, as OpenAI's SDK does.

    Strings concatenate (``content``, ``reasoning_content``, a tool call's ``arguments``),
    except names (``id``, ``type``, ``role``, ``index``), which a later value replaces; objects
    merge key by key; in lists, items carrying an ``index`` merge with the item of that index
    (``tool_calls``), others append; a ``null`` never erases what came before.
    """
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
            continue
        old = into.get(key)
        if old is None or key in _REPLACED_KEYS:
            into[key] = _copy(value)
        elif isinstance(old, str) and isinstance(value, str):
            into[key] = old + value
        elif isinstance(old, dict) and isinstance(value, dict):
            merge_delta(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            _merge_items(old, value)
        else:
            into[key] = _copy(value)


def _merge_items(into: list[Any], items: list[Any]) -> None:
    for item in items:
        index = item.get("index") if isinstance(item, dict) else None
        if isinstance(index, int) and not isinstance(index, bool):
            for existing in into:
                if isinstance(existing, dict) and existing.get("index") == index:
                    merge_delta(existing, item)
                    break
            else:
                into.append(_copy(item))
        else:
            into.append(_copy(item))


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value
