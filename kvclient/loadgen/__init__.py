"""A load generator that behaves well: it paces itself by the server's Retry-After and hides
nothing (every 429, 503 and failure is counted with its message, latencies include the time spent
backing off, and failures count at the deadline in the all-requests latency).

Used by ``kvclient bench`` and ``kvclient demo``; the pieces are public for scripts and benchmarks.
"""

from ._kvsender import KVClientSender, failure_cause
from ._metrics import (
    SLO,
    Distribution,
    FailureGroup,
    RecordTimer,
    RequestRecord,
    Summary,
    percentile,
    summarize,
)
from ._naive import NaiveSender
from ._runner import Sender, run_load
from ._schedule import ArrivalKind, arrival_offsets
from ._workload import (
    MIXED,
    Shape,
    SyntheticWorkload,
    WorkItem,
    exact_prompt,
    load_dataset,
    load_jsonl,
    load_sharegpt,
    make_prompt,
)

__all__ = [
    "MIXED",
    "SLO",
    "ArrivalKind",
    "Distribution",
    "FailureGroup",
    "KVClientSender",
    "NaiveSender",
    "RecordTimer",
    "RequestRecord",
    "Sender",
    "Shape",
    "Summary",
    "SyntheticWorkload",
    "WorkItem",
    "arrival_offsets",
    "exact_prompt",
    "failure_cause",
    "load_dataset",
    "load_jsonl",
    "load_sharegpt",
    "make_prompt",
    "percentile",
    "run_load",
    "summarize",
]
