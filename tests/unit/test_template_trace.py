"""The traced-skeleton cache of chat templates: a filled skeleton equals a full render, always.

Every test compares a cached ``ChatTemplate`` with one whose cache is off
(``cache_shapes=0``), on conversations of one shape and many contents, so that a skeleton traced
for one content is replayed for the others. Templates that use content in ways a skeleton cannot
replay (``split``, ``tojson``, ``strftime_now``, C-level paths) must never be served from a
skeleton; templates that only concatenate, strip and test it must be (hits > 0), or the cache
would be a no-op.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvclient import ChatTemplateError
from kvclient._chat_template import ChatTemplate

pytest.importorskip("jinja2")

LOOP = "{% for m in messages %}"
END = "{% endfor %}"

#: Templates a skeleton can replay (each must hit the cache for some contents).
CACHEABLE = {
    "concat": LOOP + "<{{ m.role }}>{{ m.content }}</s>" + END,
    "plus": LOOP + "{{ '<' + m.role + '>' + m.content + '</s>' }}" + END,
    "trim": LOOP + "[{{ m.content | trim }}]" + END,
    "strip chars": LOOP + "[{{ m.content.strip('\\n') }}|{{ m.content.lstrip() }}]" + END,
    "rstrip": LOOP + "[{{ m.content.rstrip(' x') }}]" + END,
    "composite trim": LOOP + "[{{ (' \\n' + m.content + '  ') | trim }}]" + END,
    "composite of two": "[{{ (messages[0].content + messages[1].content) | trim }}]",
    "tilde": LOOP + "[{{ (m.content ~ ' ' ~ loop.index) | trim }}]" + END,
    "tilde compare": LOOP + "{% if (m.content ~ '') == 'x' %}X{% endif %}{{ m.content }}" + END,
    "truth": LOOP + "{% if m.content %}({{ m.content }}){% else %}(none){% endif %}" + END,
    "not": LOOP + "{% if not m.content | trim %}empty{% endif %}" + END,
    "length": LOOP + "{% if m.content | length > 3 %}long {% endif %}{{ m.content }}" + END,
    "equality": LOOP + "{% if m.content == 'x' %}is x{% endif %}{{ m.content }}" + END,
    "order": LOOP + "{% if m.content < 'm' %}early{% endif %}" + END,
    "two contents equal": "{% if messages[0].content == messages[1].content %}same{% endif %}.",
    "dict equality": LOOP + "{% if m == messages[-1] %}last:{% endif %}{{ m.content }}" + END,
    "in content": LOOP + "{% if '</think>' in m.content %}T{% endif %}{{ m.content }}" + END,
    "content in literal": LOOP + "{% if m.content in 'abc def' %}sub{% endif %}!" + END,
    "content in list": LOOP + "{% if m.content in ['x', 'abc'] %}listed{% endif %}!" + END,
    "in test": LOOP + "{% if m.content is in 'abc' %}sub{% endif %}!" + END,
    "startswith": LOOP
    + "{% if m.content.startswith('<tool_response>') and m.content.endswith('>') %}"
    "tool{% else %}{{ m.content }}{% endif %}" + END,
    "predicates": LOOP
    + "{{ m.content.isspace() }}{{ m.content.find('a') }}{{ m.content.count('x') }}"
    "{{ m.content is lower }}" + END,
    "default": LOOP + "{{ m.content | default('dflt', true) }}" + END,
    "string filter": LOOP + "{{ m.content | string | trim }}" + END,
    "join": "{{ messages | map(attribute='content') | join('\\n') | trim }}",
    "block set": LOOP + "{% set x %} {{ m.content }} {% endset %}{% if x | trim %}[{{ x | trim }}]"
    "{% endif %}" + END,
    "macro": "{% macro q(c) %} <{{ c }}> {% endmacro %}" + LOOP + "{{ q(m.content) | trim }}" + END,
    "namespace": "{% set ns = namespace(s='') %}"
    + LOOP
    + "{% set ns.s = ns.s + m.content %}"
    + END
    + "{{ ns.s | trim }}",
    "loop cycle": LOOP + "{{ loop.cycle('a', m.content) }}" + END,
    "sliced messages": "{% for m in messages[::-1] %}{{ m.content }}{% endfor %}",
    "attribute fallback": LOOP + "{% if m.content.content is defined %}?{% endif %}." + END,
}

#: Templates that read content in ways a skeleton cannot replay: always rendered in full.
UNCACHEABLE = {
    "split": LOOP + "{{ m.content.split('</think>')[-1] }}" + END,
    "replace": LOOP + "{{ m.content.replace('a', 'b') }}" + END,
    "upper filter": LOOP + "{{ m.content | upper }}" + END,
    "upper method": LOOP + "{{ m.content.upper() }}" + END,
    "index": LOOP + "{{ m.content[0] if m.content else '' }}" + END,
    "slice": LOOP + "{{ m.content[:-1] }}" + END,
    "tojson": LOOP + "{{ m.content | tojson }}" + END,
    "tojson message": LOOP + "{{ m | tojson }}" + END,
    "repr": "{{ messages }}",
    "percent": LOOP + "{{ '%s!' % m.content }}" + END,
    "format": LOOP + "{{ '{}!'.format(m.content) }}" + END,
    "format filter": LOOP + "{{ '%s!' | format(m.content) }}" + END,
    "times": LOOP + "{{ m.content * 2 }}" + END,
    "iterate": LOOP + "{% for ch in m.content %}{{ ch }}.{% endfor %}" + END,
    "list filter": LOOP + "{{ m.content | list | length }}" + END,
    "reverse": LOOP + "{{ m.content | reverse }}" + END,
    "literal startswith content": LOOP + "{{ 'abc def'.startswith(m.content) }}" + END,
    "literal find content": LOOP + "{{ 'abc'.find(m.content) }}" + END,
    "join method": "{{ ''.join([messages[0].content, 'x']) }}",
    "sameas": "{% if messages[0].content is sameas messages[1].content %}same{% endif %}.",
    "hash": LOOP + "{{ {m.content: 1} | length }}" + END,
    "wordcount": LOOP + "{{ m.content | wordcount }}" + END,
    "filter block": LOOP + "{% filter upper %}{{ m.content }}{% endfilter %}" + END,
    "block set compared": LOOP + "{% set x %}{{ m.content }}{% endset %}{{ x | upper }}" + END,
    "strftime": LOOP + "{{ m.content }}{{ strftime_now('%Y') }}" + END,
}

CONTENTS = [
    "hello",
    " hello ",
    "\nhello\n",
    "",
    "   ",
    "\n",
    "x",
    "xx x",
    "abc",
    "a",
    "m",
    "Mixed Case",
    "lower",
    "<tool_response>r</tool_response>",
    "<think>why</think>\n\nanswer",
    "</think>",
    "ab\U000f0000c",  # the marker character inside content: content never reaches a buffer
    "emoji 🚀 and 漢字",
]


def _conversations() -> list[list[dict[str, Any]]]:
    """Two-message conversations: each content paired with itself and three others."""
    n = len(CONTENTS)
    return [
        [{"role": "user", "content": a}, {"role": "assistant", "content": CONTENTS[(i + k) % n]}]
        for i, a in enumerate(CONTENTS)
        for k in (0, 1, 5, 11)
    ]


def _render(template: ChatTemplate, messages: list[dict[str, Any]]) -> Any:
    try:
        return template.render(messages)
    except ChatTemplateError as exc:
        return ("error", str(exc))


def _compare(source: str) -> ChatTemplate:
    cached = ChatTemplate(source, special_tokens={"bos_token": "<s>"})
    plain = ChatTemplate(source, special_tokens={"bos_token": "<s>"}, cache_shapes=0)
    for messages in _conversations():
        assert _render(cached, messages) == _render(plain, messages), messages
    assert plain.cache_info().hits == 0
    return cached


@pytest.mark.parametrize("name", sorted(CACHEABLE))
def test_a_filled_skeleton_equals_the_full_render(name: str) -> None:
    cached = _compare(CACHEABLE[name])
    assert cached.cache_info().hits > 0


@pytest.mark.parametrize("name", sorted(UNCACHEABLE))
def test_content_read_in_other_ways_is_never_replayed(name: str) -> None:
    cached = _compare(UNCACHEABLE[name])
    assert cached.cache_info().hits == 0


def test_same_string_object_in_two_messages() -> None:
    # `is sameas` sees identity: a skeleton traced on distinct strings must not answer for one
    # string object used twice.
    source = UNCACHEABLE["sameas"]
    cached = ChatTemplate(source)
    text = "shared"
    distinct = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    same = [{"role": "user", "content": text}, {"role": "user", "content": text}]
    assert cached.render(distinct)[0] == "."
    assert cached.render(same)[0] == "same."


def test_guards_decide_per_content_and_variants_are_bounded() -> None:
    source = LOOP + "{% if m.content | length > 3 %}long {% endif %}{{ m.content }}" + END
    cached = ChatTemplate(source)
    for n in range(1, 12):  # a length guard: every length is its own variant, up to a bound
        text, _ = cached.render([{"role": "user", "content": "y" * n}])
        assert text == ("long " if n > 3 else "") + "y" * n
    info = cached.cache_info()
    assert info.shapes == 1
    assert len(cached._cache[next(iter(cached._cache))]) <= 4
    assert cached.render([{"role": "user", "content": "zz"}])[0] == "zz"  # a held variant
    assert cached.cache_info().hits == info.hits + 1


def test_shape_includes_everything_but_content() -> None:
    source = (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}"
        ":{{ m.content }}{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}"
        ";{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}>{% endif %}{{ flag | default('') }}"
    )
    cached = ChatTemplate(source)
    plain = ChatTemplate(source, cache_shapes=0)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    variants: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
        ([{"role": "user", "content": "q"}], {}),
        ([{"role": "user", "content": "q", "name": "ann"}], {}),
        ([{"role": "user", "content": "q", "name": "bob"}], {}),
        ([{"role": "system", "content": "q"}], {}),
        ([{"role": "assistant", "content": "q", "tool_calls": [call]}], {}),
        ([{"role": "assistant", "content": "q", "tool_calls": [{**call, "id": "c2"}]}], {}),
        ([{"role": "user", "content": "q"}], {"tools": [tool]}),
        ([{"role": "user", "content": "q"}], {"add_generation_prompt": False}),
        ([{"role": "user", "content": "q"}], {"flag": 1}),
        ([{"role": "user", "content": "q"}], {"flag": True}),  # True == 1, renders differently
        ([{"role": "user", "content": "q"}], {"flag": 0.0}),
        ([{"role": "user", "content": "q"}], {"flag": -0.0}),
    ]
    for _ in range(3):  # seen, traced, filled
        for messages, kwargs in variants:
            assert cached.render(messages, **kwargs) == plain.render(messages, **kwargs)
    assert cached.cache_info().hits == len(variants)


def test_parts_media_and_unusual_input_take_the_full_path() -> None:
    parts = ChatTemplate(
        "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] | trim }}>"
        "{% endfor %}{% endfor %}"
    )
    assert parts.content_format == "openai"
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    for texts in (["a", " b "], ["", "c"], ["d"]):
        content = [{"type": "text", "text": t} for t in texts] + [image]
        text, media = parts.render([{"role": "user", "content": content}])
        assert text == "".join(f"<{t.strip()}>" for t in texts)
        assert media == 1
    string = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert string.render([{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}]) == (
        "[a\nb]",
        0,
    )

    class Sub(str):
        def strip(self, chars: Any = None) -> str:
            return "sub"

    # A str subclass reaches a parts template as it is (its own methods): never a skeleton's.
    sub = [{"role": "user", "content": [{"type": "text", "text": Sub(" a ")}]}]
    for _ in range(3):
        assert parts.render([{"role": "user", "content": " a "}])[0] == "<a>"
        assert parts.render(sub)[0] == "<sub>"
    trimmed = ChatTemplate("{% for m in messages %}{{ m.content | trim }}{% endfor %}")
    with pytest.raises(ChatTemplateError):
        trimmed.render([{"role": "user", "content": 3}])
    with pytest.raises(TypeError):
        trimmed.render([["not", "a", "mapping"]])  # type: ignore[list-item]


def test_rejections_are_never_cached() -> None:
    source = (
        "{% for m in messages %}{% if m.content == 'bad' %}"
        "{{ raise_exception('no: ' + m.content) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    cached = ChatTemplate(source)
    for _ in range(3):
        assert cached.render([{"role": "user", "content": "ok"}])[0] == "ok"
        with pytest.raises(ChatTemplateError, match="no: bad"):
            cached.render([{"role": "user", "content": "bad"}])


def test_cache_is_bounded_and_can_be_off() -> None:
    cached = ChatTemplate(LOOP + "{{ m.role }}{{ m.content }}" + END, cache_shapes=3)
    for i in range(10):
        cached.render([{"role": f"r{i}", "content": "c"}])
    assert cached.cache_info().shapes == 3
    off = ChatTemplate(LOOP + "{{ m.content }}" + END, cache_shapes=0)
    for _ in range(3):
        off.render([{"role": "user", "content": "c"}])
    assert off.cache_info() == (0, 0, 0)
    with pytest.raises(ValueError, match="cache_shapes"):
        ChatTemplate("x", cache_shapes=-1)
