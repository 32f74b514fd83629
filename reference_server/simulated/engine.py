"""A simulated decoding engine with a physical KV pool that can really run out.

No GPU, no model: sequences "decode" real tokens of the configured tokenizer in lockstep steps,
as vLLM's do: each step makes one token for every running sequence and takes ``1 / decode_rate``
(plus ``1 / throughput`` per other running sequence when a throughput is set). At most
``max_running`` sequences run at once; the others wait in FIFO order holding no KV. Full prompt
blocks another running sequence has prefilled are shared (``prefix_caching``). The steps and the
pool's books are :class:`~reference_server.simulated.scheduler.Scheduler`'s; this module draws
each sequence's length and words, and hands its text to the caller once per tick (one wake-up
per tick, not per token; whichever sequence wakes first in a tick runs the steps due, so the
engine needs no task of its own and runs wherever its callers do).

The physical pool holds, per live sequence, its prompt plus what it has generated so far, in
whole blocks (shared prefix blocks once). If that ever exceeds the pool's capacity, every
sequence in the engine fails with :class:`EngineOOMError` and the pool is emptied: the
mid-decode crash that reserving only for the prompt leads to.

A sequence stops by itself at a natural length drawn for it (its end-of-sequence token), unless
the request says ``ignore_eos`` or ``min_tokens``, as vLLM's sampling parameters do: load that
must fill the pool (the contract suite's bursts) runs to its cap.

With ``fault_rate`` > 0 the engine also fails that share of sequences on purpose, at a random
token (:class:`EngineFaultError`), so tests and the soak can check that every failure path gives
the reservation back.

Output is reproducible: natural output lengths and words are drawn from one ``random.Random(seed)``
in the order sequences arrive; faults from a second generator of the same seed, so turning them
on changes no output. Runs under asyncio and trio (anyio only).
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

from kvclient import DEFAULT_BLOCK_SIZE, Tokenizer

from .scheduler import EngineOOMError, ScheduledSequence, Scheduler, prefix_keys

__all__ = ["EngineFaultError", "EngineOOMError", "EngineStats", "Generated", "SimulatedEngine"]

FinishReason = Literal["stop", "length"]
#: Receives each tick's new text and the tokens generated so far (for streams' usage).
OnText = Callable[[str, int], Awaitable[None]]

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


class EngineFaultError(Exception):
    """A sequence failed on purpose (``fault_rate``): a stand-in for any engine error."""

    def __init__(self, generated_tokens: int) -> None:
        super().__init__(f"injected fault after {generated_tokens} generated tokens")
        self.generated_tokens = generated_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Generated:
    """What a finished sequence produced: its text, its token count and why it stopped."""

    text: str
    completion_tokens: int
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    capacity_tokens: int
    used_tokens: int
    peak_used_tokens: int
    running: int
    waiting: int
    max_running: int | None
    prefix_caching: bool
    block_size: int
    steps_total: int
    shared_blocks_total: int
    started_total: int
    finished_total: int
    oom_events_total: int
    oom_failed_sequences_total: int
    faults_total: int
    generated_tokens_total: int
    preempts: bool = False
    preemptions_total: int = 0


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
        throughput: float | None = None,
        max_running: int | None = None,
        prefix_caching: bool = True,
        on_overflow: str = "fail",
        recompute_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if not decode_rate > 0 or math.isinf(decode_rate):
            raise ValueError(f"decode_rate must be a positive number, got {decode_rate}")
        if throughput is not None and (not throughput > 0 or math.isinf(throughput)):
            raise ValueError(f"throughput must be a positive number or None, got {throughput}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        if not mean_output_tokens >= 1:
            raise ValueError(f"mean_output_tokens must be >= 1, got {mean_output_tokens}")
        if not tick_seconds > 0:
            raise ValueError(f"tick_seconds must be > 0, got {tick_seconds}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be within 0..1, got {fault_rate}")
        self.tokenizer = tokenizer
        self.capacity_tokens = capacity_tokens
        self.decode_rate = float(decode_rate)
        self.throughput = None if throughput is None else float(throughput)
        self.max_running = max_running
        self.prefix_caching = prefix_caching
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
        self._scheduler = Scheduler(
            capacity_tokens=capacity_tokens,
            block_size=block_size,
            decode_rate=self.decode_rate,
            throughput=self.throughput,
            max_running=max_running,
            on_overflow=on_overflow,
            recompute_seconds=recompute_seconds,
        )
        self.on_overflow = on_overflow
        self._started = 0
        self._finished = 0
        self._faults = 0

    @property
    def vocabulary(self) -> Sequence[int]:
        if self._vocab is None:
            self._vocab = _vocabulary(self.tokenizer)
        return self._vocab

    def stats(self) -> EngineStats:
        """The engine as of now (the steps due by now are run first)."""
        with self._lock:
            scheduler = self._scheduler
            scheduler.advance(self._clock())
            return EngineStats(
                capacity_tokens=self.capacity_tokens,
                used_tokens=scheduler.used_tokens,
                peak_used_tokens=scheduler.peak_used_tokens,
                running=len(scheduler.running),
                waiting=len(scheduler.waiting),
                max_running=self.max_running,
                prefix_caching=self.prefix_caching,
                block_size=self.block_size,
                steps_total=scheduler.steps_total,
                shared_blocks_total=scheduler.shared_blocks_total,
                started_total=self._started,
                finished_total=self._finished,
                oom_events_total=scheduler.oom_events_total,
                oom_failed_sequences_total=scheduler.oom_failed_total,
                faults_total=self._faults,
                generated_tokens_total=scheduler.generated_tokens_total,
                preempts=scheduler.on_overflow == "preempt",
                preemptions_total=scheduler.preemptions_total,
            )

    async def generate(
        self,
        prompt_tokens: int,
        max_tokens: int,
        on_text: OnText | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> Generated:
        """Decode up to ``max_tokens`` tokens after a prompt of ``prompt_tokens`` tokens.

        ``prompt_ids`` are the prompt's token ids: with prefix caching on, its full blocks are
        shared with running sequences that hold the same prefix and ``cache_salt`` (without
        ids, nothing is).

        A sequence stops by itself at its natural length, as vLLM's does at its end-of-sequence
        token, unless ``ignore_eos`` (it runs to ``max_tokens``, finish reason ``length``) or
        ``min_tokens`` (no stop before that many tokens) say otherwise; neither changes the
        random draws, so other sequences' outputs stay as they were.

        ``on_text`` receives each tick's new text and the number of tokens generated so far, as
        they are produced (for streaming). Raises :class:`EngineOOMError` when the pool
        overflows while this sequence is in the engine, and :class:`EngineFaultError` when it
        was picked to fail (``fault_rate``). Cancellation (client gone) frees the sequence's
        blocks, or its place in the waiting line.
        """
        vocab = self.vocabulary
        keys: list[bytes] = []
        if self.prefix_caching and prompt_ids is not None:
            keys = prefix_keys(prompt_tokens, prompt_ids, self.block_size, cache_salt)
        with self._lock:
            natural = max(1, math.ceil(self._rng.expovariate(1.0 / self.mean_output_tokens)))
            words = _WordStream(self._rng.getrandbits(64), vocab)
            # Where the end-of-sequence token would come, once it is allowed.
            stop_at = max_tokens + 1 if ignore_eos else max(natural, min_tokens)
            target = min(stop_at, max_tokens)
            fault_at: int | None = None
            if self.fault_rate > 0 and self._fault_rng.random() < self.fault_rate:
                fault_at = self._fault_rng.randrange(target)  # tokens delivered before it
            seq = ScheduledSequence(
                id=next(self._ids),
                prompt_tokens=prompt_tokens,
                stop=target if fault_at is None else fault_at,
                keys=keys,
            )
            self._started += 1
            self._scheduler.add(seq, self._clock())
        pieces: list[str] = []
        delivered = 0
        try:
            while True:
                # Read under the lock: a scrape in another thread may run steps too.
                with self._lock:
                    generated, done, failure = seq.generated, seq.done, seq.failure
                if failure is not None:
                    raise failure
                if generated > delivered:
                    text = self.tokenizer.decode(words.take(generated - delivered))
                    delivered = generated
                    pieces.append(text)
                    if on_text is not None:
                        await on_text(text, generated)
                if done:
                    break
                await anyio.sleep(self.tick_seconds)
                with self._lock:
                    self._scheduler.advance(self._clock())
            if fault_at is not None:
                with self._lock:
                    self._faults += 1
                raise EngineFaultError(delivered)
            with self._lock:
                self._finished += 1
        finally:
            with self._lock:
                self._scheduler.remove(seq, self._clock())
        return Generated(
            text="".join(pieces),
            completion_tokens=delivered,
            finish_reason=_finish_reason(natural, stop_at, max_tokens),
        )


def _finish_reason(natural: int, stop_at: int, max_tokens: int) -> FinishReason:
    """``stop`` when the sequence ended by itself within its cap, ``length`` when the cap cut it
    (or when ``min_tokens`` held its end back to exactly the cap)."""
    if stop_at == natural:
        return "stop" if natural <= max_tokens else "length"
    return "stop" if stop_at < max_tokens else "length"
