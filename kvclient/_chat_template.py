"""A model's chat template, rendered as ``transformers`` and vLLM render it (the ``hf`` extra).

Counting a chat request exactly means counting what the server tokenizes: the conversation passed
through the model's own Jinja2 chat template. This module renders it the way
``transformers.PreTrainedTokenizerBase.apply_chat_template`` does (an immutable sandbox,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a no-op
``{% generation %}`` tag, HF's ``tojson``, ``raise_exception``, ``strftime_now``), and prepares
messages the way vLLM's chat endpoint does before rendering:

- list-of-parts content is joined with newlines for templates that expect a string, and kept as a
  list of text parts for templates that iterate over a message's content (found, as vLLM finds
  it, by looking for a ``for`` loop over ``message['content']`` in the template's syntax tree);
- non-text parts (``image_url``, ``input_audio``, ...) are taken out and counted by the caller at
  a per-part cost, never as their URL's characters.

A template that rejects the conversation (``raise_exception``, or an error while rendering)
raises :class:`~kvclient.ChatTemplateError`. ``transformers`` is not used: it is the independent
reference the tests compare with.

Every chat is rendered in full: the count must be exact, and the template is the only thing
that knows what the server will see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from ._exceptions import ChatTemplateError, TokenizerError

__all__ = [
    "ChatTemplate",
    "ContentFormat",
    "detect_content_format",
    "split_parts",
]

ContentFormat = Literal["string", "openai"]

#: Part types whose text is counted; every other part is media, counted at a per-part cost.
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


def _import_jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
    except ImportError as exc:
        raise TokenizerError(
            "rendering chat templates needs jinja2: pip install 'kvclient[hf]'"
        ) from exc
    return jinja2


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping (Jinja's built-in escapes <, >, &, ') and the
    # json.dumps options exposed.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> Any:
    jinja2 = _import_jinja()

    extension: Any = jinja2.ext.Extension

    class _Generation(extension):  # type: ignore[misc]
        """``{% generation %}...{% endgeneration %}`` renders its body (HF marks spans with it)."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            text: str = caller()
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _is_access(node: Any, names: set[str], key: str | None, nodes: Any) -> bool:
    """``name``, ``name[key]`` or ``name.key``, through filters, tests and slices (vLLM's rule)."""
    while True:
        wrapped = isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None
        sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        if wrapped or sliced:
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.name in names
    if isinstance(node, nodes.Getitem):
        ok = isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        ok = node.attr == key
    else:
        return False
    return ok and isinstance(node.node, nodes.Name) and node.node.name in names


def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``.

    vLLM's rule: the variables holding the message list (``messages``, or set from it, e.g.
    ``loop_messages = messages[1:]``) give the loop variables over messages; a ``for`` loop over
    one of those variables' ``content`` means the template renders parts itself.
    """
    jinja2 = _import_jinja()
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc}") from exc
    nodes = jinja2.nodes
    lists = {"messages"}
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_access(assign.node, lists, None, nodes):
            lists.add(assign.target.name)
    loops = list(tree.find_all(nodes.For))
    items = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and _is_access(loop.iter, lists, None, nodes)
    }
    if any(_is_access(loop.iter, items, "content", nodes) for loop in loops):
        return "openai"
    return "string"


def split_parts(content: Any) -> tuple[list[str] | None, int]:
    """The text parts of a list-of-parts content and how many media parts it had.

    Returns ``(None, 0)`` when ``content`` is not a list (a string, None: left as it is).
    Plain strings inside the list count as text parts, as OpenAI's SDKs accept them.
    """
    if not isinstance(content, list):
        return None, 0
    texts: list[str] = []
    media = 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type", "text")
            if kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind not in _TEXT_PART_TYPES:
                media += 1
            else:
                raise ChatTemplateError(f"a {kind!r} content part has no string 'text'")
        else:
            raise ChatTemplateError(f"content parts must be objects, got {type(part).__name__}")
    return texts, media


def _parsed_call(call: Any) -> Any:
    """A tool call with its arguments as an object, as vLLM passes them to templates."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            function["arguments"] = {}
    elif not isinstance(arguments, (dict, list)):
        function["arguments"] = {}
    return {**call, "function": function}


