"""The engine dialects, from realistic bodies: context-window discovery and error kinds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvclient import PromptTooLongError
from kvclient.engines.discovery import Answer, Discovery, discover_context
from kvclient.engines.errors import classify_error
from tests.helpers import vllm_bodies

NOT_FOUND = Answer(404, {"detail": "Not Found"})

LLAMA_CPP_MODELS = {
    "models": [{"name": "/m/tiny.gguf", "model": "/m/tiny.gguf", "type": "model"}],
    "object": "list",
    "data": [
        {
            "id": "/m/tiny.gguf",
            "aliases": ["/m/tiny.gguf"],
            "object": "model",
            "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 128256, "n_ctx": 512, "n_ctx_train": 8192},
        }
    ],
}
LLAMA_CPP_PROPS = {
    "default_generation_settings": {"n_ctx": 512, "params": {"n_predict": -1}},
    "total_slots": 4,
    "model_path": "/m/tiny.gguf",
    "build_info": "b1-0c1e570",
}
VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "meta-llama/Llama-3.1-8B-Instruct",
            "object": "model",
            "owned_by": "vllm",
            "root": "meta-llama/Llama-3.1-8B-Instruct",
            "parent": None,
            "max_model_len": 8192,
            "permission": [{"id": "modelperm-1", "object": "model_permission"}],
        }
    ],
}
TGI_MODELS = {"object": "list", "data": [{"id": "tgi", "object": "model", "owned_by": "tgi"}]}
TGI_INFO = {
    "model_id": "mistralai/Mistral-7B-Instruct-v0.3",
    "model_dtype": "torch.float16",
    "max_concurrent_requests": 128,
    "max_input_tokens": 4095,
    "max_total_tokens": 4096,
    "router": "text-generation-router",
    "version": "3.0.1",
}
SGLANG_MODEL_INFO = {"model_path": "Qwen/Qwen3-8B", "tokenizer_path": "Qwen/Qwen3-8B"}
SGLANG_SERVER_INFO = {
    "model_path": "Qwen/Qwen3-8B",
    "context_length": 32768,
    "max_total_num_tokens": 412000,
    "version": "0.4.6",
}
OLLAMA_MODELS = {
    "object": "list",
    "data": [{"id": "llama3.2:latest", "object": "model", "owned_by": "library"}],
}
OLLAMA_SHOW = {
    "template": "{{ .Prompt }}",
    "details": {"family": "llama", "parameter_size": "3.2B"},
    "model_info": {
        "general.architecture": "llama",
        "general.parameter_count": 3212749888,
        "llama.context_length": 131072,
        "llama.embedding_length": 3072,
    },
}


def drive(answers: dict[str, Answer], model: str | None = None, **kw: Any) -> Discovery:
    """Run the driver against scripted answers (any path not scripted: 404)."""
    driver = discover_context(model, **kw)
    probe = next(driver)
    seen = []
    while True:
        seen.append(str(probe))
        if probe.path == "/api/show":
            assert probe.json is not None
            assert isinstance(probe.json["model"], str)
        try:
            probe = driver.send(answers.get(str(probe), NOT_FOUND))
        except StopIteration as stop:
            result: Discovery = stop.value
            assert len(result.tried) == len(seen)
            return result


def test_vllm_and_ours_from_max_model_len() -> None:
    found = drive({"GET /v1/models": Answer(200, VLLM_MODELS)})
    assert (found.model, found.context_window, found.engine) == (
        "meta-llama/Llama-3.1-8B-Instruct",
        8192,
        "vllm",
    )
    assert found.tried == ("GET /v1/models -> 200",)


def test_llama_cpp_from_meta_n_ctx_per_slot() -> None:
    found = drive({"GET /v1/models": Answer(200, LLAMA_CPP_MODELS)})
    assert (found.model, found.context_window, found.engine) == ("/m/tiny.gguf", 512, "llama.cpp")


def test_llama_cpp_alias_names_the_model() -> None:
    models = json.loads(json.dumps(LLAMA_CPP_MODELS))
    models["data"][0]["aliases"].append("tiny")
    found = drive({"GET /v1/models": Answer(200, models)}, model="tiny")
    assert (found.model, found.context_window) == ("tiny", 512)


def test_older_llama_cpp_from_props() -> None:
    models = json.loads(json.dumps(LLAMA_CPP_MODELS))
    del models["data"][0]["meta"]
    found = drive(
        {"GET /v1/models": Answer(200, models), "GET /props": Answer(200, LLAMA_CPP_PROPS)}
    )
    assert (found.context_window, found.engine, found.extra) == (
        512,
        "llama.cpp",
        {"total_slots": 4},
    )


def test_tgi_from_info_max_total_tokens() -> None:
    found = drive({"GET /v1/models": Answer(200, TGI_MODELS), "GET /info": Answer(200, TGI_INFO)})
    assert (found.model, found.context_window, found.engine) == ("tgi", 4096, "tgi")
    found = drive({"GET /info": Answer(200, TGI_INFO)})  # an older TGI without /v1/models
    assert found.model == "mistralai/Mistral-7B-Instruct-v0.3"


def test_sglang_from_server_info_context_length() -> None:
    found = drive(
        {
            "GET /get_model_info": Answer(200, SGLANG_MODEL_INFO),
            "GET /get_server_info": Answer(200, SGLANG_SERVER_INFO),
        }
    )
    assert (found.model, found.context_window, found.engine) == ("Qwen/Qwen3-8B", 32768, "sglang")


def test_ollama_from_api_show() -> None:
    found = drive(
        {"GET /v1/models": Answer(200, OLLAMA_MODELS), "POST /api/show": Answer(200, OLLAMA_SHOW)}
    )
    assert (found.model, found.context_window, found.engine) == (
        "llama3.2:latest",
        131072,
        "ollama",
    )


def test_nothing_answers_says_what_was_tried() -> None:
    found = drive({"GET /v1/models": Answer(200, TGI_MODELS)})
    assert found.context_window is None
    message = found.explain()
    for probe in ("GET /v1/models", "GET /props", "GET /info", "GET /get_server_info"):
        assert probe in message
    assert "POST /api/show -> 404" in message
    assert "context_window=" in message


def test_a_model_not_served_is_a_problem_not_a_guess() -> None:
    found = drive({"GET /v1/models": Answer(200, VLLM_MODELS)}, model="typo")
    assert found.context_window is None
    assert found.problem is not None
    assert "'typo' is not served" in found.problem
    assert "meta-llama/Llama-3.1-8B-Instruct" in found.problem


def test_window_known_stops_once_the_model_is() -> None:
    found = drive({"GET /v1/models": Answer(200, TGI_MODELS)}, need_window=False)
    assert (found.model, found.tried) == (
        "tgi",
        ("GET /v1/models -> 200 (no max_model_len or meta.n_ctx)",),
    )


@pytest.mark.parametrize("bad", [0, -5, True, "8192", 8192.0])
def test_bad_numbers_are_not_windows(bad: object) -> None:
    models = {"data": [{"id": "m", "max_model_len": bad}]}
    found = drive({"GET /v1/models": Answer(200, models)})
    assert found.context_window is None
    assert found.problem is not None
    assert repr(bad) in found.problem
    models = {"data": [{"id": "m", "meta": {"n_ctx": bad}}]}
    found = drive({"GET /v1/models": Answer(200, models)})
    assert found.context_window is None


# --- error kinds ------------------------------------------------------------------------------


def test_llama_cpp_context_error_keeps_its_kind_and_numbers() -> None:
    body = {
        "error": {
            "code": 400,
            "message": "request (600 tokens) exceeds the available context size (512 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 600,
            "n_ctx": 512,
        }
    }
    verdict = classify_error(400, json.dumps(body))
    assert verdict.exception is PromptTooLongError
    assert not verdict.retryable
    details = verdict.details
    assert (details.code, details.error_type) == ("exceed_context_size_error",) * 2
    assert (details.prompt_tokens, details.context_window) == (600, 512)


@pytest.mark.parametrize(
    ("message", "prompt_tokens", "lower_bound"),
    [
        # vLLM 0.32 (recorded): it stops counting one token past the window.
        (
            vllm_bodies.AT_LEAST["error"]["message"],
            2049,
            True,
        ),
        # Older vLLM: the whole count.
        (
            "This model's maximum context length is 2048 tokens. However, your request has "
            "2100 input tokens. Please reduce the length of the input messages.",
            2100,
            False,
        ),
    ],
    ids=["at-least", "exact"],
)
def test_vllm_prompt_counts_say_whether_they_are_a_lower_bound(
    message: str, prompt_tokens: int, lower_bound: bool
) -> None:
    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    verdict = classify_error(400, json.dumps(body))
    assert verdict.exception is PromptTooLongError
    details = verdict.details
    assert (details.prompt_tokens, details.context_window) == (prompt_tokens, 2048)
    assert details.prompt_tokens_lower_bound is lower_bound


def test_vllm_no_room_for_its_default_cap_is_prompt_too_long() -> None:
    # vLLM 0.32 (recorded), a prompt of exactly the window sent without max_tokens.
    body = vllm_bodies.NO_ROOM
    verdict = classify_error(400, json.dumps(body))
    assert verdict.exception is PromptTooLongError
    assert not verdict.retryable
    assert (verdict.details.prompt_tokens, verdict.details.context_window) == (None, None)
    assert classify_error(500, json.dumps(body)).exception is not PromptTooLongError


def test_llama_cpp_loading_503_is_retryable_with_its_kind() -> None:
    body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    verdict = classify_error(503, json.dumps(body))
    assert verdict.retryable
    assert verdict.details.code == "unavailable_error"


def test_a_string_code_stays_the_code() -> None:
    body = {"error": {"message": "x", "type": "invalid_request_error", "code": "model_not_found"}}
    assert classify_error(404, json.dumps(body)).details.code == "model_not_found"


# --- KV budget --------------------------------------------------------------------------------

from kvclient.engines.budget import Budget, discover_budget  # noqa: E402
from kvclient.engines.metrics import preemptions_from_vllm_metrics, prometheus_samples  # noqa: E402

_VLLM_CACHE_LABELS = (
    'block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27709",'
    'num_gpu_blocks_override="None",swap_space="4",swap_space_bytes="4294967296"'
)
VLLM_METRICS = f"""# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{{_VLLM_CACHE_LABELS}}} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{{engine="0",model_name="Qwen/Qwen3-8B"}} 0.0
"""
TGI_METRICS = """# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 163840
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 0
"""
LLAMA_CPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 0
llamacpp:requests_processing 0
"""


