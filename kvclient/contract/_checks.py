"""The checks: one coroutine each, talking plain HTTP to any OpenAI-compatible server.

Each check is bounded in requests (at most ``burst`` at once) and in time (``timeout`` seconds,
every wait included) and returns a :class:`~._judge.Verdict` with one line of evidence. The
requests go through :class:`~._session.Session`; what to conclude from the answers lives in
:mod:`._judge`; this module only decides what to send and what to read.

Nothing here imports a server: the suite must judge vLLM, TGI, llama.cpp or SGLang exactly as it
judges the reference server.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ..engines.discovery import Answer as DialectAnswer
from ..engines.discovery import Discovery, discover_context
from ..engines.metrics import KVLosses
from ._judge import (
    BurstOutcome,
    EngineLosses,
    Verdict,
    describe_counts,
    judge_bad_input,
    judge_completion_tokens,
    judge_holders,
    judge_overlong_prompt,
    judge_saturation,
    usage_tokens,
)
from ._results import CheckStatus
from ._session import UNSET, Session

__all__ = ["CHECKS"]

#: Asks for a short answer: burst requests should finish quickly even on a real model.
SHORT_PROMPT = "Reply with the single word OK."
#: Asks for a long answer, so that a small max_tokens really has to cut it.
LONG_OUTPUT_PROMPT = "Write a long story about a lighthouse keeper, in at least five hundred words."
#: The overlong prompt: this many times the context, in words the tokenizer keeps apart.
OVERLONG_FACTOR = 1.25
#: Caps the explicit-max_tokens check asks for.
EXPLICIT_CAPS = (1, 4, 16)
#: How long the holders of the honesty check may take to fill the server before the probe.
HOLDERS_ANSWER_WAIT = 10.0

# --- the checks ---------------------------------------------------------------------------------


async def check_context_window(s: Session) -> Verdict:
    """Discover the per-request window through the engine's dialect; a ``--context-window`` that
    disagrees with what the server reports fails (the checks would test the wrong limit) and the
    server's own number is used."""
    option = s.options.context_window
    driver = discover_context(s.options.model)
    probe = next(driver)
    while True:
        answer = await s.request(probe.method, probe.path, json_body=probe.json or UNSET)
        if answer.status is None:
            s.reachable = False
            return Verdict(CheckStatus.FAIL, f"cannot reach the server: {answer.error}")
        if answer.status in (401, 403):
            return Verdict(
                CheckStatus.FAIL, f"{probe} answered {answer.describe()} (pass --api-key?)"
            )
        payload = answer.json() if answer.status == 200 else None
        try:
            probe = driver.send(DialectAnswer(answer.status, payload))
        except StopIteration as stop:
            found: Discovery = stop.value
            break
    s.model = s.options.model or found.model
    s.engine = found.engine
    if found.problem is not None:
        return Verdict(CheckStatus.FAIL, found.problem)
    length = found.context_window
    if length is None:
        tried = "; ".join(found.tried)
        if option is not None:
            return Verdict(
                CheckStatus.UNSUPPORTED,
                f"no context window reported (tried: {tried}); using --context-window {option}",
            )
        return Verdict(
            CheckStatus.FAIL, f"no context window reported (tried: {tried}) and no --context-window"
        )
    s.context_window = length
    data = {"context_window": length, "source": found.source, "engine": found.engine}
    where = f"model {found.model}: {length} tokens per request ({found.source})"
    if option is not None and option != length:
        return Verdict(
            CheckStatus.FAIL,
            f"--context-window {option} disagrees with the server: {where}; the checks use "
            f"{length}",
            data,
        )
    return Verdict(CheckStatus.PASS, where, data)


