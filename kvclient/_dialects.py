"""What each engine says and means: one home for every fact about a server's dialect.

Pure functions over status codes, parsed JSON and text; no I/O. The client, the contract suite and
the gateway do the requests and hand the answers here. Engines: vLLM, llama.cpp (``llama-server``),
TGI, SGLang, Ollama, and our reference server (which speaks vLLM's dialect).

- **Error answers.** Each server words the same two situations differently. "The prompt does not
  fit the context": our reference server's 413, OpenAI's and vLLM's 400 "maximum context length",
  TGI's 422 "`inputs` tokens + `max_new_tokens` must be <= N", llama.cpp's 400
  ``exceed_context_size_error``, vLLM's 400 "prompt contains at least N input tokens" (N a lower
  bound) and, for a prompt of exactly the window, "max_tokens must be at least 1, got 0". "Full
  now, come back later": 429 (TGI says "Model is overloaded") and 503 (vLLM, SGLang, Ollama's
  "server busy", llama.cpp's "Loading model").
  :func:`classify_error` maps status + body to one exception class, whether a retry can help, and
  the numbers the body carries.
- **Context-window discovery.** :func:`discover_context` is a sans-I/O driver: it yields the
  requests to make (:class:`Probe`), is sent each answer (:class:`Answer`) and returns a
  :class:`Discovery`; the sync client, the async client and the contract suite each drive it with
  their own I/O.
- ``/tokenize`` shapes and KV budget discovery: below.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ._exceptions import (
    APIStatusError,
    AuthenticationError,
    BadGatewayError,
    BadRequestError,
    GatewayTimeoutError,
    InsufficientQuotaError,
    InternalServerError,
    KVClientError,
    NotFoundError,
    PermissionDeniedError,
    PromptTooLongError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)

__all__ = [
    "CONTEXT_PROBES",
    "LENGTH_FIELDS",
    "METRICS",
    "MIN_LENGTH_FIELDS",
    "PROGRESS_ENGINES",
    "PROMPT_SHARING_ENGINES",
    "RENDER_FIELDS",
    "RETRYABLE_STATUSES",
    "SEQUENCE_FIELDS",
    "STATUS_ERRORS",
    "TOKENIZE_ENGINES",
    "UNPRICED_FIELDS",
    "Answer",
    "Budget",
    "DecodeCounters",
    "Discovery",
    "ErrorClass",
    "ErrorDetails",
    "KVLosses",
    "Lockstep",
    "Probe",
    "Spend",
    "SpendError",
    "Tokenized",
    "classify_error",
    "count_by_tokenize",
    "countable_render_fields",
    "decode_counters",
    "discover_budget",
    "discover_context",
    "is_kv_exhaustion",
    "kv_losses_from_metrics",
    "lockstep_from_metrics",
    "parse_error_body",
    "preemptions_from_vllm_metrics",
    "prefix_caching_from_vllm_metrics",
    "prometheus_samples",
    "request_spend",
    "run_to_cap_fields",
    "runs_on_after_reset",
    "tokenize",
]

# --- error answers ----------------------------------------------------------------------------

#: The one status -> exception class table; anything else 4xx is APIStatusError, 5xx
#: InternalServerError.
STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    500: InternalServerError,
    502: BadGatewayError,
    503: ServiceUnavailableError,
    504: GatewayTimeoutError,
}

#: Answers a retry can fix: the server is full or a proxy could not reach it, now.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})

_MAX_MESSAGE = 1000

_CONTEXT_CODES = frozenset(
    {"context_length_exceeded", "exceed_context_size_error", "prompt_too_long"}
)
_CONTEXT_PATTERNS = (
    re.compile(r"maximum context length", re.I),  # OpenAI, vLLM, SGLang
    re.compile(r"`inputs` tokens \+ `max_new_tokens` must be", re.I),  # TGI
    re.compile(r"`inputs` must have less than \d+ tokens", re.I),  # TGI
    re.compile(r"exceeds the available context size", re.I),  # llama.cpp
    re.compile(r"context length exceeded|exceeds? the context window", re.I),
    re.compile(r"is longer than the model's context length", re.I),  # SGLang
    # vLLM >= 0.32, a prompt of exactly the window sent without max_tokens: the room left, 0, is
    # its default cap. (It says the same to a request that asks for 0 itself; kvclient never does.)
    re.compile(r"max_tokens must be at least 1, got 0\b", re.I),
)
_QUOTA = "insufficient_quota"

# Numbers in the messages: (pattern, group for the context window, group for prompt tokens).
_NUMBER_PATTERNS: tuple[tuple[re.Pattern[str], int | None, int | None], ...] = (
    # vLLM / OpenAI: "maximum context length is 8192 tokens. However, you requested 9000 tokens
    # (8000 in the messages, 1000 in the completion)"
    (re.compile(r"maximum context length is (\d+) tokens", re.I), 1, None),
    # vLLM >= 0.32 stops tokenizing one token past the window: "However, your prompt contains at
    # least 2049 input tokens" is a lower bound (_LOWER_BOUND below).
    (re.compile(r"contains at least (\d+) input tokens", re.I), None, 1),
    (re.compile(r"\((\d+) in the (?:messages|prompt)", re.I), None, 1),
    # vLLM >= 0.6: "However, your request has 9000 input tokens"; "your messages resulted in N"
    (re.compile(r"request has (\d+) input tokens", re.I), None, 1),
    (re.compile(r"(?:messages|prompt) resulted in (\d+) tokens", re.I), None, 1),
    (re.compile(r"prompt (?:has|contains|is|of) (\d+) tokens", re.I), None, 1),
    (re.compile(r"context window (?:is |of )(\d+) tokens", re.I), 1, None),
    # TGI: "must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`"
    (re.compile(r"must be <= (\d+)\. Given: (\d+) `inputs` tokens", re.I), 1, None),
    (re.compile(r"Given: (\d+) `inputs` tokens", re.I), None, 1),
    # TGI: "`inputs` must have less than 4096 tokens. Given: 5000"
    (re.compile(r"`inputs` must have less than (\d+) tokens\. Given: (\d+)", re.I), 1, None),
    (re.compile(r"`inputs` must have less than \d+ tokens\. Given: (\d+)", re.I), None, 1),
    # llama.cpp: "request (9412 tokens) exceeds the available context size (8192 tokens)"
    (re.compile(r"request \((\d+) tokens\) exceeds", re.I), None, 1),
    (re.compile(r"available context size \((\d+) tokens\)", re.I), 1, None),
    # SGLang: "The input (9000 tokens) is longer than the model's context length (8192 tokens)"
    (re.compile(r"input \((\d+) tokens\)", re.I), None, 1),
    (re.compile(r"context length \((\d+) tokens\)", re.I), 1, None),
)
#: A prompt count that is only a lower bound, when the number came from this pattern.
_LOWER_BOUND = _NUMBER_PATTERNS[1][0]


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What an error body says, whatever its server's shape."""

    message: str
    error_type: str | None = None
    code: str | None = None
    prompt_tokens: int | None = None
    context_window: int | None = None
    body: Any = None
    #: ``prompt_tokens`` is a lower bound ("at least N input tokens"), not the prompt's count.
    prompt_tokens_lower_bound: bool = False


