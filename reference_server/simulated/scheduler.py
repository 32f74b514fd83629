"""The simulated engine's scheduler: lockstep decode steps over a physical KV pool.

Pure: no I/O, no lock and no clock of its own (every call that moves time takes ``now``), so
tests drive it step by step and the engine calls it under its lock. It models what real engines
(vLLM) do and what the gateway's peak-of-the-sum admission relies on:

- **Lockstep decode.** One step makes one token for every running sequence. A step takes
  ``1 / decode_rate``, plus ``1 / throughput`` for each running sequence beyond the first when a
  throughput is set (the ledger's ``rate_at``), the batch being every sequence running while the
  step runs. A sequence scheduled between two steps has its prompt's blocks charged at once (its
  prefill, in the step in progress) and its first token when that step ends.
- **A cap on running sequences** (vLLM's ``max_num_seqs``): beyond ``max_running``, sequences
  wait in FIFO order, holding no KV and generating nothing, until a running one ends.
- **Shared prefix blocks** (vLLM's automatic prefix caching): a prompt's full blocks before its
  last token are named by a chained hash (:func:`prefix_keys`). A sequence that starts shares
  each such block another running sequence holds, once the block is computed (the prefill of
  the holder that made it is done: it has produced a token); computed, a block stays shareable
  for as long as any holder holds it, its maker gone or not (vLLM keeps a full block's hash
  while it is held). A block is charged to the pool once, for as long as any holder lives; let
  go by its last holder it stays cached, holding nothing, and a sequence that starts takes it
  back (charged again) until the pool needs its room: the cached blocks nobody holds are
  evicted oldest first once they and the blocks in use would not fit the pool together, as
  vLLM's free list hands out its oldest cached block first.
- **The pool can overflow**, and what that does is the engine's (``on_overflow``): ``fail``,
  every sequence in the engine (running or waiting) fails with :class:`EngineOOMError` and the
  pool is emptied (llama.cpp with a unified cache); ``preempt``, as vLLM's scheduler does, the
  step that would overflow first takes back the newest running sequence's blocks and puts it
  at the head of the waiting line, to be recomputed (its prompt and what it had generated, at
  ``recompute_seconds`` a token added to the step it rejoins in) once its blocks fit again. A
  waiting sequence then starts only when its blocks fit.

>>> scheduler = Scheduler(capacity_tokens=1024, block_size=16, decode_rate=100.0)
>>> seq = ScheduledSequence(id=1, prompt_tokens=20, stop=3)
>>> scheduler.add(seq, now=0.0)
>>> scheduler.used_tokens            # the prompt's two blocks, charged at once
32
>>> scheduler.advance(0.025); seq.generated   # two steps of 10 ms
2
>>> scheduler.advance(1.0); seq.done, scheduler.used_tokens
(True, 0)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

__all__ = ["OVERFLOWS", "EngineOOMError", "ScheduledSequence", "Scheduler", "prefix_keys"]

#: What an overflow of the pool does: fail every sequence, or preempt the newest.
OVERFLOWS = ("fail", "preempt")


class EngineOOMError(Exception):
    """The physical KV pool overflowed; every in-flight sequence was lost."""

    def __init__(self, used_tokens: int, capacity_tokens: int) -> None:
        super().__init__(
            f"KV cache out of memory: {used_tokens} tokens in use exceed the physical capacity "
            f"of {capacity_tokens}; all in-flight sequences were aborted"
        )
        self.used_tokens = used_tokens
        self.capacity_tokens = capacity_tokens


def prefix_keys(
    prompt_tokens: int, token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[bytes]:
    """The chained hashes of a prompt's shareable blocks: its full blocks strictly before its
    last token, ``floor((prompt_tokens - 1) / block_size)`` of them (fewer if ``token_ids``
    is shorter). Each covers its block's ids and the previous block's hash, so two equal keys
    mean two equal prefixes up to that block's end; a ``salt`` (vLLM's ``cache_salt``) goes
    into the first, so prompts salted differently, or one salted and one not, share nothing."""
    shareable = min(max(0, prompt_tokens - 1) // block_size, len(token_ids) // block_size)
    keys: list[bytes] = []
    previous = b"" if salt is None else hashlib.sha256(b"salt:" + salt.encode()).digest()
    for i in range(shareable):
        block = token_ids[i * block_size : (i + 1) * block_size]
        previous = hashlib.sha256(previous + ",".join(map(str, block)).encode()).digest()
        keys.append(previous)
    return keys


class _Block:
    """One physical block of a prompt's shareable prefix."""

    __slots__ = ("holders", "key", "ready")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.holders = 1
        #: Computed (its maker's prefill is done): shareable from then on while it is held.
        self.ready = False


