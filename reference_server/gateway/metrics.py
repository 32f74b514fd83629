"""The gateway's ``/metrics``: the reference server's ledger metrics summed over upstreams, and
each upstream's labelled by its URL (shown without user and password). Those are this process's
own holdings; ``kv_upstream_shared_*`` (what an autoscaler reads) are every gateway's with a
shared ledger, read from Redis at the scrape and the same at each gateway, and this
gateway's own with an in-process one."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..admission.fairness import TenantStats
from ..admission.values import Backlog, LedgerStats
from .state import GatewayState

if TYPE_CHECKING:
    from ..admission.queue import AdmissionQueue

__all__ = [
    "OTHER_TENANTS",
    "TOP_TENANTS",
    "GatewayCollector",
    "backlog",
    "registry_for",
    "tenant_rows",
]


def registry_for(state: GatewayState) -> CollectorRegistry:
    """A registry of its own (several gateways live in one test process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(state))
    return registry


#: Tenants given a label of their own in ``/metrics`` (those that took the most KV
#: token-seconds); the rest are summed under ``other``, so the series stay bounded.
TOP_TENANTS = 10
OTHER_TENANTS = "other"


def tenant_rows(stats: Iterable[TenantStats], top: int = TOP_TENANTS) -> list[TenantStats]:
    """Each tenant's figures summed over upstreams; the ``top`` that took the most token-seconds
    by name, the others summed as :data:`OTHER_TENANTS`."""
    summed: dict[str, TenantStats] = {}
    for s in stats:
        summed[s.tenant] = _plus(summed[s.tenant], s) if s.tenant in summed else s
    ranked = sorted(summed.values(), key=lambda s: (-s.token_seconds, s.tenant))
    rows, rest = ranked[:top], ranked[top:]
    if rest:
        other = rest[0]
        for s in rest[1:]:
            other = _plus(other, s)
        rows.append(dataclasses.replace(other, tenant=OTHER_TENANTS, weight=0.0))
    return rows


def _plus(a: TenantStats, b: TenantStats) -> TenantStats:
    return dataclasses.replace(
        a,
        held=a.held + b.held,
        token_seconds=a.token_seconds + b.token_seconds,
        waiting=a.waiting + b.waiting,
        admitted=a.admitted + b.admitted,
        refused=a.refused + b.refused,
    )


def _tenant_metrics(state: GatewayState) -> Iterable[Metric]:
    """Per tenant, labelled by the names in the tenants file (a request no listed key or
    trusted header names is ``default``'s): no key, nor any digest of one, is ever a label."""
    queues = [u.known.queue for u in state.upstreams if u.known is not None]
    stats = [s for q in queues for s in q.tenants()]
    rows = tenant_rows(stats)
    gauges: dict[str, tuple[str, Callable[[TenantStats], float]]] = {
        "kv_tenant_reserved_tokens": (
            "KV tokens the tenant holds now, as the admission rule counts them.",
            lambda s: s.held,
        ),
        "kv_tenant_waiting_requests": ("The tenant's requests waiting.", lambda s: s.waiting),
        "kv_tenant_weight": ("The tenant's weight (0 for other).", lambda s: s.weight),
    }
    counters: dict[str, tuple[str, Callable[[TenantStats], float]]] = {
        "kv_tenant_token_seconds": (
            "KV token-seconds the tenant's requests held (prompt and tokens so far where their "
            "progress is relayed, else their reservations).",
            lambda s: s.token_seconds,
        ),
        "kv_tenant_admitted": ("The tenant's requests admitted.", lambda s: s.admitted),
        "kv_tenant_rejected": ("The tenant's requests refused with 429.", lambda s: s.refused),
    }
    for name, (documentation, value) in gauges.items():
        gauge = GaugeMetricFamily(name, documentation, labels=["tenant"])
        for row in rows:
            gauge.add_metric([row.tenant], value(row))
        yield gauge
    for name, (documentation, value) in counters.items():
        counter = CounterMetricFamily(name, documentation, labels=["tenant"])
        for row in rows:
            counter.add_metric([row.tenant], value(row))
        yield counter


