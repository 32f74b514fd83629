"""What outputs really do: the lengths finished requests reached, and a forecast of a running
holder's remaining output from them (pure: no I/O, no lock, no clock).

Real outputs stop well before their caps (an end-of-sequence or stop token), with a long tail.
A holder that has made ``g`` tokens is still running, so what it will make is the length of
outputs longer than ``g``: the forecast is a quantile of that *conditional* distribution (a
survival estimate), never a mean. Outputs that reached their caps, or were cut before their
end (a client gone), say only that the output would have been longer: they are *censored*,
and the survival curve is the Kaplan-Meier estimate, which counts them as at risk up to where
they were seen and no further. So caps do not bias the forecast down, and traffic whose
outputs all run to their caps never gets one (the curve never falls far enough).

The estimate assumes an output's natural length does not depend on its cap (Kaplan-Meier's
non-informative censoring): a cap is a limit, not a hint. Lengths are kept per *kind* (an
upstream's model, and its tenant where there are tenants), the most recent ``window`` each.

>>> lengths = OutputLengths(min_finished=4, min_at_risk=2)
>>> for n in (10, 20, 30, 40, 50, 60, 70, 80):
...     lengths.record("m", n, ended=True)
>>> lengths.remaining("m", generated=0, quantile=0.75)      # 75 % end by 60 tokens
60
>>> lengths.remaining("m", generated=45, quantile=0.5)      # of those past 45, half by 60
15
>>> lengths.remaining("m", generated=75, quantile=0.5) is None   # too few seen that long
True
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Hashable

__all__ = ["DEFAULT_MIN_AT_RISK", "DEFAULT_MIN_FINISHED", "DEFAULT_WINDOW", "OutputLengths"]

#: Finished outputs of a kind needed before any forecast for it (fewer: the cap).
DEFAULT_MIN_FINISHED = 32
#: Outputs seen longer than what a holder has made that its forecast needs (fewer: its cap):
#: the tail beyond it is what the forecast is about.
DEFAULT_MIN_AT_RISK = 16
#: Recent outputs kept per kind: traffic changes, and an old mix should not steer a new one.
DEFAULT_WINDOW = 2000


class _Curve:
    """A Kaplan-Meier survival curve over one kind's outputs: at each length where outputs
    ended, the share of outputs still running after it (``survival``), and how many were seen
    at least that long (``at_risk``)."""

    __slots__ = ("ends", "lengths", "survival")

    def __init__(self, outputs: deque[tuple[int, bool]]) -> None:
        ordered = sorted(outputs)
        #: Every output's length, sorted: how many were seen longer than a length.
        self.lengths = [length for length, _ in ordered]
        self.ends: list[int] = []
        self.survival: list[float] = []
        alive, remaining, i = 1.0, len(ordered), 0
        while i < len(ordered):
            length = ordered[i][0]
            ended = seen = 0
            while i < len(ordered) and ordered[i][0] == length:
                ended += ordered[i][1]
                seen += 1
                i += 1
            if ended:
                alive *= 1.0 - ended / remaining
                self.ends.append(length)
                self.survival.append(alive)
            remaining -= seen

    def longer_than(self, length: int) -> int:
        """Outputs seen longer than ``length`` tokens (ended or not)."""
        return len(self.lengths) - bisect.bisect_right(self.lengths, length)

    def alive_after(self, length: int) -> float:
        """The estimated share of outputs longer than ``length``."""
        index = bisect.bisect_right(self.ends, length)
        return self.survival[index - 1] if index else 1.0

    def quantile_after(self, generated: int, quantile: float) -> int | None:
        """The smallest length by which ``quantile`` of the outputs longer than ``generated``
        have ended; None when the curve never falls that far (censored beyond)."""
        target = self.alive_after(generated) * (1.0 - quantile)
        start = bisect.bisect_right(self.ends, generated)
        # Survival only falls along the curve: the first end at or under the target.
        low, high = start, len(self.ends)
        while low < high:
            middle = (low + high) // 2
            if self.survival[middle] <= target + 1e-12:
                high = middle
            else:
                low = middle + 1
        return self.ends[low] if low < len(self.ends) else None


class OutputLengths:
    """Finished outputs by kind, and forecasts of a running holder's remaining output."""

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        min_finished: int = DEFAULT_MIN_FINISHED,
        min_at_risk: int = DEFAULT_MIN_AT_RISK,
    ) -> None:
        if window < 1 or min_finished < 1 or min_at_risk < 1:
            raise ValueError("window, min_finished and min_at_risk must be at least 1")
        self.window = window
        self.min_finished = min_finished
        self.min_at_risk = min_at_risk
        self._outputs: dict[Hashable, deque[tuple[int, bool]]] = {}
        self._curves: dict[Hashable, _Curve] = {}

    def record(self, kind: Hashable, length: int, *, ended: bool) -> None:
        """A finished output of ``kind``: ``length`` tokens, and whether it ``ended`` by
        itself (an end-of-sequence or stop token) rather than at its cap or cut short."""
        outputs = self._outputs.get(kind)
        if outputs is None:
            outputs = self._outputs[kind] = deque(maxlen=self.window)
        outputs.append((max(0, int(length)), bool(ended)))
        self._curves.pop(kind, None)

    def finished(self, kind: Hashable) -> int:
        """Outputs of ``kind`` kept."""
        outputs = self._outputs.get(kind)
        return len(outputs) if outputs is not None else 0

    def _curve(self, kind: Hashable) -> _Curve | None:
        outputs = self._outputs.get(kind)
        if outputs is None or len(outputs) < self.min_finished:
            return None
        curve = self._curves.get(kind)
        if curve is None:
            curve = self._curves[kind] = _Curve(outputs)
        return curve

    def remaining(self, kind: Hashable, *, generated: int, quantile: float) -> int | None:
        """Tokens a holder of ``kind`` that has made ``generated`` is forecast to make still:
        the ``quantile`` of the lengths of outputs longer than ``generated``, less
        ``generated``. None (count it to its cap) with too few outputs of its kind, too few
        seen longer than ``generated``, or a tail that censoring leaves unknown."""
        curve = self._curve(kind)
        if curve is None or curve.longer_than(generated) < self.min_at_risk:
            return None
        length = curve.quantile_after(generated, quantile)
        return None if length is None else length - generated
