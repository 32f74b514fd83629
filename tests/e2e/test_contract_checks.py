"""The contract suite's pure judgements, and its checks against small fake servers.

The fakes are ``httpx.MockTransport`` handlers: each one keeps (or breaks) one rule of the
contract, so every verdict here is decided by the server's answers alone.
"""

from __future__ import annotations

import email.utils
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvclient.contract import (
    CHECK_NAMES,
    CheckResult,
    CheckStatus,
    ContractOptions,
    ContractReport,
    arun_contract,
)
from kvclient.contract._judge import (
    BurstOutcome,
    EngineLosses,
    classify_error_body,
    judge_bad_input,
    judge_completion_tokens,
    judge_holders,
    judge_overlong_prompt,
    judge_retry_after,
    judge_saturation,
    prometheus_value,
    usage_tokens,
)
from kvclient.contract._session import _has_text
from kvclient.contract.cli import main, render_table

NOW = 1_700_000_000.0

# --- Retry-After ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "2", " 30 ", "3600"])
def test_retry_after_delta_seconds_valid(value: str) -> None:
    advice = judge_retry_after(value)
    assert advice.valid
    assert advice.seconds == float(value.strip())


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "immediate retry"),
        ("1.5", "neither delta-seconds"),
        ("-1", "neither delta-seconds"),
        ("soon", "neither delta-seconds"),
        ("", "neither delta-seconds"),
        ("9" * 80, "characters"),
        ("86400", "implausibly long"),
    ],
)
def test_retry_after_problems(value: str, problem: str) -> None:
    advice = judge_retry_after(value)
    assert not advice.valid
    assert problem in (advice.problem or "")


def test_retry_after_missing() -> None:
    advice = judge_retry_after(None)
    assert advice.missing
    assert not advice.valid
    assert not judge_retry_after(None, millis="500").missing


def test_retry_after_http_date() -> None:
    future = email.utils.formatdate(NOW + 5, usegmt=True)
    past = email.utils.formatdate(NOW - 5, usegmt=True)
    assert judge_retry_after(future, now=NOW).seconds == pytest.approx(5.0)
    assert "in the past" in (judge_retry_after(past, now=NOW).problem or "")
    assert "current time" in (judge_retry_after(future).problem or "")


def test_retry_after_millis_must_agree() -> None:
    assert judge_retry_after("2", millis="1500").valid
    assert "disagrees" in (judge_retry_after("1", millis="9000").problem or "")
    assert "not a number" in (judge_retry_after("1", millis="soon").problem or "")


# --- error bodies and single answers --------------------------------------------------------------


def test_classify_error_bodies() -> None:
    openai = classify_error_body(b'{"error": {"message": "m", "type": "t", "code": "c"}}')
    assert (openai.shape, openai.code, openai.type) == ("openai", "c", "t")
    tgi = classify_error_body(b'{"error": "Input validation error", "error_type": "validation"}')
    assert (tgi.shape, tgi.type) == ("json", "validation")
    fastapi = classify_error_body(b'{"detail": [{"loc": ["body"], "msg": "bad"}]}')
    assert fastapi.shape == "json"
    for content in (b"Internal Server Error", b"[1, 2]", b'{"ok": true}', b"\xff"):
        assert classify_error_body(content).shape == "none"
    assert classify_error_body(b"oops").describe() == "no JSON error body"


@pytest.mark.parametrize(
    ("status", "body", "expected", "words"),
    [
        (413, b'{"error": {"message": "too long"}}', CheckStatus.PASS, "413"),
        (400, b'{"error": {"message": "too long"}}', CheckStatus.PASS, "413 preferred"),
        (422, b'{"detail": "too long"}', CheckStatus.PASS, "413 preferred"),
        (500, b'{"error": {"message": "boom"}}', CheckStatus.FAIL, "server error"),
        (429, b'{"error": {"message": "busy"}}', CheckStatus.FAIL, "retryable"),
        (503, b'{"error": {"message": "busy"}}', CheckStatus.FAIL, "server error"),
        (200, b'{"choices": []}', CheckStatus.FAIL, "accepted"),
        (413, b"<html>too long</html>", CheckStatus.FAIL, "not JSON"),
        (404, b'{"error": {"message": "?"}}', CheckStatus.FAIL, "expected 413"),
        (None, b"", CheckStatus.FAIL, "connection dropped"),
    ],
)
def test_judge_overlong_prompt(
    status: int | None, body: bytes, expected: CheckStatus, words: str
) -> None:
    verdict = judge_overlong_prompt(status, classify_error_body(body), prompt_tokens="9000")
    assert verdict.status is expected
    assert words in verdict.evidence


