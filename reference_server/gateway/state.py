"""What one gateway owns (its upstreams, their ledgers, the shared ledger, its counters) and how
it discovers its upstreams; ``app.state.gateway``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from kvclient import TiktokenCounter, TokenCounter

from .config import GatewayConfig
from .redis_ledgers import SharedLedgers
from .upstream import Known, Upstream, UpstreamUnavailable

__all__ = ["GatewayCounters", "GatewayState"]

logger = logging.getLogger("kvclient.gateway")


@dataclass(slots=True)
class GatewayCounters:
    """What the gateway counts of its own (the upstreams count theirs): written by the relay,
    read by ``/metrics``."""

    #: Answers cut for not being read within ``--send-timeout``.
    send_timeouts: int = 0


class GatewayState:
    """Everything one gateway owns; ``app.state.gateway``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        n = len(config.upstreams)
        overrides = [*config.kv_tokens, *[None] * (n - len(config.kv_tokens))]
        running = [*config.max_running, *[None] * (n - len(config.max_running))]
        budgets = [*config.preemption_budget, *[None] * (n - len(config.preemption_budget))]
        self.upstreams = [
            Upstream(url, kv, config, most, budget)
            for url, kv, most, budget in zip(
                config.upstreams, overrides, running, budgets, strict=True
            )
        ]
        self.fallback_counter: TokenCounter = config.counter or TiktokenCounter()
        self.counters = GatewayCounters()
        self._discovery_lock: anyio.Lock | None = None
        #: The shared ledger (``--ledger``), or None: each upstream's ledger is this process's.
        self.shared: SharedLedgers | None = None
        if config.ledger is not None:
            self.shared = SharedLedgers(
                config.ledger,
                lease_seconds=config.lease_seconds,
                ca_file=config.ledger_ca_file,
                client_cert=config.ledger_client_cert,
                client_key=config.ledger_client_key,
            )
            for upstream in self.upstreams:
                upstream.shared = self.shared

    @property
    def known(self) -> list[Known]:
        """The upstreams discovered so far."""
        return [u.known for u in self.upstreams if u.known is not None]

    async def admission(self) -> list[Known]:
        """The upstreams known to the gateway, discovering (again) those not yet known."""
        if any(u.known is None for u in self.upstreams):
            if self._discovery_lock is None:
                self._discovery_lock = anyio.Lock()
            async with self._discovery_lock:
                now = time.monotonic()
                for upstream in self.upstreams:
                    if upstream.known is not None or not upstream.health.in_service(now):
                        continue
                    try:
                        await upstream.discover()
                        upstream.discovery_error = None
                        upstream.health.succeeded()
                    except UpstreamUnavailable as exc:
                        upstream.discovery_error = str(exc)
                        upstream.health.failed(now, at_once=True)  # it never answered
                        logger.warning("upstream %s: %s", upstream.name, exc)
        return self.known

    def window(self, known: Sequence[Known]) -> int:
        """The largest request the gateway can ever admit: each upstream's context window, or
        its usable budget (whole blocks) where that is smaller, as ``/v1/models`` reports it.
        So an unset ``max_tokens`` is clamped to what can really be reserved, never refused."""
        sizes = []
        for k in known:
            ledger = k.ledger
            whole = ledger.usable_tokens // ledger.block_size * ledger.block_size
            sizes.append(min(ledger.context_window, whole))
        return min(sizes)

    def model(self) -> str | None:
        for upstream in self.upstreams:
            if upstream.discovery is not None and upstream.discovery.model is not None:
                return upstream.discovery.model
        return None

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.aclose()
        if self.shared is not None:
            await self.shared.aclose()
