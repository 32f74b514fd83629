"""The clients of ``retry_storm.py``, one run each against a server already started: the naive
client, the ``openai`` SDK (alone and through ``kvclient.openai``) and kvclient's rows, with the
attempts counted client-side and the server's metrics sampled; and the summary of a run."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
from _common import MetricsSampler, mean

from kvclient import AsyncClient, RetryPolicy
from kvclient.loadgen import (
    NaiveSender,
    RecordTimer,
    RequestRecord,
    Sender,
    WorkItem,
    percentile,
    run_load,
)
from kvclient.loadgen._kvsender import KVClientSender

#: The servers' model and context window (``retry_storm.py`` starts them with this window).
CONTEXT = 8192
MODEL = "kvclient-sim"


class OpenAISender:
    """Sends a work item through the official SDK, bounded by the deadline."""

    def __init__(self, client: Any, *, deadline: float) -> None:
        self._client = client
        self._deadline = deadline

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        import openai

        r = timer.record
        timer.mark_sent()
        params: dict[str, Any] = {"model": MODEL, "prompt": item.prompt}
        if item.max_tokens is not None:
            params["max_tokens"] = item.max_tokens
        with anyio.move_on_after(self._deadline) as scope:
            try:
                completion = await self._client.completions.create(**params)
            except openai.RateLimitError:
                r.error = "http_429"
            except openai.APIStatusError as exc:
                r.error = f"http_{exc.status_code}"
            except openai.APIError as exc:
                r.error = type(exc).__name__
            else:
                r.ok = True
                r.output_tokens = completion.usage.completion_tokens if completion.usage else 0
        if scope.cancelled_caught:
            r.error = "deadline"
        timer.mark_end()


def limits() -> httpx.Limits:
    return httpx.Limits(max_connections=None, max_keepalive_connections=1024)


class CountingTransport(httpx.AsyncBaseTransport):
    """Calls ``hook`` with every request it sends on (the event hook of the other rows)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, hook: Any) -> None:
        self._inner = inner
        self._hook = hook

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self._hook(request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def run_client(
    name: str,
    url: str,
    items: list[WorkItem],
    offsets: list[float] | None,
    deadline: float,
    *,
    concurrency: int | None = None,
    discover: bool = False,
) -> dict[str, Any]:
    """One client's run; ``discover``: kvclient is given neither model nor window (it reads
    ``/v1/models`` before its first request)."""
    sampler = MetricsSampler(url, interval=0.05)
    sent_by_hook = 0

    async def count(request: httpx.Request) -> None:
        nonlocal sent_by_hook
        if request.url.path.endswith("/completions"):
            sent_by_hook += 1

    http = httpx.AsyncClient(limits=limits(), timeout=deadline, event_hooks={"request": [count]})
    sender: Sender
    owned: Any = None  # a client that owns its connections, closed at the end
    if name == "kvclient.openai":
        from kvclient.openai import AsyncOpenAI

        owned = AsyncOpenAI(
            base_url=url + "/v1",
            api_key="x",
            timeout=deadline,
            context_window=CONTEXT,
            retry=RetryPolicy(deadline=deadline),
            # Counted below kvclient: every attempt, as the server sees them.
            transport=CountingTransport(httpx.AsyncHTTPTransport(limits=limits()), count),
        )
        sender = OpenAISender(owned, deadline=deadline)
    elif name == "naive":
        http.base_url = httpx.URL(url)
        sender = NaiveSender(http, max_attempts=50, deadline=deadline)
    elif name.startswith("openai"):
        import openai

        retries = 2 if name == "openai" else int(name.rsplit("=", 1)[1])
        sdk = openai.AsyncOpenAI(
            base_url=url + "/v1",
            api_key="x",
            http_client=http,
            max_retries=retries,
            timeout=deadline,
        )
        sender = OpenAISender(sdk, deadline=deadline)
    else:
        given = not discover or name.endswith("no discovery")
        client = AsyncClient(
            base_url=url,
            model=MODEL if given else None,
            context_window=CONTEXT if given else None,
            http_client=http,
            retry=RetryPolicy(
                deadline=deadline,
                cooldown_by_size=name.endswith("by_size"),
                pace=not name.endswith("pace=False"),
                pace_in_order=name.endswith("pace_in_order"),
            ),
        )
        sender = KVClientSender(client, stream=False)
    async with http, anyio.create_task_group() as tg:
        tg.start_soon(sampler.run)
        start = anyio.current_time()
        records, wall = await run_load(
            items, sender, offsets=offsets, concurrency=concurrency, grace=deadline + 5
        )
        end = anyio.current_time()
        await anyio.sleep(0.1)
        sampler.stop = True
        tg.cancel_scope.cancel()
    if owned is not None:
        await owned.close()
    return summarize_run(name, records, wall, sampler, (start, end), deadline, sent_by_hook)


def summarize_run(
    name: str,
    records: list[RequestRecord],
    wall: float,
    sampler: MetricsSampler,
    span: tuple[float, float],
    deadline: float,
    sent_by_hook: int,
) -> dict[str, Any]:
    final = sampler.last()
    during = sampler.between(*span)
    completed = [r for r in records if r.ok]
    in_time = [r for r in completed if r.latency is not None and r.latency <= deadline]
    latencies = [r.latency for r in completed if r.latency is not None]
    admitted = final.get("kv_admitted_total", 0)
    rejected = final.get("kv_rejected_total", 0)
    attempts = admitted + rejected
    causes: dict[str, int] = {}
    for r in records:
        if not r.ok:
            causes[r.error or "unknown"] = causes.get(r.error or "unknown", 0) + 1
    return {
        "client": name,
        "requests": len(records),
        "completed": len(completed),
        "completed_within_deadline": len(in_time),
        "share_within_deadline": len(in_time) / len(records) if records else 0.0,
        "failed_by_cause": causes,
        "attempts_server": attempts,
        "attempts_client": sent_by_hook,
        "attempts_per_completed": attempts / len(completed) if completed else None,
        "http_429_server": rejected,
        "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "utilisation_reserved_over_usable": mean(
            [m["kv_reserved_tokens"] / m["kv_usable_tokens"] for m in during]
        ),
        "physical_utilisation": mean(
            [m["kv_used_tokens"] / m["kv_physical_capacity_tokens"] for m in during]
        ),
        "oom_events": final.get("kv_oom_events_total", 0),
        "completed_per_second": len(completed) / wall if wall else 0.0,
        "wall_seconds": wall,
        "metric_samples": len(during),
    }
