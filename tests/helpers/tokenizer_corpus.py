"""A deterministic corpus of texts and conversations for comparing token counts.

Varied on purpose where tokenizers and chat templates differ: prose, code, JSON, CJK, emoji,
digit and whitespace runs, special-token look-alikes, ``name`` fields, list-of-parts content,
system prompts, multi-turn chats, tool calls, and conversations whose roles do not alternate.
Everything comes from seeded ``random.Random`` instances: the same corpus on every run.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "can more out up about into than them could only other time new some these two may first "
    "then do any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come "
    "since against go came right used take three tokenization KV-cache admission Retry-After"
).split()
CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自之着去"
JAPANESE = "これはテストですひらがなカタカナ漢字を含む日本語の文章東京大阪"
KOREAN = "안녕하세요토큰화테스트한국어문장입니다"
EMOJI = ["😀", "🚀", "👍🏽", "🇫🇷", "👨‍👩‍👧‍👦", "❤️", "🔥", "🤖", "✨", "🧪", "🐍", "☕"]
OTHER_SCRIPTS = ["Ελληνικά κείμενα", "Русский текст", "نص عربي", "טקסט עברי", "हिन्दी पाठ", "ไทย"]
ACCENTS = ["café", "naïve", "façade", "Ångström", "über", "señor", "Zürich", "crème brûlée"]
LOOKALIKES = [
    "<|endoftext|>",
    "<|im_start|>",
    "<s>",
    "</s>",
    "[INST]",
    "<bos>",
    "<|eot_id|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "{{ bos_token }}",
    "{% raw %}",
]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "const x = await fetch(`/api/${id}`);\nconsole.log(x?.status ?? 'none');",
    'fn main() {\n    println!("{}", 1 + 2);\n}',
    "    if a and not b:\n        raise ValueError('bad')\n",
    "#include <stdio.h>\nint main(void) { return 0; }\n",
    "$ curl -s http://127.0.0.1:8000/v1/models | jq '.data[0]'",
]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 5)):
        s = _words(rng, rng.randint(3, 18))
        sentences.append(s[:1].upper() + s[1:] + rng.choice([".", "!", "?", "...", ";"]))
    return " ".join(sentences)


def _json(rng: random.Random) -> str:
    value: Any = {
        _words(rng, 1): rng.randint(-(10**6), 10**6),
        "items": [rng.random() for _ in range(rng.randint(0, 4))],
        "name": _words(rng, 2),
        "ok": rng.choice([True, False, None]),
        "nested": {"k": [_words(rng, 1), {"deep": rng.choice(EMOJI)}]},
    }
    indent = rng.choice([None, 2, 4])
    return json.dumps(value, indent=indent, ensure_ascii=rng.random() < 0.5)


def _cjk(rng: random.Random) -> str:
    pool = rng.choice([CJK, JAPANESE, KOREAN])
    text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.5:
        text += " " + _words(rng, rng.randint(1, 5))
    return text


def _emoji(rng: random.Random) -> str:
    return "".join(
        rng.choice(EMOJI) + (" " if rng.random() < 0.3 else "") for _ in range(rng.randint(1, 12))
    ) + rng.choice(["", " " + _words(rng, 3)])


def _digits(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 60)))
    if kind == 1:
        return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(10))
    if kind == 2:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 9)}f}"
    if kind == 3:
        return "2026-12-01T09:00:00Z, 10:45, 3.14159, 1e-9, 0x1F, 1,234,567.89"
    return "".join(rng.choice("0123456789 .,-+") for _ in range(rng.randint(5, 50)))


def _whitespace(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 6)):
        pieces.append(rng.choice([" ", "  ", "\t", "\n", "\n\n", "\r\n", " " * rng.randint(3, 40)]))
        if rng.random() < 0.7:
            pieces.append(_words(rng, rng.randint(1, 3)))
    return "".join(pieces)


def _mixed(rng: random.Random) -> str:
    parts = [
        rng.choice(ACCENTS),
        rng.choice(OTHER_SCRIPTS),
        rng.choice(LOOKALIKES),
        _words(rng, 3),
        rng.choice(CODE),
        rng.choice(EMOJI),
    ]
    rng.shuffle(parts)
    return rng.choice([" ", "", "\n"]).join(parts[: rng.randint(2, 6)])


def _long(rng: random.Random) -> str:
    return "\n\n".join(_prose(rng) for _ in range(rng.randint(8, 25)))


_KINDS = (_prose, _json, _cjk, _emoji, _digits, _whitespace, _mixed, _long)


def texts(n: int = 320, seed: int = 13) -> list[str]:
    """``n`` varied texts (the first few are edge cases: empty, one space, special-token text)."""
    rng = random.Random(seed)
    fixed = ["", " ", "\n", "a", " hello", "hello ", "<|endoftext|>", "<s>[INST]x[/INST]"]
    out = fixed + [rng.choice(CODE) for _ in range(8)]
    while len(out) < n:
        out.append(_KINDS[len(out) % len(_KINDS)](rng))
    return out[:n]


def _content(rng: random.Random) -> str:
    text = _KINDS[rng.randrange(len(_KINDS) - 1)](rng)  # no long ones: keep chats quick
    if rng.random() < 0.2:
        text = rng.choice([" ", "\n", "  \n"]) + text + rng.choice([" ", "\n\n", "\t"])
    return text


def _parts(rng: random.Random) -> list[Any]:
    parts: list[Any] = [{"type": "text", "text": _content(rng)} for _ in range(rng.randint(1, 3))]
    return parts


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, now.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "count_tokens",
            "description": "Tokens in a text.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    },
]


def _tool_call_id(rng: random.Random) -> str:
    # Mistral's template insists on 9 alphanumerics.
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(9))


def _tool_turns(rng: random.Random) -> list[dict[str, Any]]:
    """An assistant turn calling tools, and the tools' answers."""
    calls = []
    answers = []
    for _ in range(rng.randint(1, 2)):
        call_id = _tool_call_id(rng)
        arguments = json.dumps({"city": rng.choice([*ACCENTS, "Paris", "東京"]), "unit": "celsius"})
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        )
        answers.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": json.dumps({"temp": rng.randint(-20, 40), "sky": _words(rng, 2)}),
            }
        )
    return [{"role": "assistant", "content": None, "tool_calls": calls}, *answers]


