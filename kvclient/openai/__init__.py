"""kvclient under the official ``openai`` SDK: a one-line change for code that already uses it.

    from kvclient.openai import OpenAI          # instead of: from openai import OpenAI

Completions and chat requests are then counted locally, sent with an explicit ``max_tokens`` (or
``max_completion_tokens``, whichever the caller used) clamped to the context window, refused
locally when the prompt cannot fit, and retried by kvclient's policy (Retry-After, cooldown, send
window) with the SDK's own retries off. Everything else (models, embeddings, ...) passes through
untouched. For frameworks that take an ``http_client``, the same behaviour is an httpx transport:
``httpx.Client(transport=kvclient.openai.Transport(...))``.

Errors reach the caller in the SDK's classes: a local refusal is ``openai.BadRequestError``
(``code == "context_length_exceeded"``, ``body["prompt_tokens"]``, ``body["context_window"]``),
giving up on a busy server is ``openai.RateLimitError`` (``code == "server_busy"``,
``body["attempts"]``), a connection failure ``openai.APIConnectionError``.

``Transport`` and ``AsyncTransport`` need only httpx; ``OpenAI`` and ``AsyncOpenAI`` import the
``openai`` package (``pip install 'kvclient[openai]'``) when first used. ``import kvclient`` never
imports this module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._async_transport import AsyncTransport
from ._plan import LOCAL_HEADER
from ._sync_transport import Transport

if TYPE_CHECKING:
    from ._async_clients import AsyncOpenAI
    from ._sync_clients import OpenAI

__all__ = ["LOCAL_HEADER", "AsyncOpenAI", "AsyncTransport", "OpenAI", "Transport"]


def __getattr__(name: str) -> Any:
    if name in ("OpenAI", "AsyncOpenAI"):
        implementation = "._sync_clients" if name == "OpenAI" else "._async_clients"
        try:
            module = importlib.import_module(implementation, __name__)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"kvclient.openai.{name} needs the openai package: pip install 'kvclient[openai]'"
            ) from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
