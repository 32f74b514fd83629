"""The shared ledger's peak rule as a property, pure (no Redis): holders spread over several
gateway processes that publish their progress late and unevenly, admissions decided by
different processes from snapshots (:class:`~reference_server.shared_ledger.view.PeakView`)
and landed by the compare-and-set on ``grown``, a process killed mid-stream whose holders run
on in the engine until its lease lapses, prompts whose prefix blocks the engine shares (some
the ledger has no keys of): the lockstep engine's pool never overflows, and the ledger returns
to 0.

``_Store`` stands for the scripts' state as far as the property needs it (the holders, their
progress and prefix records, ``grown`` and the caps' sum, the lease sweep, the tainted blocks
worked out where a holder goes as the scripts do, by ``tainted_after``: a real-Redis test holds
the scripts to it); the decision, and what a newcomer borrows, are the production view's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.admission.holders import START_SLACK_STEPS, holds_unkeyed, tainted_after
from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.peak import prefix_blocks
from reference_server.admission.values import Handle
from reference_server.shared_ledger.view import Fit, PeakView, Record
from tests.helpers.lockstep import LockstepEngine, Seq
from tests.helpers.relay import Relay, relay_step

_DT = 0.01  # seconds a decode step takes: one token a step, 100 tokens/s


class _Store:
    """The shared ledger's state in Redis, as the scripts keep it (see the module)."""

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self.records: dict[str, Record] = {}
        self.grown = 0
        self.tainted: set[Hashable] = set()

    def view(
        self, now: float, pricing: KVAdmissionController, publish_seconds: float, clock: bool
    ) -> PeakView:
        return PeakView(
            now=now, grown=str(self.grown), records=self.records.values(), pricing=pricing,
            publish_seconds=publish_seconds, clock=clock,
            tainted=self.tainted,  # type: ignore[arg-type]
        )  # fmt: skip

    def admit(self, record: Record, grown: str | None) -> bool | None:
        """ADMIT: on whole caps, or by the peak read at ``grown`` if no holder came since;
        None: one did (read again)."""
        if sum(r.tokens for r in self.records.values()) + record.tokens <= self.usable:
            pass
        elif grown is None:
            return False
        elif grown != str(self.grown):
            return None
        self.records[record.field] = record
        self.grown += 1
        return True

    def release(self, name: str) -> None:
        """RELEASE, and each holder of a lease swept: its prefix record goes, and what its
        going leaves is tainted."""
        gone = self.records.pop(name)
        live = [_as_handle(r) for r in self.records.values()]
        self.tainted = tainted_after(_as_handle(gone), live, self.tainted)

    def sweep(self, lease: str) -> None:
        for name in [n for n, r in self.records.items() if r.lease == lease]:
            self.release(name)


def _as_handle(record: Record) -> Handle:
    """A record as ``tainted_after`` reads a holder (what the scripts read of it)."""
    handle = Handle(
        id=0, prompt_tokens=record.prompt or 0, output_cap=record.cap,
        reserved_tokens=record.tokens, admitted_at=record.admitted_at, due_at=math.inf,
    )  # fmt: skip
    handle.prefix, handle.borrowed, handle.unkeyed = record.prefix, record.borrowed, record.unkeyed
    handle.generated, handle.first_seen_at = record.generated, record.first_seen_at
    return handle


def _keys(pricing: KVAdmissionController, request: dict[str, object]) -> tuple[Hashable, ...]:
    """The keys its gateway gives the shared ledger: none for a prompt counted without token ids
    (unkeyed, where the engine shares), nor where the engine shares nothing."""
    if request.get("unkeyed"):
        return ()
    return pricing.prefix_keys(request.get("ids"), None)  # type: ignore[arg-type]


@dataclass
class _Process:
    lease: str
    every: int  # steps between two publishes at most
    alive: bool = True
    lapses_at: int | None = None
    held: dict[int, Relay] = field(default_factory=dict)  # engine sequence -> its relay


