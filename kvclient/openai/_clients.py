"""The openai SDK's clients with kvclient's transport installed and their own retries off.

The checks both share are here; ``AsyncOpenAI`` is in ``_async_clients.py`` and ``OpenAI`` is
generated from it (``scripts/unasync.py``).
"""

from __future__ import annotations

from typing import Any

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


# The clients, importable from here as before.
from ._async_clients import AsyncOpenAI  # noqa: E402
from ._sync_clients import OpenAI  # noqa: E402