def test_judge_bad_input() -> None:
    json_error = classify_error_body(b'{"error": {"message": "bad"}}')
    assert judge_bad_input("x", 400, json_error) is None
    assert judge_bad_input("x", 422, json_error) is None
    assert "500" in (judge_bad_input("x", 500, json_error) or "")
    assert "accepted" in (judge_bad_input("x", 200, json_error) or "")
    assert "retryable" in (judge_bad_input("x", 429, json_error) or "")
    assert "without a JSON" in (judge_bad_input("x", 400, classify_error_body(b"no")) or "")
    assert "dropped" in (judge_bad_input("x", None, json_error) or "")


def test_usage_and_completion_limits() -> None:
    assert usage_tokens({"usage": {"prompt_tokens": 3, "completion_tokens": 5}}) == (3, 5)
    assert usage_tokens({"usage": {"prompt_tokens": True}}) == (None, None)
    assert usage_tokens("nope") == (None, None)
    assert judge_completion_tokens(5, 5, "x") is None
    assert "6 completion tokens > 5" in (judge_completion_tokens(6, 5, "x") or "")
    assert "no usage" in (judge_completion_tokens(None, 5, "x") or "")


def test_prometheus_value() -> None:
    text = (
        "# HELP kv_reserved_tokens Reserved.\n# TYPE kv_reserved_tokens gauge\n"
        "kv_reserved_tokens_peak 9.0\nkv_reserved_tokens 3072.0\n"
    )
    assert prometheus_value(text, "kv_reserved_tokens") == 3072.0
    assert prometheus_value(text, "kv_missing") is None
    assert prometheus_value("kv_reserved_tokens NaN\n", "kv_reserved_tokens") is None


def test_stream_events_that_carry_text() -> None:
    def event(**choice: Any) -> str:
        return json.dumps({"choices": [{"index": 0, **choice}]})

    assert not _has_text(event(delta={"role": "assistant", "content": ""}, finish_reason=None))
    assert not _has_text(event(text="", finish_reason=None))
    assert _has_text(event(delta={"content": " the"}, finish_reason=None))
    assert _has_text(event(text=" the", finish_reason=None))
    assert _has_text(event(text="", finish_reason="stop"))
    assert _has_text("[DONE]")
    assert _has_text(json.dumps({"error": {"message": "oom"}}))


# --- the burst verdict ----------------------------------------------------------------------------


def _ok(streamed: bool = False) -> BurstOutcome:
    return BurstOutcome(streamed=streamed, status=200, completed=True)


def _refused(value: str | None = "1", status: int = 429) -> BurstOutcome:
    return BurstOutcome(status=status, retry_after=judge_retry_after(value))


def test_saturation_pass() -> None:
    verdict = judge_saturation([_ok(), _ok(True), _refused("1"), _refused("2", status=503)])
    assert verdict.status is CheckStatus.PASS
    assert "Retry-After 1-2 s" in verdict.evidence
    assert verdict.details["refused"] == 2


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            BurstOutcome(status=500, error_code="kv_cache_oom"),
            "1 of 2 admitted requests died mid-decode, 1 of them out of KV memory (OOM): 500 x1 "
            "(kv_cache_oom x1)",
        ),
        (BurstOutcome(status=500, error_code="internal_error"), "1 server errors (internal_error"),
        (BurstOutcome(transport_error="RemoteProtocolError"), "dropped connections"),
        (
            BurstOutcome(status=200, problem="error event mid-stream"),
            "1 of 2 admitted requests died mid-decode: error event mid-stream x1",
        ),
        (
            # llama.cpp's unified KV cache, full mid-decode: an error event with this message.
            BurstOutcome(
                status=200,
                streamed=True,
                problem="error event mid-stream",
                error_code="500",
                error_message="Context size has been exceeded.",
            ),
            "died mid-decode, 1 of them out of KV memory (OOM)",
        ),
        (
            BurstOutcome(status=200, problem="stream ended without [DONE] or finish_reason"),
            "died mid-decode: stream ended without [DONE]",
        ),
        (
            BurstOutcome(status=200, problem="connection broke mid-answer (RemoteProtocolError)"),
            "died mid-decode: connection broke mid-answer",
        ),
        (BurstOutcome(status=200, problem="an error body in a 2xx answer"), "died mid-decode"),
        (BurstOutcome(status=200, unfinished=True), "unfinished at the deadline"),
        (BurstOutcome(status=400, error_code="kv_budget_exceeded"), "unexpected 3xx/4xx"),
        (_refused("soon"), "invalid Retry-After"),
        (_refused(None), "without Retry-After"),
    ],
)
def test_saturation_failures(extra: BurstOutcome, words: str) -> None:
    verdict = judge_saturation([_ok(), _refused("1"), extra])
    assert verdict.status is CheckStatus.FAIL
    assert words in verdict.evidence