def drive_budget(answers: dict[str, Answer]) -> Budget:
    driver = discover_budget()
    probe = next(driver)
    while True:
        try:
            probe = driver.send(answers.get(str(probe), NOT_FOUND))
        except StopIteration as stop:
            result: Budget = stop.value
            return result


def test_vllm_budget_from_cache_config_info() -> None:
    budget = drive_budget({"GET /metrics": Answer(200, VLLM_METRICS)})
    assert (budget.kv_tokens, budget.block_size, budget.engine) == (27709 * 16, 16, "vllm")


def test_a_pool_counted_in_blocks_says_what_the_engine_keeps_and_that_it_preempts() -> None:
    vllm = drive_budget({"GET /metrics": Answer(200, VLLM_METRICS)})
    assert (vllm.kept_blocks, vllm.preempts) == (1, True)
    assert vllm.exact_pool == (27709 - 1) * 16
    ours = drive_budget(
        {"GET /metrics": Answer(200, "kv_physical_capacity_tokens 4096\nkv_engine_preempts 1\n")}
    )
    assert (ours.kept_blocks, ours.preempts, ours.exact_pool) == (0, True, 4096)
    failing = drive_budget(
        {"GET /metrics": Answer(200, "kv_physical_capacity_tokens 4096\nkv_engine_preempts 0\n")}
    )
    assert not failing.preempts
    tgi = drive_budget({"GET /metrics": Answer(200, TGI_METRICS)})
    assert (tgi.kept_blocks, tgi.exact_pool, tgi.preempts) == (None, None, False)


