"""The shared fair shares by the peak as a property, pure (no Redis): gateways that each decide
on a snapshot of the fair state (:class:`~reference_server.shared_ledger.fair_state.Decision`,
the production decision) and commit some steps later, refused when the version or ``grown``
moved meanwhile; admitted holders written with the records the commit carries (their clock's
deadline, what they are counted to); their progress published late and unevenly; a gateway
that runs on whole caps beside others on the peak; tenants weighted apart, one limited to half:
a lockstep engine's pool never exceeds the budget, every request is admitted, and the ledger
returns to 0.

``_Store`` stands for the scripts' state as far as the property needs it (``FAIR_SNAPSHOT``'s
answer, ``FAIR_COMMIT``'s checks and writes, ``PROGRESS``, ``RELEASE``); real-Redis tests hold
the scripts to the same (``test_shared_fair_peak.py``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.admission.holders import START_SLACK_STEPS
from reference_server.admission.ledger import KVAdmissionController
from reference_server.shared_ledger.fair_state import Decision, FairState, PeakAsk, Seat
from reference_server.shared_ledger.lua import ticket_need
from reference_server.shared_ledger.view import Record
from tests.helpers.lockstep import LockstepEngine, Seq
from tests.helpers.relay import Relay, relay_step

_DT = 0.01  # seconds a decode step takes: one token a step, 100 tokens/s
POLICY = FairPolicy(
    tenants={"a": Tenant(weight=3.0), "b": Tenant(weight=1.0), "half": Tenant(max_share=0.5)}
)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class _Store:
    """The fair state in Redis, as the scripts keep it (see the module)."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.tenants: dict[str, str] = {}
        self.metas: dict[str, str] = {}
        self.queue: dict[str, int] = {}  # waiting ticket -> its sequence number
        self.fair: dict[str, str] = {}
        self.version = 0
        self.grown = 0
        self.seq = itertools.count(1)

    def raw(self, now: float) -> list[Any]:
        """``FAIR_SNAPSHOT``'s answer."""
        holders, progress = [], []
        for name, r in self.records.items():
            holders += [
                name,
                f"{r.lease} {r.tokens} {r.cap} {_ms(r.admitted_at)} {self.tenants[name]}",
            ]
            made = -1 if r.generated is None else r.generated
            start = _ms(r.start_by) if r.start_by is not None else 0
            progress += [
                name,
                f"{r.prompt} {r.counted} {int(r.tracked)} {made} {_ms(r.seen_at)} "
                f"{_ms(r.first_seen_at)} {start}",
            ]
        queue = [x for ticket, n in self.queue.items() for x in (ticket, str(n))]
        metas = [x for item in self.metas.items() for x in item]
        fair = [x for item in self.fair.items() for x in item]
        reserved = sum(r.tokens for r in self.records.values())
        return [
            _ms(now), str(self.version), reserved, holders, queue, metas, fair, self.grown,
            progress, "", [], [],
        ]  # fmt: skip

    def commit(self, args: list[Any], now: float) -> bool:
        """``FAIR_COMMIT``: False when the version (or, by the peak, ``grown``) moved."""
        if args[0] != str(self.version) or (args[4] != "" and args[4] != str(self.grown)):
            return False
        i = 5
        lists = []
        for width in (2, 8, 2, 2, 2):
            n = int(args[i])
            lists.append([args[i + 1 + k * width : i + 1 + (k + 1) * width] for k in range(n)])
            i += 1 + n * width
        joins, admits, refuses, passes, offsets = lists
        assert not refuses  # no bound on the queue here
        for ticket, meta in joins:
            self.queue[ticket] = next(self.seq)
            self.metas[ticket] = meta
        for ticket, cap, tenant, prompt, tracked, start, counted, _ in admits:
            self.queue.pop(ticket, None)  # admitted as it joins: never queued
            self.metas.pop(ticket, None)
            need = ticket_need(ticket)
            self.records[ticket] = Record(
                field=ticket, lease=ticket.split(":")[0], tokens=need, cap=int(cap),
                admitted_at=now, prompt=int(prompt), counted=int(counted or cap),
                tracked=tracked == "1", seen_at=now, first_seen_at=now,
                start_by=int(start) / 1000 if start else None,
            )  # fmt: skip
            self.tenants[ticket] = tenant
            self.grown += 1
        for ticket, meta in passes:
            self.metas[ticket] = meta
        for tenant, offset in offsets:
            self.fair[f"offset:{tenant}"] = offset
        if args[i]:
            self.fair["vtime"] = args[i]
        self.version += 1
        return True

    def release(self, name: str) -> None:
        del self.records[name], self.tenants[name]
        self.version += 1


