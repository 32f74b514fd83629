"""Context window and model discovery: the probe/answer driver protocol (pure).

:func:`discover_context` is a sans-I/O driver: it yields the requests to make (:class:`Probe`), is
sent each answer (:class:`Answer`) and returns a :class:`Discovery`; the sync client, the async
client, the contract suite and the gateway each drive it with their own I/O. The other drivers of
this package (:func:`kvclient.engines.tokenize.tokenize`,
:func:`kvclient.engines.budget.discover_budget`) speak the same protocol.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from ._answers import dig, positive

__all__ = [
    "CONTEXT_PROBES",
    "MODELS",
    "PROPS",
    "SGLANG_MODEL_INFO",
    "SGLANG_SERVER_INFO",
    "TGI_INFO",
    "Answer",
    "Discovery",
    "Probe",
    "discover_context",
    "models_entry",
    "window_from_models_entry",
    "window_from_ollama_show",
    "window_from_props",
    "window_from_sglang",
    "window_from_tgi_info",
]


@dataclass(frozen=True, slots=True)
class Probe:
    """One discovery request: ``method path`` with an optional JSON body."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    #: Which engines answer it, for messages.
    engines: str = ""

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True, slots=True)
class Answer:
    """What a probe got: the HTTP status and the decoded JSON body (None when it was not JSON)."""

    status: int
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Discovery:
    """What discovery found. ``context_window`` is None when no probe told it."""

    model: str | None
    context_window: int | None
    #: The engine whose dialect answered (``"vllm"``, ``"llama.cpp"``, ``"tgi"``, ...), if known.
    engine: str | None = None
    #: Where the window came from, e.g. ``"GET /v1/models data[].meta.n_ctx"``.
    source: str | None = None
    #: Every probe made and what it answered, for the error when nothing told the window.
    tried: tuple[str, ...] = ()
    #: A problem to report instead of guessing (a listed model mismatch, a bad number).
    problem: str | None = None
    #: Facts found on the way that the gateway uses (llama.cpp ``total_slots``, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def explain(self) -> str:
        """One line: what was tried, and what to do."""
        tried = "; ".join(self.tried) or "nothing"
        return f"no context window discovered (tried: {tried}); pass context_window="


MODELS = Probe("GET", "/v1/models", engines="vLLM, llama.cpp, SGLang, TGI, Ollama, ours")
PROPS = Probe("GET", "/props", engines="llama.cpp")
TGI_INFO = Probe("GET", "/info", engines="TGI")
SGLANG_MODEL_INFO = Probe("GET", "/get_model_info", engines="SGLang")
SGLANG_SERVER_INFO = Probe("GET", "/get_server_info", engines="SGLang")

#: The probes in the order :func:`discover_context` makes them (Ollama's ``POST /api/show`` comes
#: last, once a model name is known).
CONTEXT_PROBES = (MODELS, PROPS, TGI_INFO, SGLANG_MODEL_INFO, SGLANG_SERVER_INFO)


def models_entry(payload: Any, model: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """``(entry, problem)``: the ``/v1/models`` entry of ``model`` (else the first listed).

    llama.cpp lists its model by file path and accepts any name; its entry's ``aliases`` count
    as names too.
    """
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return None, "/v1/models is not an OpenAI model list"
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]
    if not entries:
        return None, "/v1/models lists no model"
    if model is None:
        return entries[0], None
    for entry in entries:
        aliases = entry.get("aliases")
        names = {entry["id"], *(aliases if isinstance(aliases, list) else ())}
        if model in names:
            return entry, None
    listed = ", ".join(str(e["id"]) for e in entries[:5])
    return None, f"model {model!r} is not served (it serves: {listed})"


def window_from_models_entry(entry: dict[str, Any]) -> tuple[int | None, str | None, str | None]:
    """``(window, engine, field)`` from a ``/v1/models`` entry: vLLM's (and ours)
    ``max_model_len``, llama.cpp's ``meta.n_ctx`` (the per-request window: ``-c`` over
    ``--parallel``)."""
    window = positive(entry.get("max_model_len"))
    if window is not None:
        return window, "vllm", "max_model_len"
    window = positive(dig(entry, "meta", "n_ctx"))
    if window is not None:
        return window, "llama.cpp", "meta.n_ctx"
    return None, None, None


def window_from_props(payload: Any) -> int | None:
    """llama.cpp ``GET /props``: ``default_generation_settings.n_ctx`` (per slot)."""
    return positive(dig(payload, "default_generation_settings", "n_ctx"))


def window_from_tgi_info(payload: Any) -> int | None:
    """TGI ``GET /info``: ``max_total_tokens`` (input + new tokens of one request)."""
    return positive(dig(payload, "max_total_tokens"))