def test_saturation_without_refusals_or_retry_after_is_unsupported() -> None:
    never_refused = judge_saturation([_ok(), _ok(True)])
    assert never_refused.status is CheckStatus.UNSUPPORTED
    assert "never refused" in never_refused.evidence
    lenient = judge_saturation([_ok(), _refused(None)], require_retry_after=False)
    assert lenient.status is CheckStatus.UNSUPPORTED
    assert "no Retry-After (allowed)" in lenient.evidence
    strict = judge_saturation([_ok(), _refused(None)])
    assert strict.status is CheckStatus.FAIL


def test_saturation_with_engine_losses_fails_even_when_never_refused() -> None:
    # vLLM admits what its KV cache cannot hold and preempts: the seed's failure in another form.
    preempted = EngineLosses(3, "preemptions", "vllm:num_preemptions_total", "evicted")
    queued = judge_saturation([_ok(), _ok(True)], losses=preempted)
    assert queued.status is CheckStatus.FAIL
    assert "3 preemptions (vllm:num_preemptions_total): evicted" in queued.evidence
    assert queued.details["engine_losses"]["count"] == 3
    none = EngineLosses(0, "preemptions", "vllm:num_preemptions_total")
    clean = judge_saturation([_ok(), _refused("1")], losses=none)
    assert clean.status is CheckStatus.PASS
    assert clean.details["engine_losses"]["count"] == 0
    unknown = judge_saturation([_ok(), _refused("1")])
    assert unknown.status is CheckStatus.PASS
    assert "engine_losses" not in unknown.details


def test_holders_that_died_or_were_counted_lost() -> None:
    cancelled = BurstOutcome(streamed=True, status=200, unfinished=True)
    died = BurstOutcome(streamed=True, status=200, problem="error event mid-stream")
    assert judge_holders([cancelled, _ok(True), _refused("1")], None) is None
    problem = judge_holders([cancelled, died], None)
    assert problem == "1 of 2 admitted requests died mid-decode: error event mid-stream x1"
    lost = EngineLosses(2, "retractions", "sglang:num_retracted_requests_total")
    assert judge_holders([cancelled], lost) == "2 retractions (sglang:num_retracted_requests_total)"


# --- options and reports --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"burst": 0},
        {"burst": True},
        {"timeout": 0},
        {"timeout": float("inf")},
        {"context_window": -1},
        {"only": ("nope",)},
        {"retry_tries": 0},
        {"api": "responses"},
    ],
)
def test_options_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ContractOptions(**kwargs)


def test_report_ok_ignores_unsupported_and_skipped() -> None:
    def result(name: str, status: CheckStatus) -> CheckResult:
        return CheckResult(name=name, status=status, evidence="e")

    report = ContractReport(
        base_url="http://x",
        model="m",
        context_window=8,
        results=(
            result("context_window", CheckStatus.UNSUPPORTED),
            result("bad_input", CheckStatus.PASS),
            result("saturation", CheckStatus.SKIPPED),
        ),
        duration=1.0,
    )
    assert report.ok
    assert report["bad_input"].status is CheckStatus.PASS
    assert report.counts() == {"pass": 1, "fail": 0, "unsupported": 1, "skipped": 1}
    json.dumps(report.to_dict())
    assert "PASSED" in render_table(report)
    failed = ContractReport(
        base_url="http://x",
        model=None,
        context_window=None,
        results=(result("bad_input", CheckStatus.FAIL),),
        duration=0.0,
    )
    assert not failed.ok
    assert "FAILED" in render_table(failed)
    with pytest.raises(KeyError):
        failed["saturation"]


