"""A simulated decoding engine with a physical KV pool that can really run out.

No GPU, no model: each sequence "decodes" real tokens of the configured tokenizer at
``decode_rate`` tokens per second, in ticks (one wake-up per tick, not per token). The physical
pool holds, per live sequence, its prompt plus what it has generated so far, in whole blocks. If
that ever exceeds the pool's capacity, every live sequence fails with :class:`EngineOOMError` and
the pool is emptied: the mid-decode crash that reserving only for the prompt leads to.

A sequence stops by itself at a natural length drawn for it (its end-of-sequence token), unless
the request says ``ignore_eos`` or ``min_tokens``, as vLLM's sampling parameters do: load that
must fill the pool (the contract suite's bursts) runs to its cap.

With ``fault_rate`` > 0 the engine also fails that share of sequences on purpose, at a random
token (:class:`EngineFaultError`), so tests and the soak can check that every failure path gives
the reservation back.

Output is reproducible: natural output lengths and words are drawn from one ``random.Random(seed)``
in the order sequences start; faults from a second generator of the same seed, so turning them on
changes no output. Runs under asyncio and trio (anyio only).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio

from kvclient import DEFAULT_BLOCK_SIZE, Tokenizer, round_up_to_blocks

__all__ = ["Completion", "EngineFaultError", "EngineOOMError", "EngineStats", "SimulatedEngine"]

FinishReason = Literal["stop", "length"]
OnText = Callable[[str], Awaitable[None]]

# Common English words; those that the tokenizer encodes as one token with a leading space form
# the vocabulary, so a generated text of n words re-tokenizes to exactly n tokens.
_WORDS = (
    "the of and to in is was for that on as with by at from his her they this be are have had "
    "not but were which one all their there been when who will more would time so some can "
    "about them into only other new than then its over also after people first made may world "
    "years state work under just many where most such through well city part day back good "
    "long water place year while light house small great found still three between high every "
    "own old name right before must again country might point end hand home river story few "
    "open small song game stone green round quiet north south early level model cache token "
    "memory server"
).split()


class EngineOOMError(Exception):
    """The physical KV pool overflowed; every in-flight sequence was lost."""

    def __init__(self, used_tokens: int, capacity_tokens: int) -> None:
        super().__init__(
            f"KV cache out of memory: {used_tokens} tokens in use exceed the physical capacity "
            f"of {capacity_tokens}; all in-flight sequences were aborted"
        )
        self.used_tokens = used_tokens
        self.capacity_tokens = capacity_tokens


class EngineFaultError(Exception):
    """A sequence failed on purpose (``fault_rate``): a stand-in for any engine error."""

    def __init__(self, generated_tokens: int) -> None:
        super().__init__(f"injected fault after {generated_tokens} generated tokens")
        self.generated_tokens = generated_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """What a finished sequence produced."""

    text: str
    completion_tokens: int
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    capacity_tokens: int
    used_tokens: int
    peak_used_tokens: int
    running: int
    started_total: int
    finished_total: int
    oom_events_total: int
    oom_failed_sequences_total: int
    faults_total: int
    generated_tokens_total: int


class _Sequence:
    __slots__ = ("failure", "generated", "id", "prompt_tokens", "used")

    def __init__(self, id: int, prompt_tokens: int) -> None:
        self.id = id
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.used = 0  # tokens charged to the pool, in whole blocks
        self.failure: EngineOOMError | None = None


class _WordStream:
    """A sequence's own reproducible stream of vocabulary tokens (a 64-bit LCG).

    Seeding a ``random.Random`` per sequence cost about 15 µs, 5 % of a one-token request; the
    words only need to be reproducible and varied, not statistically strong.
    """

    _MULTIPLIER = 6364136223846793005  # Knuth's MMIX constants
    _INCREMENT = 1442695040888963407
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int, vocab: Sequence[int]) -> None:
        self._state = seed
        self._vocab = vocab

    def take(self, n: int) -> list[int]:
        state, vocab, size = self._state, self._vocab, len(self._vocab)
        out = []
        for _ in range(n):
            state = (state * self._MULTIPLIER + self._INCREMENT) & self._MASK
            out.append(vocab[(state >> 33) % size])  # the high bits: the low ones cycle short
        self._state = state
        return out


def _vocabulary(tokenizer: Tokenizer) -> list[int]:
    ids: list[int] = []
    seen: set[int] = set()
    for word in _WORDS:
        encoded = tokenizer.encode(" " + word)
        if len(encoded) == 1 and encoded[0] not in seen:
            seen.add(encoded[0])
            ids.append(encoded[0])
    if len(ids) < 8:
        raise ValueError("the tokenizer encodes too few common words as single tokens")
    return ids


class SimulatedEngine:
    """Generates tokens for admitted requests and keeps the physical KV pool's books."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        capacity_tokens: int,
        decode_rate: float,
        mean_output_tokens: float,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tick_seconds: float = 0.01,
        fault_rate: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if not decode_rate > 0 or math.isinf(decode_rate):
            raise ValueError(f"decode_rate must be a positive number, got {decode_rate}")
        if not mean_output_tokens >= 1:
            raise ValueError(f"mean_output_tokens must be >= 1, got {mean_output_tokens}")
        if not tick_seconds > 0:
            raise ValueError(f"tick_seconds must be > 0, got {tick_seconds}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be within 0..1, got {fault_rate}")
        self.tokenizer = tokenizer
        self.capacity_tokens = capacity_tokens
        self.decode_rate = float(decode_rate)
        self.mean_output_tokens = float(mean_output_tokens)
        self.block_size = block_size
        self.tick_seconds = tick_seconds
        self.fault_rate = float(fault_rate)
        self._clock = clock
        self._rng = random.Random(seed)
        self._fault_rng = random.Random(f"faults-{seed}")
        self._vocab: list[int] | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._running: dict[int, _Sequence] = {}
        self._used = 0
        self._peak_used = 0
        self._started = 0
        self._finished = 0
        self._oom_events = 0
        self._oom_failed = 0
        self._faults = 0
        self._generated_total = 0

    @property
    def vocabulary(self) -> Sequence[int]:
        if self._vocab is None:
            self._vocab = _vocabulary(self.tokenizer)
        return self._vocab

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                capacity_tokens=self.capacity_tokens,
                used_tokens=self._used,
                peak_used_tokens=self._peak_used,
                running=len(self._running),
                started_total=self._started,
                finished_total=self._finished,
                oom_events_total=self._oom_events,
                oom_failed_sequences_total=self._oom_failed,
                faults_total=self._faults,
                generated_tokens_total=self._generated_total,
            )

    # --- pool bookkeeping (under the lock) -----------------------------------------------------

    def _charge(self, seq: _Sequence) -> None:
        """Recharge ``seq`` for its prompt + generated tokens; fail everyone on overflow."""
        if seq.failure is not None:
            raise seq.failure
        blocks = round_up_to_blocks(seq.prompt_tokens + seq.generated, self.block_size)
        self._used += blocks - seq.used
        seq.used = blocks
        self._peak_used = max(self._peak_used, self._used)
        if self._used > self.capacity_tokens:
            error = EngineOOMError(self._used, self.capacity_tokens)
            self._oom_events += 1
            self._oom_failed += len(self._running)
            for victim in self._running.values():
                victim.failure = error
                victim.used = 0
            self._running.clear()
            self._used = 0
            raise error

    def _remove(self, seq: _Sequence) -> None:
        if self._running.pop(seq.id, None) is not None:
            self._used -= seq.used
            seq.used = 0

    # --- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt_tokens: int,
        max_tokens: int,
        on_text: OnText | None = None,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> Completion:
        """Decode up to ``max_tokens`` tokens after a prompt of ``prompt_tokens`` tokens.

        A sequence stops by itself at its natural length, as vLLM's does at its end-of-sequence
        token, unless ``ignore_eos`` (it runs to ``max_tokens``, finish reason ``length``) or
        ``min_tokens`` (no stop before that many tokens) say otherwise; neither changes the
        random draws, so other sequences' outputs stay as they were.

        ``on_text`` receives each tick's new text as it is produced (for streaming). Raises
        :class:`EngineOOMError` when the pool overflows while this sequence is live, and
        :class:`EngineFaultError` when it was picked to fail (``fault_rate``). Cancellation
        (client gone) frees the sequence's blocks.
        """
        vocab = self.vocabulary
        with self._lock:
            natural = max(1, math.ceil(self._rng.expovariate(1.0 / self.mean_output_tokens)))
            words = _WordStream(self._rng.getrandbits(64), vocab)
            seq = _Sequence(next(self._ids), prompt_tokens)
            self._running[seq.id] = seq
            self._started += 1
        # Where the end-of-sequence token would come, once it is allowed.
        stop_at = max_tokens + 1 if ignore_eos else max(natural, min_tokens)
        target = min(stop_at, max_tokens)
        fault_at: int | None = None
        if self.fault_rate > 0:
            with self._lock:
                if self._fault_rng.random() < self.fault_rate:
                    fault_at = self._fault_rng.randrange(target)  # tokens delivered before it
        stop = target if fault_at is None else fault_at
        pieces: list[str] = []
        try:
            with self._lock:
                self._charge(seq)  # prefill: the prompt's blocks
            start = self._clock()
            while seq.generated < stop:
                await anyio.sleep(self.tick_seconds)
                if seq.failure is not None:
                    raise seq.failure
                due = min(stop, math.floor((self._clock() - start) * self.decode_rate))
                if due <= seq.generated:
                    continue
                new_ids = words.take(due - seq.generated)
                with self._lock:
                    seq.generated = due
                    self._generated_total += len(new_ids)
                    self._charge(seq)
                text = self.tokenizer.decode(new_ids)
                pieces.append(text)
                if on_text is not None:
                    await on_text(text)
            if fault_at is not None:
                with self._lock:
                    self._faults += 1
                raise EngineFaultError(seq.generated)
            with self._lock:
                self._finished += 1
        finally:
            with self._lock:
                self._remove(seq)
        return Completion(
            text="".join(pieces),
            completion_tokens=seq.generated,
            finish_reason=_finish_reason(natural, stop_at, max_tokens),
        )


def _finish_reason(natural: int, stop_at: int, max_tokens: int) -> FinishReason:
    """``stop`` when the sequence ended by itself within its cap, ``length`` when the cap cut it
    (or when ``min_tokens`` held its end back to exactly the cap)."""
    if stop_at == natural:
        return "stop" if natural <= max_tokens else "length"
    return "stop" if stop_at < max_tokens else "length"