def window_from_sglang(payload: Any) -> int | None:
    """SGLang ``GET /get_model_info`` / ``/get_server_info``: ``context_length``."""
    window = positive(dig(payload, "context_length"))
    if window is None:
        window = positive(dig(payload, "server_args", "context_length"))
    return window


def window_from_ollama_show(payload: Any) -> int | None:
    """Ollama ``POST /api/show``: ``model_info["<architecture>.context_length"]``."""
    info = dig(payload, "model_info")
    if not isinstance(info, dict):
        return None
    arch = info.get("general.architecture")
    if isinstance(arch, str):
        window = positive(info.get(f"{arch}.context_length"))
        if window is not None:
            return window
    for key, value in info.items():
        if isinstance(key, str) and key.endswith(".context_length"):
            return positive(value)
    return None


def _model_from(payload: Any, *keys: str) -> str | None:
    for key in keys:
        value = dig(payload, key)
        if isinstance(value, str) and value:
            return value
    return None


def discover_context(
    model: str | None, *, need_window: bool = True
) -> Generator[Probe, Answer, Discovery]:
    """Find the model and its per-request context window, in this order:

    1. ``GET /v1/models``: ``max_model_len`` (vLLM, ours) or ``meta.n_ctx`` (llama.cpp);
    2. ``GET /props``: ``default_generation_settings.n_ctx`` (llama.cpp);
    3. ``GET /info``: ``max_total_tokens`` (TGI);
    4. ``GET /get_model_info``, then ``GET /get_server_info``: ``context_length`` (SGLang);
    5. ``POST /api/show`` with the model: ``model_info.<arch>.context_length`` (Ollama).

    Drive it: ``probe = next(gen)``, then ``probe = gen.send(answer)`` until ``StopIteration``
    carries the :class:`Discovery`. A probe answered with anything but 200 (404 on another
    engine) moves on; the caller decides what to raise for 401/403 or an unreachable server.
    With ``need_window=False`` it stops once the model is known.
    """
    tried: list[str] = []
    extra: dict[str, Any] = {}

    def done(window: int, engine: str, source: str) -> Discovery:
        return Discovery(model, window, engine, source, tuple(tried), None, extra)

    answer = yield MODELS
    tried.append(f"{MODELS} -> {answer.status}")
    if answer.status == 200:
        entry, problem = models_entry(answer.payload, model)
        if entry is None:
            return Discovery(model, None, None, None, tuple(tried), problem, extra)
        if model is None:
            model = entry["id"]
        window, engine, name = window_from_models_entry(entry)
        reported = entry.get("max_model_len")
        if window is None and reported is not None:
            problem = f"/v1/models max_model_len {reported!r} is not a positive integer"
            return Discovery(model, None, None, None, tuple(tried), problem, extra)
        if window is not None and engine is not None:
            return done(window, engine, f"{MODELS} data[].{name}")
        tried[-1] += " (no max_model_len or meta.n_ctx)"
        if not need_window:
            return Discovery(model, None, None, None, tuple(tried), None, extra)

    answer = yield PROPS
    tried.append(f"{PROPS} -> {answer.status}")
    if answer.status == 200:
        slots = positive(dig(answer.payload, "total_slots"))
        if slots is not None:
            extra["total_slots"] = slots
        window = window_from_props(answer.payload)
        if window is not None:
            return done(window, "llama.cpp", f"{PROPS} default_generation_settings.n_ctx")

    answer = yield TGI_INFO
    tried.append(f"{TGI_INFO} -> {answer.status}")
    if answer.status == 200:
        window = window_from_tgi_info(answer.payload)
        if model is None:
            model = _model_from(answer.payload, "model_id")
        if window is not None:
            return done(window, "tgi", f"{TGI_INFO} max_total_tokens")

    for probe in (SGLANG_MODEL_INFO, SGLANG_SERVER_INFO):
        answer = yield probe
        tried.append(f"{probe} -> {answer.status}")
        if answer.status == 200:
            if model is None:
                model = _model_from(answer.payload, "model_path", "served_model_name")
            window = window_from_sglang(answer.payload)
            if window is not None:
                return done(window, "sglang", f"{probe} context_length")

    if model is not None:
        show = Probe("POST", "/api/show", {"model": model}, engines="Ollama")
        answer = yield show
        tried.append(f"{show} -> {answer.status}")
        if answer.status == 200:
            window = window_from_ollama_show(answer.payload)
            if window is not None:
                return done(window, "ollama", f"{show} model_info.*.context_length")
    return Discovery(model, None, None, None, tuple(tried), None, extra)
