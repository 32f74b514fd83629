"""An OpenAI-compatible server that answers at once: what the benchmarks measure clients against.

No model, no ledger: a canned one-token completion (or a three-event stream: one token, the
final event, ``[DONE]``; with ``--token-streams`` a stream has ``max_tokens`` token events, sent
``--event-gap`` seconds apart), so that the time a request takes is the client's and the HTTP
stack's. Run alone or started by the bench scripts:

    python bench/instant_server.py --port 8001 [--cpu 1] [--token-streams] [--event-gap S]
        [--delay S]

It is also the "bare Starlette/uvicorn endpoint" the reference server's throughput is compared
with in ``bench/ledger_server.py``, and the upstream behind ``kvclient gateway`` and nginx in
``bench/gateway_overhead.py``, so it speaks enough of vLLM's dialect for the gateway to discover
it: ``max_model_len`` in ``/v1/models``, ``kv_physical_capacity_tokens`` in ``/metrics`` (the
reference server's budget line), and ``POST /tokenize`` in vLLM's shape (``{"prompt"}`` or
``{"messages"}`` -> ``{"count"}``; the count is whitespace-separated words plus 4 per message, a
cheap stand-in: only its cost and shape matter here). A prompt of exactly ``instant:500`` is
answered 500 and ``instant:429`` 429 with ``Retry-After: 7``; ``/metrics`` counts generation
requests by status (``instant_answers_total``), so a bench can see whether a proxy retried, and
its own CPU time (``process_cpu_seconds_total``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CONTEXT = 8192
#: The budget ``/metrics`` reports: large enough that a gateway in front never refuses.
KV_TOKENS = 10_000_000
MAX_EVENTS = 100_000
RETRY_AFTER = "7"
ANSWERS: Counter[int] = Counter()
#: ``--token-streams`` (streams of ``max_tokens`` events) and ``--event-gap`` (seconds between
#: them; 0 sends them back to back).
TOKEN_STREAMS = [False]
EVENT_GAP = [0.0]
#: ``--delay``: seconds a generation request waits before it is answered (an engine's time).
DELAY = [0.0]
COMPLETION = {
    "id": "cmpl-instant",
    "object": "text_completion",
    "created": 0,
    "model": "instant",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
CHAT = {
    "id": "chatcmpl-instant",
    "object": "chat.completion",
    "created": 0,
    "model": "instant",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
MODELS = {
    "object": "list",
    "data": [{"id": "instant", "object": "model", "owned_by": "bench", "max_model_len": CONTEXT}],
}


def _stream(chat: bool, events: int) -> StreamingResponse:
    gap = EVENT_GAP[0]

    async def body():  # type: ignore[no-untyped-def]
        if chat:
            delta = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
        else:
            delta = {"choices": [{"index": 0, "text": " ok", "finish_reason": None}]}
        event = f"data: {json.dumps(delta)}\n\n"
        for i in range(events):
            if gap and i:
                await anyio.sleep(gap)
            yield event
        done = {"choices": [{"index": 0, "finish_reason": "length", "text": "", "delta": {}}]}
        yield f"data: {json.dumps(done)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _scripted(body: dict) -> Response | None:  # type: ignore[type-arg]
    """The scripted failures: ``instant:500`` and ``instant:429`` (with Retry-After)."""
    if body.get("prompt") == "instant:500":
        error = {"message": "scripted engine failure", "type": "InternalServerError", "code": 500}
        return JSONResponse({"error": error}, status_code=500)
    if body.get("prompt") == "instant:429":
        error = {"message": "scripted: too busy", "type": "rate_limit", "code": 429}
        return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": RETRY_AFTER})
    return None


def _events(body: dict) -> int:  # type: ignore[type-arg]
    cap = body.get("max_tokens")
    if not TOKEN_STREAMS[0]:
        return 1
    return min(cap, MAX_EVENTS) if isinstance(cap, int) and cap > 0 else 1


async def _generate(request: Request, chat: bool) -> Response:
    body = await request.json()
    if DELAY[0]:
        await anyio.sleep(DELAY[0])
    response = _scripted(body)
    if response is None:
        if body.get("stream"):
            response = _stream(chat, _events(body))
        else:
            response = JSONResponse(CHAT if chat else COMPLETION)
    ANSWERS[response.status_code] += 1
    return response


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat(request: Request) -> Response:
    return await _generate(request, chat=True)


async def tokenize(request: Request) -> Response:
    body = await request.json()
    if isinstance(body.get("messages"), list):
        count = sum(4 + len(str(m.get("content", "")).split()) for m in body["messages"])
    else:
        count = len(str(body.get("prompt", "")).split())
    return JSONResponse({"count": count, "max_model_len": CONTEXT, "tokens": [0] * count})


async def metrics(request: Request) -> Response:
    times = os.times()
    lines = [
        f"kv_physical_capacity_tokens {KV_TOKENS}",
        f"process_cpu_seconds_total {times.user + times.system}",
    ]
    lines += [f'instant_answers_total{{status="{k}"}} {v}' for k, v in sorted(ANSWERS.items())]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def models(request: Request) -> Response:
    return JSONResponse(MODELS)


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/metrics", metrics),
        ]
    )


app = create_app()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cpu", type=int, help="pin to this CPU")
    parser.add_argument(
        "--token-streams", action="store_true", help="streams of max_tokens events (default 1)"
    )
    parser.add_argument("--event-gap", type=float, default=0.0, help="seconds between events")
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds before a generation is answered"
    )
    args = parser.parse_args()
    TOKEN_STREAMS[0] = args.token_streams
    EVENT_GAP[0] = args.event_gap
    DELAY[0] = args.delay
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    # h11 + asyncio whether or not httptools / uvloop are installed (the gateway's extras): the
    # baseline the README's figures were measured on.
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, http="h11", loop="asyncio", log_level="error",
        access_log=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
