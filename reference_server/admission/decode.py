"""The engine's decode speed and the progress it makes, as the ledger models it: pure, no lock
(the ledger calls it under its own), no clock (every call takes ``now``)."""

from __future__ import annotations

import math

__all__ = ["Decoding", "check_speed"]


def check_speed(decode_rate: float, throughput: float | None) -> None:
    if not decode_rate > 0 or math.isinf(decode_rate):
        raise ValueError(f"decode_rate must be a positive number, got {decode_rate}")
    if throughput is not None and (not throughput > 0 or math.isinf(throughput)):
        raise ValueError(f"throughput must be a positive number or None, got {throughput}")


class Decoding:
    """How fast sequences decode, and how far one has got since the ledger began.

    ``progress`` is the tokens one sequence has generated since the ledger began, at ``at``: a
    live handle has generated about ``progress - progress_at_admit``. ``held_seconds`` and
    ``busy_seconds`` are time integrals since the ledger began, at ``at``: of the live handles
    (handle-seconds), and of the time any was live.
    """

    __slots__ = ("at", "busy_seconds", "decode_rate", "held_seconds", "progress", "throughput")

    def __init__(self, decode_rate: float, throughput: float | None) -> None:
        self.decode_rate = 0.0
        self.throughput: float | None = None
        self.set(decode_rate, throughput)
        self.progress = 0.0
        self.at: float | None = None
        self.held_seconds = 0.0
        self.busy_seconds = 0.0

    def set(self, decode_rate: float, throughput: float | None) -> None:
        check_speed(decode_rate, throughput)
        self.decode_rate = float(decode_rate)
        self.throughput = None if throughput is None else float(throughput)

    def rate_at(self, sequences: int) -> float:
        """Tokens per second one sequence decodes at while ``sequences`` decode together.

        A decode step makes one token for every running sequence and takes longer the more
        there are: ``1 / decode_rate`` for one sequence, plus ``1 / throughput`` for each other
        one. So one sequence alone decodes at ``decode_rate``, and many share ``throughput``
        between them (the engine's tokens per second when its batch is large). Without a
        ``throughput`` every sequence decodes at ``decode_rate`` however many there are.
        """
        if self.throughput is None or sequences <= 1:
            return self.decode_rate
        return 1.0 / (1.0 / self.decode_rate + (sequences - 1) / self.throughput)

    def advance(self, now: float, live: int) -> None:
        """Move the progress to ``now`` at the rate ``live`` sequences decode at. Time never runs
        backwards here: a ``now`` before the last one moves nothing."""
        if self.at is None:
            self.at = now
        elif now > self.at:
            elapsed = now - self.at
            self.progress += elapsed * self.rate_at(live)
            self.held_seconds += elapsed * live
            if live:
                self.busy_seconds += elapsed
            self.at = now
