"""What ``kvclient gateway`` is told, checked when it is built."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import yarl

from kvclient import TokenCounter

from ..admission.fairness import FairPolicy
from ..admission.holders import DEFAULT_RELAY_LAG
from ..admission.ledger import RULES, Rule
from ..admission.preemption import DEFAULT_START_QUANTILE, LADDER
from ..http.generation import DEFAULT_SEND_TIMEOUT
from ..http.requests import DEFAULT_MAX_BODY_BYTES
from ..shared_ledger.scripts import DEFAULT_LEASE_SECONDS
from .tenants import TenantKeys, check_tenant_header

__all__ = [
    "DEFAULT_DECODE_RATE",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_ANSWER_BYTES",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE_WAIT",
    "DEFAULT_PREEMPTION_BUDGET",
    "DEFAULT_SEND_TIMEOUT",
    "GatewayConfig",
    "public_url",
]

#: Per-sequence decode rate assumed for Retry-After estimates until the gateway has measured one.
DEFAULT_DECODE_RATE = 50.0
#: Seconds a request waits in the FIFO queue for budget before a 429: what does not fit waits
#: its turn, as in the engine's own queue, and is admitted the moment a release makes room. A
#: client's ``Prefer: wait=N`` (RFC 7240; kvclient sends it) shortens it.
DEFAULT_MAX_QUEUE_WAIT = 300.0
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_OUT_OF_SERVICE_SECONDS = 2.0
#: A whole (not streamed) upstream answer larger than this is refused (502), not buffered.
DEFAULT_MAX_ANSWER_BYTES = 16 * 1024 * 1024
#: Connections to one upstream at once: every admitted request holds one for its whole life.
DEFAULT_MAX_CONNECTIONS = 1024
#: Preemptions per 1,000 requests the forecast of outputs may cost an engine that preempts and
#: recomputes (vLLM, SGLang): at most one request in 50 pays a recompute (one prefill of what it
#: held) and a wait in the engine's queue, where vLLM left alone preempted about 400 per 1,000 on
#: the realistic mix the gateway is measured on. Tighter budgets measured no better: one
#: preemption early in a window tightens the quantile past what outputs that stop early leave
#: to gain (docs/results.md). 0: the exact rule, no forecast.
DEFAULT_PREEMPTION_BUDGET = 20.0


def public_url(url: str) -> str:
    """``url`` as it may be shown (logs, metrics, health, errors): without user and password."""
    try:
        parsed = yarl.URL(url)
    except ValueError:
        return "<an unparseable URL>"
    if parsed.user is None and parsed.password is None:
        return url.rstrip("/")
    return str(parsed.with_user(None)).rstrip("/")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """What ``kvclient gateway`` is told. ``kv_tokens[i]`` overrides upstream ``i``'s budget."""

    upstreams: tuple[str, ...]
    kv_tokens: tuple[int | None, ...] = ()
    context_window: int | None = None
    #: The share of each upstream's KV pool admitted into; None: the pool less what the engine
    #: keeps for itself where it counts its pool in blocks (vLLM, ours), else
    #: ``DEFAULT_SAFETY_FRACTION`` of it (and of a ``--kv-tokens``).
    safety_fraction: float | None = None
    max_queue_wait: float = DEFAULT_MAX_QUEUE_WAIT
    decode_rate: float = DEFAULT_DECODE_RATE
    #: The peak rule's allowance, in seconds, for a token's way from the engine's decode step to
    #: the gateway's reading of it (``--relay-lag``; see ``admission/holders.py``).
    relay_lag: float = DEFAULT_RELAY_LAG
    #: Seconds between scrapes of each engine's ``/metrics`` (one at most: the peak rule's
    #: watch needs its figures that often, see ``gateway/watch.py``), from whose decode
    #: counters the ledger's decode speed is measured (see ``gateway/speed.py``); 0: scraped
    #: once a second for the watch alone, the answers' own rates are used.
    speed_interval: float = 1.0
    #: A local counter (a model's tokenizer); None: the upstream's /tokenize, else tiktoken.
    counter: TokenCounter | None = None
    #: The key clients must send (``Authorization: Bearer``); checked here, never forwarded.
    api_key: str | None = None
    #: The key sent to every upstream (``Authorization: Bearer``); a user and password in an
    #: upstream's URL are sent to it as Basic auth instead.
    upstream_api_key: str | None = None
    #: TLS to upstreams: a CA bundle to verify them with, and a client certificate (a PEM file
    #: with the key, or the certificate with ``upstream_client_key``).
    upstream_ca_bundle: str | None = None
    upstream_client_cert: str | None = None
    upstream_client_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    #: A write to the client that waits longer than this ends the request (a stalled reader must
    #: not pin its reservation).
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    out_of_service_seconds: float = DEFAULT_OUT_OF_SERVICE_SECONDS
    #: ``redis://HOST:PORT/DB`` (or ``rediss://``, or ``redis+sentinel://HOST:PORT/SERVICE``):
    #: every upstream's reservations are kept there, shared by every gateway given the same URL.
    #: None: in this process only.
    ledger: str | None = None
    #: Seconds a gateway's reservations outlive it in the shared ledger when it dies.
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    #: With ``rediss://``: the CA certificates (PEM) Redis's certificate is verified with (None:
    #: the system's), and a client certificate and its key for a Redis that asks for one.
    ledger_ca_file: str | None = None
    ledger_client_cert: str | None = None
    ledger_client_key: str | None = None
    #: The admission rule (``--admission-rule``): ``"peak"``, the worst-case peak of the holders'
    #: sum over the coming decode steps from their relayed progress, where the engine qualifies
    #: (else whole caps, with the reason in /health, /metrics and the log); ``"caps"``, the sum
    #: of every holder's whole reservation.
    admission_rule: Rule = "peak"
    #: ``max_running[i]``: how many sequences upstream ``i`` runs at once (vLLM's
    #: ``--max-num-seqs``); None: discovered where the engine says (llama.cpp's slots, ours).
    max_running: tuple[int | None, ...] = ()
    #: ``preemption_budget[i]``: preemptions per 1,000 requests the forecast of outputs may cost
    #: upstream ``i`` (``--preemption-budget``); 0: the exact rule; None:
    #: ``DEFAULT_PREEMPTION_BUDGET`` for an engine that preempts, 0 for one that fails requests.
    preemption_budget: tuple[float | None, ...] = ()
    #: The quantile of a holder's remaining output the forecast starts at
    #: (``--forecast-quantile``), one of :data:`~..admission.preemption.LADDER`.
    forecast_quantile: float = DEFAULT_START_QUANTILE
    #: Fair shares of each upstream's budget between tenants (``--tenants FILE``): None, one
    #: FIFO queue for everyone.
    fairness: FairPolicy | None = None
    #: The API keys the tenants file lists, and what an unlisted key gets (None: none listed).
    tenant_keys: TenantKeys | None = None
    #: The header a proxy the operator trusts sets to a request's tenant (``--tenant-header``),
    #: read only for a request no listed key names; None: not read.
    tenant_header: str | None = None

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream is needed")
        for url in self.upstreams:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"an upstream must be an http(s) URL, got {public_url(url)!r}")
        if len(self.kv_tokens) > len(self.upstreams):
            raise ValueError("more --kv-tokens than --upstream")
        for kv in self.kv_tokens:
            if kv is not None and kv < 1:
                raise ValueError(f"--kv-tokens must be at least 1, got {kv}")
        if len(self.max_running) > len(self.upstreams):
            raise ValueError("more --max-running than --upstream")
        for running in self.max_running:
            if running is not None and running < 1:
                raise ValueError(f"--max-running must be at least 1, got {running}")
        if len(self.preemption_budget) > len(self.upstreams):
            raise ValueError("more --preemption-budget than --upstream")
        for budget in self.preemption_budget:
            if budget is not None and not (budget >= 0 and math.isfinite(budget)):
                raise ValueError(f"--preemption-budget must be a finite number >= 0, got {budget}")
        if self.forecast_quantile not in LADDER:
            choices = ", ".join(f"{q:g}" for q in LADDER)
            raise ValueError(f"--forecast-quantile must be one of {choices}")
        if self.admission_rule not in RULES:
            raise ValueError(f"--admission-rule must be one of {', '.join(RULES)}")
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(f"--context-window must be at least 1, got {self.context_window}")
        if self.safety_fraction is not None and not 0.0 < self.safety_fraction <= 1.0:
            raise ValueError(f"--safety-fraction must be in (0, 1], got {self.safety_fraction}")
        if self.max_queue_wait < 0 or not math.isfinite(self.max_queue_wait):
            raise ValueError(
                f"max_queue_wait must be a finite number >= 0, got {self.max_queue_wait}"
            )
        if self.ledger is not None and not self.ledger.startswith(
            ("redis://", "rediss://", "redis+sentinel://")
        ):
            raise ValueError("--ledger must be a redis://, rediss:// or redis+sentinel:// URL")
        for flag, path in (
            ("--ledger-ca-file", self.ledger_ca_file),
            ("--ledger-client-cert", self.ledger_client_cert),
            ("--ledger-client-key", self.ledger_client_key),
        ):
            if path is None:
                continue
            if self.ledger is None or not self.ledger.startswith("rediss://"):
                raise ValueError(f"{flag} needs a rediss:// --ledger (Redis over TLS)")
            if not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file: {path}")
        self._check_tenants()
        if self.ledger_client_key is not None and self.ledger_client_cert is None:
            raise ValueError("--ledger-client-key needs --ledger-client-cert")
        if not 0 < self.lease_seconds < 3600:
            raise ValueError(f"--lease-seconds must be > 0 and < 3600, got {self.lease_seconds}")
        if self.relay_lag < 0 or not math.isfinite(self.relay_lag):
            raise ValueError(f"--relay-lag must be a finite number >= 0, got {self.relay_lag}")
        if self.speed_interval < 0 or not math.isfinite(self.speed_interval):
            raise ValueError(
                f"speed_interval must be a finite number >= 0, got {self.speed_interval}"
            )
        for name in ("decode_rate", "connect_timeout", "read_timeout", "send_timeout"):
            _positive(name, getattr(self, name))
        for name in ("max_body_bytes", "max_answer_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def _check_tenants(self) -> None:
        if self.tenant_header is not None:
            if self.fairness is None:
                raise ValueError("--tenant-header needs --tenants FILE")
            check_tenant_header(self.tenant_header)
        if self.tenant_keys is not None and self.fairness is None:
            raise ValueError("tenant keys need --tenants FILE")
        keys = self.tenant_keys
        if self.api_key is not None and keys is not None and keys.unlisted == "default":
            raise ValueError(
                '--api-key with a --tenants file whose unlisted = "default": the file lets any '
                "key in as the default tenant, the option only its own; drop one of them"
            )