def test_tgi_budget_from_batch_max_total_tokens() -> None:
    budget = drive_budget({"GET /metrics": Answer(200, TGI_METRICS)})
    assert (budget.kv_tokens, budget.engine) == (163840, "tgi")


def test_llama_cpp_budget_is_one_window_bounded_by_the_slots() -> None:
    budget = drive_budget(
        {"GET /metrics": Answer(200, LLAMA_CPP_METRICS), "GET /props": Answer(200, LLAMA_CPP_PROPS)}
    )
    assert (budget.kv_tokens, budget.max_concurrency, budget.engine) == (512, 4, "llama.cpp")


def test_sglang_budget_from_max_total_num_tokens() -> None:
    budget = drive_budget({"GET /get_server_info": Answer(200, SGLANG_SERVER_INFO)})
    assert (budget.kv_tokens, budget.engine) == (412000, "sglang")


def test_no_budget_says_what_was_tried() -> None:
    budget = drive_budget({})
    assert budget.kv_tokens is None
    assert budget.tried == (
        "GET /metrics -> 404",
        "GET /props -> 404",
        "GET /get_server_info -> 404",
    )


def test_prometheus_samples_take_labels_and_skip_lookalikes() -> None:
    text = 'a_total{x="1",y="q\\"uote"} 3\na_total_more 9\na_total 4.5\n# a_total 7\nbad{ 1'
    assert prometheus_samples(text, "a_total") == [({"x": "1", "y": 'q"uote'}, 3.0), ({}, 4.5)]


