"""Before a run: is the server there, does it take our key, does it serve the model, and how large
is its context window? Each failure is one line that says what to fix (I/O, bounded in time).

The context window and the model come from the client's own discovery (``AsyncClient``'s
``/v1/models`` dialects), run once with no retries, so a run never starts against a server it
cannot use and never spends minutes retrying one that is not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    return f"{url}: {error}"


def _listed(payload: Any) -> list[str]:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [str(e.get("id")) for e in data if isinstance(e, dict)]


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
    from .._client import AsyncClient
    from .._retry import RetryPolicy

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
                if client._needs_discovery():
                    await client._discover()
                else:
                    # Both given: discovery has nothing to learn, but the server must still be
                    # there, take the key and serve the model.
                    payload = await _models(client)
                    listed = _listed(payload)
                    if listed and model not in listed:
                        raise PreflightError(
                            f"model {model!r} is not served at {client.base_url} "
                            f"(it serves: {', '.join(listed)})"
                        )
    except TimeoutError:
        raise PreflightError(f"{url} did not answer within {limit:g} s") from None
    except KVClientError as exc:
        raise PreflightError(explain(exc, client.base_url)) from None
    assert client.context_window is not None
    return Served(model=client.model, context_window=client.context_window)


async def _models(client: Any) -> Any:
    call = client._new_call()

    async def attempt(call: Any) -> Any:
        request = client._models_request(client._http, call)
        return client._json(await client._send_request(request, stream=False))

    return await client._run(call, attempt)