@dataclass(frozen=True, slots=True)
class ErrorClass:
    """The verdict on an error answer."""

    exception: type[KVClientError]
    retryable: bool
    details: ErrorDetails


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def _code(value: Any, error_type: str | None) -> str | None:
    """The error's kind. llama.cpp (and vLLM >= 0.8) put the HTTP status in ``code`` as a number
    and the kind in ``type``: then the kind is the type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return error_type
    return _text(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_error_body(content: bytes | str) -> ErrorDetails:
    """The message, type, code and token numbers of an error body (any server's shape).

    Shapes: OpenAI ``{"error": {"message", "type", "code"}}`` (also vLLM >= 0.8, SGLang, our
    reference server, llama.cpp with its ``n_prompt_tokens``/``n_ctx``); vLLM's older flat
    ``{"object": "error", "message", "type", "code"}``; TGI's and Ollama's
    ``{"error": "...", "error_type": "..."}``; FastAPI's ``{"detail": ...}``; plain text.
    """
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body: Any = json.loads(text) if text.strip() else None
    except ValueError:
        body = None
    message: str | None = None
    error_type = code = None
    prompt_tokens = context_window = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = _text(error.get("message"))
            error_type = _text(error.get("type"))
            code = _code(error.get("code"), error_type)
            prompt_tokens = _int(error.get("n_prompt_tokens"))
            context_window = _int(error.get("n_ctx"))
        elif isinstance(error, str):
            message = error
            error_type = _text(body.get("error_type"))
            code = _text(body.get("code"))
        elif "message" in body:
            message = _text(body.get("message"))
            error_type = _text(body.get("type"))
            code = _code(body.get("code"), error_type)
        elif "detail" in body:
            detail = body["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)[:_MAX_MESSAGE]
    if message is None:
        message = text.strip() or "(empty body)"
    message = message[:_MAX_MESSAGE]
    lower_bound = False
    for pattern, window_group, prompt_group in _NUMBER_PATTERNS:
        match = pattern.search(message)
        if match is None:
            continue
        if window_group is not None and context_window is None:
            context_window = int(match.group(window_group))
        if prompt_group is not None and prompt_tokens is None:
            prompt_tokens = int(match.group(prompt_group))
            lower_bound = pattern is _LOWER_BOUND
    return ErrorDetails(message, error_type, code, prompt_tokens, context_window, body, lower_bound)


def _is_context_error(status: int, details: ErrorDetails) -> bool:
    if status == 413:
        return True
    if status not in (400, 422):
        return False
    if details.code in _CONTEXT_CODES or details.error_type in _CONTEXT_CODES:
        return True
    return any(pattern.search(details.message) for pattern in _CONTEXT_PATTERNS)


def classify_error(status: int, content: bytes | str) -> ErrorClass:
    """Which exception an error answer becomes, and whether a retry can help."""
    details = parse_error_body(content)
    if _is_context_error(status, details):
        return ErrorClass(PromptTooLongError, False, details)
    if status == 429 and _QUOTA in (details.code, details.error_type):
        return ErrorClass(InsufficientQuotaError, False, details)
    exception: type[APIStatusError] = STATUS_ERRORS.get(
        status, InternalServerError if status >= 500 else APIStatusError
    )
    return ErrorClass(exception, status in RETRYABLE_STATUSES, details)


# --- context-window discovery -----------------------------------------------------------------


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


#: The most any engine's numbers are believed to be: a window or a KV pool of more tokens than
#: this, or KV blocks larger than ``_MAX_BLOCK``, are a broken or lying answer, not a setting.
_MAX_TOKENS = 1 << 40
_MAX_BLOCK = 1 << 16


def _positive(value: Any, most: int = _MAX_TOKENS) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        return None
    return value


def _whole_sample(value: float) -> int | None:
    """A Prometheus sample as a token count: finite, whole, within bounds; else None."""
    if not math.isfinite(value) or not value.is_integer():
        return None
    return _positive(int(value))


def _dig(payload: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(payload, dict):
            return None
        payload = payload.get(key)
    return payload


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
    window = _positive(entry.get("max_model_len"))
    if window is not None:
        return window, "vllm", "max_model_len"
    window = _positive(_dig(entry, "meta", "n_ctx"))
    if window is not None:
        return window, "llama.cpp", "meta.n_ctx"
    return None, None, None


def window_from_props(payload: Any) -> int | None:
    """llama.cpp ``GET /props``: ``default_generation_settings.n_ctx`` (per slot)."""
    return _positive(_dig(payload, "default_generation_settings", "n_ctx"))


def window_from_tgi_info(payload: Any) -> int | None:
    """TGI ``GET /info``: ``max_total_tokens`` (input + new tokens of one request)."""
    return _positive(_dig(payload, "max_total_tokens"))


def window_from_sglang(payload: Any) -> int | None:
    """SGLang ``GET /get_model_info`` / ``/get_server_info``: ``context_length``."""
    window = _positive(_dig(payload, "context_length"))
    if window is None:
        window = _positive(_dig(payload, "server_args", "context_length"))
    return window


def window_from_ollama_show(payload: Any) -> int | None:
    """Ollama ``POST /api/show``: ``model_info["<architecture>.context_length"]``."""
    info = _dig(payload, "model_info")
    if not isinstance(info, dict):
        return None
    arch = info.get("general.architecture")
    if isinstance(arch, str):
        window = _positive(info.get(f"{arch}.context_length"))
        if window is not None:
            return window
    for key, value in info.items():
        if isinstance(key, str) and key.endswith(".context_length"):
            return _positive(value)
    return None


def _model_from(payload: Any, *keys: str) -> str | None:
    for key in keys:
        value = _dig(payload, key)
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
        slots = _positive(_dig(answer.payload, "total_slots"))
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


# --- /tokenize ---------------------------------------------------------------------------------


#: Engines whose ``POST /tokenize`` counts what their generation endpoints count.
TOKENIZE_ENGINES = frozenset({"vllm", "llama.cpp", "tgi"})


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A server's own tokenization of a prompt: its count, and its token ids when it gave them
    (each a whole number, as many as the count; None otherwise)."""

    count: int
    ids: tuple[int, ...] | None = None


def _token_list(payload: Any, key: str | None, count: int | None = None) -> Tokenized | None:
    tokens = payload.get(key) if key is not None and isinstance(payload, dict) else payload
    if not isinstance(tokens, list):
        return None if count is None else Tokenized(count)
    if count is not None and count != len(tokens):
        return Tokenized(count)
    whole = all(type(t) is int and t >= 0 for t in tokens)
    return Tokenized(len(tokens), tuple(tokens) if whole else None)


def count_by_tokenize(
    engine: str | None,
    *,
    prompt: str | None = None,
    messages: list[Any] | None = None,
    model: str | None = None,
    tools: list[Any] | None = None,
    render: Mapping[str, Any] | None = None,
) -> Generator[Probe, Answer, int | None]:
    """The server's own count of a prompt or a chat request (its template applied), or None
    when its ``/tokenize`` cannot say: :func:`tokenize`'s count."""
    found = yield from tokenize(
        engine, prompt=prompt, messages=messages, model=model, tools=tools, render=render
    )
    return None if found is None else found.count


def tokenize(
    engine: str | None,
    *,
    prompt: str | None = None,
    messages: list[Any] | None = None,
    model: str | None = None,
    tools: list[Any] | None = None,
    render: Mapping[str, Any] | None = None,
) -> Generator[Probe, Answer, Tokenized | None]:
    """The server's own tokenization of a prompt or a chat request (its template applied), or
    None when its ``/tokenize`` cannot say. A driver like :func:`discover_context`.

    ``render``: the chat request's own fields that change the rendered prompt
    (:data:`RENDER_FIELDS`, see :func:`countable_render_fields`), sent with its messages.

    - vLLM (and our reference server): ``POST /tokenize`` ``{"prompt"}`` or ``{"messages",
      "add_generation_prompt": true}`` -> ``count``;
    - llama.cpp: a chat is rendered by ``POST /apply-template`` (without the BOS, which
      tokenizing adds), then ``POST /tokenize`` ``{"content", "add_special": true}`` ->
      ``tokens``, as its chat endpoint counts;
    - TGI: ``POST /tokenize`` ``{"inputs"}`` -> a list of tokens (prompts only).

    A chat's ``tools`` go with its messages (vLLM's ``/tokenize`` and llama.cpp's
    ``/apply-template`` take them), so a template that lays them out counts them.
    """
    if engine == "vllm":
        body: dict[str, Any] = (
            {"messages": messages, "add_generation_prompt": True}
            if messages is not None
            else {"prompt": prompt}
        )
        if messages is not None and tools is not None:
            body["tools"] = tools
        if messages is not None and render:
            body.update(render)
        if model is not None:
            body["model"] = model
        answer = yield Probe("POST", "/tokenize", body, engines="vLLM, ours")
        if answer.status != 200 or not isinstance(answer.payload, dict):
            return None
        count = answer.payload.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return _token_list(answer.payload, "tokens", count)
        return _token_list(answer.payload, "tokens")
    if engine == "llama.cpp":
        text = prompt
        if messages is not None:
            template_body: dict[str, Any] = {"messages": messages}
            if tools is not None:
                template_body["tools"] = tools
            if render:
                template_body.update(render)
            answer = yield Probe("POST", "/apply-template", template_body, "llama.cpp")
            rendered = _dig(answer.payload, "prompt") if answer.status == 200 else None
            if not isinstance(rendered, str):
                return None
            text = rendered
        body = {"content": text, "add_special": True}
        answer = yield Probe("POST", "/tokenize", body, engines="llama.cpp")
        return _token_list(answer.payload, "tokens") if answer.status == 200 else None
    if engine == "tgi" and prompt is not None:
        answer = yield Probe("POST", "/tokenize", {"inputs": prompt}, engines="TGI")
        return _token_list(answer.payload, None) if answer.status == 200 else None
    return None


# --- what a request spends: its output length and its sequences --------------------------------

#: Fields that set how many tokens a sequence may generate, in any engine's dialect: OpenAI's
#: ``max_tokens`` and ``max_completion_tokens`` (vLLM, SGLang, TGI, llama.cpp), llama.cpp's
#: ``n_predict`` (it wins over ``max_tokens`` there; ``-1`` or ``0``: until the context is full)
#: and TGI's ``max_new_tokens``. An engine obeys one of them; which one differs, so all are set.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens")
#: Fields that set how many tokens a sequence must generate at least (vLLM's and SGLang's
#: ``min_tokens``): above the output cap the engine refuses the request (400), so a cap lowered
#: to what can be reserved lowers them too.
MIN_LENGTH_FIELDS = ("min_tokens",)
#: Fields whose non-positive value means "no limit" rather than an error.
UNLIMITED_WHEN_NOT_POSITIVE = frozenset({"n_predict"})
#: Fields that set how many sequences one request generates: ``n`` (OpenAI, vLLM, llama.cpp),
#: llama.cpp's alias ``n_cmpl``, vLLM's ``best_of`` (it generates that many, returns ``n``).
SEQUENCE_FIELDS = ("n", "n_cmpl", "best_of")
#: Engines whose sequences of one request share the prompt's KV blocks (vLLM and SGLang fork
#: them); elsewhere (llama.cpp runs each in a slot of its own) each holds its own prompt.
PROMPT_SHARING_ENGINES = frozenset({"vllm", "sglang"})
#: Fields that spend KV in ways the reservation cannot price: beam search holds a changing set
#: of beams whose count the request does not bound.
UNPRICED_FIELDS = ("use_beam_search", "beam_width")
#: A chat request's own fields that change the prompt its engine renders.
RENDER_FIELDS = (
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
)
#: The render fields each engine's own count (``/tokenize``, ``/apply-template``) takes as its
#: chat endpoint does, so that counting them is exact. vLLM's ``/tokenize`` has no
#: ``documents``.
_COUNTED_RENDER_FIELDS: dict[str, frozenset[str]] = {
    "vllm": frozenset(RENDER_FIELDS) - {"documents"},
    "llama.cpp": frozenset(RENDER_FIELDS),
}


#: Fields that make each engine generate up to the cap instead of stopping at its end-of-sequence
#: token: vLLM's and SGLang's ``ignore_eos`` and ``min_tokens``, llama.cpp's ``ignore_eos`` (its
#: length field ``n_predict`` follows ``max_tokens`` when unset). TGI's and Ollama's HTTP APIs
#: have none (TGI's ``ignore_eos_token`` is internal to its shards).
_RUN_TO_CAP_FIELDS: dict[str, tuple[str, ...]] = {
    "vllm": ("ignore_eos", "min_tokens"),
    "sglang": ("ignore_eos", "min_tokens"),
    "llama.cpp": ("ignore_eos",),
    "tgi": (),
    "ollama": (),
}


def run_to_cap_fields(engine: str | None, cap: int) -> dict[str, Any]:
    """Body fields that make ``engine`` generate all of ``cap`` tokens, however early its model
    would stop: for load that must really fill a KV cache. An engine not known here gets vLLM's
    (the dialect our servers speak too); other engines ignore fields they do not know.

    >>> run_to_cap_fields("vllm", 64)
    {'ignore_eos': True, 'min_tokens': 64}
    """
    names = _RUN_TO_CAP_FIELDS.get(engine or "vllm", _RUN_TO_CAP_FIELDS["vllm"])
    values: dict[str, Any] = {"ignore_eos": True, "min_tokens": cap}
    return {name: values[name] for name in names}


#: Engines that go on generating a request whose connection was reset, as measured: llama.cpp
#: stops a stream at its next token, but runs a plain (non-streamed) request to its end.
_RUNS_ON_AFTER_RESET: dict[str, frozenset[bool]] = {"llama.cpp": frozenset({False})}


def runs_on_after_reset(engine: str | None, *, stream: bool) -> bool:
    """Whether ``engine`` keeps generating a request (streamed or not) after its connection is
    reset: then the KV it holds is freed only when it finishes."""
    return stream in _RUNS_ON_AFTER_RESET.get(engine or "", frozenset())


@dataclass(frozen=True, slots=True)
class Spend:
    """What a request may make an engine hold: each sequence's output cap (None: unset, so up
    to the context window) and how many sequences."""

    max_tokens: int | None
    sequences: int = 1


class SpendError(ValueError):
    """A field that sets what a request spends is malformed, or cannot be priced."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


_JSON_TYPES = {bool: "a boolean", str: "a string", float: "a fraction", list: "an array"}


def _whole(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e3 is an integer in JSON's eyes
    if isinstance(value, bool) or not isinstance(value, int):
        kind = _JSON_TYPES.get(type(value), "an object")
        raise SpendError(f"{name} must be an integer, got {kind}", name)
    return value


def request_spend(body: Mapping[str, Any]) -> Spend:
    """The largest output any of the request's length fields allows, and its number of
    sequences, in every engine's dialect at once (an engine obeys one of them: the reservation
    covers whichever). Raises :class:`SpendError` naming the field."""
    for name in UNPRICED_FIELDS:
        value = body.get(name)
        off = value is None or value is False or (type(value) is int and value <= 1)
        if not off:
            raise SpendError(f"{name} cannot be priced by a KV reservation", name)
    caps: list[int] = []
    unlimited = False
    for name in LENGTH_FIELDS:
        value = _whole(body, name)
        if value is None:
            continue
        if value < 1:
            if name not in UNLIMITED_WHEN_NOT_POSITIVE:
                raise SpendError(f"{name} must be at least 1, got {value}", name)
            unlimited = True
        else:
            caps.append(value)
    sequences = 1
    for name in SEQUENCE_FIELDS:
        value = _whole(body, name)
        if value is None:
            continue
        if value < 1:
            raise SpendError(f"{name} must be at least 1, got {value}", name)
        sequences = max(sequences, value)
    return Spend(max_tokens=None if unlimited or not caps else max(caps), sequences=sequences)


def countable_render_fields(engine: str | None, present: Iterable[str]) -> str | None:
    """The first of the ``present`` render fields that ``engine``'s own count cannot take (it
    would count a prompt other than the one generated), or None when it takes them all."""
    taken = _COUNTED_RENDER_FIELDS.get(engine or "", frozenset())
    return next((name for name in present if name not in taken), None)


# --- KV budget ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    """An engine's KV pool as the gateway reserves against it."""

    #: Tokens of KV cache the engine has (before any safety fraction).
    kv_tokens: int | None
    #: The engine's KV block size in tokens (vLLM's paged blocks; 1 where it has none).
    block_size: int = 1
    #: Requests it can run at once (llama.cpp's slots), when bounded.
    max_concurrency: int | None = None
    engine: str | None = None
    source: str | None = None
    tried: tuple[str, ...] = ()
    #: Whether it shares the KV blocks of identical prompt prefixes among running requests
    #: (vLLM's ``enable_prefix_caching``, ours); None when it does not say.
    prefix_caching: bool | None = None


