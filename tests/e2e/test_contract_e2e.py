"""The contract suite against the real reference server, over real loopback HTTP.

The reference server in ``reserve`` mode passes every check. Then each check is shown able to fail:
the server is broken on purpose (an ASGI middleware around its app, a different admission mode,
a monkeypatched release) and the check meant for that behaviour catches it.

Configs are small and fast: a 1024-token context, a KV pool of four contexts (three fit in the
usable budget), 2000 tokens/s, and natural outputs that always run to their cap, so every
admitted request holds its reservation for a predictable half second.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvclient.cli import main as kvclient_main
from kvclient.contract import CHECK_NAMES, CheckStatus, ContractReport, arun_contract, run_contract

reference_server = pytest.importorskip("reference_server")
from reference_server import ServerConfig, create_app, serve_in_thread  # noqa: E402
from reference_server.gateway import GatewayConfig  # noqa: E402
from reference_server.testing import running_gateway, running_server  # noqa: E402

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

FAST = ServerConfig(context_window=1024, kv_tokens=4096, decode_rate=2000.0, mean_output_tokens=1e6)
#: Outputs that end by themselves long before their caps, as real models' do.
EARLY = dataclasses.replace(FAST, mean_output_tokens=20.0)
OPTIONS: dict[str, Any] = {"burst": 8, "timeout": 15.0, "capacity_wait": 2.0}


@contextmanager
def serve(
    config: ServerConfig = FAST, wrap: Callable[[ASGIApp], ASGIApp] | None = None
) -> Iterator[tuple[str, Any]]:
    """``(base_url, the reference app)``; ``wrap`` puts a breaking middleware in front of it."""
    app = create_app(config)
    served = wrap(app) if wrap is not None else app
    with serve_in_thread(served) as server:  # type: ignore[arg-type]
        yield server.base_url, app


def state(app: Any) -> Any:
    return app.state.server


# --- breaking middlewares ------------------------------------------------------------------------


class PatchResponses:
    """Rewrites response starts: change statuses, drop headers, force headers on 429s."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        statuses: dict[int, int] | None = None,
        drop: tuple[str, ...] = (),
        on_429: dict[str, str] | None = None,
    ) -> None:
        self.app = app
        self.statuses = statuses or {}
        self.drop = {name.lower().encode() for name in drop}
        self.on_429 = [(k.lower().encode(), v.encode()) for k, v in (on_429 or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def patched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                forced = {k for k, _ in self.on_429} if status == 429 else set()
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.lower() not in self.drop and k.lower() not in forced
                ]
                if status == 429:
                    headers += self.on_429
                message = {
                    **message,
                    "status": self.statuses.get(status, status),
                    "headers": headers,
                }
            await send(message)

        await self.app(scope, receive, patched)


class RewriteCompletionRequests:
    """Rewrites the JSON body of every ``POST /v1/completions`` before the server reads it."""

    def __init__(self, app: ASGIApp, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.app = app
        self.rewrite = rewrite

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict):
            body = json.dumps(self.rewrite(data)).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)


class ModelsWithout:
    """``GET /v1/models`` without ``max_model_len`` (as TGI and llama.cpp list models)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            # The served model's id: the reference server answers any other with 404.
            model = {"id": "kvclient-sim", "object": "model"}
            body = json.dumps({"object": "list", "data": [model]})
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await self.app(scope, receive, send)


def leak_on_disconnect(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the ledger release whenever it runs while an exception unwinds: a client that went
    away (cancellation) leaves its reservation behind; normal completions still release."""
    ledger = state(app).ledger
    release = ledger.release

    def leaky(handle: Any) -> None:
        if sys.exc_info()[0] is not None:
            return
        release(handle)

    monkeypatch.setattr(ledger, "release", leaky)


def assert_caught(report: ContractReport, check: str, *words: str) -> None:
    result = report[check]
    assert result.status is CheckStatus.FAIL, result
    for word in words:
        assert word in result.evidence, result.evidence
    assert not report.ok


# --- the reference server keeps the contract -----------------------------------------------------


@pytest.mark.anyio
async def test_reference_server_in_reserve_mode_passes_every_check() -> None:
    with serve() as (url, app):
        report = await arun_contract(url, **OPTIONS)
        stats = state(app).engine.stats()
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    failed = {r.name: r.evidence for r in report.results if r.status is not CheckStatus.PASS}
    assert not failed, failed
    assert report.ok
    assert report.context_window == 1024
    assert stats.oom_events_total == 0
    assert state(app).ledger.stats().reserved_tokens == 0
    assert "kv_reserved_tokens 0" in report["capacity_returns"].evidence
    assert "429" in report["saturation"].evidence