def conversations(
    n: int = 110, seed: int = 7, *, tools: bool = True
) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """``n`` varied conversations as ``(messages, tools or None)``.

    About one in twelve does not alternate user/assistant roles (templates like Gemma's and
    Mistral's refuse those). With ``tools``, some call tools and pass ``TOOLS`` with the request.
    """
    rng = random.Random(seed)
    out: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for i in range(n):
        messages: list[dict[str, Any]] = []
        request_tools: list[dict[str, Any]] | None = None
        shape = i % 12
        if rng.random() < 0.45 or shape == 3:
            system: Any = _parts(rng)[:1] if shape == 5 else _content(rng)
            messages.append({"role": "system", "content": system})
        turns = 1 if shape in (0, 1) else rng.randint(1, 4)
        for turn in range(turns):
            user: dict[str, Any] = {"role": "user", "content": _content(rng)}
            if shape in (2, 6):
                user["content"] = _parts(rng)
            if shape == 7 and turn == 0:
                user["content"] = _long(rng)  # long enough for the counters' fast path
            if shape == 4 or rng.random() < 0.1:
                user["name"] = rng.choice(["alice", "bob_2", "Zoë"])
            messages.append(user)
            if turn < turns - 1:
                reply = _content(rng)
                if shape == 8:
                    reply = "<think>\n" + _words(rng, 6) + "\n</think>\n\n" + reply
                messages.append({"role": "assistant", "content": reply})
        if shape == 9:
            # Two user turns in a row: the roles do not alternate.
            messages.append({"role": "user", "content": _content(rng)})
        if shape == 10 and tools:
            request_tools = TOOLS
            messages.extend(_tool_turns(rng))
        if shape == 11 and tools:
            request_tools = TOOLS[: rng.randint(1, 2)]
        out.append((messages, request_tools))
    return out