METRICS = Probe("GET", "/metrics", engines="vLLM, TGI, llama.cpp (--metrics), ours")

_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in Prometheus text: ``[(labels, value), ...]``."""
    samples = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            end = rest.find("}")
            if end < 0:
                continue
            labels = dict(_LABELS.findall(rest[1:end]))
            rest = rest[end + 1 :]
        elif rest[:1] not in (" ", "\t"):
            continue  # another metric whose name starts the same
        fields = rest.split()
        if not fields:
            continue
        try:
            samples.append((labels, float(fields[0])))
        except ValueError:
            continue
    return samples


def budget_from_vllm_metrics(text: str) -> tuple[int, int] | None:
    """vLLM ``/metrics``: ``vllm:cache_config_info`` labels ``num_gpu_blocks`` x ``block_size``
    -> ``(kv tokens, block size)``."""
    for labels, _ in prometheus_samples(text, "vllm:cache_config_info"):
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if _positive(size, _MAX_BLOCK) and _positive(blocks) and _positive(blocks * size):
            return blocks * size, size
    return None


def prefix_caching_from_vllm_metrics(text: str) -> bool | None:
    """vLLM ``/metrics``: ``vllm:cache_config_info``'s ``enable_prefix_caching`` label (``True``
    or ``False``); None when absent."""
    for labels, _ in prometheus_samples(text, "vllm:cache_config_info"):
        value = labels.get("enable_prefix_caching")
        if value in ("True", "False"):
            return value == "True"
    return None


def preemptions_from_vllm_metrics(text: str) -> float | None:
    """vLLM ``/metrics``: ``vllm:num_preemptions_total`` over all its engines, None when absent.

    A preemption evicts a running request's KV cache to recompute it later: the engine admitted
    more than its KV cache holds (no crash, but latency, and the over-admission the ledger
    exists to prevent)."""
    values = [
        value
        for _, value in prometheus_samples(text, "vllm:num_preemptions_total")
        if math.isfinite(value) and value >= 0
    ]
    return sum(values) if values else None


@dataclass(frozen=True, slots=True)
class DecodeCounters:
    """How far an engine's decoding has gone, from one ``/metrics`` scrape: two scrapes and how
    many sequences ran in between give its speed (see ``reference_server.gateway.speed``)."""

    #: Tokens generated so far by all its sequences (a counter).
    generated: float
    #: Decode steps so far (a counter), when the engine exports them.
    steps: float | None = None


#: Engines' generated-token counters, updated at every decode step. (TGI counts generated
#: tokens only when a request ends, in a histogram: too late for a speed.)
_GENERATED_COUNTERS = (
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
    "kv_generated_tokens_total",  # ours
)


def _metric_sum(text: str, name: str) -> float | None:
    """The sum of a metric's samples over its label sets (several engines, say); None when it
    has none, or a sample is negative, infinite or not a number."""
    values = [value for _, value in prometheus_samples(text, name)]
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return sum(values)


def decode_counters(text: str) -> DecodeCounters | None:
    """An engine's decode counters from its ``/metrics`` text, None when it exports none.

    vLLM, SGLang and our reference server count generated tokens at every step. llama.cpp
    (``--metrics``) counts ``llama_decode()`` calls and exports the average busy slots per call
    since start: their product is the slot-steps so far, one token each (prompt batches
    included, so a little more than it generated).
    """
    for name in _GENERATED_COUNTERS:
        total = _metric_sum(text, name)
        if total is not None:
            return DecodeCounters(total)
    steps = _metric_sum(text, "llamacpp:n_decode_total")
    busy = _metric_sum(text, "llamacpp:n_busy_slots_per_decode")
    if steps is not None and busy is not None:
        return DecodeCounters(steps * busy, steps)
    return None


# --- running in lockstep: what the peak admission rule needs --------------------------------------

#: Engines whose streams report, in every chunk, how many tokens the request has generated so
#: far, when asked with ``stream_options: {"include_usage": true, "continuous_usage_stats":
#: true}``: vLLM's OpenAI server, and ours. The gateway's peak rule follows each holder's
#: progress from them; other engines' holders count at their whole caps.
PROGRESS_ENGINES = frozenset({"vllm", "kvclient"})


@dataclass(frozen=True, slots=True)
class Lockstep:
    """What an engine's ``/metrics`` says of whether it runs every admitted request at each
    step: requests waiting for a place in its batch now, and preemptions so far (a counter).
    None where it does not say."""

    waiting: float | None
    preemptions: float | None


def lockstep_from_metrics(text: str) -> Lockstep:
    """vLLM's ``vllm:num_requests_waiting`` and ``vllm:num_preemptions_total``; ours'
    ``kv_engine_requests_waiting``."""
    waiting = _metric_sum(text, "vllm:num_requests_waiting")
    if waiting is None:
        waiting = _metric_sum(text, "kv_engine_requests_waiting")
    return Lockstep(waiting=waiting, preemptions=preemptions_from_vllm_metrics(text))


# --- what an engine lost for lack of KV ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVLosses:
    """Requests an engine has preempted, retracted or failed for lack of KV cache so far, as its
    ``/metrics`` counts them: ``total`` of the counter ``metric``, summed over its samples."""

    total: float
    engine: str
    #: The counter read, as the server names it: ``"vllm:num_preemptions_total"``.
    metric: str
    #: What it counts, for messages: ``"preemptions"``, ``"requests lost to KV OOM"``, ...
    kind: str
    #: What that did to the requests, for messages.
    meaning: str = ""

    def since(self, before: KVLosses | None) -> KVLosses | None:
        """The losses since ``before``, the same counter read earlier (``total`` the difference);
        None when ``before`` is unknown or another counter. A restarted engine counts from 0
        again: never negative."""
        if before is None or before.metric != self.metric:
            return None
        return replace(self, total=max(0.0, self.total - before.total))


@dataclass(frozen=True, slots=True)
class _LossCounter:
    metric: str
    engine: str
    kind: str
    meaning: str
    #: Only samples whose label has one of these values count (None: every sample).
    only: tuple[str, frozenset[str]] | None = None
    #: A metric prefix that shows this engine is talking even before the counter exists (counters
    #: with labels, or in Rust's ``metrics``, appear at their first increment): then 0.
    speaks: str | None = None


#: Where each engine counts what it lost for lack of KV, first match wins. llama.cpp has no such
#: counter: its ``/metrics`` (``llamacpp:*``) counts tokens and decode calls only; with a unified
#: KV cache a full pool fails the live requests ("Context size has been exceeded", an error
#: event or a 500) without counting them. Ollama has no ``/metrics``.
_LOSS_COUNTERS = (
    # vLLM: a running request's KV blocks taken back when the pool runs out, to be recomputed.
    _LossCounter(
        "vllm:num_preemptions_total",
        "vllm",
        "preemptions",
        "admitted requests were evicted from the KV cache to be recomputed",
        speaks="vllm:",
    ),
    # SGLang's preemption is a retraction: the request goes back to the queue, its KV freed.
    _LossCounter(
        "sglang:num_retracted_requests_total",
        "sglang",
        "retractions",
        "admitted requests were sent back to the queue, their KV cache freed",
        speaks="sglang:",
    ),
    # TGI: a batch that fails in the shards (a CUDA OOM among others) fails every request in it;
    # "incomplete": a stream that ended without its last token.
    _LossCounter(
        "tgi_request_failure",
        "tgi",
        "failed generations",
        "admitted requests failed in the middle of generating",
        only=("err", frozenset({"generation", "incomplete"})),
        speaks="tgi_",
    ),
    # Ours: every in-flight request of a simulated KV OOM.
    _LossCounter(
        "kv_oom_failed_requests_total",
        "kvclient",
        "requests lost to KV OOM",
        "admitted requests died mid-decode when the KV pool overflowed",
    ),
)


def _speaks(text: str, prefix: str) -> bool:
    return any(line.startswith(prefix) for line in text.splitlines())


def kv_losses_from_metrics(text: str) -> KVLosses | None:
    """What the engine behind a ``/metrics`` text lost for lack of KV cache so far: vLLM's
    preemptions, SGLang's retractions, TGI's failed generations, our server's OOM-failed
    requests. None when the text shows no such counter (llama.cpp, a gateway, another server).

    >>> kv_losses_from_metrics('vllm:num_preemptions_total{engine="0"} 2.0').total
    2.0
    """
    for counter in _LOSS_COUNTERS:
        samples = prometheus_samples(text, counter.metric)
        if counter.only is not None:
            label, wanted = counter.only
            samples = [(labels, v) for labels, v in samples if labels.get(label) in wanted]
        counts = [v for _, v in samples if math.isfinite(v) and v >= 0]
        if counts or (counter.speaks is not None and _speaks(text, counter.speaks)):
            total = sum(counts, 0.0)
            return KVLosses(total, counter.engine, counter.metric, counter.kind, counter.meaning)
    return None


#: Error codes and messages that say a request died because the KV cache ran out: our server's
#: ``kv_cache_oom``, llama.cpp's unified cache overflowing mid-decode, a CUDA OOM relayed by TGI.
_KV_EXHAUSTION_CODES = frozenset({"kv_cache_oom"})
_KV_EXHAUSTION_MESSAGES = re.compile(r"out of memory|context size has been exceeded", re.I)


def is_kv_exhaustion(code: str | None, message: str | None) -> bool:
    """Whether an error (its code, its message) says the engine ran out of KV cache."""
    if code is not None and code in _KV_EXHAUSTION_CODES:
        return True
    return message is not None and _KV_EXHAUSTION_MESSAGES.search(message) is not None


def _metric_whole(text: str, name: str) -> int | None:
    """The first sample of ``name`` that is a whole number >= 0, or None."""
    for _, value in prometheus_samples(text, name):
        if (whole := _whole_sample(value)) is not None:
            return whole
    return None


def budget_from_reference_metrics(text: str) -> int | None:
    """Our reference server's ``/metrics``: ``kv_physical_capacity_tokens`` (its KV blocks are
    16 tokens)."""
    for _, value in prometheus_samples(text, "kv_physical_capacity_tokens"):
        if (tokens := _whole_sample(value)) is not None:
            return tokens
    return None


def budget_from_tgi_metrics(text: str) -> int | None:
    """TGI ``/metrics``: ``tgi_batch_max_total_tokens`` (its ``/info`` dropped the field)."""
    for _, value in prometheus_samples(text, "tgi_batch_max_total_tokens"):
        if (tokens := _whole_sample(value)) is not None:
            return tokens
    return None


def budget_from_llama_cpp_props(payload: Any) -> tuple[int, int] | None:
    """llama.cpp ``/props`` -> ``(kv tokens, slots)``.

    ``n_ctx`` is each slot's window. Slots have a window each unless the KV cache is unified
    (``--kv-unified``), when they share one pool of ``-c`` tokens and each slot's window is that
    whole pool. ``/props`` does not say which, so the pool taken is one window: exact when
    unified, and safe (one window's worth at a time) when not; ``--kv-tokens`` says otherwise.
    """
    window = window_from_props(payload)
    slots = _positive(_dig(payload, "total_slots"))
    if window is None or slots is None:
        return None
    return window, slots


def budget_from_sglang(payload: Any) -> int | None:
    """SGLang ``/get_server_info``: ``max_total_num_tokens``."""
    return _positive(_dig(payload, "max_total_num_tokens"))


def discover_budget() -> Generator[Probe, Answer, Budget]:
    """Find an engine's KV pool: vLLM's and TGI's ``/metrics``, llama.cpp's ``/props``, SGLang's
    ``/get_server_info``. ``/metrics`` answers are text: send them as ``Answer(status, text)``."""
    tried: list[str] = []
    answer = yield METRICS
    tried.append(f"{METRICS} -> {answer.status}")
    if answer.status == 200 and isinstance(answer.payload, str):
        text = answer.payload
        vllm = budget_from_vllm_metrics(text)
        if vllm is not None:
            source = f"{METRICS} vllm:cache_config_info num_gpu_blocks x block_size"
            sharing = prefix_caching_from_vllm_metrics(text)
            return Budget(vllm[0], vllm[1], None, "vllm", source, tuple(tried), sharing)
        ours = budget_from_reference_metrics(text)
        if ours is not None:
            source = f"{METRICS} kv_physical_capacity_tokens"
            block = _metric_whole(text, "kv_engine_block_size") or 16
            running = _metric_whole(text, "kv_engine_max_running")
            shares = _metric_whole(text, "kv_engine_prefix_caching")
            return Budget(
                ours, block, running, "kvclient", source, tuple(tried),
                None if shares is None else shares == 1,
            )  # fmt: skip
        tgi = budget_from_tgi_metrics(answer.payload)
        if tgi is not None:
            source = f"{METRICS} tgi_batch_max_total_tokens"
            return Budget(tgi, 1, None, "tgi", source, tuple(tried))
    answer = yield PROPS
    tried.append(f"{PROPS} -> {answer.status}")
    if answer.status == 200:
        llama = budget_from_llama_cpp_props(answer.payload)
        if llama is not None:
            source = f"{PROPS} default_generation_settings.n_ctx, total_slots"
            return Budget(llama[0], 1, llama[1], "llama.cpp", source, tuple(tried))
    answer = yield SGLANG_SERVER_INFO
    tried.append(f"{SGLANG_SERVER_INFO} -> {answer.status}")
    if answer.status == 200:
        tokens = budget_from_sglang(answer.payload)
        if tokens is not None:
            source = f"{SGLANG_SERVER_INFO} max_total_num_tokens"
            return Budget(tokens, 1, None, "sglang", source, tuple(tried))
    return Budget(None, tried=tuple(tried))
