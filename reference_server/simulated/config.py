"""Server settings: one frozen, keyword-only dataclass, defaults tuned for a fast demo."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvclient import DEFAULT_BLOCK_SIZE, ModelProfile, TiktokenCounter, Tokenizer

from ..admission.ledger import DEFAULT_SAFETY_FRACTION, STRATEGIES, Strategy
from ..http.generation import DEFAULT_SEND_TIMEOUT
from ..http.requests import DEFAULT_MAX_BODY_BYTES
from .scheduler import OVERFLOWS

__all__ = [
    "DEFAULT_CONTEXT_WINDOW",
    "DEFAULT_DECODE_RATE",
    "DEFAULT_KV_TOKENS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MEAN_OUTPUT_TOKENS",
    "DEFAULT_MODEL_ID",
    "DEFAULT_PROFILE",
    "DEFAULT_SEND_TIMEOUT",
    "DEFAULT_TICK_SECONDS",
    "ServerConfig",
]

DEFAULT_MODEL_ID = "kvclient-sim"
DEFAULT_CONTEXT_WINDOW = 8192
#: Four full contexts: small enough that a handful of large requests saturate it.
DEFAULT_KV_TOKENS = 32768
DEFAULT_DECODE_RATE = 1000.0
DEFAULT_MEAN_OUTPUT_TOKENS = 200.0
DEFAULT_TICK_SECONDS = 0.01
#: Retry-After from every holder's worst case by default (see ServerConfig): a quantile of
#: recent output lengths is a bet, which told 0.6-2.3 % of the soak's 429s less than the wait.
DEFAULT_RETRY_AFTER_QUANTILE: float | None = None
#: Bytes per token of the simulated model's KV cache (for the byte gauges): Llama-3.1-8B's.
DEFAULT_PROFILE = ModelProfile.preset("llama-3.1-8b")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything the reference server needs.

    The KV budget is ``kv_tokens`` tokens, or ``kv_bytes`` bytes divided by the profile's
    per-token bytes (``model_profile``, e.g. ``ModelProfile.preset("llama-3.1-8b")``); give one.
    ``context_window`` is the server's own, independent of the profile's (the simulated model is
    not the profile's model; only its per-token KV cost is borrowed).
    """

    model: str = DEFAULT_MODEL_ID
    context_window: int = DEFAULT_CONTEXT_WINDOW
    kv_tokens: int | None = None
    kv_bytes: int | None = None
    model_profile: ModelProfile = DEFAULT_PROFILE
    safety_fraction: float = DEFAULT_SAFETY_FRACTION
    block_size: int = DEFAULT_BLOCK_SIZE
    decode_rate: float = DEFAULT_DECODE_RATE
    #: Tokens per second the engine makes in all with a large batch: a decode step takes
    #: ``1 / decode_rate`` plus ``1 / throughput`` per other running sequence (the ledger's
    #: ``rate_at``). None: every step takes ``1 / decode_rate``, however many run.
    throughput: float | None = None
    #: Sequences the engine decodes at once (vLLM's ``max_num_seqs``); the others wait in
    #: FIFO order holding no KV. None: no cap.
    max_running: int | None = None
    #: Share full prompt blocks between running sequences with the same prefix (vLLM's
    #: automatic prefix caching), once the holder's prefill is done.
    prefix_caching: bool = True
    #: What an overflow of the pool does: ``fail`` every request in the engine (a crash, as
    #: llama.cpp's unified cache does), or ``preempt`` the newest running sequence to recompute
    #: it later (vLLM's scheduler), each recomputed token adding ``recompute_seconds`` to the
    #: step it rejoins in.
    on_overflow: str = "fail"
    recompute_seconds: float = 0.0
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS
    admission: Strategy = "reserve"
    max_concurrency: int | None = None
    max_queue_wait: float = 0.0
    #: Remember each 429's advice as a promise so clients turned away together are told staggered
    #: times (helps clients that follow Retry-After exactly, without jitter; costs waiting time
    #: when outputs stop well before their caps). Off: the plain estimate from in-flight requests.
    stagger_retry_after: bool = False
    #: None (the default): Retry-After is the earliest moment the request fits if every holder
    #: runs to its cap at the decode rate (a stalled one to its cut), the worst case: never
    #: shorter than the real wait, only later when outputs stop early (clients that pace from
    #: the RateLimit room come back as soon as an answer shows it). A quantile (say 0.9): each
    #: holder is expected to end by that quantile of recent output lengths when shorter than
    #: its cap, a bet that tells some clients to come back before capacity does.
    retry_after_quantile: float | None = DEFAULT_RETRY_AFTER_QUANTILE
    api_key: str | None = None
    seed: int = 0
    #: Share of requests the engine fails on purpose at a random token (chaos tests, the soak);
    #: seeded by ``seed``. Answered as 500 ``injected_fault`` (in a stream: an error event).
    fault_rate: float = 0.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: A client that stops reading (its socket buffers full, the server's writes waiting) must
    #: not pin its reservation: a write that waits this many seconds ends the request. The
    #: ledger's Retry-After counts such a holder as ending then.
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    #: Append every admission, release and 429 (with its advice) to this file as JSON lines
    #: (``reference_server.admission.journal``); None: no log.
    admission_log: str | None = None
    #: SO_SNDBUF of every connection, in bytes; None: the kernel's (it grows to megabytes on
    #: loopback). Smaller means a client that stops reading blocks the server's writes sooner.
    #: Applied where the server binds its socket (``running_server``, ``python -m``).
    socket_send_buffer: int | None = None
    tick_seconds: float = DEFAULT_TICK_SECONDS
    tokenizer: Tokenizer = field(default_factory=TiktokenCounter)

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def positive_number(name: str, value: float) -> None:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

        positive_int("context_window", self.context_window)
        positive_int("block_size", self.block_size)
        positive_int("max_body_bytes", self.max_body_bytes)
        if self.kv_tokens is not None and self.kv_bytes is not None:
            raise ValueError("give the KV budget as kv_tokens or as kv_bytes, not both")
        if self.kv_tokens is not None:
            positive_int("kv_tokens", self.kv_tokens)
        if self.kv_bytes is not None:
            positive_int("kv_bytes", self.kv_bytes)
            if self.model_profile.tokens_for_bytes(self.kv_bytes) < 1:
                raise ValueError(
                    f"kv_bytes={self.kv_bytes} holds no token at "
                    f"{self.model_profile.kv_bytes_per_token} bytes per token"
                )
        if not 0.0 < self.safety_fraction <= 1.0:
            raise ValueError(f"safety_fraction must be in (0, 1], got {self.safety_fraction!r}")
        positive_number("decode_rate", self.decode_rate)
        positive_number("tick_seconds", self.tick_seconds)
        if self.throughput is not None:
            positive_number("throughput", self.throughput)
        if self.max_running is not None:
            positive_int("max_running", self.max_running)
        if self.on_overflow not in OVERFLOWS:
            raise ValueError(f"on_overflow must be one of {', '.join(OVERFLOWS)}")
        if not (self.recompute_seconds >= 0 and math.isfinite(self.recompute_seconds)):
            raise ValueError(
                f"recompute_seconds must be a finite number >= 0, got {self.recompute_seconds}"
            )
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a boolean, got {self.prefix_caching!r}")
        positive_number("send_timeout", self.send_timeout)
        if self.socket_send_buffer is not None:
            positive_int("socket_send_buffer", self.socket_send_buffer)
        if not (math.isfinite(self.mean_output_tokens) and self.mean_output_tokens >= 1):
            raise ValueError(f"mean_output_tokens must be >= 1, got {self.mean_output_tokens!r}")
        if self.admission not in STRATEGIES:
            raise ValueError(
                f"admission must be one of {', '.join(STRATEGIES)}, got {self.admission!r}"
            )
        if self.max_concurrency is not None:
            positive_int("max_concurrency", self.max_concurrency)
        if not (math.isfinite(self.max_queue_wait) and self.max_queue_wait >= 0):
            raise ValueError(f"max_queue_wait must be >= 0 seconds, got {self.max_queue_wait!r}")
        if self.retry_after_quantile is not None and not 0.0 < self.retry_after_quantile <= 1.0:
            raise ValueError(
                f"retry_after_quantile must be in (0, 1] or None, got {self.retry_after_quantile!r}"
            )
        if not (isinstance(self.fault_rate, (int, float)) and 0.0 <= self.fault_rate <= 1.0):
            raise ValueError(f"fault_rate must be within 0..1, got {self.fault_rate!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")

    @property
    def total_kv_tokens(self) -> int:
        """The physical KV pool, in tokens (before the safety fraction)."""
        if self.kv_bytes is not None:
            return self.model_profile.tokens_for_bytes(self.kv_bytes)
        return self.kv_tokens if self.kv_tokens is not None else DEFAULT_KV_TOKENS

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_profile.kv_bytes_per_token