def test_cli_rejects_unknown_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["http://127.0.0.1:9", "--only", "saturation,nope"]) == 2
    assert "unknown check(s) nope" in capsys.readouterr().err


# --- checks against fake servers ------------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


def _error(status: int, message: str, **headers: str) -> httpx.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return httpx.Response(status, json=body, headers=headers)


def fake_server(
    *,
    context: int = 64,
    models: Any = None,
    unset_output: int = 10,
    overlong_status: int = 413,
    usage: bool = True,
) -> Handler:
    """A tiny in-memory server that keeps the contract, except where told otherwise.

    It counts one token per word and never saturates (so the burst checks are unsupported).
    """

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            if models == 404:
                return _error(404, "no route")
            listing = models or {"data": [{"id": "fake", "max_model_len": context}]}
            return httpx.Response(200, json=listing)
        if request.url.path == "/tokenize":
            return _error(404, "no route")
        if request.url.path != "/v1/completions":
            return _error(404, "no route")
        try:
            body = json.loads(request.content)
        except ValueError:
            return _error(400, "not JSON")
        prompt, cap = body.get("prompt"), body.get("max_tokens")
        if not isinstance(prompt, str) or (
            cap is not None and (not isinstance(cap, int) or cap < 1)
        ):
            return _error(400, "bad field")
        prompt_tokens = len(prompt.split())
        if prompt_tokens >= context:
            return _error(overlong_status, "prompt too long")
        completion = unset_output if cap is None else min(cap, 3)
        counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
        if body.get("stream"):
            events = [
                {"choices": [{"index": 0, "text": " ok", "finish_reason": None}]},
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
            ]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(
                200, content=text.encode(), headers={"content-type": "text/event-stream"}
            )
        choice = {"index": 0, "text": " ok" * completion, "finish_reason": "length"}
        answer: dict[str, Any] = {"choices": [choice]}
        if usage:
            answer["usage"] = counts
        return httpx.Response(200, json=answer)

    return handler


async def _run(handler: Handler, **options: Any) -> ContractReport:
    options.setdefault("burst", 4)
    options.setdefault("timeout", 5.0)
    options.setdefault("capacity_wait", 0.5)
    return await arun_contract("http://fake/v1", transport=httpx.MockTransport(handler), **options)


@pytest.mark.anyio
async def test_fake_server_that_keeps_the_contract() -> None:
    report = await _run(fake_server())
    statuses = {r.name: r.status for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert report.base_url == "http://fake"
    assert report.model == "fake"
    assert report.context_window == 64
    # It never refuses, so there is no Retry-After to judge: unsupported, not failed.
    assert statuses["saturation"] is CheckStatus.UNSUPPORTED
    assert statuses["retry_after_honest"] is CheckStatus.UNSUPPORTED
    others = {k: v for k, v in statuses.items() if k not in ("saturation", "retry_after_honest")}
    assert set(others.values()) == {CheckStatus.PASS}, report.to_dict()
    assert report.ok


@pytest.mark.anyio
async def test_unset_max_tokens_overrunning_the_context_fails() -> None:
    report = await _run(fake_server(context=64, unset_output=500), only=("unset_max_tokens",))
    result = report["unset_max_tokens"]
    assert result.status is CheckStatus.FAIL
    assert "500 completion tokens" in result.evidence
    assert not report.ok


@pytest.mark.anyio
async def test_prompt_too_long_answered_500_fails() -> None:
    report = await _run(fake_server(overlong_status=500), only=("prompt_too_long",))
    assert report["prompt_too_long"].status is CheckStatus.FAIL


@pytest.mark.anyio
async def test_no_models_endpoint() -> None:
    without = await _run(fake_server(models=404))
    assert without["context_window"].status is CheckStatus.FAIL
    assert without["prompt_too_long"].status is CheckStatus.SKIPPED
    assert without["bad_input"].status is CheckStatus.PASS  # needs no context window
    assert not without.ok
    given = await _run(fake_server(models=404), context_window=64, only=("context_window",))
    assert given["context_window"].status is CheckStatus.UNSUPPORTED
    assert "--context-window 64" in given["context_window"].evidence
    assert given.ok


@pytest.mark.anyio
async def test_invalid_max_model_len_fails() -> None:
    models = {"data": [{"id": "fake", "max_model_len": "8k"}]}
    report = await _run(fake_server(models=models), only=("context_window",))
    assert report["context_window"].status is CheckStatus.FAIL
    assert "'8k'" in report["context_window"].evidence


@pytest.mark.anyio
async def test_unreachable_server_fails_once_and_skips_the_rest() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    report = await _run(refuse)
    assert report["context_window"].status is CheckStatus.FAIL
    assert "cannot reach" in report["context_window"].evidence
    assert {r.status for r in report.results[1:]} == {CheckStatus.SKIPPED}


@pytest.mark.anyio
async def test_a_server_answering_nonsense_fails_checks_without_crashing_the_suite() -> None:
    def nonsense(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "x", "max_model_len": 64}]})
        return httpx.Response(200, content=b"\x00garbage")

    report = await _run(nonsense)
    assert not report.ok
    assert report["bad_input"].status is CheckStatus.FAIL
    assert report["saturation"].status is CheckStatus.FAIL  # admitted but unreadable


