"""``AsyncOpenAI``: the openai SDK's async client with kvclient's transport, its retries off.

The source of ``_sync_clients.py`` (``OpenAI``): ``python scripts/unasync.py`` writes that file
from this one, and ``--check`` fails when they differ; edit this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import httpx
import openai

from .._models import RetryEvent
from .._policy import RetryPolicy
from .._tokens import TokenCounter
from ._async_transport import AsyncTransport
from ._base_clients import _check_retries, _existing, _replicas, _sdk_base_url

__all__ = ["AsyncOpenAI"]


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose completions and chat requests go through kvclient
    (asyncio and trio).

    >>> client = AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")  # doctest: +SKIP
    >>> await client.chat.completions.create(model="m", messages=[...])  # doctest: +SKIP

    The SDK's constructor arguments, plus kvclient's: ``context_window`` (discovered from
    ``/v1/models`` when not given), ``counter``, ``retry``, ``safety_margin``, ``on_retry``, and
    ``transport``, the httpx transport that reaches the server. ``base_url`` may be a list of
    replicas, as :class:`kvclient.AsyncClient` takes it: requests are routed among them and fail
    over (the SDK itself is given the first). ``max_retries`` is 0: kvclient
    retries. A prompt that cannot fit raises the SDK's ``BadRequestError`` (code
    ``context_length_exceeded``) without a byte sent; giving up on a busy server raises its
    ``RateLimitError`` (code ``server_busy``). ``priority`` goes with each completion and chat
    request as ``X-Priority`` (lower served first); a call gives its own with the SDK's
    ``extra_headers={"X-Priority": "2"}``.
    """

    kvclient_transport: AsyncTransport

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | Sequence[str | httpx.URL] | None = None,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        max_retries: int = 0,
        priority: int | None = None,
        **kwargs: Any,
    ) -> None:
        _check_retries(max_retries)
        replicas = _replicas(base_url)
        transport_kv: AsyncTransport
        if http_client is None:
            transport_kv = AsyncTransport(
                inner=transport,
                base_url=replicas,
                context_window=context_window,
                counter=counter,
                retry=retry,
                safety_margin=safety_margin or 0.0,
                on_retry=on_retry,
                priority=priority,
            )
            http_client = httpx.AsyncClient(transport=transport_kv, follow_redirects=True)
        else:
            given = {
                "base_url (several)": replicas,
                "context_window": context_window,
                "counter": counter,
                "retry": retry,
                "safety_margin": safety_margin,
                "on_retry": on_retry,
                "transport": transport,
                "priority": priority,
            }
            transport_kv = _existing(http_client, AsyncTransport, given)
        self.kvclient_transport = transport_kv
        sdk_base_url: Any = base_url if replicas is None else _sdk_base_url(replicas[0])
        super().__init__(
            base_url=sdk_base_url, http_client=cast(Any, http_client), max_retries=0, **kwargs
        )
