"""An engine's KV budget: how many tokens of KV cache it has, and how it spends them (pure).

:func:`discover_budget` is a driver like :func:`kvclient.engines.discovery.discover_context`:
vLLM's, TGI's and our server's ``/metrics`` (the names in
:data:`kvclient.engines.metrics.METRIC_NAMES`), llama.cpp's ``/props``, SGLang's
``/get_server_info``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from ._answers import MAX_BLOCK, dig, positive
from .discovery import PROPS, SGLANG_SERVER_INFO, Answer, Probe, window_from_props
from .metrics import (
    OURS,
    TGI,
    VLLM,
    lockstep_from_metrics,
    metric_whole,
    prefix_caching_from_vllm_metrics,
    prometheus_samples,
)

__all__ = [
    "METRICS",
    "VLLM_KEPT_BLOCKS",
    "Budget",
    "budget_from_llama_cpp_props",
    "budget_from_reference_metrics",
    "budget_from_sglang",
    "budget_from_tgi_metrics",
    "budget_from_vllm_metrics",
    "discover_budget",
]


@dataclass(frozen=True, slots=True)
class Budget:
    """An engine's KV pool as the gateway reserves against it."""

    #: Tokens of KV cache the engine has (before any safety fraction).
    kv_tokens: int | None
    #: The engine's KV block size in tokens (vLLM's paged blocks; 1 where it has none).
    block_size: int = 1
    #: Requests it can run at once (llama.cpp's slots), when bounded.
    max_concurrency: int | None = None
    engine: str | None = None
    source: str | None = None
    tried: tuple[str, ...] = ()
    #: Whether it shares the KV blocks of identical prompt prefixes among running requests
    #: (vLLM's ``enable_prefix_caching``, ours); None when it does not say.
    prefix_caching: bool | None = None
    #: It says that it runs every request it is sent at each step, however many (ours without
    #: ``--max-running``: it exports its waiting line and no cap).
    runs_all: bool = False
    #: Where the engine reports its pool in blocks it manages itself, the blocks of it that it
    #: keeps for itself (vLLM: one, its null block): the budget is the pool less those, exactly.
    #: None where its memory is not counted in blocks: a safety fraction of it is budgeted.
    kept_blocks: int | None = None
    #: Its overflow preempts a running sequence and recomputes it later (vLLM, SGLang; ours
    #: when told to) rather than failing requests: a forecast of outputs may bet within a budget.
    preempts: bool = False
    #: The engine said its block size (else ``block_size`` is a default): the peak rule counts
    #: in its blocks, and is refused without them.
    block_known: bool = False
    #: It decodes speculatively (vLLM's ``spec_decode`` counters): a sequence may advance
    #: several tokens a step, and holds slots for the tokens it drafts.
    speculative: bool = False

    @property
    def exact_pool(self) -> int | None:
        """Tokens of KV the engine can really hand out, where it counts them in blocks: its pool
        less the blocks it keeps; None elsewhere."""
        if self.kv_tokens is None or self.kept_blocks is None:
            return None
        return max(0, self.kv_tokens - self.kept_blocks * self.block_size)


METRICS = Probe("GET", "/metrics", engines="vLLM, TGI, llama.cpp (--metrics), ours")
#: Blocks vLLM keeps out of its ``num_gpu_blocks`` for itself: its block pool's null block
#: (``BlockPool.null_block``, taken from the free queue when the pool is made).
VLLM_KEPT_BLOCKS = 1


def budget_from_vllm_metrics(text: str) -> tuple[int, int] | None:
    """vLLM ``/metrics``: ``vllm:cache_config_info`` labels ``num_gpu_blocks`` x ``block_size``
    -> ``(kv tokens, block size)``."""
    for labels, _ in prometheus_samples(text, VLLM.cache_config):
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if positive(size, MAX_BLOCK) and positive(blocks) and positive(blocks * size):
            return blocks * size, size
    return None


