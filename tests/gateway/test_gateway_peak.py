"""The gateway's peak rule in front of a scripted engine that decodes every request at one rate
(in lockstep) and reports its usage in every chunk, as vLLM does when asked: the holders'
progress is followed, a newcomer is admitted beside holders whose caps would not have let it in,
and the engine seen out of lockstep puts the upstream on whole caps with its reason shown."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from reference_server.gateway import GatewayConfig, GatewayState
from reference_server.testing import running_gateway
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import RATE, LockstepUpstream, scripted_upstream

#: The scripted engine under the name other gateway tests import it by.
_Engine = LockstepUpstream


def _state(gateway: Any) -> GatewayState:
    state: GatewayState = gateway.app.state.gateway
    return state


def _config(url: str, **extra: Any) -> GatewayConfig:
    return GatewayConfig(
        upstreams=(url,), safety_fraction=1.0, decode_rate=RATE, speed_interval=0.1, **extra
    )


def _complete(base: str, name: str, cap: int, out: dict[str, Any]) -> None:
    answer = httpx.post(
        base + "/v1/completions", json={"prompt": name, "max_tokens": cap}, timeout=30
    )
    out[name] = answer


@pytest.fixture
def engine() -> Iterator[tuple[LockstepUpstream, str]]:
    scripted = LockstepUpstream()
    with scripted_upstream(scripted.app()) as up:
        yield scripted, up.base_url


@pytest.mark.parametrize("rule", ["peak", "caps"])
def test_a_newcomer_runs_beside_holders_whose_caps_left_no_room(
    engine: tuple[LockstepUpstream, str], rule: str
) -> None:
    """1,200 KV tokens; requests of 3 + 400. A alone, then B and C when A is halfway: the caps
    (3 x 403) keep C waiting for A's end; the peak (A ends within 200 steps, B has just begun:
    at worst 403 + 303 + C's 403) admits C as soon as B's first token has come."""
    scripted, url = engine
    answers: dict[str, Any] = {}
    with running_gateway(_config(url, admission_rule=rule, relay_lag=0.1)) as gw:
        a = threading.Thread(target=_complete, args=(gw.base_url, "A", 400, answers))
        a.start()
        wait_for(lambda: scripted.made.get("A", 0) >= 200, timeout=10)  # A halfway
        others = [
            threading.Thread(target=_complete, args=(gw.base_url, name, 400, answers))
            for name in ("B", "C")
        ]
        others[0].start()
        wait_for(lambda: "B" in scripted.started, timeout=10)  # B first, then C
        others[1].start()
        for thread in (a, *others):
            thread.join(30)
        health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
        ledger = _state(gw).upstreams[0].known.ledger  # type: ignore[union-attr]
        wait_for(lambda: ledger.stats().reserved_tokens == 0)
        stats = ledger.stats()
    assert ledger.relay_lag == 0.1  # --relay-lag reaches the upstream's ledger
    assert all(answers[n].status_code == 200 for n in "ABC")
    assert all(answers[n].json()["usage"]["completion_tokens"] == 400 for n in "ABC")
    assert health["admission"] == rule
    assert stats.reserved_tokens == 0
    # How far A had got when C started (its 400 tokens: it had ended).
    made_by_a = scripted.made_at_start["C"]["A"]
    if rule == "caps":
        assert made_by_a == 400
        assert scripted.started["C"] >= scripted.ended["A"]
        assert stats.peak_inflight == 2
    else:
        assert made_by_a < 400 - 60  # well before A's end (0.3 s of its tokens)
        assert stats.peak_inflight == 3
    # Every request went upstream as a stream that reports its usage in each chunk (a plain
    # one's answer assembled); under caps, as the client sent it.
    streamed = [b.get("stream_options", {}).get("continuous_usage_stats") for b in scripted.bodies]
    assert streamed == ([True] * 3 if rule == "peak" else [None] * 3)


def test_a_stream_carries_no_usage_the_client_did_not_ask_for(
    engine: tuple[LockstepUpstream, str],
) -> None:
    _, url = engine
    with running_gateway(_config(url)) as gw:
        plain = httpx.post(
            gw.base_url + "/v1/completions",
            json={"prompt": "P", "max_tokens": 5, "stream": True},
        ).text
        asked = httpx.post(
            gw.base_url + "/v1/completions",
            json={
                "prompt": "Q", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True},
            },
        ).text  # fmt: skip
    assert '"choices": []' not in plain
    assert plain.count("data: ") == 6  # five tokens and [DONE]
    assert plain.endswith("data: [DONE]\n\n")
    assert '"choices": []' in asked  # asked for: kept


def test_an_engine_with_requests_waiting_puts_the_upstream_on_caps() -> None:
    scripted = LockstepUpstream(waiting=2)
    with scripted_upstream(scripted.app()) as up, running_gateway(_config(up.base_url)) as gw:
        holder = threading.Thread(target=_complete, args=(gw.base_url, "A", 300, {}))
        holder.start()
        upstream = _state(gw).upstreams[0]
        wait_for(lambda: upstream.lockstep_breaks == 1, timeout=10)
        health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
        metrics = httpx.get(gw.base_url + "/metrics").text
        holder.join(30)
    assert health["admission"] == "caps"
    assert health["caps_reason"] == "2 requests wait inside the engine"
    assert 'kv_upstream_caps_reason{reason="2 requests wait inside the engine"' in metrics
    assert "kv_upstream_admission_peak{" in metrics


def test_an_engine_that_does_not_say_how_many_it_runs_counts_whole_caps() -> None:
    scripted = LockstepUpstream(max_running=None)
    with scripted_upstream(scripted.app()) as up, running_gateway(_config(up.base_url)) as gw:
        health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
        answer = httpx.post(gw.base_url + "/v1/completions", json={"prompt": "A", "max_tokens": 3})
    assert health["admission"] == "caps"
    assert "--max-running" in health["caps_reason"]
    assert answer.status_code == 200
    assert "stream_options" not in scripted.bodies[0]  # not tracked: sent as it came


# --- in front of the reference server's engine ----------------------------------------------------


def _burst(base: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def one(body: dict[str, Any]) -> None:
        answer = httpx.post(base + "/v1/completions", json=body, timeout=120)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    return answers


_ENGINE = {
    "decode_rate": 400.0,
    "tick_seconds": 0.005,
    "kv_tokens": 4096,
    "context_window": 2048,
    # The server admits whatever comes (prompt admission): only the gateway stands between its
    # engine's pool and an overflow.
    "admission": "prompt",
    "max_running": 16,
}


@pytest.mark.slow
def test_in_front_of_the_reference_server_the_peak_runs_more_and_nothing_overflows() -> None:
    rng = __import__("random").Random(7)
    bodies = [
        {"prompt": f"request {i}", "max_tokens": rng.randint(300, 600), "ignore_eos": True,
         "stream": i % 2 == 0}
        for i in range(24)
    ]  # fmt: skip
    most: dict[str, int] = {}
    for rule in ("caps", "peak"):
        from reference_server import running_server

        with running_server(**_ENGINE) as upstream:
            # One stream lags another by a tick or two here, not the 0.25 s of the default (an
            # engine sharing its cores with its clients): at 400 tokens/s that default's margin
            # (200 tokens a holder) would leave the peak little room over the caps.
            config = GatewayConfig(
                upstreams=(upstream.base_url,), decode_rate=400.0, admission_rule=rule,
                max_queue_wait=120.0, speed_interval=0.2, relay_lag=0.05,
            )  # fmt: skip
            with running_gateway(config) as gw:
                answers = _burst(gw.base_url, bodies)
                ledger = _state(gw).upstreams[0].known.ledger  # type: ignore[union-attr]
                # The last release lands just after its answer was sent.
                wait_for(lambda: ledger.stats().reserved_tokens == 0)  # noqa: B023
                stats = ledger.stats()
                health = httpx.get(gw.base_url + "/health").json()["upstreams"][0]
            metrics = upstream.metrics()
        assert [a.status_code for a in answers] == [200] * 24, rule
        assert health["admission"] == rule
        assert metrics["kv_oom_events_total"] == 0, rule
        assert stats.reserved_tokens == 0
        most[rule] = stats.peak_inflight
    assert most["peak"] > most["caps"]


@pytest.mark.slow
def test_shared_prefixes_count_once_where_the_engine_shares_them() -> None:
    """Prompts of one 400-word prefix and a short suffix of their own, 100 tokens each: with the
    engine's prefix caching the gateway counts the prefix's blocks once for the holders past
    their prefill, and runs more at once; without it, each counts its own. Never an overflow."""
    prefix = " ".join(["river"] * 400)
    bodies = [{"prompt": f"{prefix} {i}", "max_tokens": 100, "ignore_eos": True} for i in range(16)]
    most: dict[bool, int] = {}
    for sharing in (False, True):
        from reference_server import running_server

        # Counted by request only (its own prompt admission would refuse these long prompts).
        engine = {
            **_ENGINE, "kv_tokens": 2400, "prefix_caching": sharing,
            "admission": "concurrency", "max_concurrency": 64,
        }  # fmt: skip
        with running_server(**engine) as upstream:
            config = GatewayConfig(
                upstreams=(upstream.base_url,), decode_rate=400.0, max_queue_wait=120.0
            )
            with running_gateway(config) as gw:
                answers = _burst(gw.base_url, bodies)
                stats = _state(gw).upstreams[0].known.ledger.stats()  # type: ignore[union-attr]
            metrics = upstream.metrics()
        assert [a.status_code for a in answers] == [200] * 16
        assert metrics["kv_oom_events_total"] == 0
        most[sharing] = stats.peak_inflight
    assert most[True] > most[False]


@pytest.mark.slow
def test_prompts_salted_apart_share_nothing_and_never_overflow() -> None:
    """The same prompts as above, each with its own ``cache_salt``: the engine (ours keys its
    prefix cache by the salt, as vLLM does) shares none of their blocks, so neither may the
    gateway. Counted as shared, they overflow its pool."""
    from reference_server import running_server

    prefix = " ".join(["river"] * 400)
    bodies = [
        {"prompt": f"{prefix} {i}", "max_tokens": 100, "ignore_eos": True, "cache_salt": f"t{i}"}
        for i in range(16)
    ]
    engine = {
        **_ENGINE, "kv_tokens": 2400, "prefix_caching": True,
        "admission": "concurrency", "max_concurrency": 64,
    }  # fmt: skip
    with running_server(**engine) as upstream:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), decode_rate=400.0, max_queue_wait=120.0
        )
        with running_gateway(config) as gw:
            answers = _burst(gw.base_url, bodies)
        metrics = upstream.metrics()
    assert [a.status_code for a in answers] == [200] * 16
    assert metrics["kv_oom_events_total"] == 0
