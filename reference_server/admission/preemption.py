"""The preemption budget: how far the forecast of outputs may bet, held by the engine's own
counter (pure: no I/O, no clock).

Counting holders by a forecast of their outputs rather than by their caps is a bet: when
several outlive their forecasts at once the engine's pool overflows. An engine whose overflow
preempts a sequence and recomputes it later (vLLM, SGLang) pays for a lost bet in recompute and
latency, not in failed requests; the operator says how much of that it accepts, in preemptions
per 1,000 requests. The forecast's quantile moves along :data:`LADDER`: a step up (more of the
tail counted) when the engine's preemptions (``vllm:num_preemptions_total``) over the recent
requests run over the budget, and a step down only after a whole window of requests stayed
well within it. Past the ladder's top the forecast is off and the exact rule counts caps. SGLang's
scheduler moves its ``new_token_ratio`` the same way on its own retractions.

A holder that outlives its forecast is counted again one step further up the ladder (its
*level*), and past the top at its cap.

>>> budget = PreemptionBudget(per_1000=20, start=0.9)
>>> budget.window, budget.allowed       # 4 preemptions in any 200 requests
(200, 4.0)
>>> budget.quantile, budget.observe(preemptions=0, finished=0)
(0.9, None)
>>> budget.observe(preemptions=4, finished=40) is None    # 4 in 40 requests: within
True
>>> print(budget.observe(preemptions=5, finished=60))
5 preemptions in the last 200 requests, over a budget of 20 per 1,000: forecast quantile 0.9 -> 0.95
>>> budget.level_quantile(1), budget.level_quantile(9) is None
(0.98, True)
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["DEFAULT_START_QUANTILE", "LADDER", "PreemptionBudget"]

#: The quantiles of the remaining output the forecast counts, from the boldest to the most
#: careful; beyond the last, caps.
LADDER = (0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995)
#: Where the forecast starts: three holders in four end before they are counted to (traffic
#: whose tail runs to its caps gets no forecast at 0.9: its quantile lies past the caps).
DEFAULT_START_QUANTILE = 0.75
#: The fewest requests a window spans, whatever the budget: over fewer, one preemption more or
#: less swings the rate past any budget (measured: a window of 50 at a budget of 20 went from
#: within to twice over on two preemptions, and the forecast lost what it had gained).
_MIN_WINDOW = 200
#: The fewest preemptions a window allows, whatever the budget.
_MIN_ALLOWED = 4
#: Samples kept of (requests finished, preemptions): enough to span any window.
_SAMPLES = 4096


class PreemptionBudget:
    """The forecast's quantile, held to ``per_1000`` preemptions per 1,000 requests.

    The budget is counted over a window of requests: ``allowed`` preemptions in any ``window``
    requests finished in a row (at least ``_MIN_WINDOW`` requests and ``_MIN_ALLOWED``
    preemptions, so that one preemption does not swing it). ``observe`` is given the engine's
    preemption counter and the requests finished so far (both cumulative); a scrape that shows
    new preemptions, more than allowed in the last window, moves the quantile one step up; a
    whole window with at most half the allowance moves it one step down. It returns a line
    saying what changed, or None.
    """

    def __init__(self, *, per_1000: float, start: float = DEFAULT_START_QUANTILE) -> None:
        if not (per_1000 > 0 and math.isfinite(per_1000)):
            raise ValueError(f"the preemption budget must be a finite number > 0, got {per_1000}")
        if start not in LADDER:
            raise ValueError(f"the start quantile must be one of {LADDER}, got {start}")
        self.per_1000 = per_1000
        #: Requests the budget is counted over, and the preemptions it allows in them.
        self.window = max(_MIN_WINDOW, math.ceil(1000 * _MIN_ALLOWED / per_1000))
        self.allowed = per_1000 * self.window / 1000
        self._index: int | None = LADDER.index(start)
        self._samples: deque[tuple[int, float]] = deque(maxlen=_SAMPLES)
        self._changed_at = 0
        self.tightened = 0
        self.loosened = 0

    @property
    def quantile(self) -> float | None:
        """The quantile new holders are counted at; None: the forecast is off (caps)."""
        return None if self._index is None else LADDER[self._index]

    def level_quantile(self, level: int) -> float | None:
        """The quantile a holder that has outlived ``level`` forecasts is counted at; None:
        at its cap."""
        if self._index is None or self._index + level >= len(LADDER):
            return None
        return LADDER[self._index + level]

    def _in_window(self) -> tuple[float, int]:
        """(preemptions, requests finished) over the last window (since the first reading
        while there has not been a whole one)."""
        finished, preemptions = self._samples[-1]
        base_finished, base_preemptions = self._samples[0]
        for sample in reversed(self._samples):
            if finished - sample[0] >= self.window:
                base_finished, base_preemptions = sample
                break
        return preemptions - base_preemptions, finished - base_finished

    def rate(self) -> float | None:
        """Preemptions per 1,000 requests over the last window; None before any request
        finished."""
        if not self._samples:
            return None
        preempted, finished = self._in_window()
        return 1000 * preempted / finished if finished > 0 else None

    def observe(self, *, preemptions: float, finished: int) -> str | None:
        """A scrape of the engine's counter with the requests finished so far."""
        previous = self._samples[-1] if self._samples else None
        if previous is not None and (preemptions < previous[1] or finished < previous[0]):
            self._samples.clear()  # the engine restarted: its counter began again
            previous = None
        self._samples.append((finished, preemptions))
        if previous is None:
            # The first reading: what the engine counted before is no measure of ours, and a
            # window within the budget is counted from here.
            self._changed_at = finished
            return None
        preempted, _ = self._in_window()
        before = self.quantile
        if preemptions > previous[1] and preempted > self.allowed and self._index is not None:
            self._index = self._index + 1 if self._index + 1 < len(LADDER) else None
            self.tightened += 1
            side = "over"
        elif (
            preemptions == previous[1]
            and finished - self._changed_at >= self.window
            and preempted <= self.allowed / 2
            and self._index != 0
        ):
            self._index = len(LADDER) - 1 if self._index is None else self._index - 1
            self.loosened += 1
            side = "within"
        else:
            return None
        self._changed_at = finished
        return (
            f"{preempted:.0f} preemptions in the last {self.window} requests, {side} a budget of "
            f"{self.per_1000:g} per 1,000: forecast quantile {_show(before)} -> "
            f"{_show(self.quantile)}"
        )


def _show(quantile: float | None) -> str:
    return "off (caps)" if quantile is None else f"{quantile:g}"