def test_reference_server_budget_from_its_physical_capacity() -> None:
    text = "# TYPE kv_physical_capacity_tokens gauge\nkv_physical_capacity_tokens 32768.0\n"
    budget = drive_budget({"GET /metrics": Answer(200, text)})
    assert (budget.kv_tokens, budget.block_size, budget.engine) == (32768, 16, "kvclient")


def test_vllm_preemptions_are_summed_over_engines() -> None:
    # vLLM 0.32 (recorded lines), with a second engine added.
    text = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/m/tiny"} 3.0
vllm:num_preemptions_total{engine="1",model_name="/m/tiny"} 2.0
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="/m/tiny"} 1.7961827e+09
"""
    assert preemptions_from_vllm_metrics(text) == 5.0
    assert preemptions_from_vllm_metrics(VLLM_METRICS) is None  # no such metric: not known
    assert preemptions_from_vllm_metrics('vllm:num_preemptions_total{engine="0"} NaN') is None


# --- what an engine lost for lack of KV -------------------------------------------------------

from kvclient.engines.behaviour import run_to_cap_fields  # noqa: E402
from kvclient.engines.errors import is_kv_exhaustion  # noqa: E402
from kvclient.engines.metrics import KVLosses, kv_losses_from_metrics  # noqa: E402

#: vLLM 0.32 (recorded lines).
VLLM_PREEMPTED = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/m/tiny"} 3.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="/m/tiny"} 1.7961827e+09
"""  # noqa: E501
#: SGLang (prometheus_client; the counter appears at the first retraction, the gauge always).
SGLANG_RETRACTED = """# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="Qwen/Qwen3-0.6B",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_retracted_requests_created Total number of retracted requests.
# TYPE sglang:num_retracted_requests_created gauge
sglang:num_retracted_requests_created{engine_type="unified",model_name="Qwen/Qwen3-0.6B",pp_rank="0",tp_rank="0"} 1.75e+09
"""  # noqa: E501
SGLANG_NOTHING_YET = SGLANG_RETRACTED.split("# HELP sglang:num_retracted_requests_total")[0]
#: TGI (Rust's metrics exporter: a counter per label set, created at its first increment).
TGI_FAILED = """# TYPE tgi_request_failure counter
tgi_request_failure{err="overloaded"} 7
tgi_request_failure{err="generation"} 2
tgi_request_failure{err="incomplete"} 1
tgi_request_failure{err="validation"} 3

# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 163840
"""
#: llama.cpp's /metrics as server-task.cpp renders it: tokens and decode calls, no failures.
LLAMA_CPP_ALL = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 310
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""  # noqa: E501
OURS_OOM = """# HELP kv_oom_failed_requests_total Requests failed by KV cache OOM events.
# TYPE kv_oom_failed_requests_total counter
kv_oom_failed_requests_total 64.0
# HELP kv_oom_events_total Times the physical KV pool overflowed (every in-flight request lost).
# TYPE kv_oom_events_total counter
kv_oom_events_total 1.0
"""
GATEWAY = """# HELP kv_usable_tokens kv_usable_tokens summed over upstreams
# TYPE kv_usable_tokens gauge
kv_usable_tokens 29491.0
# TYPE kv_admitted_total counter
kv_admitted_total 12.0
"""


@pytest.mark.parametrize(
    ("text", "total", "engine", "metric"),
    [
        (VLLM_PREEMPTED, 3.0, "vllm", "vllm:num_preemptions_total"),
        (VLLM_METRICS, 0.0, "vllm", "vllm:num_preemptions_total"),  # vLLM without the counter
        (SGLANG_RETRACTED, 4.0, "sglang", "sglang:num_retracted_requests_total"),
        (SGLANG_NOTHING_YET, 0.0, "sglang", "sglang:num_retracted_requests_total"),
        (TGI_FAILED, 3.0, "tgi", "tgi_request_failure"),  # generation + incomplete only
        (TGI_METRICS, 0.0, "tgi", "tgi_request_failure"),  # no failure counted yet
        (OURS_OOM, 64.0, "kvclient", "kv_oom_failed_requests_total"),
    ],
)
def test_kv_losses_in_each_engines_metrics(
    text: str, total: float, engine: str, metric: str
) -> None:
    losses = kv_losses_from_metrics(text)
    assert losses is not None
    assert (losses.total, losses.engine, losses.metric) == (total, engine, metric)
    assert losses.kind
    assert losses.meaning


