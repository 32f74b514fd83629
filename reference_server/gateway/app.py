"""``kvclient gateway``'s app: the reservation ledger in front of real engines.

The same admission core as the reference server (the ledger, the FIFO queue, the Retry-After
estimate, the error shapes, the one generation endpoint) over upstream engines instead of the
simulated one: :class:`~reference_server.gateway.relay.UpstreamBackend`. Upstream budgets and
windows are discovered through :mod:`kvclient.engines` (vLLM, llama.cpp, TGI, SGLang), or
given with ``kv_tokens``, on the first request (and again for an upstream that failed to answer).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..http.answers import room
from ..http.errors import APIError
from ..http.generation import GenerationEndpoint
from ..http.middleware import build_app
from ..http.requests import ClientGone, read_body
from .config import GatewayConfig
from .metrics import registry_for
from .relay import UpstreamBackend, unavailable
from .state import GatewayState
from .tenancy import TenantMiddleware
from .tenants import TenantResolver
from .upstream import UPSTREAM_ERRORS, Known, Upstream, parse_json

__all__ = ["create_gateway_app"]

logger = logging.getLogger("kvclient.gateway")

_MAX_LISTING_BYTES = 4 * 1024 * 1024


# --- small endpoints ---------------------------------------------------------------------------


def _gateway(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def _first_upstream(state: GatewayState) -> tuple[list[Known], Upstream]:
    """The upstreams known, and the first of them (which answers what is not generation)."""
    known = await state.admission()
    if not known:
        raise unavailable("no upstream is in service")
    return known, known[0].upstream


def _room(known: Sequence[Known]) -> dict[str, str]:
    """The RateLimit headers of the upstream in service with the most room now: where the next
    request would most likely go. A client reads them at discovery and paces its first sends."""
    now = time.monotonic()
    serving = [k for k in known if k.upstream.health.in_service(now)] or list(known)

    def free(k: Known) -> int:
        return k.ledger.headroom(k.queue.now(), queued=k.queue.waiting_tokens).free

    roomiest = max(serving, key=free)
    return room(roomiest.ledger, roomiest.queue)


async def _models(request: Request) -> Response:
    """The first upstream's model list, each entry with the gateway's ``max_model_len``, and
    the room left (RateLimit headers, as on every admission answer)."""
    state = _gateway(request)
    try:
        known, upstream = await _first_upstream(state)
    except APIError as error:
        return error.response()
    try:
        _, _, listed = await upstream.fetch("GET", "/v1/models")
    except UPSTREAM_ERRORS:
        listed = None
    payload = parse_json(listed) if listed is not None else None
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or not data:
        model = state.model() or "upstream"
        data = [{"id": model, "object": "model", "owned_by": "kvclient-gateway"}]
    window = state.window(known)
    for entry in data:
        if isinstance(entry, dict):
            entry["max_model_len"] = window
    return JSONResponse({"object": "list", "data": data}, headers=_room(known))


async def _tokenize(request: Request) -> Response:
    """Passed to the first upstream as it is."""
    state = _gateway(request)
    try:
        _, upstream = await _first_upstream(state)
        body = await read_body(request.scope, request.receive, state.config.max_body_bytes)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    except APIError as error:
        return error.response()
    try:
        status, media, data = await upstream.fetch(
            "POST", "/tokenize", content=body, limit=state.config.max_answer_bytes
        )
    except UPSTREAM_ERRORS as exc:
        return unavailable(f"upstream {upstream.name}: {type(exc).__name__}").response()
    if data is None:
        return unavailable(f"upstream {upstream.name}: /tokenize answered too much").response()
    return Response(data, status_code=status, media_type=media or "application/json")


async def _health(request: Request) -> Response:
    state = _gateway(request)
    await state.admission()
    now = time.monotonic()
    upstreams = []
    for u in state.upstreams:
        stats = u.known.ledger.stats(now) if u.known is not None else None
        upstreams.append(
            {
                "url": u.name,
                "engine": u.engine,
                "in_service": stats is not None and u.health.in_service(now),
                "usable_tokens": stats.usable_tokens if stats else None,
                "reserved_tokens": stats.reserved_tokens if stats else None,
                "inflight": stats.inflight if stats else None,
                "admission": stats.rule if stats else None,
                "caps_reason": stats.caps_reason if stats else None,
                "committed_tokens": stats.committed_tokens if stats else None,
                "max_running": stats.max_concurrency if stats else None,
                "budget": u.pool_basis,
                "forecast": (
                    {
                        "quantile": stats.forecast_quantile,
                        "preemption_budget": stats.preemption_budget,
                        "preemptions_per_1000": stats.preemption_rate,
                        "off_because": stats.forecast_reason,
                    }
                    if stats
                    else None
                ),
                "start_clock": stats.start_clock if stats else None,
                "late_starts": stats.late_starts if stats else None,
                "slow_readers": stats.slow_readers if stats else None,
                "unknown_tokens": stats.unknown_tokens if stats else None,
                "figures_unread": u.watch.blind,
                "engine_figures": u.watch.figures(now),
                "problem": u.discovery_error,
            }
        )
    ok = any(entry["in_service"] for entry in upstreams)
    fairness = _fairness(state.config)
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "upstreams": upstreams, "fairness": fairness},
        status_code=200 if ok else 503,
    )


def _fairness(config: GatewayConfig) -> dict[str, Any]:
    """``/health``'s ``fairness``: whether it is on, how many tenants the file lists, and what
    a request's tenant is taken from (its listed key, then the trusted header)."""
    policy = config.fairness
    sources = []
    if config.tenant_keys is not None and config.tenant_keys.listed:
        sources.append("keys")
    if config.tenant_header:
        sources.append(f"header {config.tenant_header}")
    return {
        "enabled": policy is not None,
        "tenants": len(policy.tenants) if policy is not None else 0,
        "tenant_from": ", then ".join(sources) if policy is not None and sources else None,
    }


