"""The server half of the admission contract: one admission core, two backends.

- :mod:`reference_server.admission`: the reservation ledger, the FIFO queue, the journal (pure).
- :mod:`reference_server.http`: what both apps serve with: errors, request reading, the 429 and
  RateLimit answers, middleware, the one generation endpoint, uvicorn.
- :mod:`reference_server.simulated`: ``kvclient serve``, over a simulated engine whose KV pool
  really overflows.
- :mod:`reference_server.gateway`: ``kvclient gateway``, the same ledger in front of real
  engines (vLLM, llama.cpp, TGI, SGLang).
- :mod:`reference_server.testing`: servers in a background thread, for tests and benchmarks.

Run the reference server embedded (a real uvicorn server on a free loopback port)::

    from reference_server import running_server

    with running_server(kv_tokens=8192, admission="reserve") as server:
        print(server.base_url, server.metrics()["kv_reserved_tokens"])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admission.ledger import Handle, KVAdmissionController, LedgerStats, Strategy
    from .simulated.app import ServerState, create_app
    from .simulated.config import ServerConfig
    from .simulated.engine import (
        EngineFaultError,
        EngineOOMError,
        EngineStats,
        Generated,
        SimulatedEngine,
    )
    from .testing import RunningServer, running_server, serve_in_thread

#: Public name -> the module that defines it. Loaded on first use, so that importing the gateway
#: does not load the simulated engine (nor the engine the gateway).
_WHERE = {
    "Handle": ".admission.ledger",
    "KVAdmissionController": ".admission.ledger",
    "LedgerStats": ".admission.ledger",
    "Strategy": ".admission.ledger",
    "ServerState": ".simulated.app",
    "create_app": ".simulated.app",
    "ServerConfig": ".simulated.config",
    "EngineFaultError": ".simulated.engine",
    "EngineOOMError": ".simulated.engine",
    "EngineStats": ".simulated.engine",
    "Generated": ".simulated.engine",
    "SimulatedEngine": ".simulated.engine",
    "RunningServer": ".testing",
    "running_server": ".testing",
    "serve_in_thread": ".testing",
}

__all__ = [
    "EngineFaultError",
    "EngineOOMError",
    "EngineStats",
    "Generated",
    "Handle",
    "KVAdmissionController",
    "LedgerStats",
    "RunningServer",
    "ServerConfig",
    "ServerState",
    "SimulatedEngine",
    "Strategy",
    "create_app",
    "running_server",
    "serve_in_thread",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where, __name__), name)
