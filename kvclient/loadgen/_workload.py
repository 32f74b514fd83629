"""Workloads: what each request of a run asks for (pure, seeded, reproducible).

Either a dataset file: our JSONL (one ``{"prompt": ...}`` or ``{"messages": [...]}`` per line,
optional ``"max_tokens"``) or ShareGPT's JSON (a list of ``{"conversations": [{"from": "human",
"value": ...}, {"from": "gpt", "value": ...}]}``); or synthetic draws of prompt length and output
cap, with a share of unset caps: the traffic the seed post warns about. Synthetic prompts have
exactly the drawn number of tokens for the run's tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._tokens import TokenCounter, Tokenizer

__all__ = [
    "MIXED",
    "Shape",
    "SyntheticWorkload",
    "WorkItem",
    "exact_prompt",
    "load_dataset",
    "load_jsonl",
    "load_sharegpt",
    "make_prompt",
]

# Common English words that cl100k_base encodes as one token each when preceded by a space, so a
# prompt of N words is N tokens and synthetic prompt lengths are exact.
_WORDS = (
    "the of and to in is for on that with as by at from this be are it an or was not have has "
    "but all can will more one about which their time use also new may other some what when "
    "there these into only any its most than out two been up first would like so after how over "
    "such where just many should people because each those year work through well while between "
    "could world years same very under must know three back being still even system during life "
    "before day health since data both information part without find they make used good great "
    "then high own state case family end need number way group "
).split()


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """A prompt of ``num_tokens`` words (tokens, for cl100k_base and most BPE vocabularies)."""
    return "".join(" " + rng.choice(_WORDS) for _ in range(num_tokens))


_EXACT_ROUNDS = 16


def exact_prompt(num_tokens: int, counter: TokenCounter, rng: random.Random) -> str:
    """A prompt of exactly ``num_tokens`` tokens as ``counter`` counts them.

    Common words first (exact at once for cl100k_base); for another tokenizer the text is cut
    back or topped up, token by token, until its count is exact.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    text = make_prompt(num_tokens, rng)
    for _ in range(_EXACT_ROUNDS):
        n = counter.count(text)
        if n == num_tokens:
            return text
        if n < num_tokens:
            text += make_prompt(num_tokens - n, rng)
        elif isinstance(counter, Tokenizer):
            ids = counter.encode(text)
            text = counter.decode(ids[: max(1, len(ids) - (n - num_tokens))])
        else:
            words = text.split(" ")
            text = " ".join(words[: max(2, len(words) - (n - num_tokens))])
    raise ValueError(
        f"could not make a prompt of exactly {num_tokens} tokens for this tokenizer "
        f"(it counts {counter.count(text)} for the closest text tried)"
    )


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request to send: a prompt or chat messages, and the cap the caller asked for."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    prompt_tokens: int = 0  # counted with the run's counter, for reporting

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @classmethod
    def of(
        cls, prompt: str, max_tokens: int | None, counter: TokenCounter, *, chat: bool
    ) -> WorkItem:
        """``prompt`` as a completion, or as one user message when ``chat``; counted."""
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return cls(
                messages=messages,
                max_tokens=max_tokens,
                prompt_tokens=counter.count_messages(messages),
            )
        return cls(prompt=prompt, max_tokens=max_tokens, prompt_tokens=counter.count(prompt))


