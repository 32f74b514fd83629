"""What one reference server owns (its engine, ledger, queue, counters) and how it counts the
requests it serves; ``app.state.server``."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..admission.journal import AdmissionLog
from ..admission.ledger import KVAdmissionController
from ..admission.queue import AdmissionQueue
from .config import ServerConfig
from .engine import SimulatedEngine
from .metrics import build_registry

__all__ = ["CountingMiddleware", "ServerState"]

_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/generate",
    "/health",
    "/metrics",
)


class ServerState:
    """Everything one server instance owns; ``app.state.server``."""

    #: A request generates one sequence here (``n`` must be 1): nothing to share among them.
    shares_prompt = False

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.admission_log = (
            AdmissionLog(config.admission_log) if config.admission_log is not None else None
        )
        self.engine = SimulatedEngine(
            tokenizer=config.tokenizer,
            capacity_tokens=config.total_kv_tokens,
            decode_rate=config.decode_rate,
            mean_output_tokens=config.mean_output_tokens,
            seed=config.seed,
            block_size=config.block_size,
            tick_seconds=config.tick_seconds,
            fault_rate=config.fault_rate,
            throughput=config.throughput,
            max_running=config.max_running,
            prefix_caching=config.prefix_caching,
            on_overflow=config.on_overflow,
            recompute_seconds=config.recompute_seconds,
        )
        self.ledger = KVAdmissionController(
            total_kv_tokens=config.total_kv_tokens,
            context_window=config.context_window,
            decode_rate=config.decode_rate,
            throughput=config.throughput,
            kv_bytes_per_token=config.kv_bytes_per_token,
            safety_fraction=config.safety_fraction,
            block_size=config.block_size,
            strategy=config.admission,
            max_concurrency=config.max_concurrency,
            # A sequence finishes within a few ticks of cap / rate; the estimate says so.
            release_margin=3 * config.tick_seconds + 0.02,
            output_quantile=config.retry_after_quantile,
            # An answer whose write waits send_timeout on its client is cut (the generation
            # endpoint): a stalled holder is expected to end then.
            overrun=config.send_timeout,
            on_event=self.admission_log,
        )
        self.queue = AdmissionQueue(
            self.ledger, max_wait=config.max_queue_wait, stagger=config.stagger_retry_after
        )
        self.created = int(time.time())
        # Completion ids: unique per server run (a random prefix) and cheap (a counter after it).
        self._id_prefix = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._requests = 0
        self._generation_requests = 0
        self._send_timeouts = 0
        self._responses: Counter[tuple[str, int]] = Counter()
        self.registry = build_registry(self.snapshot, self.responses)

    def completion_id(self, prefix: str) -> str:
        """A new id such as ``cmpl-3f9a0c1b2d4e0000002a``, as OpenAI's are opaque strings."""
        return f"{prefix}-{self._id_prefix}{next(self._ids):010x}"

    def count_request(self, path: str, *, generation: bool) -> None:
        with self._lock:
            self._requests += 1
            if generation:
                self._generation_requests += 1

    def count_send_timeout(self) -> None:
        with self._lock:
            self._send_timeouts += 1

    def count_response(self, path: str, status: int) -> None:
        route = path if path in _ROUTES else "other"
        with self._lock:
            self._responses[(route, status)] += 1

    def responses(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._responses)

    def snapshot(self) -> dict[str, float]:
        """Every metric by its Prometheus name (counters with ``_total``)."""
        ledger = self.ledger.stats()
        headroom = self.ledger.headroom(self.queue.now(), queued=self.queue.waiting_tokens)
        engine = self.engine.stats()
        with self._lock:
            requests, generation = self._requests, self._generation_requests
            send_timeouts = self._send_timeouts
        values: dict[str, float] = {
            "kv_usable_tokens": ledger.usable_tokens,
            "kv_usable_bytes": ledger.usable_bytes,
            "kv_physical_capacity_tokens": engine.capacity_tokens,
            "kv_reserved_tokens": ledger.reserved_tokens,
            "kv_reserved_bytes": ledger.reserved_bytes,
            "kv_peak_reserved_tokens": ledger.peak_reserved_tokens,
            "kv_used_tokens": engine.used_tokens,
            "kv_peak_used_tokens": engine.peak_used_tokens,
            "kv_inflight_requests": ledger.inflight,
            "kv_queue_waiting_requests": self.queue.waiting,
            "kv_free_tokens": headroom.free,
            "kv_next_release_seconds": headroom.next_release_in,
            "kv_admitted_total": ledger.admitted_total,
            "kv_rejected_total": ledger.rejected_total,
            "kv_oom_events_total": engine.oom_events_total,
            "kv_oom_failed_requests_total": engine.oom_failed_sequences_total,
            "kv_injected_faults_total": engine.faults_total,
            "kv_generated_tokens_total": engine.generated_tokens_total,
            "kv_send_timeouts_total": send_timeouts,
            "kv_http_requests_total": requests,
            "kv_generation_requests_total": generation,
            "kv_engine_requests_running": engine.running,
            "kv_engine_requests_waiting": engine.waiting,
            "kv_engine_prefix_caching": int(engine.prefix_caching),
            "kv_engine_block_size": engine.block_size,
            "kv_engine_preempts": int(engine.preempts),
            "kv_engine_preemptions_total": engine.preemptions_total,
        }
        if engine.max_running is not None:
            values["kv_engine_max_running"] = engine.max_running
        return values


class CountingMiddleware:
    """Counts requests and responses by route and status, for ``/metrics`` and tests."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        self.state.count_request(
            path, generation=path in ("/v1/completions", "/v1/chat/completions", "/generate")
        )

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.state.count_response(path, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