async def check_bad_input(s: Session) -> Verdict:
    base = s.body(SHORT_PROMPT, max_tokens=4)
    cases: list[tuple[str, Any, bytes | None]] = [
        ("malformed JSON", UNSET, json.dumps(base).encode()[:-1]),
        ("max_tokens 'ten'", {**base, "max_tokens": "ten"}, None),
        ("messages as an object", {**base, "messages": {"text": 1}}, None)
        if s.chat
        else ("prompt as an object", {**base, "prompt": {"text": 1}}, None),
        ("max_tokens -1", {**base, "max_tokens": -1}, None),
        ("max_tokens 0", {**base, "max_tokens": 0}, None),
    ]
    seen: list[str] = []
    problems: list[str] = []
    for case, body, raw in cases:
        answer = await s.request("POST", s.path, json_body=body, content=raw)
        seen.append(f"{case} {answer.status if answer.status is not None else 'dropped'}")
        problem = judge_bad_input(case, answer.status, answer.error_body())
        if problem is not None:
            problems.append(problem)
    after, _ = await s.admitted(base)
    evidence = ", ".join(seen) + f"; then a valid request {after.describe()}"
    if after.status != 200:
        problems.append(f"the server stopped serving: a valid request got {after.describe()}")
    if problems:
        return Verdict(CheckStatus.FAIL, "; ".join(problems) + f" [{evidence}]")
    return Verdict(CheckStatus.PASS, evidence)


async def _overlong_prompt(s: Session) -> tuple[str, str]:
    """A prompt longer than the context, and how its length is known."""
    assert s.context_window is not None
    words = math.ceil(s.context_window * OVERLONG_FACTOR) + 64
    for _ in range(3):
        prompt = "hello " * words
        counted = await s.tokenize(prompt)
        if counted is None:
            return prompt, f"~{words} tokens (estimated) > {s.context_window}"
        if counted[0] > s.context_window:
            return prompt, f"{counted[0]} tokens > {s.context_window}"
        words *= 2
    return prompt, f"{words} words > {s.context_window}"


async def check_prompt_too_long(s: Session) -> Verdict:
    prompt, described = await _overlong_prompt(s)
    answer = await s.request("POST", s.path, json_body=s.body(prompt, max_tokens=16))
    verdict = judge_overlong_prompt(answer.status, answer.error_body(), prompt_tokens=described)
    if answer.status is None:
        return Verdict(verdict.status, f"{verdict.evidence} ({answer.error})")
    return verdict


async def check_unset_max_tokens(s: Session) -> Verdict:
    assert s.context_window is not None
    answer, tries = await s.admitted(s.body(SHORT_PROMPT))
    if answer.status != 200:
        return Verdict(CheckStatus.FAIL, f"a request without max_tokens got {answer.describe()}")
    data = answer.json()
    prompt_tokens, completion_tokens = usage_tokens(data)
    source = "usage"
    if prompt_tokens is None:
        prompt_tokens, source = await s.count_prompt(SHORT_PROMPT)
    limit = s.context_window - prompt_tokens
    if completion_tokens is None:
        return Verdict(
            CheckStatus.UNSUPPORTED, "accepted (200) but no usage.completion_tokens to judge"
        )
    problem = judge_completion_tokens(completion_tokens, limit, "unset max_tokens")
    numbers = (
        f"{completion_tokens} completion tokens, limit {s.context_window} - "
        f"{prompt_tokens} prompt ({source}) = {limit}"
    )
    details = {"completion_tokens": completion_tokens, "limit": limit, "attempts": tries}
    if problem is not None:
        return Verdict(CheckStatus.FAIL, f"accepted, but {numbers}", details)
    return Verdict(CheckStatus.PASS, f"accepted (200): {numbers}", details)


async def check_explicit_max_tokens(s: Session) -> Verdict:
    seen: list[str] = []
    problems: list[str] = []
    for cap in EXPLICIT_CAPS:
        answer, _ = await s.admitted(s.body(LONG_OUTPUT_PROMPT, max_tokens=cap))
        if answer.status != 200:
            problems.append(f"max_tokens {cap} got {answer.describe()}")
            continue
        _, completion_tokens = usage_tokens(answer.json())
        if completion_tokens is None:
            return Verdict(CheckStatus.UNSUPPORTED, "no usage.completion_tokens in the answers")
        seen.append(f"{cap}->{completion_tokens}")
        problem = judge_completion_tokens(completion_tokens, cap, f"max_tokens {cap}")
        if problem is not None:
            problems.append(problem)
    evidence = "max_tokens->completion_tokens: " + ", ".join(seen)
    if problems:
        return Verdict(CheckStatus.FAIL, "; ".join(problems) + f" [{evidence}]")
    return Verdict(CheckStatus.PASS, evidence)