def test_reference_server_passes_over_chat_completions() -> None:
    with serve() as (url, app):
        report = run_contract(url, **OPTIONS, api="chat")
    failed = {r.name: r.evidence for r in report.results if r.status is not CheckStatus.PASS}
    assert not failed, failed
    assert "messages as an object 400" in report["bad_input"].evidence
    assert state(app).ledger.stats().reserved_tokens == 0


def test_cli_table_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    args = ["--burst", "8", "--timeout", "15", "--json", str(out), "--plain"]
    with serve() as (url, _):
        assert kvclient_main(["contract", url + "/v1", *args, "--only", "saturation"]) == 0
    table = capsys.readouterr().out
    assert "saturation" in table
    assert "PASSED" in table
    data = json.loads(out.read_text())
    assert data["ok"] is True
    assert [c["name"] for c in data["checks"]] == ["saturation"]
    assert data["checks"][0]["status"] == "pass"

    def broken(app: ASGIApp) -> ASGIApp:
        return PatchResponses(app, statuses={400: 500})

    with serve(wrap=broken) as (url, _):
        assert kvclient_main(["contract", url, *args, "--only", "bad_input"]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert json.loads(out.read_text())["checks"][0]["status"] == "fail"


# --- every check can fail: one broken server each -------------------------------------------------


def test_context_window_not_advertised() -> None:
    with serve(wrap=ModelsWithout) as (url, _):
        report = run_contract(url, **OPTIONS, only=("context_window", "prompt_too_long"))
        given = run_contract(
            url, **OPTIONS, context_window=1024, only=("context_window", "prompt_too_long")
        )
    assert_caught(report, "context_window", "no max_model_len")
    assert report["prompt_too_long"].status is CheckStatus.SKIPPED
    # With the window given, the same server is "unsupported" there and judged on the rest.
    assert given["context_window"].status is CheckStatus.UNSUPPORTED
    assert given["prompt_too_long"].status is CheckStatus.PASS
    assert given.ok


def test_bad_input_answered_with_500() -> None:
    def broken(app: ASGIApp) -> ASGIApp:
        return PatchResponses(app, statuses={400: 500})

    with serve(wrap=broken) as (url, _):
        report = run_contract(url, **OPTIONS, only=("bad_input",))
    assert_caught(report, "bad_input", "malformed JSON: 500", "max_tokens 0: 500")


def test_overlong_prompt_answered_with_500() -> None:
    def broken(app: ASGIApp) -> ASGIApp:
        return PatchResponses(app, statuses={413: 500})

    with serve(wrap=broken) as (url, _):
        report = run_contract(url, **OPTIONS, only=("prompt_too_long",))
    assert_caught(report, "prompt_too_long", "-> 500")


def test_unset_max_tokens_rejected() -> None:
    def require_max_tokens(body: dict[str, Any]) -> dict[str, Any]:
        return body if "max_tokens" in body else {**body, "max_tokens": "required"}

    def broken(app: ASGIApp) -> ASGIApp:
        return RewriteCompletionRequests(app, require_max_tokens)

    with serve(wrap=broken) as (url, _):
        report = run_contract(url, **OPTIONS, only=("unset_max_tokens",))
    assert_caught(report, "unset_max_tokens", "without max_tokens got 400")


def test_explicit_max_tokens_ignored() -> None:
    def drop_max_tokens(body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k != "max_tokens"}

    def broken(app: ASGIApp) -> ASGIApp:
        return RewriteCompletionRequests(app, drop_max_tokens)

    with serve(wrap=broken) as (url, _):
        report = run_contract(url, **OPTIONS, only=("explicit_max_tokens",))
    assert_caught(report, "explicit_max_tokens", "completion tokens > 1")


def test_prompt_only_admission_ooms_under_saturation() -> None:
    with serve(dataclasses.replace(FAST, admission="prompt")) as (url, app):
        report = run_contract(url, **OPTIONS, only=("saturation",))
        ooms = state(app).engine.stats().oom_events_total
    assert_caught(report, "saturation", "kv_cache_oom")
    assert ooms >= 1


# --- saturation makes admitted sequences run to their caps ----------------------------------------


def test_prompt_admission_fails_even_when_outputs_end_early() -> None:
    # Without ignore_eos the burst's outputs would end after ~20 tokens and never fill the pool.
    with serve(dataclasses.replace(EARLY, admission="prompt")) as (url, app):
        report = run_contract(url, **OPTIONS)
        lost = state(app).engine.stats().oom_failed_sequences_total
    assert_caught(
        report,
        "saturation",
        "admitted requests died mid-decode",
        "of them out of KV memory (OOM)",
        "requests lost to KV OOM (kv_oom_failed_requests_total)",
    )
    assert report["saturation"].details["died"] >= 1
    assert report["saturation"].details["engine_losses"]["count"] >= 1
    assert lost >= 1


def test_reserve_mode_passes_when_outputs_end_early() -> None:
    with serve(EARLY) as (url, app):
        report = run_contract(url, **OPTIONS)
        stats = state(app).engine.stats()
    failed = {r.name: r.evidence for r in report.results if r.status is not CheckStatus.PASS}
    assert not failed, failed
    assert report["saturation"].details["engine_losses"]["count"] == 0
    assert "kv_physical_capacity_tokens" in report["saturation"].details["sized_by"]
    assert stats.oom_events_total == 0


def test_the_gateway_in_front_of_the_reference_server_passes() -> None:
    with serve(EARLY) as (upstream, app):
        config = GatewayConfig(upstreams=(upstream,), decode_rate=EARLY.decode_rate)
        with running_gateway(config) as gateway:
            report = run_contract(gateway.base_url, **OPTIONS)
        stats = state(app).engine.stats()
    failed = {r.name: r.evidence for r in report.results if r.status is not CheckStatus.PASS}
    assert not failed, failed
    assert "kv_usable_tokens" in report["saturation"].details["sized_by"]
    assert stats.oom_events_total == 0


@pytest.mark.slow
@pytest.mark.parametrize(("admission", "code"), [("prompt", 1), ("reserve", 0)])
def test_cli_with_its_defaults_against_kvclient_serve_with_its_defaults(
    admission: str, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # The commands as a user types them: `kvclient serve [--admission prompt]`, then
    # `kvclient contract URL`; the burst is sized from the server's /metrics KV pool.
    with running_server(admission=admission) as server:
        assert kvclient_main(["contract", server.base_url, "--plain"]) == code
        stats = server.engine.stats()
    table = capsys.readouterr().out
    if code:
        assert "FAILED" in table
        assert "died mid-decode" in table
        assert stats.oom_failed_sequences_total >= 1
    else:
        assert "PASSED: 8 pass" in table
        assert stats.oom_events_total == 0


def test_429_without_retry_after() -> None:
    def broken(app: ASGIApp) -> ASGIApp:
        return PatchResponses(app, drop=("retry-after", "retry-after-ms"))

    only = ("saturation", "retry_after_honest")
    with serve(wrap=broken) as (url, _):
        strict = run_contract(url, **OPTIONS, only=only)
        lenient = run_contract(url, **OPTIONS, only=only, require_retry_after=False)
    assert_caught(strict, "saturation", "refusals without Retry-After")
    # A server that legitimately sends none (TGI): reported as unsupported, not as failed.
    assert lenient["saturation"].status is CheckStatus.UNSUPPORTED
    assert lenient["retry_after_honest"].status is CheckStatus.UNSUPPORTED
    assert lenient.ok


def test_retry_after_that_understates_the_wait() -> None:
    # Requests decode for ~5 s, but every 429 claims the server will have room in 1 s.
    slow = dataclasses.replace(FAST, decode_rate=200.0)

    def broken(app: ASGIApp) -> ASGIApp:
        return PatchResponses(app, drop=("retry-after-ms",), on_429={"Retry-After": "1"})

    with serve(slow, wrap=broken) as (url, _):
        report = run_contract(url, **OPTIONS, only=("retry_after_honest",))
    assert_caught(report, "retry_after_honest", "still refused after 3 retries")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_reservation_leaked_on_disconnect(api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with serve() as (url, app):
        leak_on_disconnect(app, monkeypatch)
        report = run_contract(url, **OPTIONS, api=api, only=("capacity_returns",))
        leaked = state(app).ledger.stats().reserved_tokens
    assert_caught(report, "capacity_returns", "still refused", "kv_reserved_tokens")
    assert leaked > 0
