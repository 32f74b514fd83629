"""The gateway's ``/metrics``: the reference server's ledger metrics summed over upstreams, and
each upstream's labelled by its URL (shown without user and password). Those are this process's
own holdings; with a shared ledger, ``kv_upstream_shared_*`` are every gateway's, read from
Redis at the scrape."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..admission.queue import AdmissionQueue
    from ..shared_ledger.ledger import SharedState
    from .state import GatewayState

__all__ = ["GatewayCollector", "registry_for"]


def registry_for(state: GatewayState) -> CollectorRegistry:
    """A registry of its own (several gateways live in one test process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(state))
    return registry


def _shared_state(queue: AdmissionQueue) -> SharedState | None:
    """Every gateway's totals for the upstream of ``queue``, when its ledger is shared."""
    from ..shared_ledger.queue import SharedQueue  # redis is needed only when shared

    return queue.shared.seen if isinstance(queue, SharedQueue) else None


class GatewayCollector:
    """The reference server's ledger metrics summed over upstreams, and each one labelled."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        now = time.monotonic()
        rows = []
        for u in self.state.upstreams:
            stats = u.known.ledger.stats() if u.known is not None else None
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
            value=self.state.send_timeouts(),
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
        }
        counters: dict[str, list[float]] = {
            "kv_upstream_admitted": [s.admitted_total if s else 0 for _, s in rows],
            "kv_upstream_rejected": [s.rejected_total if s else 0 for _, s in rows],
            "kv_upstream_errors": [u.errors for u, _ in rows],
            "kv_upstream_lockstep_breaks": [u.lockstep_breaks for u, _ in rows],
        }
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
                "kv_ledger_lease_lapses", "Times this gateway found its lease lapsed.",
                value=shared.lease.lapsed_total,
            )  # fmt: skip
        if shared is not None:
            seen = [_shared_state(u.known.queue) if u.known else None for u, _ in rows]
            gauges["kv_upstream_shared_reserved_tokens"] = [s.reserved if s else 0 for s in seen]
            gauges["kv_upstream_shared_inflight_requests"] = [s.inflight if s else 0 for s in seen]
            gauges["kv_upstream_shared_queued_tokens"] = [s.queued if s else 0 for s in seen]
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
