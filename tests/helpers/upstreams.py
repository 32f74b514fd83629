"""Scripted upstreams for the gateway's tests: small Starlette apps that answer discovery like an
engine (a window, a KV budget, ``/tokenize``) and whatever generation routes a test gives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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
