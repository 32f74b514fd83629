"""The openai SDK's clients with kvclient's transport installed and their own retries off.

The checks both share are here; ``AsyncOpenAI`` is in ``_async_clients.py`` and ``OpenAI`` is
generated from it (``scripts/unasync.py``). This module imports neither: they import it.
"""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T")

_RETRIES = (
    "kvclient does the retrying (cooldown, send window, Retry-After): the SDK's max_retries "
    "must stay 0 so that the two never multiply; use retry=kvclient.RetryPolicy(...) instead"
)


def _check_retries(max_retries: int) -> None:
    if max_retries != 0:
        raise ValueError(f"{_RETRIES}, got max_retries={max_retries!r}")


def _replicas(base_url: Any) -> list[str] | None:
    """The replicas when ``base_url`` is a list or tuple, else None: the SDK takes a single
    base URL (a str or its own URL type) as it is, and kvclient learns it from the first
    request."""
    if isinstance(base_url, (list, tuple)):
        return [str(url) for url in base_url]
    return None


def _sdk_base_url(url: str) -> str:
    """The base URL the SDK builds its requests on: the first replica's, with ``/v1``."""
    text = url.rstrip("/")
    return text if text.endswith("/v1") else f"{text}/v1"


def _existing(http_client: Any, transport_type: type[_T], given: dict[str, Any]) -> _T:
    """The kvclient transport of an ``http_client`` that already sends through kvclient (the
    SDK's ``copy()`` / ``with_options()`` pass the original client's on); anything else is
    refused."""
    # httpx keeps the transport given to it there, and offers no public accessor.
    transport = getattr(http_client, "_transport", None)
    if not isinstance(transport, transport_type):
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
    return transport