@dataclass
class _Gateway:
    name: str
    pricing: KVAdmissionController
    peak: bool
    slow: int  # steps between its snapshot and its commit
    every: int  # steps between two publishes of its holders' progress at most
    #: its waiters, each with its request
    seats: dict[str, tuple[Seat, dict[str, Any]]] = field(default_factory=dict)
    pending: tuple[int, list[Any]] | None = None  # a decision: when it commits, what
    seen: tuple[int, int] | None = None  # the state it last decided on


@dataclass
class _Ran:
    engine: LockstepEngine
    store: _Store
    usable: int
    admitted: int = 0
    most_running: int = 0


@st.composite
def workload(draw: st.DrawFn) -> dict[str, Any]:
    requests = [
        {
            "arrival": draw(st.integers(0, 120)),
            "prompt": draw(st.integers(1, 40)),
            "cap": (cap := draw(st.integers(1, 150))),
            "length": draw(st.one_of(st.just(cap), st.integers(1, cap))),
            "tenant": draw(st.sampled_from(["a", "b", "half"])),
            "gateway": draw(st.integers(0, 2)),
            "late": draw(st.integers(0, 3)),  # steps its counts reach its relay late
            # Steps after its commit the engine starts it: within the clock's slack, or late.
            "start": draw(st.integers(0, 2 * START_SLACK_STEPS)),
        }
        for _ in range(draw(st.integers(1, 14)))
    ]
    return {
        "requests": requests,
        "kv": draw(st.integers(420, 900)),  # tenant "half" may hold any one request
        "block": draw(st.sampled_from([1, 4, 16])),
        "caps": draw(st.integers(-1, 2)),  # the gateway on whole caps (-1: none)
        "slow": [draw(st.integers(0, 3)) for _ in range(3)],
        "every": [draw(st.integers(1, 8)) for _ in range(3)],
        "release_delay": draw(st.integers(0, 3)),
        "clock": draw(st.booleans()),  # the engine starts every newcomer at once
    }


def _gateways(work: dict[str, Any]) -> list[_Gateway]:
    gateways = []
    for i in range(3):
        pricing = KVAdmissionController(
            total_kv_tokens=work["kv"], context_window=10_000, decode_rate=1 / _DT,
            block_size=work["block"], safety_fraction=1.0, rule="peak", relay_lag=2 * _DT,
            start_clock=work["clock"],
        )  # fmt: skip
        pricing.set_speed(1 / _DT, None, 0.0, steps=True)  # from the engine's counters
        peak = i != work["caps"]
        gateways.append(_Gateway(f"g{i}", pricing, peak, work["slow"][i], work["every"][i]))
    return gateways


