"""The openai SDK's clients with kvclient's transport installed and their own retries off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import httpx
import openai

from .._models import RetryEvent
from .._retry import RetryPolicy
from .._tokens import TokenCounter
from ._transport import AsyncTransport, Transport

__all__ = ["AsyncOpenAI", "OpenAI"]

_RETRIES = (
    "kvclient does the retrying (cooldown, send window, Retry-After): the SDK's max_retries "
    "must stay 0 so that the two never multiply; use retry=kvclient.RetryPolicy(...) instead"
)


def _check_retries(max_retries: int) -> None:
    if max_retries != 0:
        raise ValueError(f"{_RETRIES}, got max_retries={max_retries!r}")


def _existing(http_client: Any, transport_type: type, given: dict[str, Any]) -> Any:
    """An ``http_client`` is accepted only when it already sends through kvclient: the SDK's
    ``copy()`` / ``with_options()`` pass the original client's on."""
    # httpx keeps the transport given to it in ``_transport``.
    if not isinstance(getattr(http_client, "_transport", None), transport_type):
        raise TypeError(
            "http_client must send through kvclient: httpx.Client(transport="
            "kvclient.openai.Transport(...)); or pass transport= (the inner transport) instead"
        )
    options = sorted(name for name, value in given.items() if value is not None)
    if options:
        raise TypeError(
            f"{', '.join(options)}: these belong to the http_client's kvclient transport; "
            "pass them there, or pass no http_client"
        )
    return http_client


class OpenAI(openai.OpenAI):
    """``openai.OpenAI`` whose completions and chat requests go through kvclient.

    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")  # doctest: +SKIP
    >>> client.chat.completions.create(model="m", messages=[...])  # doctest: +SKIP

    The SDK's constructor arguments, plus kvclient's: ``context_window`` (discovered from
    ``/v1/models`` when not given), ``counter``, ``retry``, ``safety_margin``, ``on_retry``, and
    ``transport``, the httpx transport that reaches the server. ``max_retries`` is 0: kvclient
    retries. A prompt that cannot fit raises the SDK's ``BadRequestError`` (code
    ``context_length_exceeded``) without a byte sent; giving up on a busy server raises its
    ``RateLimitError`` (code ``server_busy``).
    """

    kvclient_transport: Transport

    def __init__(
        self,
        *,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        max_retries: int = 0,
        **kwargs: Any,
    ) -> None:
        _check_retries(max_retries)
        if http_client is None:
            http_client = httpx.Client(
                transport=Transport(
                    inner=transport,
                    context_window=context_window,
                    counter=counter,
                    retry=retry,
                    safety_margin=safety_margin or 0.0,
                    on_retry=on_retry,
                ),
                follow_redirects=True,
            )
        else:
            given = {
                "context_window": context_window,
                "counter": counter,
                "retry": retry,
                "safety_margin": safety_margin,
                "on_retry": on_retry,
                "transport": transport,
            }
            http_client = _existing(http_client, Transport, given)
        self.kvclient_transport = http_client._transport  # type: ignore[assignment]
        super().__init__(http_client=cast(Any, http_client), max_retries=0, **kwargs)


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose completions and chat requests go through kvclient (asyncio
    and trio); the options are :class:`OpenAI`'s, ``transport`` an ``httpx.AsyncBaseTransport``.
    """

    kvclient_transport: AsyncTransport

    def __init__(
        self,
        *,
        context_window: int | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        safety_margin: float | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        max_retries: int = 0,
        **kwargs: Any,
    ) -> None:
        _check_retries(max_retries)
        if http_client is None:
            http_client = httpx.AsyncClient(
                transport=AsyncTransport(
                    inner=transport,
                    context_window=context_window,
                    counter=counter,
                    retry=retry,
                    safety_margin=safety_margin or 0.0,
                    on_retry=on_retry,
                ),
                follow_redirects=True,
            )
        else:
            given = {
                "context_window": context_window,
                "counter": counter,
                "retry": retry,
                "safety_margin": safety_margin,
                "on_retry": on_retry,
                "transport": transport,
            }
            http_client = _existing(http_client, AsyncTransport, given)
        self.kvclient_transport = http_client._transport  # type: ignore[assignment]
        super().__init__(http_client=cast(Any, http_client), max_retries=0, **kwargs)
