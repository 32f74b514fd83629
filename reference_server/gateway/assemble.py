"""A plain (non-streamed) completion assembled from the stream it went upstream as: pure, no I/O.

An engine that runs a plain request to its end after its client has gone, but stops a stream
at its next token (llama.cpp: :func:`kvclient.engines.behaviour.runs_on_after_reset`), is sent a
client's plain request as a stream; the client gets the plain answer that stream stands for:

- ``id``, ``object`` (``chat.completion`` or ``text_completion``), ``created``, ``model``,
  ``system_fingerprint`` when sent;
- ``choices`` in the order of their ``index`` (several choices come interleaved): a chat's
  ``message`` (``role``; ``content`` joined, ``""`` when none, as llama.cpp's plain answer has
  it; ``reasoning_content`` joined; ``tool_calls`` merged by their index, ``arguments``
  joined; any other delta field merged), a completion's ``text``; ``finish_reason``;
  ``logprobs`` when the stream carried the field, each list in it concatenated;
- ``usage``, and llama.cpp's ``timings`` beside it, from the chunk that carries them. With
  several choices llama.cpp sends one per choice (a chat's right after that choice's finish)
  and its plain answer gives choice 0's: so does this;
- every other field the engine sent, where it sent it: at the top (vLLM's
  ``kv_transfer_params``, ``prompt_token_ids``, ``prompt_logprobs``) and in a choice (vLLM's
  ``stop_reason``, ``token_ids``, a field no one here knows), a list's pieces concatenated
  (``token_ids`` come a few per chunk), else the last value that is not ``null``.

What llama.cpp's plain answer holds that its stream cannot give: nothing but what differs
between any two answers anyway (``id``, ``created``, ``timings``, ``cached_tokens``) and
``__verbose`` (its ``--verbose`` debugging field, left out).

An ``error`` event (llama.cpp sends ``{"error": {"code", "message", "type"}}`` mid-stream and
ends it) is the error the plain request would have been answered with: :class:`EngineError`,
its status the event's ``code`` (an HTTP error status; else 500). A stream that is not SSE of
JSON objects, has no choice, or ends before ``[DONE]`` with a choice unfinished, is
:class:`BrokenStream`.

>>> assembler = Assembler(chat=False)
>>> assembler.feed(b'data: {"id": "c", "choices": [{"index": 0, "text": "Hi"}]}\\n\\n')
>>> assembler.feed(b'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}\\n\\n')
>>> assembler.feed(b"data: [DONE]\\n\\n")
>>> assembler.end()["choices"]
[{'index': 0, 'text': 'Hi!', 'finish_reason': 'stop'}]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvclient import APIResponseError
from kvclient.sse import DONE, LineSplitter, SSEDecoder, merge_delta

__all__ = ["Assembler", "BrokenStream", "EngineError", "assemble"]

_OBJECTS = {True: "chat.completion", False: "text_completion"}
_HEAD = ("id", "created", "model", "system_fingerprint")
#: Top-level fields read apart from the others: a chunk's own (``object``), its choices, the
#: usage and timings kept per choice, an error event's.
_READ = frozenset({*_HEAD, "object", "choices", "usage", "timings", "error"})
#: A choice's fields read apart from the others.
_CHOICE_READ = frozenset({"index", "delta", "text", "logprobs", "finish_reason"})


class BrokenStream(ValueError):
    """The stream cannot be read as a completion's, or it was cut off."""


