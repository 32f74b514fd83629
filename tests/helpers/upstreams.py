"""Scripted upstreams for the gateway's tests: small Starlette apps that answer discovery like an
engine (a window, a KV budget, ``/tokenize``) and whatever generation routes a test gives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reference_server import RunningServer, serve_in_thread


@contextmanager
def scripted_upstream(app: Starlette) -> Iterator[RunningServer]:
    with serve_in_thread(app) as server:
        yield server


def discoverable(routes: list[Route], *, window: int = 1024, kv: int = 4096) -> Starlette:
    """An app the gateway discovers as ours (window ``window``, ``kv`` KV tokens, a /tokenize
    that counts 3), with ``routes`` added."""

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "max_model_len": window}]})

    async def metrics(request: Request) -> Response:
        return Response(f"kv_physical_capacity_tokens {kv}\n")

    async def tokenize(request: Request) -> Response:
        return JSONResponse({"count": 3, "tokens": [1, 2, 3]})

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/tokenize", tokenize, methods=["POST"]),
            *routes,
        ]
    )


#: Tokens a second :class:`LockstepUpstream` makes for every request alike.
RATE = 200.0


class LockstepUpstream:
    """A scripted engine that decodes every request at ``RATE`` tokens a second (in lockstep)
    and reports its usage in every chunk when asked, as vLLM does; it says what ours says on
    its ``/metrics`` (its waiting line, what it runs, a running cap). It records what it was
    sent and when each request started and ended."""

    def __init__(
        self, *, max_running: int | None = 8, waiting: int = 0, text: str = "x", rate: float = RATE
    ) -> None:
        self.max_running = max_running
        #: Tokens a second it makes for every request alike.
        self.rate = rate
        self.waiting = waiting
        #: The text of each token (a long one makes a client's socket buffers fill sooner).
        self.text = text
        self.bodies: list[dict[str, Any]] = []
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        #: When it let each request go: at its end, or ``let_go_seconds`` after a client cut it.
        self.gone: dict[str, float] = {}
        self.let_go_seconds = 0.0
        #: What each request had made when each other one started (name -> name -> tokens).
        self.made: dict[str, int] = {}
        self.made_at_start: dict[str, dict[str, int]] = {}
        self.generated = 0
        self.lock = threading.Lock()
        #: What its /metrics says: False, a 404 (a proxy that hides it); its decode counter;
        #: requests it lost to a KV OOM.
        self.shows_metrics = True
        self.counters = True
        self.oom = 0
        #: Its preemption counter, and how many times its /metrics was read.
        self.preemptions = 0
        self.scrapes = 0

    @property
    def running(self) -> int:
        return len(self.started) - len(self.gone)

    async def metrics(self, request: Request) -> Response:
        self.scrapes += 1
        if not self.shows_metrics:
            return Response("not found", status_code=404)
        lines = [
            "kv_physical_capacity_tokens 1200",
            "kv_engine_block_size 1",
            f"kv_engine_requests_waiting {self.waiting}",
            f"kv_engine_requests_running {self.running}",
            f"kv_engine_preemptions_total {self.preemptions}",
            f"kv_oom_failed_requests_total {self.oom}",
        ]
        if self.counters:
            lines.append(f"kv_generated_tokens_total {self.generated}")
        if self.max_running is not None:
            lines.append(f"kv_engine_max_running {self.max_running}")
        return Response("\n".join(lines) + "\n")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "max_model_len": 1000}]})

    async def tokenize(self, request: Request) -> Response:
        return JSONResponse({"count": 3, "tokens": [1, 2, 3]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        name = body["prompt"]
        cap = body["max_tokens"]
        options = body.get("stream_options") or {}
        continuous = options.get("continuous_usage_stats") is True

        def chunk(made: int, text: str, finish: str | None) -> bytes:
            event: dict[str, Any] = {
                "choices": [{"index": 0, "text": text, "finish_reason": finish}]
            }
            if continuous:
                event["usage"] = {"prompt_tokens": 3, "completion_tokens": made}
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        async def tokens() -> Any:
            self.made_at_start[name] = dict(self.made)
            self.started[name] = time.monotonic()
            try:
                for made in range(1, cap + 1):
                    await anyio.sleep(1 / self.rate)
                    self.generated += 1
                    self.made[name] = made
                    yield chunk(made, self.text, "length" if made == cap else None)
                self.ended[name] = time.monotonic()
                if options.get("include_usage"):
                    usage = {"prompt_tokens": 3, "completion_tokens": cap}
                    usage_event = json.dumps({"choices": [], "usage": usage}).encode()
                    yield b"data: " + usage_event + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if name not in self.ended:  # cut: it takes the engine a while to let go
                    with anyio.CancelScope(shield=True):
                        await anyio.sleep(self.let_go_seconds)
                self.gone[name] = time.monotonic()

        if body.get("stream"):
            return StreamingResponse(tokens(), media_type="text/event-stream")
        async for _ in tokens():
            pass
        answer = {"choices": [{"index": 0, "text": "x" * cap, "finish_reason": "length"}]}
        return JSONResponse({**answer, "usage": {"prompt_tokens": 3, "completion_tokens": cap}})

    def app(self) -> Any:
        return Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/metrics", self.metrics),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