@pytest.mark.parametrize("text", [LLAMA_CPP_ALL, GATEWAY, ""])
def test_no_kv_loss_counter_is_none_not_zero(text: str) -> None:
    # llama.cpp counts no failures; a gateway relays none: unknown, not "nothing lost".
    assert kv_losses_from_metrics(text) is None


def test_a_non_finite_count_is_dropped() -> None:
    losses = kv_losses_from_metrics('vllm:num_preemptions_total{engine="0"} NaN')
    assert losses is not None
    assert losses.total == 0.0


def test_kv_losses_since_an_earlier_reading() -> None:
    before = KVLosses(3.0, "vllm", "vllm:num_preemptions_total", "preemptions")
    after = KVLosses(5.0, "vllm", "vllm:num_preemptions_total", "preemptions")
    during = after.since(before)
    assert during is not None
    assert (during.total, during.metric) == (2.0, "vllm:num_preemptions_total")
    assert after.since(None) is None
    restarted = before.since(after)  # a restarted engine counts from 0 again
    assert restarted is not None
    assert restarted.total == 0.0
    other = KVLosses(9.0, "kvclient", "kv_oom_failed_requests_total", "requests lost to KV OOM")
    assert other.since(before) is None


def test_run_to_cap_fields_per_engine() -> None:
    assert run_to_cap_fields("vllm", 100) == {"ignore_eos": True, "min_tokens": 100}
    assert run_to_cap_fields("sglang", 100) == {"ignore_eos": True, "min_tokens": 100}
    assert run_to_cap_fields("llama.cpp", 100) == {"ignore_eos": True}
    assert run_to_cap_fields("tgi", 100) == {}
    assert run_to_cap_fields(None, 5) == {"ignore_eos": True, "min_tokens": 5}


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        ("kv_cache_oom", "KV cache out of memory: 4112 tokens in use exceed ...", True),
        ("500", "Context size has been exceeded.", True),  # llama.cpp, unified KV
        (None, "CUDA out of memory. Tried to allocate 20.00 MiB", True),  # via TGI
        ("internal_error", "The server had an internal error.", False),
        (None, None, False),
    ],
)
def test_kv_exhaustion_errors(code: str | None, message: str | None, expected: bool) -> None:
    assert is_kv_exhaustion(code, message) is expected


# --- the metric names table ------------------------------------------------------------------

from dataclasses import fields  # noqa: E402

from kvclient.engines.metrics import METRIC_NAMES, EngineMetrics  # noqa: E402


def _names(row: EngineMetrics) -> list[str]:
    found = [getattr(row, f.name) for f in fields(row) if f.name not in ("engine", "prefix")]
    found = [name for name in found if isinstance(name, str)]
    return found if row.losses is None else [*found, row.losses.metric]


@pytest.mark.parametrize("engine", sorted(METRIC_NAMES))
def test_each_engines_metric_names_carry_its_prefix(engine: str) -> None:
    row = METRIC_NAMES[engine]
    assert row.engine == engine
    prefix = row.prefix or "kv_"  # ours: the reference server's names
    assert _names(row)
    assert all(name.startswith(prefix) for name in _names(row)), _names(row)


def test_a_metric_name_belongs_to_one_engine() -> None:
    owners: dict[str, set[str]] = {}
    for row in METRIC_NAMES.values():
        for name in _names(row):
            owners.setdefault(name, set()).add(row.engine)
    assert all(len(engines) == 1 for engines in owners.values()), owners


def test_our_servers_preemptions_and_waiting_line_are_read_as_vllms_are() -> None:
    from kvclient.engines.metrics import lockstep_from_metrics

    text = "kv_engine_requests_waiting 2\nkv_engine_preemptions_total 7\n"
    assert lockstep_from_metrics(text) == lockstep_from_metrics(
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_preemptions_total{engine="0"} 7\n'
    )
    assert lockstep_from_metrics(text).preemptions == 7
