"""What engines' ``/metrics`` pages say: metric names as data, one table row per engine, and the
readers over them (pure).

Every page is parsed by the one parser (:func:`kvclient._prometheus.parse_samples`, which is
prometheus-client's), once for all its facts. :data:`METRIC_NAMES` says under which name each
engine exports each fact; the readers take the first engine, in the table's order, whose name
has samples: decode counters (how far decoding has gone, for a speed), lockstep signals (a
waiting line, preemptions) and what an engine lost for lack of KV. KV budgets read from
``/metrics`` are in :mod:`kvclient.engines.budget`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from .._prometheus import parse_samples
from ._answers import whole_sample

__all__ = [
    "LLAMA_CPP",
    "METRIC_NAMES",
    "OURS",
    "SGLANG",
    "TGI",
    "VLLM",
    "DecodeCounters",
    "EngineMetrics",
    "KVLosses",
    "Lockstep",
    "LossCounter",
    "decode_counters",
    "kv_losses_from_metrics",
    "lockstep_from_metrics",
    "metric_whole",
    "preemptions_from_vllm_metrics",
    "prefix_caching_from_vllm_metrics",
    "prometheus_samples",
]


@dataclass(frozen=True, slots=True)
class LossCounter:
    """Where an engine counts the requests it lost for lack of KV cache, and what that meant."""

    #: The counter, as the server names it: ``"vllm:num_preemptions_total"``.
    metric: str
    #: What it counts, for messages: ``"preemptions"``, ``"requests lost to KV OOM"``, ...
    kind: str
    #: What that did to the requests, for messages.
    meaning: str
    #: Only samples whose label has one of these values count (None: every sample).
    only: tuple[str, frozenset[str]] | None = None


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The names under which one engine's ``/metrics`` says each fact read here; None where it
    does not say it."""

    engine: str
    #: A prefix of its metric names that shows this engine is talking even before a counter
    #: exists (counters with labels, or in Rust's ``metrics``, appear at their first increment).
    prefix: str | None = None
    #: Tokens generated so far by all its sequences, a counter updated at every decode step.
    generated_tokens: str | None = None
    #: Decode calls so far (a counter), and the average busy slots per call since start.
    decode_calls: str | None = None
    busy_slots_per_decode: str | None = None
    #: Requests waiting for a place in its running batch, and those in it, now.
    requests_waiting: str | None = None
    requests_running: str | None = None
    #: Running requests' KV taken back so far (a counter).
    preemptions: str | None = None
    #: An info gauge whose labels describe the KV cache (blocks, block size, prefix caching).
    cache_config: str | None = None
    #: Tokens of KV cache it has.
    kv_tokens: str | None = None
    #: Its KV block size in tokens, its cap on running requests, and whether it shares prefixes.
    block_size: str | None = None
    max_running: str | None = None
    prefix_caching: str | None = None
    #: What it lost for lack of KV.
    losses: LossCounter | None = None
    #: 1 when its overflow preempts and recomputes (0: it fails requests), where it says.
    preempts: str | None = None
    #: The KV cache it uses now: in tokens, or as a share of its pool (0 to 1).
    kv_used_tokens: str | None = None
    kv_used_share: str | None = None
    #: A metric that exists only while it decodes speculatively (several tokens a step).
    speculative: str | None = None


