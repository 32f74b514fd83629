"""How far the peak rule looks past what it has seen: a newcomer's clock and the forecast of
outputs (pure: no I/O, no lock, no clock; the ledger calls it under its lock).

The exact peak rule counts a holder flat at prompt + cap until its first token, and every
holder's future to its cap. Two facts about the engine let it count less, each where it holds:

- **A newcomer's clock starts at admission** when the engine starts it at once: a running slot
  free (the ledger admits no more than the engine runs), nothing waiting inside the engine, and
  room for its prompt (the peak check itself). It is counted from its admission as if it had
  started then, its first token due within ``START_SLACK_STEPS`` steps and the relay's lag
  (:func:`.holders.start_deadline`); one that is later is counted whole from then on, and so is
  every newcomer until its first token has come (a *late start*).
- **The forecast of outputs**, for engines whose overflow preempts and recomputes (vLLM,
  SGLang), within a preemption budget (:mod:`.preemption`): each holder counted to a quantile
  of its remaining output given what it has made (:mod:`.outputs`), a holder that outlives its
  forecast counted again at the next quantile, and at last at its cap. An engine whose
  overflow kills requests is never given a budget: it keeps the exact rule.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any

from .holders import start_deadline
from .outputs import OutputLengths
from .preemption import DEFAULT_START_QUANTILE, PreemptionBudget
from .values import Handle

__all__ = ["Outlook"]


class Outlook:
    """A ledger's newcomer clock and forecast. ``preemption_budget`` (per 1,000 requests) > 0
    turns the forecast on; ``start_clock`` says the engine starts a newcomer at once when it
    has a free slot and nothing waiting."""

    def __init__(
        self,
        *,
        preemption_budget: float = 0.0,
        start_clock: bool = False,
        start_quantile: float = DEFAULT_START_QUANTILE,
        outputs: OutputLengths | None = None,
    ) -> None:
        self.outputs = outputs if outputs is not None else OutputLengths()
        self.budget = (
            PreemptionBudget(per_1000=preemption_budget, start=start_quantile)
            if preemption_budget > 0
            else None
        )
        self.start_clock = start_clock
        #: Requests waiting inside the engine, as last read from its ``/metrics`` (None: it
        #: could not be read, and a newcomer may not start at once).
        self.engine_waiting: int | None = 0
        #: Whether the engine's speed has been measured (the clock's bound is in its steps).
        self.speed_known = False
        #: Holders admitted on the clock whose first token is late and has not come.
        self._late: set[int] = set()
        self.late_starts = 0
        #: Finished holders whose progress was followed (the preemption rate's denominator).
        self.finished_total = 0

    # --- the forecast ------------------------------------------------------------------------

    def quantile(self, level: int = 0) -> float | None:
        """The quantile a holder that has outlived ``level`` forecasts is counted at (None:
        at its cap: no forecast)."""
        return None if self.budget is None else self.budget.level_quantile(level)

    def count_to(self, handle: Handle, generated: int, level: int) -> int:
        """The output ``handle`` is counted to at ``level``, having made ``generated``."""
        cap = handle.output_cap
        quantile = self.quantile(level)
        if quantile is None or not handle.tracked:
            return cap
        left = None
        for kind in _kinds(handle.kind):
            left = self.outputs.remaining(kind, generated=generated, quantile=quantile)
            if left is not None:
                break
        if left is None:
            return cap
        return min(cap, generated + max(1, left))

    def outlived(self, handle: Handle, generated: int) -> None:
        """``handle`` has made ``generated``: past its forecast, it is counted again one level
        up (at its cap past the last)."""
        while handle.counted_output < handle.output_cap and generated >= handle.counted_output:
            handle.level += 1
            handle.counted_output = max(
                handle.counted_output, self.count_to(handle, generated, handle.level)
            )

    def tightened(self, live: Collection[Handle]) -> None:
        """The quantile went up: every holder is counted at least to its forecast at the new
        one at once (a forecast is never lowered while it is held)."""
        for handle in live:
            made = handle.generated or 0
            handle.counted_output = max(
                handle.counted_output, self.count_to(handle, made, handle.level)
            )

    def observe(
        self, preemptions: float, live: Collection[Handle], *, requests: int | None = None
    ) -> str | None:
        """The engine's preemption counter, read now, over ``requests`` run so far (None: the
        holders followed here to their ends): the budget's verdict (a line for the log when
        the quantile moved)."""
        if self.budget is None:
            return None
        before = self.budget.quantile
        finished = self.finished_total if requests is None else requests
        said = self.budget.observe(preemptions=preemptions, finished=finished)
        after = self.budget.quantile
        if said is not None and (after is None or (before is not None and after > before)):
            self.tightened(live)
        return said

    def twin(self, *, start_clock: bool) -> Outlook:
        """An outlook that counts newcomers as this one does now (the same outputs learnt, the
        same quantile, which does not move in it): a scratch ledger's, modelling holders kept
        elsewhere (the shared ledger's view of every gateway's holders). It learns nothing:
        the holders it is given are not followed to their ends there."""
        quantile = self.quantile()
        budget = self.budget
        return Outlook(
            preemption_budget=budget.per_1000 if budget is not None and quantile is not None else 0,
            start_clock=start_clock,
            start_quantile=quantile if quantile is not None else DEFAULT_START_QUANTILE,
            outputs=self.outputs,
        )

    # --- the newcomer's clock ----------------------------------------------------------------

    def clock_runs(self) -> bool:
        """Whether a newcomer admitted now is counted from its admission."""
        return self.start_clock and self.speed_known and self.engine_waiting == 0 and not self._late

    def admit(
        self,
        handle: Handle,
        now: float,
        *,
        kind: Hashable,
        follow: bool,
        step_seconds: float,
        relay_lag: float,
    ) -> None:
        """Set up a newcomer: whether its progress is followed, whose outputs it learns from,
        what it is counted to, and its clock."""
        handle.tracked = follow
        handle.kind = kind
        handle.counted_output = self.count_to(handle, 0, 0)
        if follow and self.clock_runs():
            handle.start_by = start_deadline(now, step_seconds, relay_lag)

    def expire(self, live: Collection[Handle], now: float) -> None:
        """Holders on the clock whose first token is overdue are counted whole from now on."""
        for handle in live:
            if handle.start_by is not None and handle.generated is None and now > handle.start_by:
                handle.start_by = None
                self._late.add(handle.id)
                self.late_starts += 1

    def started(self, handle: Handle) -> None:
        """``handle``'s first token has come."""
        self._late.discard(handle.id)

    def figures(self, *, peak: bool) -> dict[str, Any]:
        """The forecast's and the clock's figures for the ledger's stats (``peak``: the peak
        rule is in force)."""
        budget = self.budget
        reason = None
        if budget is not None and budget.quantile is None:
            reason = "preemptions over the budget: the forecast is off until they fall"
        return {
            "forecast_quantile": self.quantile() if peak else None,
            "preemption_budget": budget.per_1000 if budget is not None else None,
            "preemption_rate": budget.rate() if budget is not None else None,
            "forecast_reason": reason,
            "start_clock": peak and self.clock_runs(),
            "late_starts": self.late_starts,
        }

    def gone(self, handle: Handle) -> None:
        """``handle`` was released: its output, when followed, is learnt."""
        self._late.discard(handle.id)
        if not handle.tracked or handle.generated is None:
            return
        self.finished_total += 1
        ended = bool(handle.ended) and handle.generated < handle.output_cap
        for kind in _kinds(handle.kind):
            self.outputs.record(kind, handle.generated, ended=ended)


def _kinds(kind: Hashable) -> tuple[Hashable, ...]:
    """Where a holder's outputs are learnt, most particular first: ``(model, tenant)`` and its
    model's outputs whoever sent them, for a tenant with too few of its own."""
    if isinstance(kind, tuple) and len(kind) == 2 and kind[1] is not None:
        return (kind, (kind[0], None))
    return (kind,)
