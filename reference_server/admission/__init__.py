"""Admission, with no I/O: the reservation ledger, the FIFO queue in front of it, the journal of
its decisions. Shared by ``kvclient serve`` and ``kvclient gateway``."""

from .ledger import Handle, Headroom, KVAdmissionController, LedgerEvent, LedgerStats, Strategy
from .queue import AdmissionQueue, Rejected

__all__ = [
    "AdmissionQueue",
    "Handle",
    "Headroom",
    "KVAdmissionController",
    "LedgerEvent",
    "LedgerStats",
    "Rejected",
    "Strategy",
]