@dataclass
class _Decision:
    """A newcomer a process decided on from a snapshot, committed ``at`` a later step."""

    process: _Process
    request: dict[str, int]
    view: PeakView
    fit: Fit | None
    at: int


#: Prompt heads several requests share (a system prompt, say).
_HEADS = [list(range(1000, 1048)), list(range(2000, 2030))]


@st.composite
def spread(draw: st.DrawFn) -> dict[str, object]:
    processes = draw(st.integers(2, 4))
    share = draw(st.booleans())  # the engine shares prefix blocks
    requests = []
    for i in range(draw(st.integers(1, 20))):
        cap = draw(st.integers(1, 300))
        group = draw(st.sampled_from([None, 0, 1])) if share else None
        head = _HEADS[group] if group is not None else []
        ids = head + [5000 + 100 * i + j for j in range(draw(st.integers(1, 60 - len(head) // 2)))]
        requests.append(
            {
                "id": i,
                "arrival": draw(st.integers(0, 150)),
                "prompt": len(ids),
                "ids": ids,
                # Shared by the engine, its keys unknown to the ledger (no token ids).
                "unkeyed": share and draw(st.integers(0, 4)) == 0,
                "cap": cap,
                "length": draw(st.one_of(st.just(cap), st.just(cap), st.integers(1, cap))),
                "process": draw(st.integers(0, processes - 1)),
                "late": draw(st.integers(0, 4)),  # steps its counts reach its relay late
                "slow": draw(st.integers(0, 3)),  # steps between its snapshot and its commit
                # Steps after its commit the engine starts it: within the clock's slack, or
                # late (then every view counts it whole from its deadline on).
                "start": draw(st.integers(0, 4 * START_SLACK_STEPS)),
            }
        )
    return {
        "requests": requests,
        "block": draw(st.sampled_from([1, 4, 16])),
        "kv": draw(st.integers(600, 2500)),
        "delay": 4,
        "every": [draw(st.integers(1, 12)) for _ in range(processes)],
        "release_delay": draw(st.integers(0, 3)),
        "kill": draw(
            st.one_of(st.none(), st.tuples(st.integers(0, processes - 1), st.integers(0, 300)))
        ),
        "lease_steps": draw(st.integers(1, 120)),
        "clock": draw(st.booleans()),  # the engine starts every newcomer at once
        "share": share,
    }


@dataclass
class _Ran:
    engine: LockstepEngine
    store: _Store
    usable: int
    admitted: int = 0
    dropped: int = 0  # the killed process's requests it never admitted
    most_running: int = 0
    conflicts: int = 0  # commits refused for a holder admitted since their snapshot
    clocked: int = 0  # admitted on the engine's clock


def _run(work: dict[str, object]) -> _Ran:
    """Steps the engine with the processes admitting by the shared peak."""
    block, kv = int(work["block"]), int(work["kv"])  # type: ignore[call-overload]
    every: list[int] = work["every"]  # type: ignore[assignment]
    pricing = KVAdmissionController(
        total_kv_tokens=kv, context_window=10_000, decode_rate=1 / _DT, block_size=block,
        rule="peak", relay_lag=int(work["delay"]) * _DT,  # type: ignore[call-overload]
        start_clock=True,
    )  # fmt: skip
    pricing.set_speed(1 / _DT, None, 0.0, steps=True)
    share = bool(work.get("share", False))
    pricing.shares_prefixes = share
    publish_seconds = max(every) * _DT  # the interval actually used
    store = _Store(pricing.usable_tokens)
    engine = LockstepEngine(block, share=share)
    processes = [_Process(lease=f"p{i}", every=n) for i, n in enumerate(every)]
    pending = sorted(work["requests"], key=lambda r: (r["arrival"], r["id"]))  # type: ignore[arg-type]
    waiting: list[dict[str, int]] = []
    deciding: list[_Decision] = []
    kill: tuple[int, int] | None = work["kill"]  # type: ignore[assignment]
    lease_steps = int(work["lease_steps"])  # type: ignore[call-overload]
    release_delay = int(work["release_delay"])  # type: ignore[call-overload]
    ended: dict[int, int] = {}
    starting: list[tuple[int, Seq]] = []  # (the step the engine starts it in, it)
    clock = bool(work.get("clock", False))
    ids = itertools.count()
    ran = _Ran(engine, store, pricing.usable_tokens)
    step = 0
    while pending or waiting or deciding or starting or store.records:
        now = step * _DT
        while pending and pending[0]["arrival"] <= step:
            waiting.append(pending.pop(0))
        for process in processes:  # a lapsed lease: swept, and the engine lets its holders go
            if process.lapses_at == step:
                store.sweep(process.lease)
                starting = [(due, seq) for due, seq in starting if seq.id not in process.held]
                for sid in process.held:
                    engine.drop(sid)
                process.held.clear()
        # Each live process decides on its own first waiter from a snapshot of its own.
        busy = {id(d.request) for d in deciding}
        for process in processes:
            mine = [r for r in waiting if processes[r["process"]] is process]
            if not process.alive:
                ran.dropped += len(mine)
                waiting = [r for r in waiting if r not in mine]
                continue
            request = next((r for r in mine if id(r) not in busy), None)
            if request is None:
                continue
            view = store.view(now, pricing, publish_seconds, clock)
            need = pricing.need_tokens(request["prompt"], request["cap"])
            keys = _keys(pricing, request)
            fit = view.fits(request["prompt"], request["cap"], need, follow=True, prefix=keys)
            deciding.append(_Decision(process, request, view, fit, step + request["slow"]))
        # The commits due, in the order their snapshots were read.
        for decision in [d for d in deciding if d.at <= step]:
            deciding.remove(decision)
            process, request = decision.process, decision.request
            if not process.alive:
                continue  # dropped with the process's waiters
            need = pricing.need_tokens(request["prompt"], request["cap"])
            name = f"{process.lease}:{next(ids)}:{need}"
            fit = decision.fit
            keys = _keys(pricing, request)
            record = Record(
                field=name, lease=process.lease, tokens=need, cap=request["cap"],
                admitted_at=now, prompt=request["prompt"], counted=request["cap"], tracked=True,
                start_by=fit.start_by if fit is not None else None, prefix=keys,  # type: ignore[arg-type]
                borrowed=decision.view.lent(keys),  # what its snapshot lent it
                unkeyed=holds_unkeyed(
                    keys, request["prompt"], shares_prefixes=share, block_size=block
                ),
            )  # fmt: skip
            landed = store.admit(record, decision.view.grown if fit is not None else None)
            if not landed:
                ran.conflicts += landed is None
                continue  # not now, or read again: it stays waiting
            waiting.remove(request)
            ran.admitted += 1
            ran.clocked += record.start_by is not None
            tokens = request.get("ids", [0] * request["prompt"])  # type: ignore[arg-type]
            seq = Seq(request["id"], tokens, request["cap"], request["length"])  # type: ignore[arg-type]
            seq.keys = prefix_blocks(seq.prompt, block) if share else ()
            process.held[seq.id] = Relay(name, request["late"], process.every)
            starting.append((step + request["start"], seq))
        for due, seq in [s for s in starting if s[0] <= step]:
            starting.remove((due, seq))
            engine.schedule(seq)
        ran.most_running = max(ran.most_running, len(engine.running))
        for seq in engine.step():
            ended[seq.id] = step
        step += 1
        now = step * _DT
        if kill is not None and step == kill[1] and processes[kill[0]].alive:
            victim = processes[kill[0]]
            victim.alive, victim.lapses_at = False, step + lease_steps
        for process in processes:
            if not process.alive:
                continue  # its holders run on in the engine; nothing of them reaches Redis
            relay_step(
                process.held, engine.running, ended, step=step, now=now,
                release_delay=release_delay, release=store.release, records=store.records,
                tracked=True,
            )  # fmt: skip
        assert engine.used() <= pricing.usable_tokens, f"overflow at step {step}"
        assert step < 100_000
    return ran


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spread())
def test_processes_sharing_the_peak_never_overflow_a_lockstep_engine(
    work: dict[str, object],
) -> None:
    ran = _run(work)
    assert ran.engine.peak_used <= ran.usable
    assert ran.store.records == {}  # the ledger returns to 0
    assert ran.store.tainted == set()
    assert ran.admitted + ran.dropped == len(work["requests"])  # type: ignore[arg-type]
    if work["kill"] is None:
        assert ran.dropped == 0


def test_the_shared_peak_runs_more_at_once_than_whole_caps() -> None:
    """Two processes, requests that end at different times, two at a time: more run at once
    than on caps, and a decision of one process is read again when the other's landed first."""
    requests = [
        {"id": i, "arrival": 20 * (i // 2), "prompt": 10, "cap": 200, "length": 200,
         "process": i % 2, "late": 1, "slow": 0, "start": 0}
        for i in range(12)
    ]  # fmt: skip
    work: dict[str, object] = {
        "requests": requests, "block": 1, "kv": 700, "delay": 2, "every": [3, 7],
        "release_delay": 1, "kill": None, "lease_steps": 50,
    }  # fmt: skip
    ran = _run(work)
    assert ran.admitted == 12
    assert ran.usable // 210 == 3  # on whole caps, three at once
    assert ran.most_running > 3
    assert ran.conflicts > 0


def test_on_the_engines_clock_newcomers_start_beside_holders_whole_counts_wait_for() -> None:
    """Holders of 10 + 200 that end at different times, a pool of 700: counted whole until its
    first token a newcomer waits for room for its whole cap; on the engine's clock it is counted
    from its admission, and more run at once."""
    requests = [
        {"id": i, "arrival": 20 * i, "prompt": 10, "cap": 200, "length": 200,
         "process": i % 2, "late": 1, "slow": 0, "start": 0}
        for i in range(12)
    ]  # fmt: skip
    most = {}
    for clock in (False, True):
        work: dict[str, object] = {
            "requests": requests, "block": 1, "kv": 700, "delay": 2, "every": [3, 7],
            "release_delay": 1, "kill": None, "lease_steps": 50, "clock": clock,
        }  # fmt: skip
        ran = _run(work)
        assert ran.admitted == 12
        assert (ran.clocked > 0) == clock
        most[clock] = ran.most_running
    assert most[True] > most[False]


def test_prompts_that_share_a_prefix_run_more_at_once_where_the_engine_shares_it() -> None:
    """Two processes, prompts of one 200-token head and a suffix of their own, 50 tokens out,
    900 usable: whole (256 each) three at once; where the engine shares the head, a newcomer at
    either process borrows its 12 blocks from a holder of the other past its prefill."""
    head = list(range(3000, 3200))
    requests = [
        {"id": i, "arrival": 3 * i, "prompt": 205, "ids": [*head, *range(10 * i, 10 * i + 5)],
         "cap": 50, "length": 50, "process": i % 2, "late": 1, "slow": 0, "start": 0}
        for i in range(16)
    ]  # fmt: skip
    most = {}
    for share in (False, True):
        work: dict[str, object] = {
            "requests": requests, "block": 16, "kv": 1000, "delay": 2, "every": [3, 7],
            "release_delay": 1, "kill": None, "lease_steps": 50, "share": share,
        }  # fmt: skip
        ran = _run(work)
        assert ran.admitted == 16
        assert ran.engine.peak_used <= ran.usable
        assert ran.store.tainted == set()
        most[share] = ran.most_running
    assert most[False] == 3
    assert most[True] >= 8  # 11 when written