class EngineError(Exception):
    """The engine reported an error mid-stream: the answer a plain request would have got."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


@dataclass(slots=True)
class _Choice:
    parts: list[str] = field(default_factory=list)
    #: A chat's deltas but their content, merged (role, reasoning_content, tool_calls, ...).
    message: dict[str, Any] = field(default_factory=dict)
    finish_reason: Any = None
    logprobs: Any = None
    has_logprobs: bool = False
    #: Any other field the engine sent in the choice (``stop_reason``, ``token_ids``, ...).
    other: dict[str, Any] = field(default_factory=dict)


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BrokenStream(f"a choice's index is not a count: {index!r}")
    return index


def _join_logprobs(old: Any, new: Any) -> Any:
    """Logprobs of more tokens: each list concatenated (``content`` of a chat's and of
    llama.cpp's, the legacy ``tokens``, ``token_logprobs``, ...); ``null`` adds nothing."""
    if new is None:
        return old
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    joined = dict(old)
    for key, value in new.items():
        before = joined.get(key)
        if isinstance(before, list) and isinstance(value, list):
            joined[key] = before + value
        elif value is not None or key not in joined:
            joined[key] = value
    return joined


def _merge_other(into: dict[str, Any], piece: dict[str, Any], skip: frozenset[str]) -> None:
    """The fields of ``piece`` not in ``skip`` merged into ``into``: lists concatenated, else
    the last value that is not ``null`` (a ``null`` is kept until a value comes)."""
    for key, value in piece.items():
        if key in skip:
            continue
        before = into.get(key)
        if isinstance(before, list) and isinstance(value, list):
            into[key] = before + value
        elif value is not None or key not in into:
            into[key] = value


def _error_status(error: Any) -> int:
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return 500


class Assembler:
    """Feed the stream's bytes as they come; :meth:`end` gives the plain answer.

    ``chat``: a ``/v1/chat/completions`` stream (deltas) rather than a ``/v1/completions`` one
    (text pieces).
    """

    __slots__ = (
        "_choices", "_decoder", "_done", "_finished", "_head", "_lines", "_other", "_tails", "chat",
    )  # fmt: skip

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self._lines = LineSplitter()
        self._decoder = SSEDecoder()
        self._head: dict[str, Any] = {}
        #: The top-level fields but those read apart (``_READ``), merged.
        self._other: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        # Usage and timings by the choice they belong to.
        self._tails: dict[int, dict[str, Any]] = {}
        self._finished = 0  # the choice that finished last: a chat's usage chunk follows it
        self._done = False

    def feed(self, data: bytes) -> None:
        """More of the stream's bytes. Raises :class:`EngineError` at an error event."""
        try:
            for line in self._lines.feed(data):
                event = self._decoder.feed(line)
                if event is not None:
                    self._event(event)
        except APIResponseError as exc:  # a line or event past the SSE reader's bounds
            raise BrokenStream(exc.message) from None

    def end(self) -> dict[str, Any]:
        """The plain answer, once the stream has ended."""
        try:
            for line in self._lines.flush():
                event = self._decoder.feed(line)
                if event is not None:
                    self._event(event)
            event = self._decoder.flush()
        except APIResponseError as exc:
            raise BrokenStream(exc.message) from None
        if event is not None:
            self._event(event)
        choices = self._choices
        if not choices:
            raise BrokenStream("the stream ended without any choice")
        if not self._done and any(c.finish_reason is None for c in choices.values()):
            raise BrokenStream("the stream ended without [DONE] before every choice finished")
        answer: dict[str, Any] = {"id": self._head.get("id")}
        answer["object"] = _OBJECTS[self.chat]
        for key in _HEAD[1:]:
            if key in self._head:
                answer[key] = self._head[key]
        answer.update(self._other)
        answer["choices"] = [self._choice(i, choices[i]) for i in sorted(choices)]
        tails = self._tails
        tail = tails.get(0) or (tails[max(tails)] if tails else {})
        answer.update(tail)
        return answer

    def _event(self, data: str) -> None:
        if self._done:
            return  # nothing counts after [DONE]
        if data.strip() == DONE:
            self._done = True
            return
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            raise BrokenStream(f"a stream event is not JSON: {data[:200]!r}") from None
        if not isinstance(payload, dict):
            raise BrokenStream(f"a stream event is not a JSON object: {data[:200]!r}")
        error = payload.get("error")
        if error is not None:
            body = error if isinstance(error, dict) else {"message": str(error)}
            raise EngineError(_error_status(error), {"error": body})
        for key in _HEAD:
            if key in payload and key not in self._head:
                self._head[key] = payload[key]
        _merge_other(self._other, payload, _READ)
        choices = payload.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise BrokenStream(
                f"a stream event's choices are not a list of objects: {data[:200]!r}"
            )
        owner = _index(choices[0]) if choices else self._finished
        for choice in choices:
            self._piece(choice)
        for key in ("usage", "timings"):
            if payload.get(key) is not None:
                self._tails.setdefault(owner, {})[key] = payload[key]

    def _piece(self, choice: dict[str, Any]) -> None:
        index = _index(choice)
        into = self._choices.setdefault(index, _Choice())
        if self.chat:
            delta = choice.get("delta")
            if delta is None:
                delta = {}
            if not isinstance(delta, dict):
                raise BrokenStream(f"a chat stream's delta is not an object: {delta!r}")
            text = delta.get("content")
            merge_delta(into.message, {k: v for k, v in delta.items() if k != "content"})
        else:
            text = choice.get("text")
        if isinstance(text, str):
            into.parts.append(text)
        elif text is not None:
            raise BrokenStream(f"a streamed text is not a string: {text!r}")
        if "logprobs" in choice:
            into.has_logprobs = True
            into.logprobs = _join_logprobs(into.logprobs, choice["logprobs"])
        if choice.get("finish_reason") is not None:
            into.finish_reason = choice["finish_reason"]
            self._finished = index
        _merge_other(into.other, choice, _CHOICE_READ)

    def _choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.parts)
        out: dict[str, Any] = {"index": index}
        if self.chat:
            merged = choice.message
            message: dict[str, Any] = {"role": merged.get("role") or "assistant", "content": text}
            for key, value in merged.items():
                if key not in ("role", "tool_calls"):
                    message[key] = value
            calls = merged.get("tool_calls")
            if isinstance(calls, list) and calls:
                message["tool_calls"] = [
                    _tool_call(call) for call in sorted(calls, key=_call_order)
                ]
            out["message"] = message
        else:
            out["text"] = text
        if choice.has_logprobs:
            out["logprobs"] = choice.logprobs
        out["finish_reason"] = choice.finish_reason
        out.update(choice.other)
        return out


def _call_order(call: Any) -> int:
    index = call.get("index") if isinstance(call, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def _tool_call(call: Any) -> Any:
    """A tool call as a plain answer has it: without its stream index, its arguments a string."""
    if not isinstance(call, dict):
        return call
    whole = {k: v for k, v in call.items() if k != "index"}
    function = whole.get("function")
    if isinstance(function, dict) and function.get("arguments") is None:
        whole["function"] = {**function, "arguments": ""}
    return whole


def assemble(stream: bytes, *, chat: bool) -> dict[str, Any]:
    """The plain answer of a whole stream's bytes (see :class:`Assembler`)."""
    assembler = Assembler(chat=chat)
    assembler.feed(stream)
    return assembler.end()
