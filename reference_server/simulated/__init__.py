"""``kvclient serve``: the simulated engine (real tokens at a set rate over a KV pool that can
really overflow), its backend and app, its settings and its command line."""

from .app import ServerState, SimulatedBackend, create_app
from .config import ServerConfig
from .engine import EngineFaultError, EngineOOMError, EngineStats, Generated, SimulatedEngine

__all__ = [
    "EngineFaultError",
    "EngineOOMError",
    "EngineStats",
    "Generated",
    "ServerConfig",
    "ServerState",
    "SimulatedBackend",
    "SimulatedEngine",
    "create_app",
]
