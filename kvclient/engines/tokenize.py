"""An engine's own count of a prompt: its ``/tokenize`` (pure).

:func:`tokenize` is a driver like :func:`kvclient.engines.discovery.discover_context`: it yields
the ``/tokenize`` (and llama.cpp's ``/apply-template``) requests each engine takes and reads their
answers. :data:`RENDER_FIELDS` are a chat request's own fields that change the prompt an engine
renders; :func:`countable_render_fields` says which of them an engine's count can take.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._answers import dig
from .discovery import Answer, Probe

__all__ = [
    "RENDER_FIELDS",
    "TOKENIZE_ENGINES",
    "Tokenized",
    "count_by_tokenize",
    "countable_render_fields",
    "tokenize",
]

#: Engines whose ``POST /tokenize`` counts what their generation endpoints count.
TOKENIZE_ENGINES = frozenset({"vllm", "llama.cpp", "tgi"})


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A server's own tokenization of a prompt: its count, and its token ids when it gave them
    (each a whole number, as many as the count; None otherwise)."""

    count: int
    ids: tuple[int, ...] | None = None


def _token_list(payload: Any, key: str | None, count: int | None = None) -> Tokenized | None:
    tokens = payload.get(key) if key is not None and isinstance(payload, dict) else payload
    if not isinstance(tokens, list):
        return None if count is None else Tokenized(count)
    if count is not None and count != len(tokens):
        return Tokenized(count)
    whole = all(type(t) is int and t >= 0 for t in tokens)
    return Tokenized(len(tokens), tuple(tokens) if whole else None)


def count_by_tokenize(engine: str | None, **request: Any) -> Generator[Probe, Answer, int | None]:
    """The server's own count of a prompt or a chat request (its template applied), or None
    when its ``/tokenize`` cannot say: :func:`tokenize`'s count, for :func:`tokenize`'s
    keyword arguments (``prompt``, ``messages``, ``model``, ``tools``, ``render``)."""
    found = yield from tokenize(engine, **request)
    return None if found is None else found.count


def tokenize(
    engine: str | None,
    *,
    prompt: str | None = None,
    messages: list[Any] | None = None,
    model: str | None = None,
    tools: list[Any] | None = None,
    render: Mapping[str, Any] | None = None,
) -> Generator[Probe, Answer, Tokenized | None]:
    """The server's own tokenization of a prompt or a chat request (its template applied), or
    None when its ``/tokenize`` cannot say. A driver like :func:`discover_context`.

    ``render``: the chat request's own fields that change the rendered prompt
    (:data:`RENDER_FIELDS`, see :func:`countable_render_fields`), sent with its messages.

    - vLLM (and our reference server): ``POST /tokenize`` ``{"prompt"}`` or ``{"messages",
      "add_generation_prompt": true}`` -> ``count``;
    - llama.cpp: a chat is rendered by ``POST /apply-template`` (without the BOS, which
      tokenizing adds), then ``POST /tokenize`` ``{"content", "add_special": true}`` ->
      ``tokens``, as its chat endpoint counts;
    - TGI: ``POST /tokenize`` ``{"inputs"}`` -> a list of tokens (prompts only).

    A chat's ``tools`` go with its messages (vLLM's ``/tokenize`` and llama.cpp's
    ``/apply-template`` take them), so a template that lays them out counts them.
    """
    if engine == "vllm":
        body: dict[str, Any] = (
            {"messages": messages, "add_generation_prompt": True}
            if messages is not None
            else {"prompt": prompt}
        )
        if messages is not None and tools is not None:
            body["tools"] = tools
        if messages is not None and render:
            body.update(render)
        if model is not None:
            body["model"] = model
        answer = yield Probe("POST", "/tokenize", body, engines="vLLM, ours")
        if answer.status != 200 or not isinstance(answer.payload, dict):
            return None
        count = answer.payload.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return _token_list(answer.payload, "tokens", count)
        return _token_list(answer.payload, "tokens")
    if engine == "llama.cpp":
        text = prompt
        if messages is not None:
            template_body: dict[str, Any] = {"messages": messages}
            if tools is not None:
                template_body["tools"] = tools
            if render:
                template_body.update(render)
            answer = yield Probe("POST", "/apply-template", template_body, "llama.cpp")
            rendered = dig(answer.payload, "prompt") if answer.status == 200 else None
            if not isinstance(rendered, str):
                return None
            text = rendered
        body = {"content": text, "add_special": True}
        answer = yield Probe("POST", "/tokenize", body, engines="llama.cpp")
        return _token_list(answer.payload, "tokens") if answer.status == 200 else None
    if engine == "tgi" and prompt is not None:
        answer = yield Probe("POST", "/tokenize", {"inputs": prompt}, engines="TGI")
        return _token_list(answer.payload, None) if answer.status == 200 else None
    return None


#: A chat request's own fields that change the prompt its engine renders.
RENDER_FIELDS = (
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
)
#: The render fields each engine's own count (``/tokenize``, ``/apply-template``) takes as its
#: chat endpoint does, so that counting them is exact. vLLM's ``/tokenize`` has no
#: ``documents``.
_COUNTED_RENDER_FIELDS: dict[str, frozenset[str]] = {
    "vllm": frozenset(RENDER_FIELDS) - {"documents"},
    "llama.cpp": frozenset(RENDER_FIELDS),
}


def countable_render_fields(engine: str | None, present: Iterable[str]) -> str | None:
    """The first of the ``present`` render fields that ``engine``'s own count cannot take (it
    would count a prompt other than the one generated), or None when it takes them all."""
    taken = _COUNTED_RENDER_FIELDS.get(engine or "", frozenset())
    return next((name for name in present if name not in taken), None)
