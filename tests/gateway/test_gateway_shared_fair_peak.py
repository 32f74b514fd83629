"""Fair shares across two gateways on one real Redis (``--ledger`` with ``--tenants``) under the
peak rule, in front of the reference server admitting on prompts (it OOMs when overrun): more run
at once than whole caps allow, the engine never overflows, and tenants weighted 3:1, both
saturating, get 3:1 of the KV token-seconds their requests hold in the engine.

Each tenant's clients are dealt to both gateways in turn (one order across them, whichever
decides); outputs run to caps drawn at random (so that holders end apart, not in waves), in
chunks of 20 tokens. What a tenant got is read from the engine's own counts in every chunk, as
``bench/tenant_fairness.py`` reads it. The load is bounded in time (12 s) and in clients."""

from __future__ import annotations

import json
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from reference_server import RunningServer, running_server
from reference_server.admission.fairness import FairPolicy, Tenant
from reference_server.gateway import GatewayConfig
from reference_server.shared_ledger.fair import SharedFairQueue
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_fairness import TENANT
from tests.gateway.test_gateway_shared import shared_reserved
from tests.gateway.test_gateway_shared_peak import most_shared
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import wait_for

pytestmark = pytest.mark.redis

RATE = 400.0
#: 4,096 KV tokens (a pool in blocks: all of it usable), each request a 1-token prompt and a cap
#: of 200 to 400 run to its end: 8 to 19 fit on whole caps.
ENGINE = {
    "kv_tokens": 4096, "context_window": 1024, "decode_rate": RATE, "tick_seconds": 0.05,
    "mean_output_tokens": 1e6, "admission": "prompt", "max_running": 64,
}  # fmt: skip
POLICY = FairPolicy(tenants={"a": Tenant(weight=3.0), "b": Tenant(weight=1.0)})
#: Clients per tenant: more than the engine runs at once, so that both stay backlogged.
CLIENTS = 24
SECONDS = 12.0


@dataclass
class _Got:
    """What one tenant's requests got: KV token-seconds held in the engine (prompt and tokens
    so far, between chunks, up to the end of the run), and their answers' statuses."""

    token_seconds: float = 0.0
    statuses: list[int] = field(default_factory=list)


async def _one(http: httpx.AsyncClient, tenant: str, cap: int, end: float, got: _Got) -> None:
    body = {
        "prompt": "hi", "max_tokens": cap, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    held, since = 0, None
    async with http.stream("POST", "/v1/completions", json=body, headers={TENANT: tenant}) as r:
        got.statuses.append(r.status_code)
        async for line in r.aiter_lines():
            usage = json.loads(line[6:]).get("usage") if line.startswith("data: {") else None
            if not usage:
                continue
            now = time.monotonic()
            if since is not None:
                got.token_seconds += held * max(0.0, min(now, end) - since)
            held, since = usage["prompt_tokens"] + usage["completion_tokens"], now


async def _saturate(gateways: list[RunningServer]) -> dict[str, _Got]:
    """Both tenants, each keeping ``CLIENTS`` streamed requests in flight through the gateways
    in turn, for ``SECONDS``."""
    rng = random.Random(7)
    end = time.monotonic() + SECONDS
    got = {"a": _Got(), "b": _Got()}

    async def keep(http: httpx.AsyncClient, tenant: str) -> None:
        while time.monotonic() < end:
            await _one(http, tenant, rng.randint(200, 400), end, got[tenant])

    limits = httpx.Limits(max_connections=2 * CLIENTS)
    clients = [httpx.AsyncClient(base_url=g.base_url, timeout=60, limits=limits) for g in gateways]
    try:
        async with anyio.create_task_group() as group:
            for tenant in ("a", "b"):
                for i in range(CLIENTS):
                    group.start_soon(keep, clients[i % len(clients)], tenant)
    finally:
        for client in clients:
            await client.aclose()
    return got


@pytest.mark.slow
def test_two_gateways_with_tenants_run_past_whole_caps_and_keep_3_to_1_by_the_peak(
    redis_server: RedisServer,
) -> None:
    with running_server(**ENGINE) as upstream, ExitStack() as stack:
        gateways = []
        for _ in range(2):
            config = GatewayConfig(
                upstreams=(upstream.base_url,), decode_rate=RATE, max_queue_wait=60.0,
                fairness=POLICY, tenant_header=TENANT, ledger=redis_server.url,
            )  # fmt: skip
            gateway = stack.enter_context(running_gateway(config))
            httpx.get(gateway.base_url + "/v1/models", timeout=10)  # discover
            gateways.append(gateway)
        known = [g.app.state.gateway.known[0] for g in gateways]
        assert all(isinstance(k.queue, SharedFairQueue) for k in known)
        usable = known[0].ledger.usable_tokens
        with most_shared(redis_server.url, upstream.base_url, reserved=True) as most:
            got = anyio.run(_saturate, gateways)
        healths = [httpx.get(g.base_url + "/health").json()["upstreams"][0] for g in gateways]
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0), 30)
        metrics = upstream.metrics()
    assert [(h["admission"], h["caps_reason"]) for h in healths] == [("peak", None)] * 2
    assert all(s == 200 for g in got.values() for s in g.statuses)
    assert metrics["kv_oom_events_total"] == 0
    assert most[0] > usable  # more at once than their whole caps allow
    # The weights, not the arrivals, decide: as many clients each would get 1:1 in a FIFO, and
    # a tenant held back by its own limit under the peak got 1.3-1.6. The 10 % goal is the
    # bench's, over 60 s (bench/tenant_fairness.py); over 12 s in one interpreter beside the
    # rest of the suite this ran at 2.58 where alone it ran at 2.81-2.99.
    ratio = got["a"].token_seconds / got["b"].token_seconds
    assert ratio == pytest.approx(3.0, rel=0.25), (got["a"], got["b"])