def _check_range(name: str, bounds: tuple[int, int], minimum: int) -> tuple[int, int]:
    low, high = bounds
    if low < minimum or high < low:
        raise ValueError(f"{name} range must satisfy {minimum} <= min <= max, got {low}:{high}")
    return low, high


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of request in a synthetic mix: ranges of prompt and cap, and its weight."""

    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    unset_cap_share: float = 0.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        _check_range("prompt_tokens", self.prompt_tokens, 1)
        _check_range("max_tokens", self.max_tokens, 1)
        if not 0.0 <= self.unset_cap_share <= 1.0:
            raise ValueError(f"unset_cap_share must be within 0..1, got {self.unset_cap_share}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")


#: The seed's adversarial mix: short prompts with large or unset caps (the big promises), and long
#: prompts with small caps (big-looking, small promises).
MIXED = (
    Shape(prompt_tokens=(50, 300), max_tokens=(1000, 4000), unset_cap_share=0.5, weight=0.6),
    Shape(prompt_tokens=(1500, 5000), max_tokens=(50, 300), weight=0.4),
)


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Seeded random requests drawn from a mix of :class:`Shape`.

    ``chat=True`` sends each prompt as one user message to ``/v1/chat/completions``.
    """

    shapes: Sequence[Shape] = field(default=MIXED)
    chat: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("a synthetic workload needs at least one shape")

    def items(self, count: int, counter: TokenCounter) -> list[WorkItem]:
        rng = random.Random(self.seed)
        weights = [s.weight for s in self.shapes]
        items = []
        for _ in range(count):
            shape = rng.choices(self.shapes, weights)[0]
            prompt = exact_prompt(rng.randint(*shape.prompt_tokens), counter, rng)
            cap: int | None = rng.randint(*shape.max_tokens)
            if rng.random() < shape.unset_cap_share:
                cap = None
            items.append(WorkItem.of(prompt, cap, counter, chat=self.chat))
        return items


def _parse_line(number: int, line: str, counter: TokenCounter) -> WorkItem:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"line {number}: expected an object with 'prompt' or 'messages'")
    cap = data.get("max_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"line {number}: max_tokens must be a positive integer or absent")
    if isinstance(data.get("prompt"), str):
        prompt = data["prompt"]
        return WorkItem(prompt=prompt, max_tokens=cap, prompt_tokens=counter.count(prompt))
    messages = data.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and messages:
        return WorkItem(
            messages=messages, max_tokens=cap, prompt_tokens=counter.count_messages(messages)
        )
    raise ValueError(f"line {number}: expected a string 'prompt' or a list of 'messages'")


def load_jsonl(path: str | Path, counter: TokenCounter) -> list[WorkItem]:
    """Read a JSONL workload; blank lines are skipped, a bad line is an error naming it."""
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                items.append(_parse_line(number, line, counter))
    if not items:
        raise ValueError(f"{path}: no requests in the file")
    return items


def cycle(items: Sequence[WorkItem], count: int) -> Iterator[WorkItem]:
    """``count`` items, repeating the file's requests in order when it is shorter."""
    for i in range(count):
        yield items[i % len(items)]


_HUMAN = ("human", "user")
_MODEL = ("gpt", "assistant", "chatgpt", "bard", "model")


def _turn(turn: Any) -> tuple[str, str] | None:
    if not isinstance(turn, dict):
        return None
    who = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if not isinstance(who, str) or not isinstance(text, str):
        return None
    return who.lower(), text


def load_sharegpt(path: str | Path, counter: TokenCounter, *, chat: bool = False) -> list[WorkItem]:
    """Read a ShareGPT JSON file as vLLM's ``bench serve`` does: each conversation's first human
    turn is the prompt, and the reply after it sets ``max_tokens`` (its length in tokens).

    Conversations with no human turn, or an empty one, are skipped; ``chat=True`` sends each
    prompt as one user message.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    items = []
    for entry in data:
        turns = (
            entry.get("conversations", entry.get("conversation"))
            if isinstance(entry, dict)
            else None
        )
        if not isinstance(turns, list):
            continue
        parsed = [t for t in map(_turn, turns) if t is not None]
        first = next((i for i, (who, text) in enumerate(parsed) if who in _HUMAN and text), None)
        if first is None:
            continue
        prompt = parsed[first][1]
        reply = next((text for who, text in parsed[first + 1 :] if who in _MODEL), None)
        cap = max(1, counter.count(reply)) if reply else None
        items.append(WorkItem.of(prompt, cap, counter, chat=chat))
    if not items:
        raise ValueError(f"{path}: no conversation with a human turn (ShareGPT format)")
    return items


def load_dataset(path: str | Path, counter: TokenCounter, *, chat: bool = False) -> list[WorkItem]:
    """Our JSONL or ShareGPT JSON, told apart by the first character (``{`` or ``[``)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        return load_sharegpt(path, counter, chat=chat)
    return load_jsonl(path, counter)