@pytest.mark.anyio
async def test_token_counting_falls_back_from_tokenize_to_usage() -> None:
    """A /tokenize that reads another field (0 tokens) is not trusted: usage counts instead."""
    seen: list[str] = []
    inner = fake_server(context=64)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": []})
        return inner(request)

    report = await _run(handler, only=("capacity_returns",))
    assert report["capacity_returns"].status is CheckStatus.PASS
    assert "prompt (usage)" in report["capacity_returns"].evidence
    # The fake never refuses, and the evidence says what that means for this check.
    assert "leaks would not show" in report["capacity_returns"].evidence
    assert seen.count("/tokenize") == 1  # learnt once, not asked again


def test_cli_prints_a_rich_table_and_fails_on_a_failed_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def canned(url: str, *, options: ContractOptions) -> ContractReport:
        assert options.burst == 8
        assert options.only == ("saturation",)
        assert options.require_retry_after is False
        result = CheckResult(name="saturation", status=CheckStatus.FAIL, evidence="500 x3")
        return ContractReport(
            base_url=url, model="m", context_window=8, results=(result,), duration=0.1
        )

    monkeypatch.setattr("kvclient.contract.cli.run_contract", canned)
    args = ["http://x", "--burst", "8", "--only", "saturation", "--allow-missing-retry-after"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "500 x3" in out
    assert "FAILED" in out


@pytest.mark.anyio
async def test_without_usage_or_tokenize_counts_are_estimated() -> None:
    report = await _run(fake_server(usage=False))
    # Output lengths cannot be judged without usage: unsupported, not failed.
    assert report["unset_max_tokens"].status is CheckStatus.UNSUPPORTED
    assert report["explicit_max_tokens"].status is CheckStatus.UNSUPPORTED
    capacity = report["capacity_returns"]
    assert capacity.status is CheckStatus.PASS
    assert "prompt (estimate)" in capacity.evidence
    assert report.ok


@pytest.mark.anyio
async def test_a_request_on_a_connection_the_server_closed_idle_is_sent_again() -> None:
    """A pooled connection the server closed as it went idle, reused in that instant, fails
    before any answer: nothing reached the server, so the request goes again at once (as
    kvclient's client sends it), instead of a check failing on "no answer"."""
    healthy = fake_server()
    stale = {"left": 1}

    def handler(request: httpx.Request) -> httpx.Response:
        posted = request.method == "POST" and request.url.path.endswith("completions")
        if posted and json.loads(request.content).get("stream") and stale["left"] > 0:
            stale["left"] -= 1
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            )
        return healthy(request)

    report = await _run(handler, only=("capacity_returns",))
    assert stale["left"] == 0
    assert report["capacity_returns"].status is CheckStatus.PASS, report.to_dict()


@pytest.mark.anyio
async def test_no_answer_names_the_transport_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("completions"):
            raise httpx.ReadError("connection reset by peer", request=request)
        return fake_server()(request)

    report = await _run(handler, only=("capacity_returns",))
    result = report["capacity_returns"]
    assert result.status is CheckStatus.FAIL
    assert "no answer (ReadError)" in result.evidence