def _run(work: dict[str, Any]) -> _Ran:
    """Steps the engine with three gateways deciding in fair shares on a shared store."""
    gateways = _gateways(work)
    store = _Store()
    ran = _Ran(LockstepEngine(work["block"], share=False), store, gateways[0].pricing.usable_tokens)
    engine = ran.engine
    pending = sorted(enumerate(work["requests"]), key=lambda r: (r[1]["arrival"], r[0]))
    ids = itertools.count(1)
    held: dict[int, Relay] = {}  # engine sequence -> its relay
    starting: list[tuple[int, Seq]] = []  # (the step the engine starts it in, it)
    ended: dict[int, int] = {}
    step = 0
    while pending or any(g.seats or g.pending for g in gateways) or store.records or starting:
        now = step * _DT
        while pending and pending[0][1]["arrival"] <= step:
            _, request = pending.pop(0)
            gateway = gateways[request["gateway"]]
            need = gateway.pricing.need_tokens(request["prompt"], request["cap"])
            seat = Seat(
                ticket=f"{gateway.name}:{next(ids)}:{need}", tenant=request["tenant"], need=need,
                priority=0, prompt_tokens=request["prompt"], output_cap=request["cap"],
                ask=PeakAsk(request["prompt"], True),
            )  # fmt: skip
            gateway.seats[seat.ticket] = (seat, request)
        for gateway in gateways:  # the commits due, in turn
            if gateway.pending is not None and gateway.pending[0] <= step:
                store.commit(gateway.pending[1], now)  # refused: it decides again
                gateway.pending = None
            for ticket in [t for t in gateway.seats if t in store.records]:  # admitted
                _, request = gateway.seats.pop(ticket)
                seq = Seq(next(ids), [0] * request["prompt"], request["cap"], request["length"])
                held[seq.id] = Relay(ticket, request["late"], gateway.every)
                starting.append((step + request["start"], seq))
                ran.admitted += 1
        for gateway in gateways:  # a decision where there is an occasion
            look = (store.version, sum(r.generated or 0 for r in store.records.values()))
            known = {*store.metas, *store.records}  # waiting, or admitted (by another)
            joining = [s for s, _ in gateway.seats.values() if s.ticket not in known]
            if gateway.pending is None and (joining or (store.queue and look != gateway.seen)):
                gateway.seen = look
                state = FairState(store.raw(now))
                decision = Decision(
                    state, state.view(gateway.pricing), POLICY, gateway.pricing,
                    peak=gateway.peak, due=lambda at, cap: at + cap * _DT,
                )  # fmt: skip
                outcome = decision.decide(joining, gateway.name)
                if outcome.args is not None:
                    gateway.pending = (step + gateway.slow, outcome.args)
        for due, seq in [s for s in starting if s[0] <= step]:
            starting.remove((due, seq))
            engine.schedule(seq)
        ran.most_running = max(ran.most_running, len(engine.running))
        for seq in engine.step():
            ended[seq.id] = step
        step += 1
        now = step * _DT
        relay_step(
            held, engine.running, ended, step=step, now=now,
            release_delay=work["release_delay"], release=store.release, records=store.records,
        )  # fmt: skip
        assert engine.used() <= ran.usable, f"overflow at step {step}"
        assert step < 20_000
    return ran


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload())
def test_gateways_deciding_fair_shares_by_the_shared_peak_never_overflow(
    work: dict[str, Any],
) -> None:
    ran = _run(work)
    assert ran.engine.peak_used <= ran.usable
    assert ran.admitted == len(work["requests"])
    assert (ran.store.records, ran.store.queue, ran.store.metas) == ({}, {}, {})  # back to 0


def test_the_shared_fair_peak_runs_more_at_once_than_whole_caps() -> None:
    """Two tenants through three gateways, requests of 10 + 100 arriving apart in a pool of
    400: on whole caps three at once, by the peak more; the pool never overflows."""
    requests = [
        {"arrival": 5 * i, "prompt": 10, "cap": 100, "length": 100, "tenant": "ab"[i % 2],
         "gateway": i % 3, "late": 1, "start": 0}
        for i in range(16)
    ]  # fmt: skip
    work = {
        "requests": requests, "kv": 400, "block": 1, "caps": -1, "slow": [0, 1, 2],
        "every": [2, 3, 5], "release_delay": 1, "clock": False,
    }  # fmt: skip
    ran = _run(work)
    assert ran.admitted == 16
    assert ran.store.records == {}
    assert ran.most_running > 400 // 110
