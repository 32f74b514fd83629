"""An OpenAI-compatible server that answers at once: what the benchmarks measure clients against.

No model, no ledger: a canned one-token completion (or a three-event stream), so that the time a
request takes is the client's and the HTTP stack's. Run alone or started by the bench scripts:

    python bench/instant_server.py --port 8001 [--cpu 1]

It is also the "bare Starlette/uvicorn endpoint" the reference server's throughput is compared
with in ``bench/ledger_server.py``.
"""

from __future__ import annotations

import argparse
import json
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CONTEXT = 8192
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


def _stream(chat: bool) -> StreamingResponse:
    async def events():  # type: ignore[no-untyped-def]
        if chat:
            delta = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
        else:
            delta = {"choices": [{"index": 0, "text": " ok", "finish_reason": None}]}
        yield f"data: {json.dumps(delta)}\n\n"
        done = {"choices": [{"index": 0, "finish_reason": "length", "text": "", "delta": {}}]}
        yield f"data: {json.dumps(done)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def completions(request: Request) -> Response:
    body = await request.json()
    if body.get("stream"):
        return _stream(chat=False)
    return JSONResponse(COMPLETION)


async def chat(request: Request) -> Response:
    body = await request.json()
    if body.get("stream"):
        return _stream(chat=True)
    return JSONResponse(CHAT)


async def models(request: Request) -> Response:
    return JSONResponse(MODELS)


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )


app = create_app()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cpu", type=int, help="pin to this CPU")
    args = parser.parse_args()
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="error", access_log=False)


if __name__ == "__main__":
    main()