VLLM = EngineMetrics(
    "vllm",
    prefix="vllm:",
    generated_tokens="vllm:generation_tokens_total",
    requests_waiting="vllm:num_requests_waiting",
    requests_running="vllm:num_requests_running",
    preemptions="vllm:num_preemptions_total",
    cache_config="vllm:cache_config_info",
    # 1 - its free blocks over num_gpu_blocks - 1 (its null block left out).
    kv_used_share="vllm:kv_cache_usage_perc",
    # Made (with a label per engine, so there from the start) only with a speculative config.
    speculative="vllm:spec_decode_num_drafts_total",
    # A running request's KV blocks taken back when the pool runs out, to be recomputed.
    losses=LossCounter(
        "vllm:num_preemptions_total",
        "preemptions",
        "admitted requests were evicted from the KV cache to be recomputed",
    ),
)
SGLANG = EngineMetrics(
    "sglang",
    prefix="sglang:",
    generated_tokens="sglang:generation_tokens_total",
    # SGLang's preemption is a retraction: the request goes back to the queue, its KV freed.
    losses=LossCounter(
        "sglang:num_retracted_requests_total",
        "retractions",
        "admitted requests were sent back to the queue, their KV cache freed",
    ),
)
#: TGI counts generated tokens only when a request ends, in a histogram: too late for a speed.
TGI = EngineMetrics(
    "tgi",
    prefix="tgi_",
    # Its /info dropped the field; /metrics has it.
    kv_tokens="tgi_batch_max_total_tokens",
    # A batch that fails in the shards (a CUDA OOM among others) fails every request in it;
    # "incomplete": a stream that ended without its last token.
    losses=LossCounter(
        "tgi_request_failure",
        "failed generations",
        "admitted requests failed in the middle of generating",
        only=("err", frozenset({"generation", "incomplete"})),
    ),
)
#: llama.cpp (``--metrics``) counts tokens and decode calls only, nothing it lost: with a
#: unified KV cache a full pool fails the live requests ("Context size has been exceeded", an
#: error event or a 500) without counting them. (Ollama has no ``/metrics``.)
LLAMA_CPP = EngineMetrics(
    "llama.cpp",
    prefix="llamacpp:",
    decode_calls="llamacpp:n_decode_total",
    busy_slots_per_decode="llamacpp:n_busy_slots_per_decode",
)
#: Our reference server (``kvclient serve``); its counters are there from the start.
OURS = EngineMetrics(
    "kvclient",
    generated_tokens="kv_generated_tokens_total",
    requests_waiting="kv_engine_requests_waiting",
    requests_running="kv_engine_requests_running",
    preemptions="kv_engine_preemptions_total",
    kv_used_tokens="kv_used_tokens",
    preempts="kv_engine_preempts",
    kv_tokens="kv_physical_capacity_tokens",
    block_size="kv_engine_block_size",
    max_running="kv_engine_max_running",
    prefix_caching="kv_engine_prefix_caching",
    # Every in-flight request of a simulated KV OOM.
    losses=LossCounter(
        "kv_oom_failed_requests_total",
        "requests lost to KV OOM",
        "admitted requests died mid-decode when the KV pool overflowed",
    ),
)

#: Each engine's metric names, in the order a page is read: the first engine that says a fact
#: is the one believed.
METRIC_NAMES: dict[str, EngineMetrics] = {
    names.engine: names for names in (VLLM, SGLANG, TGI, LLAMA_CPP, OURS)
}


