"""The engine's own books: what its ``/metrics`` says it runs, waits, preempted, uses and lost,
and KV it uses beyond what the gateway's holders explain, counted as held by someone unseen."""

from __future__ import annotations

import pytest

from kvclient.engines.budget import Budget, budget_from_vllm_metrics, discover_budget
from kvclient.engines.discovery import Answer
from kvclient.engines.metrics import lockstep_from_metrics
from reference_server.admission.ledger import KVAdmissionController
from reference_server.admission.peak import prefix_blocks

VLLM_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="65"} 1.0
"""
SPEC = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0
"""


def test_vllms_figures_are_read() -> None:
    signals = lockstep_from_metrics(VLLM_PAGE)
    assert (signals.waiting, signals.running, signals.preemptions) == (1.0, 2.0, 3.0)
    assert signals.kv_used_share == 0.25
    assert not signals.speculative
    assert signals.missing(preempts=True) == []
    assert lockstep_from_metrics(VLLM_PAGE + SPEC).speculative


def test_ours_are_read_and_what_is_missing_is_named() -> None:
    signals = lockstep_from_metrics("kv_engine_requests_waiting 0\nkv_used_tokens 48\n")
    assert signals.kv_used_tokens == 48
    assert signals.missing(preempts=False) == ["running"]
    assert signals.missing(preempts=True) == ["running", "preemptions"]
    assert lockstep_from_metrics("").missing(preempts=False) == ["waiting", "running"]


def _budget(text: str) -> Budget:
    driver = discover_budget()
    next(driver)
    with pytest.raises(StopIteration) as done:
        driver.send(Answer(200, text))
    budget: Budget = done.value.value
    return budget


def test_a_budget_says_whether_its_block_size_is_known_and_if_it_decodes_speculatively() -> None:
    assert budget_from_vllm_metrics(VLLM_PAGE) == (65 * 16, 16)
    vllm = _budget(VLLM_PAGE)
    assert vllm.block_known
    assert not vllm.speculative
    assert _budget(VLLM_PAGE + SPEC).speculative
    ours = _budget("kv_physical_capacity_tokens 4096\n")
    assert not ours.block_known
    assert ours.block_size == 16  # a default, not the engine's
    assert _budget("kv_physical_capacity_tokens 4096\nkv_engine_block_size 16\n").block_known


# --- KV nobody explains ----------------------------------------------------------------------


def _ledger(rule: str = "peak") -> KVAdmissionController:
    return KVAdmissionController(
        total_kv_tokens=1600, context_window=4000, decode_rate=100.0, rule=rule,  # type: ignore[arg-type]
        block_size=16, safety_fraction=1.0, relay_lag=0.1,
    )  # fmt: skip


@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_kv_the_holders_do_not_explain_is_counted_as_held(rule: str) -> None:
    ledger = _ledger(rule)
    holder = ledger.try_admit(100, 300, now=0.0, follow=True)
    assert holder is not None
    ledger.progress(holder, 50, 1.0)
    # Followed, it holds at most 100 + 50 + 20 (the relay's margin: 2 x 100 tokens/s x 0.1 s):
    # 176 in blocks; under caps its progress is not followed: its whole 400. The engine says
    # 800: the rest is held by someone the gateway does not see.
    explained = 176 if rule == "peak" else 400
    assert ledger.engine_used(800, since=1.0, now=1.0) == 800 - explained
    stats = ledger.stats()
    assert stats.unknown_tokens == 800 - explained
    assert stats.committed_tokens == ledger.usable_tokens - ledger.room(1.0)[0]
    assert stats.committed_tokens >= 400 + 800 - explained
    # 1,008 fits the budget beside the holder's 400, not beside the unknown too.
    assert ledger.try_admit(400, 600, now=1.0) is None
    assert ledger.retry_after(1008, 1.0) > 0
    assert ledger.engine_used(explained, since=1.0, now=1.1) == 0  # gone: the room is back
    assert ledger.retry_after(1008, 1.1) == 0
    assert ledger.try_admit(400, 600, now=1.1) is not None


def test_what_the_holders_may_really_hold_explains_the_engines_books() -> None:
    ledger = _ledger()
    ledger.shares_prefixes = True
    prefix = prefix_blocks(list(range(100)), 16)  # 6 blocks
    first = ledger.try_admit(100, 300, now=0.0, prefix=prefix, follow=True)
    assert first is not None
    ledger.progress(first, 40, 0.5)
    second = ledger.try_admit(100, 300, now=0.5, prefix=prefix, follow=True)
    n_of_them = ledger.try_admit(200, 200, now=0.5)  # not followed: its whole reservation
    assert second is not None
    assert n_of_them is not None
    # first: 100 + 40 + 20 -> 160; second, before its first count: 100 + 20 -> 128, its 6
    # prefix blocks borrowed; the other: 400. The engine can hold no more than that.
    most = 160 + (128 - 6 * 16) + 400
    assert ledger.engine_used(most, since=0.5, now=0.5) == 0
    assert ledger.engine_used(most + 16, since=0.5, now=0.5) == 16


def test_a_holder_released_lately_may_still_be_in_the_engines_books() -> None:
    ledger = _ledger()
    holder = ledger.try_admit(100, 300, now=0.0, follow=True)
    assert holder is not None
    ledger.progress(holder, 300, 3.0)
    ledger.release(holder, 3.1)
    # A scrape begun before the release may still count it (a figure a step old).
    assert ledger.engine_used(400, since=3.0, now=3.2) == 0
    assert ledger.engine_used(400, since=3.2, now=3.3) == 400  # read after: nobody's
