"""The contract suite: does a live server keep the KV admission contract?

Schema checkers verify shapes; this verifies behaviour under pressure: what the server does when
it is full, when a prompt cannot fit, when a cap is unset, when a client walks away. It talks plain
HTTP to any OpenAI-compatible server (vLLM, TGI, llama.cpp, SGLang, the reference server).

>>> report = run_contract("http://127.0.0.1:8000")                # doctest: +SKIP
>>> report.ok, report["saturation"].evidence                      # doctest: +SKIP

From the shell: ``kvclient contract URL``; from pytest: ``pytest --kv-contract-url URL``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import httpx

from ._checks import CHECKS
from ._judge import RetryAfterAdvice, judge_retry_after
from ._results import (
    CHECK_NAMES,
    CHECK_TITLES,
    DEFAULT_BURST,
    DEFAULT_TIMEOUT,
    CheckResult,
    CheckStatus,
    ContractOptions,
    ContractReport,
)
from ._session import Session

__all__ = [
    "CHECK_NAMES",
    "CHECK_TITLES",
    "DEFAULT_BURST",
    "DEFAULT_TIMEOUT",
    "CheckResult",
    "CheckStatus",
    "ContractOptions",
    "ContractReport",
    "RetryAfterAdvice",
    "arun_contract",
    "judge_retry_after",
    "run_contract",
]

# Extra seconds a check gets past its own budget to write its verdict before it is cut.
_GRACE = 5.0


def _options(options: ContractOptions | None, overrides: dict[str, Any]) -> ContractOptions:
    options = options if options is not None else ContractOptions()
    return dataclasses.replace(options, **overrides) if overrides else options


def _base_url(url: str) -> str:
    # Accept an OpenAI-style base URL ending in /v1: the suite also needs /tokenize and /metrics.
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _run_one(session: Session, name: str) -> CheckResult:
    check, needs_context = CHECKS[name]
    start = anyio.current_time()
    if not session.reachable:
        return CheckResult(name=name, status=CheckStatus.SKIPPED, evidence="server unreachable")
    if needs_context and session.context_window is None:
        return CheckResult(
            name=name,
            status=CheckStatus.SKIPPED,
            evidence="context window unknown (no max_model_len; pass --context-window)",
        )
    timeout = session.options.timeout
    session.deadline = start + timeout
    verdict = None
    try:
        with anyio.move_on_after(timeout + _GRACE):
            verdict = await check(session)
    except Exception as exc:  # a server can answer anything; report it, never crash the suite
        return CheckResult(
            name=name,
            status=CheckStatus.FAIL,
            evidence=f"the check could not finish: {type(exc).__name__}: {exc}",
            duration=anyio.current_time() - start,
        )
    duration = anyio.current_time() - start
    if verdict is None:
        return CheckResult(
            name=name,
            status=CheckStatus.FAIL,
            evidence=f"no verdict within {timeout:g} s",
            duration=duration,
        )
    return CheckResult(
        name=name,
        status=verdict.status,
        evidence=verdict.evidence,
        duration=duration,
        details=dict(verdict.details),
    )


async def arun_contract(
    base_url: str,
    *,
    options: ContractOptions | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    **overrides: Any,
) -> ContractReport:
    """Run the selected checks against ``base_url``, in order, one at a time.

    ``overrides`` replace fields of ``options``: ``arun_contract(url, burst=16, timeout=20)``.
    ``transport`` is for tests (``httpx.ASGITransport``, ``httpx.MockTransport``). Never raises
    for anything the server does: every surprise becomes a failed check with its evidence.
    """
    opts = _options(options, overrides)
    url = _base_url(base_url)
    # RFC 7240: answer at once. A server that queues what does not fit (kvclient gateway's
    # --max-queue-wait) then shows its refusals, which are what the checks judge.
    headers = {"Prefer": "wait=0"}
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    limits = httpx.Limits(max_connections=opts.burst + 16, max_keepalive_connections=16)
    start = anyio.current_time()
    results: list[CheckResult] = []
    async with httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(opts.timeout),
        limits=limits,
        transport=transport,
    ) as http:
        session = Session(http, opts)
        for name in CHECK_NAMES:
            # Discovery always runs: the other checks need the model and the context window.
            if name == "context_window" or opts.selected(name):
                result = await _run_one(session, name)
                if opts.selected(name):
                    results.append(result)
    return ContractReport(
        base_url=url,
        model=session.model,
        context_window=session.context_window,
        results=tuple(results),
        duration=anyio.current_time() - start,
    )


def run_contract(
    base_url: str,
    *,
    options: ContractOptions | None = None,
    backend: str = "asyncio",
    **overrides: Any,
) -> ContractReport:
    """Blocking :func:`arun_contract`, on its own event loop (``backend``: asyncio or trio)."""

    async def main() -> ContractReport:
        return await arun_contract(base_url, options=options, **overrides)

    return anyio.run(main, backend=backend)