class ScheduledSequence:
    """A sequence's place in the engine: waiting, running or done, and the blocks it holds.

    ``stop`` is how many tokens it generates before it ends (its cap, its natural end, or the
    token an injected fault cuts it at); ``keys`` are its prompt's :func:`prefix_keys`.
    """

    __slots__ = (
        "done",
        "failure",
        "generated",
        "id",
        "keys",
        "prefilled",
        "prefix",
        "prompt_tokens",
        "running",
        "stop",
        "tail",
    )

    def __init__(
        self, *, id: int, prompt_tokens: int, stop: int, keys: Sequence[bytes] = ()
    ) -> None:
        self.id = id
        self.prompt_tokens = prompt_tokens
        self.stop = stop
        self.keys = keys
        self.generated = 0
        self.running = False
        self.done = False
        #: Its prompt (and what it had generated, when recomputed) is in the pool.
        self.prefilled = False
        self.failure: EngineOOMError | None = None
        #: The physical blocks of the shareable prefix (shared or its own), one per key.
        self.prefix: list[_Block] = []
        #: Its other blocks (the rest of the prompt and the output), never shared.
        self.tail = 0

    @property
    def shared_blocks(self) -> int:
        """Prefix blocks it holds with another sequence (for tests and stats)."""
        return sum(1 for block in self.prefix if block.holders > 1)


