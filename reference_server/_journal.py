"""The admission log (``--admission-log PATH``): every admission, release and 429, as JSON lines.

One line per ledger event, stamped with ``time.monotonic()`` as it happens (under the ledger's
lock, so in the ledger's order), line-buffered so that a killed server loses at most a line:

    {"t": 12.5031, "kind": "admit", "id": 7, "tokens": 2016}
    {"t": 12.5102, "kind": "refuse", "id": 0, "tokens": 208, "retry_after": 9.49}
    {"t": 22.5530, "kind": "release", "id": 7, "tokens": 2016}

``bench/soak.py`` replays it to compare each 429's advice with the time until a request of that
size really fitted beside the reservations held when it was refused.
"""

from __future__ import annotations

import json
import time
from typing import IO

from .ledger import LedgerEvent

__all__ = ["AdmissionLog"]


class AdmissionLog:
    """An ``on_event`` observer for :class:`~reference_server.ledger.KVAdmissionController`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def __call__(self, event: LedgerEvent) -> None:
        record: dict[str, object] = {
            "t": round(time.monotonic(), 6),
            "kind": event.kind,
            "id": event.id,
            "tokens": event.tokens,
        }
        if event.kind == "refuse":
            record["retry_after"] = round(event.retry_after, 6)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
