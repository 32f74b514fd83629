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
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from .ledger import LedgerEvent

__all__ = ["AdmissionLog", "AdviceCheck", "check_advice", "read_log"]


class AdmissionLog:
    """An ``on_event`` observer for a
    :class:`~reference_server.admission.ledger.KVAdmissionController`."""

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


def read_log(path: str) -> list[dict[str, Any]]:
    """The events of an admission log, in order (a last, partly written line is skipped)."""
    events = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


@dataclass(frozen=True, slots=True, kw_only=True)
class AdviceCheck:
    """Each 429's advice against the time capacity really returned for it.

    *Really returned*: the first moment after the refusal at which the reservations held when
    it was refused, as they were really released, left room for its need (later admissions
    ignored: they took room the advice could not know about). ``told_less`` counts refusals
    advised less than that by more than ``tolerance`` seconds; ``fits_now_lies`` those told at
    most 1 ms while it really took ``tolerance`` or more (the issue's "Retry-After: 1 ms").
    """

    refused: int
    checked: int  # refusals whose holders were all seen to be released
    told_less: int
    fits_now_lies: int
    tolerance: float
    worst_shortfall: float  # seconds, the largest (really returned - advised)
    ratios: tuple[float, ...]  # advised / really returned, sorted (really returned > 0 only)

    @property
    def told_less_share(self) -> float:
        return self.told_less / self.checked if self.checked else 0.0

    def ratio_quantile(self, q: float) -> float:
        if not self.ratios:
            return math.nan
        return self.ratios[min(len(self.ratios) - 1, max(0, math.ceil(q * len(self.ratios)) - 1))]


def check_advice(
    events: Iterable[Mapping[str, Any]], usable_tokens: int, *, tolerance: float = 0.0
) -> AdviceCheck:
    """Replay an admission log; see :class:`AdviceCheck`."""
    live: dict[int, int] = {}  # id -> tokens
    released_at: dict[int, float] = {}
    refusals: list[tuple[float, int, float, dict[int, int]]] = []
    for event in events:
        kind, t = event["kind"], float(event["t"])
        if kind == "admit":
            live[int(event["id"])] = int(event["tokens"])
        elif kind == "release":
            live.pop(int(event["id"]), None)
            released_at[int(event["id"])] = t
        elif kind == "refuse":
            refusals.append((t, int(event["tokens"]), float(event["retry_after"]), dict(live)))
    told_less = lies = checked = 0
    worst = 0.0
    ratios = []
    for at, need, advised, held in refusals:
        if any(i not in released_at for i in held):
            continue  # still held when the log ends
        checked += 1
        reserved = sum(held.values())
        returned = at
        for i in sorted(held, key=released_at.__getitem__):
            if reserved + need <= usable_tokens:
                break
            reserved -= held[i]
            returned = max(at, released_at[i])
        real = returned - at
        shortfall = real - advised
        worst = max(worst, shortfall)
        told_less += shortfall > tolerance
        lies += advised <= 0.001 and real >= max(tolerance, 0.001)
        if real > 0:
            ratios.append(advised / real)
    return AdviceCheck(
        refused=len(refusals),
        checked=checked,
        told_less=told_less,
        fits_now_lies=lies,
        tolerance=tolerance,
        worst_shortfall=worst,
        ratios=tuple(sorted(ratios)),
    )