def _losses(before: KVLosses | None, after: KVLosses | None) -> EngineLosses | None:
    during = after.since(before) if after is not None else None
    if during is None:
        return None
    return EngineLosses(during.total, during.kind, during.metric, during.meaning)


async def check_saturation(s: Session) -> Verdict:
    # Each request asks for its sequence to run to its cap (ignore_eos, min_tokens): a model that
    # stops early would never fill the pool, and an over-admitting server would pass.
    prompt_tokens, _ = await s.count_prompt(SHORT_PROMPT)
    cap, sized = await s.burst_cap(prompt_tokens)
    before = await s.kv_losses()
    outcomes = await s.burst(
        s.body(SHORT_PROMPT, max_tokens=cap, run_to_cap=True),
        s.options.burst,
        budget=s.remaining() - 0.5,
    )
    losses = _losses(before, await s.kv_losses() if before is not None else None)
    verdict = judge_saturation(
        outcomes, require_retry_after=s.options.require_retry_after, losses=losses
    )
    details = {
        **verdict.details,
        "max_tokens": cap,
        "prompt_tokens": prompt_tokens,
        "sized_by": sized,
    }
    return Verdict(
        verdict.status, f"max_tokens {cap} to the cap [{sized}]; {verdict.evidence}", details
    )


async def check_retry_after_honest(s: Session) -> Verdict:
    # Holders ask for long answers so that they are still generating when the probe comes.
    prompt_tokens, _ = await s.count_prompt(LONG_OUTPUT_PROMPT)
    cap, _ = await s.burst_cap(prompt_tokens)
    body = s.body(LONG_OUTPUT_PROMPT, max_tokens=cap, run_to_cap=True)
    holders = [BurstOutcome(streamed=True) for _ in range(s.options.burst)]
    before = await s.kv_losses()
    full = anyio.Event()  # set at the first refusal, or once every holder has its answer

    def on_answer() -> None:
        answered = [h for h in holders if h.status is not None or h.transport_error is not None]
        if len(answered) == len(holders) or any(h.status in (429, 503) for h in answered):
            full.set()

    async with anyio.create_task_group() as group:
        for holder in holders:
            group.start_soon(functools.partial(s.send_one, body, holder, on_answer=on_answer))
        # The holders keep their streams open while the probe asks to be admitted.
        with anyio.move_on_after(min(HOLDERS_ANSWER_WAIT, s.remaining())):
            await full.wait()
        if not any(h.status in (429, 503) for h in holders):
            verdict = Verdict(
                CheckStatus.UNSUPPORTED,
                f"a burst of {len(holders)} was never refused: no Retry-After to judge",
            )
        else:
            verdict = await _probe_retry_after(s, body)
        group.cancel_scope.cancel()
    # Holders that died on the way (cancelled ones are unfinished, not dead) fail the check too.
    losses = _losses(before, await s.kv_losses() if before is not None else None)
    problem = judge_holders(holders, losses)
    if problem is not None:
        return Verdict(
            CheckStatus.FAIL, f"{problem}; while {verdict.evidence}", dict(verdict.details)
        )
    return verdict