def backlog(queue: AdmissionQueue, *, shared: bool) -> Backlog:
    """The upstream's backlog as an autoscaler reads it: every gateway's, from the last view of
    Redis, where the ledger is ``shared`` (read at each scrape: see ``SharedLedgers.refresh``);
    this gateway's own, now, otherwise."""
    if shared:
        from ..shared_ledger.queue import SharedQueue  # redis is needed only when shared

        if isinstance(queue, SharedQueue):
            return queue.backlog or Backlog(read_at=-math.inf)
    reserved, inflight = queue.load()
    return Backlog(
        reserved=reserved,
        inflight=inflight,
        waiting=queue.waiting,
        waiting_tokens=queue.waiting_tokens,
        room=queue.headroom().free,
    )


def _preemption_rate(measured: float | None, stats: LedgerStats | None) -> float:
    """The watch's rate over its window where the engine's counter was read, else the
    forecast's own (0: neither known)."""
    if measured is not None:
        return measured
    return (stats.preemption_rate or 0) if stats is not None else 0


class GatewayCollector:
    """The reference server's ledger metrics summed over upstreams, and each one labelled."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        now = time.monotonic()
        rows = []
        for u in self.state.upstreams:
            stats = u.known.ledger.stats(now) if u.known is not None else None
            rows.append((u, stats))
        total = {
            "kv_usable_tokens": sum(s.usable_tokens for _, s in rows if s),
            "kv_reserved_tokens": sum(s.reserved_tokens for _, s in rows if s),
            "kv_inflight_requests": sum(s.inflight for _, s in rows if s),
        }
        for name, value in total.items():
            yield GaugeMetricFamily(name, f"{name} summed over upstreams", value=value)
        yield CounterMetricFamily(
            "kv_admitted_total",
            "Requests admitted.",
            value=sum(s.admitted_total for _, s in rows if s),
        )
        yield CounterMetricFamily(
            "kv_send_timeouts_total",
            "Answers cut for not being read within --send-timeout.",
            value=self.state.counters.send_timeouts,
        )
        yield CounterMetricFamily(
            "kv_rejected_total",
            "Requests refused with 429.",
            value=sum(s.rejected_total for _, s in rows if s),
        )
        gauges: dict[str, list[float]] = {
            "kv_upstream_usable_tokens": [s.usable_tokens if s else 0 for _, s in rows],
            "kv_upstream_reserved_tokens": [s.reserved_tokens if s else 0 for _, s in rows],
            "kv_upstream_inflight_requests": [s.inflight if s else 0 for _, s in rows],
            "kv_upstream_out_of_service": [
                0 if s is not None and u.health.in_service(now) else 1 for u, s in rows
            ],
            # The speed the ledger's advice is built on (0: none known); throughput 0 also
            # when its sequences do not measurably slow each other down.
            "kv_upstream_decode_rate": [
                u.known.ledger.decode_rate if u.known else 0 for u, _ in rows
            ],
            "kv_upstream_decode_throughput": [
                (u.known.ledger.throughput or 0) if u.known else 0 for u, _ in rows
            ],
            # The admission rule in force (1: peak, 0: whole caps) and the most its holders
            # may hold at once by it (under caps, the reserved sum).
            "kv_upstream_admission_peak": [
                1 if s is not None and s.rule == "peak" else 0 for _, s in rows
            ],
            "kv_upstream_committed_tokens": [s.committed_tokens if s else 0 for _, s in rows],
            # The forecast of outputs: the quantile new holders are counted at (0: off, whole
            # caps), the preemption budget (0: none, the exact rule) and the engine's measured
            # preemptions per 1,000 requests; 1 while newcomers are counted from admission.
            "kv_upstream_forecast_quantile": [
                (s.forecast_quantile or 0) if s else 0 for _, s in rows
            ],
            "kv_upstream_preemption_budget": [
                (s.preemption_budget or 0) if s else 0 for _, s in rows
            ],
            "kv_upstream_preemptions_per_1000": [
                _preemption_rate(u.watch.preemptions.rate(), s) for u, s in rows
            ],
            "kv_upstream_start_clock": [
                1 if s is not None and s.start_clock else 0 for _, s in rows
            ],
            # Holders whose client reads slowly: counted as advancing at the engine's speed.
            "kv_upstream_slow_readers": [s.slow_readers if s else 0 for _, s in rows],
            # KV the engine uses that no holder explains (counted as held), and 1 while its
            # waiting, running and preemption figures cannot be read (whole caps).
            "kv_upstream_unknown_tokens": [s.unknown_tokens if s else 0 for _, s in rows],
            "kv_upstream_figures_unread": [1 if u.watch.blind else 0 for u, _ in rows],
        }
        counters: dict[str, list[float]] = {
            "kv_upstream_admitted": [s.admitted_total if s else 0 for _, s in rows],
            "kv_upstream_rejected": [s.rejected_total if s else 0 for _, s in rows],
            "kv_upstream_errors": [u.errors for u, _ in rows],
            "kv_upstream_lockstep_breaks": [u.lockstep_breaks for u, _ in rows],
            "kv_upstream_late_starts": [s.late_starts if s else 0 for _, s in rows],
        }
        yield GaugeMetricFamily(
            "kv_fairness_enabled",
            "1 when the budget is shared fairly between tenants (--tenants), 0: one FIFO queue.",
            value=1 if self.state.config.fairness is not None else 0,
        )
        if self.state.config.fairness is not None:
            yield from _tenant_metrics(self.state)
        reasons = GaugeMetricFamily(
            "kv_upstream_caps_reason",
            "1, with the reason, for an upstream on whole caps under --admission-rule peak.",
            labels=["upstream", "reason"],
        )
        for u, s in rows:
            if s is not None and s.caps_reason is not None:
                reasons.add_metric([u.name, s.caps_reason], 1)
        yield reasons
        shared = self.state.shared
        if shared is not None:
            yield GaugeMetricFamily(
                "kv_ledger_unreachable",
                "1 while the shared ledger (Redis) cannot be reached: new requests get 503.",
                value=0 if shared.reachable else 1,
            )
            yield CounterMetricFamily(
                "kv_ledger_outages", "Times the shared ledger became unreachable.",
                value=shared.outages,
            )  # fmt: skip
            yield CounterMetricFamily(
                "kv_ledger_refused", "Requests refused (503) while the shared ledger was away.",
                value=shared.refused,
            )  # fmt: skip
            yield CounterMetricFamily(
                "kv_ledger_lease_lapses",
                "Times this gateway found its lease lapsed while it held reservations (they "
                "were put back: their requests run on).",
                value=shared.lease.lapsed_total,
            )  # fmt: skip
        # What an autoscaler reads: every gateway's on a shared ledger, the same at each of
        # them; this gateway's where its ledger is its own (age 0).
        seen = [
            backlog(u.known.queue, shared=shared is not None) if u.known else None for u, _ in rows
        ]
        gauges["kv_upstream_shared_reserved_tokens"] = [b.reserved if b else 0 for b in seen]
        gauges["kv_upstream_shared_inflight_requests"] = [b.inflight if b else 0 for b in seen]
        gauges["kv_upstream_shared_queued_requests"] = [b.waiting if b else 0 for b in seen]
        gauges["kv_upstream_shared_queued_tokens"] = [b.waiting_tokens if b else 0 for b in seen]
        gauges["kv_upstream_shared_room_tokens"] = [b.room if b else 0 for b in seen]
        gauges["kv_upstream_shared_view_age_seconds"] = [
            max(0.0, now - b.read_at) if b and b.read_at is not None else 0 for b in seen
        ]
        for name, values in gauges.items():
            gauge = GaugeMetricFamily(name, name.replace("_", " "), labels=["upstream"])
            for (u, _), amount in zip(rows, values, strict=True):
                gauge.add_metric([u.name], amount)
            yield gauge
        for name, values in counters.items():
            counter = CounterMetricFamily(name, name.replace("_", " "), labels=["upstream"])
            for (u, _), amount in zip(rows, values, strict=True):
                counter.add_metric([u.name], amount)
            yield counter
