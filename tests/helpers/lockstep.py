"""A lockstep engine for the peak rule's properties, and the loop that drives a ledger against
it (pure: steps, no clock).

The engine runs at most ``max_running`` sequences one token a step (vLLM's ``max_num_seqs``);
beyond that, sequences wait in a FIFO line holding nothing. Prompt blocks are shared as vLLM's
prefix cache shares them: the full blocks before a prompt's last token, keyed by a chained hash.
A sequence that starts takes, for each of its keys in order while one is cached, the oldest
cached copy of that block (in use, or freed and still cached: vLLM hands out the oldest);
the rest it computes in its prefill step and registers as copies of its own. Two sequences
that compute the same block in one step make two copies; once one is let go, the freed copy is
the one the next sequence is handed. Freed copies hold no KV until handed out again.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.peak import prefix_blocks
from reference_server.admission.values import Handle

__all__ = ["LockstepEngine", "Run", "Seq", "run"]


class _Copy:
    """One physical copy of a prefix block; free (cached) at 0 references."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs = 0


@dataclass
class Seq:
    id: int
    prompt: list[int]
    cap: int
    length: int  # where it stops by itself (its end-of-sequence), at most its cap
    generated: int = 0
    started: bool = False
    keys: tuple[bytes, ...] = ()
    #: The prefix copies it references (taken at its start, or computed in its prefill).
    copies: list[_Copy] = field(default_factory=list)


class LockstepEngine:
    """Runs every running sequence one token a step; see the module."""

    def __init__(self, block: int, share: bool, max_running: int | None = None) -> None:
        self.block = block
        self.share = share
        self.max_running = max_running
        self.running: dict[int, Seq] = {}
        self.waiting: deque[Seq] = deque()
        self.table: dict[bytes, list[_Copy]] = {}  # cached copies, oldest first
        self.peak_used = 0

    def schedule(self, seq: Seq) -> None:
        """A sequence sent to the engine: it runs when a place is free, in arrival order."""
        self.waiting.append(seq)
        self._start_waiting()

    def _start_waiting(self) -> None:
        while self.waiting and (self.max_running is None or len(self.running) < self.max_running):
            seq = self.waiting.popleft()
            if self.share:
                for key in seq.keys:
                    if key not in self.table:
                        break
                    copy = self.table[key][0]
                    copy.refs += 1
                    seq.copies.append(copy)
            self.running[seq.id] = seq

    def drop(self, sid: int) -> None:
        """The engine lets sequence ``sid`` go before its end (its client gone), its prefix
        copies with it."""
        seq = self.running.pop(sid, None)
        if seq is None:
            self.waiting = deque(s for s in self.waiting if s.id != sid)
            return
        for copy in seq.copies:
            copy.refs -= 1
        self._start_waiting()

    def used(self) -> int:
        copies = sum(1 for copies in self.table.values() for c in copies if c.refs > 0)
        total = self.block * copies
        for seq in self.running.values():
            blocks = math.ceil((len(seq.prompt) + seq.generated) / self.block)
            total += self.block * (blocks - len(seq.copies))
        return total

    def step(self) -> list[Seq]:
        """One decode step: every running sequence makes a token (its first ends its prefill);
        those at their length end after it, and waiting ones take their places."""
        finished = []
        for seq in list(self.running.values()):
            if not seq.started:
                seq.started = True
                if self.share:
                    for key in seq.keys[len(seq.copies) :]:
                        copy = _Copy()
                        copy.refs = 1
                        self.table.setdefault(key, []).append(copy)
                        seq.copies.append(copy)
            seq.generated += 1
        self.peak_used = max(self.peak_used, self.used())
        for seq in list(self.running.values()):
            if seq.generated >= seq.length:
                finished.append(seq)
                del self.running[seq.id]
                for copy in seq.copies:
                    copy.refs -= 1
        self._start_waiting()
        return finished


@dataclass
class Run:
    """What a run showed: the ledger, the engine, the most sequences that ran at once, and the
    most the engine held against the ledger's usable budget."""

    ledger: KVAdmissionController
    engine: LockstepEngine
    most_running: int

    @property
    def overflowed(self) -> bool:
        return self.engine.peak_used > self.ledger.usable_tokens


def run(work: dict[str, Any]) -> Run:
    """Steps the engine (0.01 s a step) with the ledger admitting by the peak. Progress and ends
    reach the ledger up to ``delay`` steps late (each sequence its own lateness, ``late``), ends
    ``release_delay`` steps late, and nothing reaches it during ``stalls`` (then each holder's
    reports resume up to 30 steps after the stall's end). A request marked ``unkeyed`` is
    shared by the engine but given to the ledger without its prefix keys (a prompt counted
    without token ids). ``max_running`` is the engine's running cap, ``ledger_running`` the one
    the ledger is told (None: unbounded, so that the engine's waiting line forms)."""
    block, kv, delay = int(work["block"]), int(work["kv"]), int(work["delay"])
    share = bool(work["share"])
    stalls = list(work.get("stalls", ()))
    release_delay = int(work.get("release_delay", delay))
    max_running = work.get("max_running")
    dt = 0.01
    ledger = KVAdmissionController(
        total_kv_tokens=kv,
        context_window=10_000,
        decode_rate=1 / dt,
        block_size=block,
        rule="peak",
        relay_lag=delay * dt,
        max_concurrency=work.get("ledger_running", max_running),
    )
    ledger.shares_prefixes = share
    engine = LockstepEngine(block, share, max_running)
    pending = sorted(work["requests"], key=lambda r: r["arrival"])
    queue: list[tuple[Seq, dict[str, Any]]] = []
    handles: dict[int, Handle] = {}
    history: dict[int, list[int]] = {}  # tokens seen at each step, for the late reports
    ended: dict[int, int] = {}  # id -> step it ended
    lateness: dict[int, int] = {}  # id -> how many steps late its counts arrive
    ids = itertools.count()
    most_running = 0
    step = 0
    while pending or queue or handles:
        now = step * dt
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            seq = Seq(next(ids), r["prompt"], r["cap"], r["length"])
            lateness[seq.id] = round(r.get("late", 1.0) * delay)
            seq.keys = prefix_blocks(seq.prompt, block) if share else ()
            queue.append((seq, r))
        while queue:  # FIFO: the head or nobody
            seq, r = queue[0]
            keys = () if r.get("unkeyed") else seq.keys
            handle = ledger.try_admit(len(seq.prompt), seq.cap, now=now, prefix=keys, follow=True)
            if handle is None:
                break
            queue.pop(0)
            handles[seq.id] = handle
            history[seq.id] = []
            engine.schedule(seq)
        most_running = max(most_running, len(engine.running))
        for seq in engine.step():
            ended[seq.id] = step
        step += 1
        now = step * dt
        for sid, handle in list(handles.items()):
            seq_now = engine.running.get(sid)
            history[sid].append(seq_now.generated if seq_now else -1)
            if any(start <= step < start + length + 10 * (sid % 4) for start, length in stalls):
                continue  # nothing of it reaches the ledger yet
            late = lateness[sid]
            seen = history[sid][-1 - late] if len(history[sid]) > late else 0
            if sid in ended and step - ended[sid] > release_delay:
                ledger.release(handle, now)
                del handles[sid]
            elif seen > 0 and sid not in ended:
                ledger.progress(handle, seen, now)
        assert step < 100_000
    return Run(ledger, engine, most_running)
