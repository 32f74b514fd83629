"""Workloads: what each request of a run asks for (pure, seeded, reproducible).

Either a JSONL file (one ``{"prompt": ...}`` or ``{"messages": [...]}`` per line, optional
``"max_tokens"``), or synthetic draws of prompt length and output cap, with a share of unset caps:
the traffic the seed post warns about.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._tokens import TokenCounter

__all__ = ["MIXED", "Shape", "SyntheticWorkload", "WorkItem", "load_jsonl", "make_prompt"]

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
            prompt = make_prompt(rng.randint(*shape.prompt_tokens), rng)
            cap: int | None = rng.randint(*shape.max_tokens)
            if rng.random() < shape.unset_cap_share:
                cap = None
            if self.chat:
                messages = [{"role": "user", "content": prompt}]
                items.append(
                    WorkItem(
                        messages=messages,
                        max_tokens=cap,
                        prompt_tokens=counter.count_messages(messages),
                    )
                )
            else:
                items.append(
                    WorkItem(prompt=prompt, max_tokens=cap, prompt_tokens=counter.count(prompt))
                )
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