def budget_from_reference_metrics(text: str) -> int | None:
    """Our reference server's ``/metrics``: ``kv_physical_capacity_tokens`` (its KV blocks are
    16 tokens)."""
    return metric_whole(text, OURS.kv_tokens)


def budget_from_tgi_metrics(text: str) -> int | None:
    """TGI ``/metrics``: ``tgi_batch_max_total_tokens`` (its ``/info`` dropped the field)."""
    return metric_whole(text, TGI.kv_tokens)


def budget_from_llama_cpp_props(payload: Any) -> tuple[int, int] | None:
    """llama.cpp ``/props`` -> ``(kv tokens, slots)``.

    ``n_ctx`` is each slot's window. Slots have a window each unless the KV cache is unified
    (``--kv-unified``), when they share one pool of ``-c`` tokens and each slot's window is that
    whole pool. ``/props`` does not say which, so the pool taken is one window: exact when
    unified, and safe (one window's worth at a time) when not; ``--kv-tokens`` says otherwise.
    """
    window = window_from_props(payload)
    slots = positive(dig(payload, "total_slots"))
    if window is None or slots is None:
        return None
    return window, slots


def budget_from_sglang(payload: Any) -> int | None:
    """SGLang ``/get_server_info``: ``max_total_num_tokens``."""
    return positive(dig(payload, "max_total_num_tokens"))


def discover_budget() -> Generator[Probe, Answer, Budget]:
    """Find an engine's KV pool: vLLM's and TGI's ``/metrics``, llama.cpp's ``/props``, SGLang's
    ``/get_server_info``. ``/metrics`` answers are text: send them as ``Answer(status, text)``."""
    tried: list[str] = []
    answer = yield METRICS
    tried.append(f"{METRICS} -> {answer.status}")
    if answer.status == 200 and isinstance(answer.payload, str):
        text = answer.payload
        vllm = budget_from_vllm_metrics(text)
        if vllm is not None:
            source = f"{METRICS} vllm:cache_config_info num_gpu_blocks x block_size"
            sharing = prefix_caching_from_vllm_metrics(text)
            return Budget(
                vllm[0], vllm[1], None, "vllm", source, tuple(tried), sharing,
                kept_blocks=VLLM_KEPT_BLOCKS, preempts=True, block_known=True,
                speculative=lockstep_from_metrics(text).speculative,
            )  # fmt: skip
        ours = budget_from_reference_metrics(text)
        if ours is not None:
            source = f"{METRICS} kv_physical_capacity_tokens"
            said = metric_whole(text, OURS.block_size)
            block = said or 16
            running = metric_whole(text, OURS.max_running)
            shares = metric_whole(text, OURS.prefix_caching)
            lined = metric_whole(text, OURS.requests_waiting) is not None
            return Budget(
                ours, block, running, "kvclient", source, tuple(tried),
                None if shares is None else shares == 1,
                runs_all=lined and running is None,
                kept_blocks=0, preempts=metric_whole(text, OURS.preempts) == 1,
                block_known=said is not None,
            )  # fmt: skip
        tgi = budget_from_tgi_metrics(answer.payload)
        if tgi is not None:
            source = f"{METRICS} tgi_batch_max_total_tokens"
            return Budget(tgi, 1, None, "tgi", source, tuple(tried))
    answer = yield PROPS
    tried.append(f"{PROPS} -> {answer.status}")
    if answer.status == 200:
        llama = budget_from_llama_cpp_props(answer.payload)
        if llama is not None:
            source = f"{PROPS} default_generation_settings.n_ctx, total_slots"
            return Budget(llama[0], 1, llama[1], "llama.cpp", source, tuple(tried))
    answer = yield SGLANG_SERVER_INFO
    tried.append(f"{SGLANG_SERVER_INFO} -> {answer.status}")
    if answer.status == 200:
        tokens = budget_from_sglang(answer.payload)
        if tokens is not None:
            source = f"{SGLANG_SERVER_INFO} max_total_num_tokens"
            return Budget(tokens, 1, None, "sglang", source, tuple(tried), preempts=True)
    return Budget(None, tried=tuple(tried))
