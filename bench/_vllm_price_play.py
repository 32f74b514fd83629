"""Each rule played on the realistic mix: Poisson arrivals, outputs that stop before their caps,
an engine that steps its sequences together and preempts when its pool overflows.

Pure (no I/O, no clock): a model of the 8-sequence vLLM of the tests, to say what each rule
can reach on the same arrivals, prompts, caps and output lengths, and so state the goal
against the best schedule that never preempts as well as against direct vLLM. The engine:

- it runs at most ``max_running`` sequences, stepping them together, each step a time of
  ``a + b x running`` seconds plus ``prefill`` a prompt token it computes (a preempted
  sequence recomputes its prompt and what it had made);
- it starts waiting requests in order while it has a place and free blocks for the prompt;
- a sequence that needs a block when none is free makes it preempt its newest sequence,
  which goes back to the head of its queue (vLLM's recompute preemption).

The rules (the gateway's FIFO queue in front of that engine, every holder's progress seen
exactly and at once, a newcomer's first token on the step after its admission):

- ``direct``: no gateway; the engine admits and preempts by itself;
- ``best``: the peak rule with every output's length known: the best FIFO schedule that never
  preempts;
- ``exact``: the peak rule, every holder counted to its cap (``--preemption-budget 0``);
- ``forecast``: the peak rule, every holder counted to a forecast of its output learnt from
  those that ended (:class:`~reference_server.admission.outlook.Outlook`, the gateway's own),
  within the preemption budget, which the engine's preemptions drive as they do the gateway's.

>>> played = play([0.0, 0.0], [100, 100], [300, 300], [50, 300], pool=512, block_size=128,
...               max_running=8, rule="best", step=(0.01, 0.001, 0.0))
>>> played.preemptions, played.tokens, round(played.running_mean, 2)
(0, 350, 1.18)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from reference_server.admission.outlook import Outlook
from reference_server.admission.peak import Holder, peak
from reference_server.admission.values import Handle

__all__ = ["PLAYED_RULES", "Played", "play"]

#: What each rule played is.
PLAYED_RULES = {
    "direct": "direct vLLM (it admits by its free blocks, preempts its newest on overflow)",
    "best": "best FIFO schedule that never preempts (every output's length known)",
    "exact": "peak rule, every holder to its cap (--preemption-budget 0)",
    "forecast": "peak rule with the forecast within the budget (the gateway's defaults)",
}

#: How often the forecast reads the engine's preemption counter (the gateway's scrape).
SCRAPE_SECONDS = 0.5


@dataclass
class Played:
    """One rule's play: output tokens/s, preemptions, sequences running at once (mean over
    the steps), and the time to first token (mean and p99) of the requests."""

    rule: str
    tokens: int
    seconds: float
    preemptions: int
    running_mean: float
    ttft_mean: float
    ttft_p99: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


class _Request:
    __slots__ = ("arrival", "cap", "first", "handle", "length", "made", "prompt")

    def __init__(self, arrival: float, prompt: int, cap: int, length: int) -> None:
        self.arrival, self.prompt, self.cap = arrival, prompt, cap
        self.length = max(1, min(cap, length))
        self.made = 0
        self.first: float | None = None
        self.handle: Handle | None = None


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def play(
    arrivals: Sequence[float],
    prompts: Sequence[int],
    caps: Sequence[int],
    lengths: Sequence[int],
    *,
    pool: int,
    block_size: int,
    max_running: int,
    rule: str,
    step: tuple[float, float, float],
    learnt: Sequence[tuple[int, int]] = (),
    budget: float = 20.0,
) -> Played:
    """Play ``rule`` (see :data:`PLAYED_RULES`) on requests arriving at ``arrivals`` (seconds,
    in order) with these prompt tokens, caps and output lengths, against an engine of ``pool``
    KV tokens (what it can use: vLLM's less its null block) in blocks of ``block_size``, a
    step taking ``a + b x running`` seconds and ``prefill`` a prompt token (``step``).
    ``learnt``: (length, cap) of outputs seen before (the bench's warm-up), for the forecast;
    ``budget``: its preemptions per 1,000 requests."""
    if rule not in PLAYED_RULES:
        raise ValueError(f"no rule {rule!r}: one of {sorted(PLAYED_RULES)}")
    a, b, prefill_cost = step
    requests = [
        _Request(t, p, c, n) for t, p, c, n in zip(arrivals, prompts, caps, lengths, strict=True)
    ]
    outlook = Outlook(preemption_budget=budget) if rule == "forecast" else None
    if outlook is not None:
        for length, cap in learnt:
            outlook.outputs.record(None, length, ended=length < cap)
    pool_blocks = pool // block_size
    arriving = deque(requests)
    queue: deque[_Request] = deque()  # the gateway's
    waiting: deque[_Request] = deque()  # the engine's
    running: list[_Request] = []
    now = seconds_running = busy = 0.0
    preemptions = finished = 0
    scraped = -SCRAPE_SECONDS

    def counted(r: _Request) -> int:
        if rule == "best":
            return r.length
        if rule == "exact" or r.handle is None:
            return r.cap
        return r.handle.counted_output

    def holder(r: _Request) -> Holder:
        total = counted(r)
        return Holder(r.prompt + r.made, r.prompt + total, max(0, total - r.made) + 1)

    def admit(r: _Request) -> bool:
        live = running + list(waiting)
        if len(live) >= max_running:
            return False
        if outlook is not None:
            r.handle = Handle(
                id=id(r), prompt_tokens=r.prompt, output_cap=r.cap,
                reserved_tokens=r.prompt + r.cap, admitted_at=now, due_at=now,
            )  # fmt: skip
            outlook.admit(r.handle, now, kind=None, follow=True, step_seconds=a, relay_lag=0.0)
        holders = [holder(h) for h in live] + [holder(r)]
        return peak(holders, block_size=block_size) <= pool

    while arriving or queue or waiting or running:
        while arriving and arriving[0].arrival <= now:
            (waiting if rule == "direct" else queue).append(arriving.popleft())
        while queue and admit(queue[0]):
            waiting.append(queue.popleft())
        used = sum(_blocks(r.prompt + r.made, block_size) for r in running)
        prefill = 0
        while waiting and len(running) < max_running:
            need = _blocks(waiting[0].prompt + waiting[0].made + 1, block_size)
            if used + need > pool_blocks:
                break
            r = waiting.popleft()
            running.append(r)
            used += need
            prefill += r.prompt + r.made
        if not running:
            if not arriving:
                raise RuntimeError(f"{rule}: requests wait with nothing running")
            now = max(now, arriving[0].arrival)
            continue
        while sum(_blocks(r.prompt + r.made + 1, block_size) for r in running) > pool_blocks:
            waiting.appendleft(running.pop())  # the newest, recomputed later
            preemptions += 1
        seconds = a + b * len(running) + prefill_cost * prefill
        now += seconds
        busy += seconds
        seconds_running += seconds * len(running)
        still = []
        for r in running:
            r.made += 1
            if r.first is None:
                r.first = now
            if r.handle is not None and outlook is not None:
                r.handle.generated = r.made
                outlook.outlived(r.handle, r.made)
            if r.made < r.length:
                still.append(r)
                continue
            finished += 1
            if r.handle is not None and outlook is not None:
                r.handle.ended = r.made < r.cap
                outlook.gone(r.handle)
        running = still
        if outlook is not None and now - scraped >= SCRAPE_SECONDS:
            scraped = now
            live = [r.handle for r in running + list(waiting) if r.handle is not None]
            outlook.observe(preemptions, live, requests=finished)
    ttfts = sorted((r.first or 0.0) - r.arrival for r in requests)
    return Played(
        rule=rule,
        tokens=sum(r.length for r in requests),
        seconds=max(now - requests[0].arrival, 1e-9) if requests else 1e-9,
        preemptions=preemptions,
        running_mean=seconds_running / busy if busy else 0.0,
        ttft_mean=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p99=ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else 0.0,
    )