@functools.lru_cache(maxsize=8)
def _samples_by_name(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A page's samples by metric name, parsed once (a scrape is read for several facts)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for sample in parse_samples(text):
        found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    # prometheus-client names a counter's samples ``..._total`` even where the page wrote them
    # without (TGI's ``tgi_request_failure``): they are found by the written name too.
    for name in [n for n in found if n.endswith("_total")]:
        found.setdefault(name.removesuffix("_total"), found[name])
    return found


def prometheus_samples(text: str, name: str | None) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in Prometheus text: ``[(labels, value), ...]``
    (:func:`kvclient._prometheus.parse_samples`); none for a name an engine does not have."""
    if name is None:
        return []
    return list(_samples_by_name(text).get(name, ()))


def _metric_sum(text: str, name: str) -> float | None:
    """The sum of a metric's samples over its label sets (several engines, say); None when it
    has none, or a sample is negative, infinite or not a number."""
    values = [value for _, value in prometheus_samples(text, name)]
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return sum(values)


def metric_whole(text: str, name: str | None) -> int | None:
    """The first sample of ``name`` that is a whole number >= 0, or None."""
    for _, value in prometheus_samples(text, name):
        if (whole := whole_sample(value)) is not None:
            return whole
    return None


def prefix_caching_from_vllm_metrics(text: str) -> bool | None:
    """vLLM ``/metrics``: ``vllm:cache_config_info``'s ``enable_prefix_caching`` label (``True``
    or ``False``); None when absent."""
    for labels, _ in prometheus_samples(text, VLLM.cache_config):
        value = labels.get("enable_prefix_caching")
        if value in ("True", "False"):
            return value == "True"
    return None


def preemptions_from_vllm_metrics(text: str) -> float | None:
    """vLLM ``/metrics``: ``vllm:num_preemptions_total`` over all its engines, None when absent.

    A preemption evicts a running request's KV cache to recompute it later: the engine admitted
    more than its KV cache holds (no crash, but latency, and the over-admission the ledger
    exists to prevent)."""
    values = [
        value
        for _, value in prometheus_samples(text, VLLM.preemptions)
        if math.isfinite(value) and value >= 0
    ]
    return sum(values) if values else None


# --- decode counters ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeCounters:
    """How far an engine's decoding has gone, from one ``/metrics`` scrape: two scrapes and how
    many sequences ran in between give its speed (see ``reference_server.gateway.speed``)."""

    #: Tokens generated so far by all its sequences (a counter).
    generated: float
    #: Decode steps so far (a counter), when the engine exports them.
    steps: float | None = None


def decode_counters(text: str) -> DecodeCounters | None:
    """An engine's decode counters from its ``/metrics`` text, None when it exports none.

    vLLM, SGLang and our reference server count generated tokens at every step. llama.cpp
    (``--metrics``) counts ``llama_decode()`` calls and exports the average busy slots per call
    since start: their product is the slot-steps so far, one token each (prompt batches
    included, so a little more than it generated).
    """
    for names in METRIC_NAMES.values():
        if names.generated_tokens is not None:
            total = _metric_sum(text, names.generated_tokens)
            if total is not None:
                return DecodeCounters(total)
    for names in METRIC_NAMES.values():
        if names.decode_calls is not None and names.busy_slots_per_decode is not None:
            steps = _metric_sum(text, names.decode_calls)
            busy = _metric_sum(text, names.busy_slots_per_decode)
            if steps is not None and busy is not None:
                return DecodeCounters(steps * busy, steps)
    return None


# --- running in lockstep: what the peak admission rule needs -----------------------------------


@dataclass(frozen=True, slots=True)
class Lockstep:
    """What an engine's ``/metrics`` says of whether it runs every admitted request at each
    step: requests waiting for a place in its batch and running now, preemptions so far (a
    counter), the KV cache it uses now (tokens, or a share of its pool), and whether it decodes
    speculatively. None where it does not say."""

    waiting: float | None
    preemptions: float | None
    running: float | None = None
    kv_used_tokens: float | None = None
    kv_used_share: float | None = None
    speculative: bool = False

    def missing(self, *, preempts: bool) -> list[str]:
        """The figures the peak rule needs that the page did not give (the preemption counter
        only from an engine that preempts)."""
        wanted = {"waiting": self.waiting, "running": self.running}
        if preempts:
            wanted["preemptions"] = self.preemptions
        return [name for name, value in wanted.items() if value is None]


def lockstep_from_metrics(text: str) -> Lockstep:
    """vLLM's ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
    ``vllm:num_preemptions_total``, ``vllm:kv_cache_usage_perc`` and its ``spec_decode``
    counters; ours' ``kv_engine_requests_waiting``, ``kv_engine_requests_running``,
    ``kv_engine_preemptions_total`` and ``kv_used_tokens``."""
    found: dict[str, float | None] = {}
    speculative = False
    for names in METRIC_NAMES.values():
        for fact in ("requests_waiting", "requests_running", "preemptions", "kv_used_tokens"):
            name = getattr(names, fact)
            if name is not None and found.get(fact) is None:
                found[fact] = _metric_sum(text, name)
        if names.kv_used_share is not None and found.get("share") is None:
            shares = [v for _, v in prometheus_samples(text, names.kv_used_share)]
            if shares and all(math.isfinite(v) and 0 <= v <= 1 for v in shares):
                found["share"] = max(shares)  # the fullest engine behind one server
        if names.speculative is not None and prometheus_samples(text, names.speculative):
            speculative = True
    return Lockstep(
        waiting=found.get("requests_waiting"),
        preemptions=found.get("preemptions"),
        running=found.get("requests_running"),
        kv_used_tokens=found.get("kv_used_tokens"),
        kv_used_share=found.get("share"),
        speculative=speculative,
    )


# --- what an engine lost for lack of KV --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVLosses:
    """Requests an engine has preempted, retracted or failed for lack of KV cache so far, as its
    ``/metrics`` counts them: ``total`` of the counter ``metric``, summed over its samples."""

    total: float
    engine: str
    #: The counter read, as the server names it: ``"vllm:num_preemptions_total"``.
    metric: str
    #: What it counts, for messages: ``"preemptions"``, ``"requests lost to KV OOM"``, ...
    kind: str
    #: What that did to the requests, for messages.
    meaning: str = ""

    def since(self, before: KVLosses | None) -> KVLosses | None:
        """The losses since ``before``, the same counter read earlier (``total`` the difference);
        None when ``before`` is unknown or another counter. A restarted engine counts from 0
        again: never negative."""
        if before is None or before.metric != self.metric:
            return None
        return replace(self, total=max(0.0, self.total - before.total))


def _speaks(text: str, prefix: str) -> bool:
    return any(line.startswith(prefix) for line in text.splitlines())


def kv_losses_from_metrics(text: str) -> KVLosses | None:
    """What the engine behind a ``/metrics`` text lost for lack of KV cache so far: vLLM's
    preemptions, SGLang's retractions, TGI's failed generations, our server's OOM-failed
    requests. None when the text shows no such counter (llama.cpp, a gateway, another server).

    >>> kv_losses_from_metrics('vllm:num_preemptions_total{engine="0"} 2.0').total
    2.0
    """
    for names in METRIC_NAMES.values():
        counter = names.losses
        if counter is None:
            continue
        samples = prometheus_samples(text, counter.metric)
        if counter.only is not None:
            label, wanted = counter.only
            samples = [(labels, v) for labels, v in samples if labels.get(label) in wanted]
        counts = [v for _, v in samples if math.isfinite(v) and v >= 0]
        if counts or (names.prefix is not None and _speaks(text, names.prefix)):
            total = sum(counts, 0.0)
            return KVLosses(total, names.engine, counter.metric, counter.kind, counter.meaning)
    return None
