"""A holder's progress, read from its engine's stream: pure, no I/O.

Under the peak admission rule (:mod:`reference_server.admission.peak`) the gateway asks an
engine that can say so (:data:`kvclient.engines.behaviour.PROGRESS_ENGINES`) for the usage so far in
every chunk of a stream (``stream_options.continuous_usage_stats``), and follows each holder's
``completion_tokens`` as the chunks pass. What the client did not ask for is taken out again: the
usage in its chunks stays (a field OpenAI's chunks have), the last chunk that carries only the
usage (no choice) goes, unless the client asked for ``include_usage`` itself.

The usage of a whole answer (:func:`completion_tokens`) is read with the same pattern.

Events are split at blank lines (``\\n\\n``, as vLLM and our server end them; a ``\\r\\n\\r\\n``
ends one too) and passed on whole; an unfinished event waits for the rest of it.

>>> reader = ProgressReader(drop_usage_only=True)
>>> reader.feed(b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}\\n\\nda')
b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}\\n\\n'
>>> reader.generated
1
>>> reader.feed(b'ta: {"choices": [], "usage": {"completion_tokens": 1}}\\n\\ndata: [DONE]\\n\\n')
b'data: [DONE]\\n\\n'
"""

from __future__ import annotations

import re

__all__ = ["ProgressReader", "completion_tokens"]

#: A complete ``completion_tokens`` figure: the digits must be followed by what ends a JSON
#: number in an object, so a figure cut between two pieces is never read short.
_FIGURE = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})\s*[,}]')
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_NO_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\]')
#: Why a choice ended, where a chunk says (``"stop"``: an end-of-sequence or stop token).
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]{1,32})"')
#: An unfinished event larger than this is passed on as it is (no engine sends one this long
#: without a break; it is not a stream of ours to read).
_MAX_PENDING = 1 << 20


class ProgressReader:
    """Reads ``completion_tokens`` from a stream's events as they pass; see the module."""

    def __init__(self, *, drop_usage_only: bool) -> None:
        self.drop_usage_only = drop_usage_only
        #: The tokens generated so far, by the latest chunk that said.
        self.generated = 0
        #: Why the output ended, once a chunk said (``"stop"``, ``"length"``, ...).
        self.finish_reason: str | None = None
        self._pending = b""

    def feed(self, piece: bytes) -> bytes:
        """The events of ``piece`` (and of what came before it) completed by it, to relay."""
        data = self._pending + piece if self._pending else piece
        ends = list(_EVENT_END.finditer(data))
        if not ends:
            if len(data) > _MAX_PENDING:
                self._pending = b""
                return data
            self._pending = data
            return b""
        cut = ends[-1].end()
        self._pending = data[cut:]
        events = data[:cut]
        found = [int(m.group(1)) for m in _FIGURE.finditer(events)]
        if found:
            self.generated = max(self.generated, *found)
        for finish in _FINISH.finditer(events):
            self.finish_reason = finish.group(1).decode("ascii")
        if not self.drop_usage_only or b'"usage"' not in events:
            return events
        kept: list[bytes] = []
        start = 0
        for end in ends:
            event = data[start : end.end()]
            start = end.end()
            if not (_NO_CHOICE.search(event) and _FIGURE.search(event)):
                kept.append(event)
        return b"".join(kept)

    def end(self) -> bytes:
        """What is left when the stream ends (an event without its blank line)."""
        rest, self._pending = self._pending, b""
        return rest


def completion_tokens(content: bytes) -> int:
    """``usage.completion_tokens`` of an answer, found without parsing the whole answer again
    (in JSON text a key is always a quoted string; inside generated text its quotes are
    escaped, so the pattern cannot match there). The last one counts: usage comes last. 0 when
    absent or not a plain integer of at most 12 digits."""
    at = content.rfind(b'"completion_tokens"')
    if at < 0:
        return 0
    found = _FIGURE.match(content, at)
    return int(found.group(1)) if found else 0
