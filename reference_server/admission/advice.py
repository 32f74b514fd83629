"""What the ledger remembers to advise the clients it turns away: the recent output lengths (for
``output_quantile``) and the returns it has promised (staggered Retry-After, see
:meth:`.ledger.KVAdmissionController.retry_after`).

A client told to come back at ``t`` is expected to hold what it asked for from ``t`` for its own
worst-case duration. Later estimates count promised returns as load, so clients turned away
together are told staggered times that each fit, instead of one time that fits only the first of
them back; promises only shape estimates, admission ignores them. A client (a connection's
address) refused again replaces the promise it was given before, so one that comes back early,
however often, holds one promise; promised returns push an answer at most ``STAGGER_ROUNDS`` of
its own duration (plus the release margin) past the plain estimate, whatever clients do.

No lock, no clock: the ledger calls it under its own lock, with its ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from .values import Handle, _Promise

__all__ = ["STAGGER_ROUNDS", "Advice"]

#: Output lengths remembered for ``output_quantile``, and how many are needed before use.
_OUTPUT_WINDOW = 256
_MIN_OUTPUTS = 20
#: Staggered advice (``promise=True``) is at most this many of the request's own durations
#: after the plain estimate: enough to spread a burst over eight rounds of returns, while
#: clients that come back early on new connections (each refusal adds a promise) cannot push it
#: further past the time capacity really returns. A client that comes back on the same
#: connection replaces its own promise.
STAGGER_ROUNDS = 8
#: Promises remembered at most (the oldest are forgotten first): each estimate scans them all.
_MAX_PROMISES = 64

#: :func:`.forecast.earliest_fit` over a budget: ``(need, now, live, promises, duration)``.
Fit = Callable[[int, float, list[tuple[float, Handle]], Sequence[_Promise], float], float]


class Advice:
    """The recent output lengths and the promised returns of one ledger (not thread-safe: the
    ledger's lock guards it)."""

    def __init__(self) -> None:
        self._promises: list[_Promise] = []
        self._outputs: deque[int] = deque(maxlen=_OUTPUT_WINDOW)

    def __len__(self) -> int:
        """Promises whose time has not run out (as of the last :meth:`forget`)."""
        return len(self._promises)

    def record_output(self, completion_tokens: int) -> None:
        self._outputs.append(max(0, completion_tokens))

    def recent_outputs(self, quantile: float | None) -> list[int] | None:
        """Recent output lengths in order, once enough were seen for ``quantile``."""
        if quantile is None or len(self._outputs) < _MIN_OUTPUTS:
            return None
        return sorted(self._outputs)

    def keep_promise(self, need: int, now: float, release_margin: float) -> None:
        """A request of ``need`` tokens was admitted at ``now``."""
        # A request of the promised size arriving once its time has come is taken to be the
        # client coming back: its promise is kept, so it is not counted twice.
        for i, promise in enumerate(self._promises):
            if promise.tokens == need and promise.start <= now + release_margin:
                del self._promises[i]
                return

    def forget(self, now: float, client: Hashable | None = None) -> None:
        """Forget the promises that ran out by ``now``, and ``client``'s own (it is told anew)."""
        self._promises = [
            p
            for p in self._promises
            if p.end > now and not (client is not None and p.client == client)
        ]

    def earliest(
        self,
        need: int,
        now: float,
        live: list[tuple[float, Handle]],
        fit: Fit,
        duration: float,
        release_margin: float,
        promise: bool,
        client: Hashable | None,
    ) -> float:
        """When ``need`` tokens fit by ``fit`` (:func:`.forecast.earliest_fit` over the usable
        budget), counting promised returns as load: a request of ``duration`` seconds, at most
        ``STAGGER_ROUNDS`` of it (and ``release_margin``) after the plain estimate. With
        ``promise``, the answer is remembered as a promise to ``client``. ``live``: when each
        holder is expected to end."""
        plain = fit(need, now, live, [], 0.0)
        chosen = plain
        if self._promises:
            staggered = fit(need, now, live, self._promises, duration)
            limit = plain + STAGGER_ROUNDS * (duration + release_margin)
            chosen = min(staggered, limit)
        if promise and chosen > now:
            end = chosen + duration + release_margin
            self._promises.append(_Promise(start=chosen, end=end, tokens=need, client=client))
            del self._promises[:-_MAX_PROMISES]
        return chosen
