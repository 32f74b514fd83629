"""``AsyncTransport``: kvclient between an OpenAI-style async client and the server (I/O only).

The source of ``_sync_transport.py`` (``Transport``): ``python scripts/unasync.py`` writes that
file from this one, and ``--check`` fails when they differ; edit this one. What both do without
I/O is ``_base_transport._Shared``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx

from .._async_client import AsyncClient
from .._exceptions import APIConnectionError, KVClientError
from .._models import RetryEvent
from .._policy import RetryPolicy
from .._tokens import TokenCounter
from ._base_transport import _UNKNOWN_BASE_URL, DEFAULT_LIMITS, _parse, _Shared
from ._plan import generation_kind

__all__ = ["AsyncTransport"]


class AsyncTransport(_Shared, httpx.AsyncBaseTransport):
    """An async httpx transport (asyncio and trio) giving an OpenAI-style client kvclient's
    behaviour.

    >>> http = httpx.AsyncClient(transport=AsyncTransport(context_window=8192))  # doctest: +SKIP
    >>> sdk = openai.AsyncOpenAI(base_url=url, http_client=http, max_retries=0)  # doctest: +SKIP

    ``inner`` is the transport that reaches the server (default: ``httpx.AsyncHTTPTransport``
    with the openai SDK's connection limits); the other options are
    :class:`kvclient.AsyncClient`'s. ``base_url`` may list several replicas: each request goes
    to one of them, and fails over, as :class:`kvclient.AsyncClient`'s do; without it, the base
    URL of the first generation request is the one server. ``priority`` goes with each
    completion and chat request as ``X-Priority``, unless the request has that header already
    (the SDK's ``extra_headers`` per call). Without ``context_window`` it is
    discovered once, from ``GET /v1/models``, for the first request's model. Keep the SDK's own
    retries off (``max_retries=0``): kvclient marks its answers ``x-should-retry: false``, but
    the SDK would still retry connection failures that kvclient already retried.
    """

    _kv: AsyncClient

    def __init__(
        self,
        *,
        inner: httpx.AsyncBaseTransport | None = None,
        base_url: str | Sequence[str] | None = None,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float = 0.0,
        on_retry: Callable[[RetryEvent], None] | None = None,
        priority: int | None = None,
    ) -> None:
        self._inner = (
            inner if inner is not None else httpx.AsyncHTTPTransport(limits=DEFAULT_LIMITS)
        )
        self._kv = AsyncClient(
            base_url=base_url or _UNKNOWN_BASE_URL,
            context_window=context_window,
            counter=counter,
            retry=retry,
            safety_margin=safety_margin,
            on_retry=on_retry,
            transport=self._inner,
            priority=priority,
        )
        self._setup(base_url)

    @property
    def client(self) -> AsyncClient:
        """The kvclient client every generation request goes through (its replicas, model,
        context window and retry policy)."""
        return self._kv

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        kind = generation_kind(request.method, request.url.path)
        body = _parse(await request.aread()) if kind is not None else None
        if kind is None or body is None:
            return await self._inner.handle_async_request(request)
        kv = self._kv
        if kv.context_window is None or not self._base_url_known:
            self._learn(request, kind, body)
        if kv.context_window is None:
            try:
                await kv.discover()
            except APIConnectionError as exc:
                return self._gave_up(exc)
            except KVClientError as exc:
                return self._discovery_failed(exc)
        plan = self._plan(kind, body)
        if plan is None:
            return await self._inner.handle_async_request(request)
        if isinstance(plan, httpx.Response):
            return plan
        call = kv.new_call(plan.size)
        try:
            response = await kv.send(call, self._builder(request, kind, plan), stream=True)
        except KVClientError as exc:
            return self._gave_up(exc)
        return self._admitted(response)

    async def aclose(self) -> None:
        await self._kv.aclose()  # closes the inner transport too