async def _probe_retry_after(s: Session, body: dict[str, Any]) -> Verdict:
    waits: list[float] = []
    statuses: Counter[str] = Counter()
    for attempt in range(s.options.retry_tries + 1):
        outcome = BurstOutcome(streamed=True)
        await s.send_one(body, outcome, drop_after_first=True)
        statuses[str(outcome.status)] += 1
        details = {"waits": waits, "statuses": dict(statuses)}
        if outcome.status is not None and 200 <= outcome.status < 300:
            if attempt == 0:
                return Verdict(
                    CheckStatus.UNSUPPORTED,
                    "the probe was admitted at once: the burst drained too fast (raise --burst)",
                    details,
                )
            return Verdict(
                CheckStatus.PASS,
                f"refused, then admitted on retry {attempt} after following Retry-After "
                f"({' + '.join(f'{w:g}' for w in waits)} s)",
                details,
            )
        if outcome.status not in (429, 503):
            return Verdict(
                CheckStatus.FAIL,
                f"retry {attempt} got {outcome.status or outcome.transport_error}, not 429/503/200",
                details,
            )
        advice = outcome.retry_after
        assert advice is not None
        if advice.missing:
            return Verdict(
                CheckStatus.UNSUPPORTED, f"{outcome.status} without Retry-After: nothing to honour"
            )
        if advice.seconds is None or not advice.valid:
            return Verdict(
                CheckStatus.FAIL, f"cannot honour Retry-After {advice.raw!r}: {advice.problem}"
            )
        if attempt == s.options.retry_tries:
            break
        if advice.seconds >= s.remaining():
            return Verdict(
                CheckStatus.FAIL,
                f"advised {advice.seconds:g} s with {s.remaining():.1f} s of the check left "
                "(raise --timeout if that wait is honest)",
                details,
            )
        waits.append(advice.seconds)
        await anyio.sleep(advice.seconds)
    return Verdict(
        CheckStatus.FAIL,
        f"still refused after {s.options.retry_tries} retries that each waited the advised "
        f"Retry-After ({' + '.join(f'{w:g}' for w in waits)} s): {describe_counts(statuses)}",
        {"waits": waits, "statuses": dict(statuses)},
    )


async def check_capacity_returns(s: Session) -> Verdict:
    assert s.context_window is not None
    # Long answers: the dropped streams must still be generating when the client walks away.
    prompt = LONG_OUTPUT_PROMPT
    prompt_tokens, source = await s.count_prompt(prompt)
    largest = s.context_window - prompt_tokens
    size = f"{prompt_tokens} prompt ({source}) + {largest} max_tokens = {s.context_window}"
    patience = min(s.options.capacity_wait, s.remaining())
    before = await s.largest_admitted(prompt, largest, patience=patience)
    if not before[0]:
        return Verdict(
            CheckStatus.FAIL,
            f"before any stream was dropped, a full-context request ({size}) was still "
            f"refused after {before[2]:.1f} s ({describe_counts(before[3])})",
        )
    cap, _ = await s.burst_cap(prompt_tokens)
    outcomes = await s.burst(
        s.body(prompt, max_tokens=cap, run_to_cap=True),
        s.options.burst,
        budget=min(s.remaining() / 3, s.options.timeout / 3),
        drop_after_first=True,
        stream_every=1,
    )
    dropped = sum(1 for o in outcomes if o.status is not None and 200 <= o.status < 300)
    statuses = describe_counts(Counter(str(o.status) for o in outcomes))
    admitted, tries, waited, seen = await s.largest_admitted(
        prompt, largest, patience=min(s.options.capacity_wait, s.remaining())
    )
    reserved = await s.reserved_tokens()
    metric = "" if reserved is None else f"; /metrics kv_reserved_tokens {reserved:g}"
    details = {"dropped_streams": dropped, "tries": tries, "kv_reserved_tokens": reserved}
    dropped_text = f"dropped {dropped} stream{'' if dropped == 1 else 's'} mid-way ({statuses})"
    if admitted:
        # A server that never refuses (it queues) admits anything: then this shows little.
        refused = any(o.status in (429, 503) for o in outcomes)
        note = "" if refused else " (the burst was never refused: leaks would not show here)"
        return Verdict(
            CheckStatus.PASS,
            f"full-context request ({size}) admitted after the bursts; {dropped_text}; admitted "
            f"again on try {tries} after {waited:.1f} s{metric}{note}",
            details,
        )
    return Verdict(
        CheckStatus.FAIL,
        f"{dropped_text}; then a full-context request ({size}) was still refused after "
        f"{waited:.1f} s, {tries} tries ({describe_counts(seen)}){metric}",
        details,
    )


#: name -> (check, needs the context window)
CHECKS: dict[str, tuple[Callable[[Session], Awaitable[Verdict]], bool]] = {
    "context_window": (check_context_window, False),
    "bad_input": (check_bad_input, False),
    "prompt_too_long": (check_prompt_too_long, True),
    "unset_max_tokens": (check_unset_max_tokens, True),
    "explicit_max_tokens": (check_explicit_max_tokens, False),
    "saturation": (check_saturation, True),
    "retry_after_honest": (check_retry_after_honest, True),
    "capacity_returns": (check_capacity_returns, True),
}
