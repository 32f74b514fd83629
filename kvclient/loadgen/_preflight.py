"""Before a run: is the server there, does it take our key, does it serve the model, and how large
is its context window? Each failure is one line that says what to fix (I/O, bounded in time).

The context window and the model come from the client's own discovery
(``AsyncClient.discover``), run once with no retries, so a run never starts against a server it
cannot use and never spends minutes retrying one that is not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import httpx

from .._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    KVClientError,
)

__all__ = ["PREFLIGHT_TIMEOUT", "PreflightError", "Served", "preflight"]

#: The whole preflight's time limit, in seconds (each failure exits well within 5 s).
PREFLIGHT_TIMEOUT = 4.0
_AUTH_HINT = "pass --api-key or set KVCLIENT_API_KEY / OPENAI_API_KEY"


class PreflightError(Exception):
    """The server cannot be benchmarked as asked; ``str()`` is the one line to print."""


@dataclass(frozen=True, slots=True)
class Served:
    """What the preflight learnt: the model to send and its context window."""

    model: str | None
    context_window: int


def explain(error: KVClientError, url: str) -> str:
    """One line for a failed preflight request (pure)."""
    if isinstance(error, APITimeoutError):
        return f"{url} did not answer within {PREFLIGHT_TIMEOUT:g} s: {error}"
    if isinstance(error, APIConnectionError):
        return f"cannot reach {url} (is the server running, and is the URL right?): {error}"
    if isinstance(error, APIStatusError):
        if error.status_code in (401, 403):
            return f"{url} refused the credentials ({error.status_code}): {_AUTH_HINT}: {error}"
        if error.status_code == 404:
            return (
                f"{url}/v1/models answered 404: give the server's base URL "
                f"(http://host:port, with or without /v1): {error}"
            )
        return f"{url}/v1/models answered {error.status_code}: {error}"
    # The client's hints name its arguments; here they are the command's flags.
    text = str(error).replace("context_window=", "--context-window").replace("model=", "--model")
    if "/v1/models -> 404" in text:
        # Every engine answers GET /v1/models: a 404 there means a path on the URL, not the server.
        return (
            f"GET {url}/v1/models answered 404: is {url} the server's base URL "
            f"(http://host:port, with or without /v1)? {text}"
        )
    return text if text.startswith(url) else f"{url}: {text}"


async def preflight(
    *,
    url: str,
    model: str | None,
    api_key: str | None,
    context_window: int | None,
    transport: httpx.AsyncBaseTransport | None = None,
    limit: float = PREFLIGHT_TIMEOUT,
) -> Served:
    """Check the server once, with no retries; raise :class:`PreflightError` with the reason."""
    from .._async_client import AsyncClient
    from .._policy import RetryPolicy

    policy = RetryPolicy(max_attempts=1, deadline=limit, window=False)
    client = AsyncClient(
        base_url=url,
        model=model,
        api_key=api_key,
        context_window=context_window,
        retry=policy,
        timeout=httpx.Timeout(limit),
        transport=transport,
    )
    try:
        with anyio.fail_after(limit + 0.5):
            async with client:
                # With model and window both given there is nothing to discover, but the
                # server must still answer, take the key and serve the model.
                await client.discover(verify=True)
    except TimeoutError:
        raise PreflightError(f"{url} did not answer within {limit:g} s") from None
    except KVClientError as exc:
        raise PreflightError(explain(exc, client.base_url)) from None
    assert client.context_window is not None
    return Served(model=client.model, context_window=client.context_window)
