"""The reference server: an OpenAI-compatible server that keeps the KV admission contract.

It admits each request against its worst case (prompt + output cap, in whole KV blocks), holds that
reservation for the request's whole life, and when the budget is short answers 429 with a
Retry-After measured from when in-flight reservations are due to be released. A simulated engine
generates real tokens at a set rate over a physical KV pool that can overflow, so the admission
strategies (``reserve``, ``prompt``, ``concurrency``) can be compared by measurement.

Run it embedded (a real uvicorn server on a free loopback port, in a background thread)::

    from reference_server import running_server

    with running_server(kv_tokens=8192, admission="reserve") as server:
        print(server.base_url, server.metrics()["kv_reserved_tokens"])
"""

from ._runner import RunningServer, running_server, serve_in_thread
from .app import ServerState, create_app
from .config import ServerConfig
from .engine import Completion, EngineFaultError, EngineOOMError, EngineStats, SimulatedEngine
from .ledger import Handle, KVAdmissionController, LedgerStats, Strategy

__all__ = [
    "Completion",
    "EngineFaultError",
    "EngineOOMError",
    "EngineStats",
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