async def _metrics(request: Request) -> Response:
    state = _gateway(request)
    await state.admission()  # a gateway scraped before its first request shows its upstreams
    if state.shared is not None:
        await state.shared.refresh()  # the shared totals, as Redis has them now
    registry = request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def create_gateway_app(config: GatewayConfig) -> Starlette:
    """The gateway as an ASGI app; ``app.state.gateway`` is its :class:`GatewayState`."""
    state = GatewayState(config)
    completions = UpstreamBackend(state, "/v1/completions")
    chat = UpstreamBackend(state, "/v1/chat/completions")
    routes = [
        Route("/v1/completions", GenerationEndpoint("completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", GenerationEndpoint("chat", chat), methods=["POST"]),
        Route("/tokenize", _tokenize, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The upstream clients are opened in the serving loop on first use; closed before it ends.
        # With a shared ledger, the lease is renewed in the background while the app serves.
        try:
            async with anyio.create_task_group() as group:
                if state.shared is not None:
                    group.start_soon(state.shared.run)
                for upstream in state.upstreams:
                    # Two tasks: a scrape that hangs must not keep the figures from going stale.
                    group.start_soon(upstream.watch.scrape)
                    group.start_soon(upstream.watch.lockstep)
                yield
                group.cancel_scope.cancel()
        finally:
            await state.aclose()

    if config.fairness is None:
        app = build_app(routes, api_key=config.api_key, lifespan=lifespan)
    else:  # the tenants' keys and --api-key are checked together, by tenant
        app = build_app(routes, api_key=None, lifespan=lifespan)
        resolver = TenantResolver(
            config.fairness,
            config.tenant_keys,
            api_key=config.api_key,
            header=config.tenant_header,
        )
        app.add_middleware(TenantMiddleware, resolver=resolver)
    app.state.gateway = state
    app.state.registry = registry_for(state)  # its own: several gateways live in one process
    return app