class ChatTemplate:
    """One compiled chat template with the special tokens it is rendered with.

    >>> t = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    >>> t.render([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}])[0]
    '[a\\nb]'
    """

    __slots__ = ("_compiled", "_template_error", "content_format", "source", "special_tokens")

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, Any] | None = None,
        content_format: ContentFormat | None = None,
    ) -> None:
        jinja2 = _import_jinja()
        self.source = source
        #: ``bos_token``, ``eos_token``, ... as the template sees them (transformers passes the
        #: tokenizer's whole special-token map).
        self.special_tokens: dict[str, Any] = dict(special_tokens or {})
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"the chat template does not parse: {exc}") from exc
        self._template_error = jinja2.TemplateError
        self.content_format: ContentFormat = (
            content_format if content_format is not None else detect_content_format(source)
        )

    def prepare(
        self,
        messages: Sequence[Mapping[str, Any]],
    ) -> tuple[list[dict[str, Any]], int]:
        """Messages as vLLM hands them to the template, and the media parts taken out.

        As vLLM's ``parse_chat_messages``: content ``None`` becomes ``""`` (``[]`` for a template
        that iterates over parts), a string stays a string (becomes one text part), list-of-parts
        is joined with newlines (kept as text parts); only ``role``, ``content``, ``name``,
        ``tool_calls`` (assistant), ``tool_call_id`` (tool) and ``reasoning`` reach the template;
        tool-call arguments given as a JSON string are parsed into an object (``{}`` if invalid).
        """
        checked: object = messages
        if isinstance(checked, (str, bytes)) or not isinstance(checked, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
        prepared: list[dict[str, Any]] = []
        media = 0
        parts_kept = self.content_format == "openai"
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"each message must be a mapping, got {type(message).__name__}")
            role = message.get("role")
            content = message.get("content")
            if content is None:
                texts: list[str] = []
            elif isinstance(content, str):
                texts = [content]
            else:
                split, count = split_parts(content)
                if split is None:
                    raise ChatTemplateError(
                        f"content must be a string or a list of parts, got {type(content).__name__}"
                    )
                texts, media = split, media + count
            out: dict[str, Any] = {"role": role}
            if parts_kept and role != "tool":
                out["content"] = [{"type": "text", "text": text} for text in texts]
            else:
                out["content"] = "\n".join(texts)
            if role == "assistant":
                calls = message.get("tool_calls")
                if isinstance(calls, list) and calls:
                    out["tool_calls"] = [_parsed_call(call) for call in calls]
                reasoning = message.get("reasoning", message.get("reasoning_content"))
                if reasoning is not None:
                    out["reasoning"] = out["reasoning_content"] = reasoning
            elif role == "tool" and "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            if isinstance(message.get("name"), str):
                out["name"] = message["name"]
            prepared.append(out)
        return prepared, media

    def _context(
        self,
        prepared: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        # As transformers renders: tools and documents always defined (None when absent).
        return {
            **self.special_tokens,
            **extra,
            "messages": prepared,
            "tools": [dict(tool) for tool in tools] if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> tuple[str, int]:
        """The prompt text the server tokenizes, and the media parts left for the caller to cost."""
        prepared, media = self.prepare(messages)
        return self._render_full(prepared, tools, add_generation_prompt, extra), media

    def _render_full(
        self,
        prepared: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: dict[str, Any],
    ) -> str:
        context = self._context(prepared, tools, add_generation_prompt, extra)
        try:
            text: str = self._compiled.render(**context)
        except self._template_error as exc:
            raise ChatTemplateError(
                f"the model's chat template rejects this conversation: {exc}"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the model's chat template cannot render this conversation: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return text