class Scheduler:
    """Running and waiting sequences, the steps that advance them, and the pool's books."""

    def __init__(
        self,
        *,
        capacity_tokens: int,
        block_size: int,
        decode_rate: float,
        throughput: float | None = None,
        max_running: int | None = None,
        on_overflow: str = "fail",
        recompute_seconds: float = 0.0,
    ) -> None:
        if on_overflow not in OVERFLOWS:
            raise ValueError(f"on_overflow must be one of {', '.join(OVERFLOWS)}")
        self.on_overflow = on_overflow
        self.recompute_seconds = recompute_seconds
        self.preemptions_total = 0
        #: Seconds the step in progress is lengthened by sequences recomputed in it.
        self._penalty = 0.0
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        self.decode_rate = decode_rate
        self.throughput = throughput
        self.max_running = max_running
        self.running: dict[int, ScheduledSequence] = {}
        self.waiting: deque[ScheduledSequence] = deque()
        #: Prefix blocks another sequence may share, by key (held, or idle: see ``_idle``).
        self._cached: dict[bytes, _Block] = {}
        #: The cached blocks no sequence holds, oldest first: in the pool's free room.
        self._idle: OrderedDict[bytes, _Block] = OrderedDict()
        self.used_blocks = 0
        self.peak_used_tokens = 0
        self.steps_total = 0
        self.generated_tokens_total = 0
        self.shared_blocks_total = 0
        self.oom_events_total = 0
        self.oom_failed_total = 0
        #: When the step in progress began and when it completes (None while nothing runs).
        self._step_started_at = 0.0
        self.next_step_at: float | None = None
        #: The steps since the batch last changed its length are timed from one moment, the
        #: first one's end, so that a step ends at the same float whether the steps before it
        #: ran one at a time or in a batch (see :meth:`_step_end`).
        self._steps_from = 0.0
        self._steps_since = 0
        self._step_length = 0.0

    @property
    def used_tokens(self) -> int:
        """Tokens of the physical pool in use: unique blocks held x block size."""
        return self.used_blocks * self.block_size

    def step_seconds(self, running: int) -> float:
        """How long one step takes with ``running`` sequences in the batch."""
        seconds = 1.0 / self.decode_rate
        if self.throughput is not None and running > 1:
            seconds += (running - 1) / self.throughput
        return seconds

    # --- what the engine calls ---------------------------------------------------------------

    def add(self, seq: ScheduledSequence, now: float) -> None:
        """A new sequence arrives at ``now``: it runs at once if a slot is free and nobody
        waits before it, else it waits. May fail everyone (:class:`EngineOOMError` set on each
        sequence's ``failure``) if its prompt overflows the pool."""
        self.advance(now)
        self.waiting.append(seq)
        self._schedule(now)

    def advance(self, now: float) -> None:
        """Run every step due by ``now``.

        Steps between two events (a sequence's end) go in one batch, one pass over the running
        sequences: while the batch does not change, neither does the step's length, and each
        sequence gains as many tokens as there were steps.
        """
        while self.next_step_at is not None and self.next_step_at <= now:
            first = self._steps_since  # the next step's number in the run
            most = min(seq.stop - seq.generated for seq in self.running.values())
            # How many steps end by now (step ends never decrease, so they are a prefix).
            due = int((now - self.next_step_at) / self._step_length) + 1
            due = max(1, min(due, most))
            while due > 1 and self._step_end(first + due - 1) > now:
                due -= 1
            while due < most and self._step_end(first + due) <= now:
                due += 1
            if self.on_overflow == "preempt":
                room = self._steps_that_fit(due)
                if room == 0:
                    self._preempt(self._step_started_at)  # before the step that would overflow
                    continue
                due = room
            self._steps(due, self._step_end(first + due - 1))

    def remove(self, seq: ScheduledSequence, now: float) -> None:
        """``seq`` leaves before its end (cancelled, its answer failed): its blocks are freed
        and its slot goes to the first waiting sequence. Nothing happens to a done sequence."""
        self.advance(now)
        if seq.done:
            return
        if seq.running:
            self._free(seq)
            del self.running[seq.id]
            self._schedule(now)
        else:
            self.waiting.remove(seq)
        seq.running = False
        seq.done = True

    # --- the steps ---------------------------------------------------------------------------

    def _steps(self, steps: int, last_at: float) -> None:
        """Run ``steps`` steps, the last at ``last_at``; none but the last ends a sequence."""
        block_size = self.block_size
        finished: list[ScheduledSequence] = []
        for seq in self.running.values():
            if not seq.prefilled:
                self._prefilled(seq)  # its first token: its prompt's blocks are ready
            seq.generated += steps
            tail = -(-(seq.prompt_tokens + seq.generated) // block_size) - len(seq.prefix)
            self.used_blocks += tail - seq.tail
            seq.tail = tail
            if seq.generated >= seq.stop:
                finished.append(seq)
        if self.used_tokens > self.capacity_tokens:
            steps = self._first_overflowing(steps)
        self.steps_total += steps
        self.generated_tokens_total += steps * len(self.running)
        if self._overflowed():
            return
        self._evict()  # at the batch's most: the pool only grows between two ends
        for seq in finished:
            self._free(seq)
            del self.running[seq.id]
            seq.running = False
            seq.done = True
        self._step_started_at = last_at
        self._steps_since += steps
        self._schedule(last_at)

    def _step_end(self, n: int) -> float:
        """When the ``n``-th step (from 0) since the batch last changed its length ends."""
        return self._steps_from + n * self._step_length

    def _used_after(self, back: int) -> Callable[[int], int]:
        """The blocks in use ``j`` steps after the running sequences had ``back`` tokens fewer
        than now (no sequence ending on the way)."""
        block_size = self.block_size
        running = list(self.running.values())
        shared = self.used_blocks - sum(seq.tail for seq in running)
        before = [seq.prompt_tokens + seq.generated - back for seq in running]
        prefixes = sum(len(seq.prefix) for seq in running)

        def used(j: int) -> int:
            return shared + sum(-(-(tokens + j) // block_size) for tokens in before) - prefixes

        return used

    def _first_overflowing(self, steps: int) -> int:
        """The pool overflowed within the last ``steps`` steps: at which one first (the pool
        only grows between two ends)? The books are set back to that step."""
        limit = self.capacity_tokens // self.block_size  # the most blocks that fit
        used = self._used_after(steps)
        low, high = 1, steps
        while low < high:
            middle = (low + high) // 2
            if used(middle) > limit:
                high = middle
            else:
                low = middle + 1
        self.used_blocks = used(low)
        return low

    def _steps_that_fit(self, steps: int) -> int:
        """How many of the next ``steps`` steps run without overflowing the pool."""
        limit = self.capacity_tokens // self.block_size
        used = self._used_after(0)
        if used(steps) <= limit:
            return steps
        low, high = 0, steps  # used(low) fits, used(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if used(middle) <= limit:
                low = middle
            else:
                high = middle
        return low

    def _preempt(self, now: float) -> None:
        """The next step would overflow the pool: the newest running sequence gives its blocks
        back and waits at the head of the line, to be recomputed (vLLM's scheduler)."""
        seq = next(reversed(self.running.values()))
        self._free(seq)
        del self.running[seq.id]
        seq.running = False
        self.waiting.appendleft(seq)
        self.preemptions_total += 1
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """Start waiting sequences while slots are free (FIFO); time the step in progress."""
        idle = not self.running
        if idle:
            self._step_started_at = now
        cap = self.max_running
        while self.waiting and (cap is None or len(self.running) < cap):
            seq = self.waiting[0]
            if self.on_overflow == "preempt" and not self._fits(seq):
                break  # its blocks must fit first (a preempting engine never overflows)
            self.waiting.popleft()
            if seq.generated:
                self._penalty += self.recompute_seconds * (seq.prompt_tokens + seq.generated)
            self._start(seq)
            if self._overflowed():
                return
            if seq.stop <= 0:  # cut before its first token: an injected fault
                self._free(seq)
                del self.running[seq.id]
                seq.running = False
                seq.done = True
        if not self.running:
            self.next_step_at = None
            return
        seconds = self.step_seconds(len(self.running))
        if idle or seconds != self._step_length or self._penalty:
            # The step in progress is as long as the batch it now holds (a sequence that joins
            # has its prefill in it, and a recomputed one its recompute); never ends before
            # now. The steps from it on are timed from its end.
            self._steps_from = max(now, self._step_started_at + seconds) + self._penalty
            self._penalty = 0.0
            self._steps_since = 0
            self._step_length = seconds
        self.next_step_at = self._step_end(self._steps_since)

    def _start(self, seq: ScheduledSequence) -> None:
        """Charge ``seq``'s prompt (its prefill), sharing the prefix blocks it may."""
        for key in seq.keys:
            block = self._cached.get(key)
            if block is not None and block.ready:
                if block.holders == 0:  # idle in the cache: taken back into the pool
                    del self._idle[key]
                    self.used_blocks += 1
                block.holders += 1
                self.shared_blocks_total += 1
            else:
                block = _Block(key)
                self.used_blocks += 1
            seq.prefix.append(block)
        whole = -(-(seq.prompt_tokens + seq.generated) // self.block_size)
        seq.tail = whole - len(seq.keys)
        self.used_blocks += seq.tail
        seq.running = True
        self.running[seq.id] = seq
        self._evict()

    def _prefilled(self, seq: ScheduledSequence) -> None:
        """``seq`` produced its first token: its prefix blocks may be shared from now on."""
        seq.prefilled = True
        for block in seq.prefix:
            block.ready = True
            self._cached.setdefault(block.key, block)

    def _evict(self) -> None:
        """Evict the oldest idle cached blocks while they would not fit the pool's free room."""
        limit = self.capacity_tokens // self.block_size
        while self._idle and self.used_blocks + len(self._idle) > limit:
            key, _ = self._idle.popitem(last=False)
            del self._cached[key]

    def _fits(self, seq: ScheduledSequence) -> bool:
        """Whether ``seq``'s blocks (its prompt, what it has generated and its next token) fit
        the pool now, none of them shared, with a block to spare for each running sequence's
        next step (else it would be preempted again at once)."""
        blocks = -(-(seq.prompt_tokens + seq.generated + 1) // self.block_size)
        spare = len(self.running)
        return self.used_blocks + blocks + spare <= self.capacity_tokens // self.block_size

    def _free(self, seq: ScheduledSequence) -> None:
        seq.prefilled = False
        # Its last blocks first, as vLLM frees them: a prefix's head is evicted last.
        for block in reversed(seq.prefix):
            block.holders -= 1
            if block.holders == 0:
                self.used_blocks -= 1
                if self._cached.get(block.key) is block:
                    self._idle[block.key] = block
        self.used_blocks -= seq.tail
        seq.prefix = []
        seq.tail = 0

    def _overflowed(self) -> bool:
        """Whether the pool overflowed; if so, fail every sequence and empty the pool."""
        used = self.used_tokens
        self.peak_used_tokens = max(self.peak_used_tokens, used)
        if used <= self.capacity_tokens:
            return False
        error = EngineOOMError(used, self.capacity_tokens)
        self.oom_events_total += 1
        victims = [*self.running.values(), *self.waiting]
        self.oom_failed_total += len(victims)
        for seq in victims:
            seq.failure = error
            seq.prefix = []
            seq.tail = 0
            seq.running = False
            seq.done = True
        self.running.clear()
        self.waiting.clear()
        self._cached.clear()
        self._idle.clear()
        self.used_blocks = 0
        self.next_step_at = None
        return True
