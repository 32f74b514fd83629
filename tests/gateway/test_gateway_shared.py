"""Several ``kvclient gateway`` processes on one real Redis (``--ledger``) in front of the
reference server: one budget per upstream across them, leases that free a killed gateway's
reservations, Redis going away and coming back, ``--workers``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import llama_engine
import pytest
import redis

from kvclient.headers import parse_ratelimit
from reference_server import running_server
from reference_server.gateway import GatewayConfig
from reference_server.gateway.config import public_url
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_speed import DECODE_RATE, stream_some
from tests.helpers.redis_server import RedisSentinel, RedisServer, TLSFiles
from tests.helpers.servers import at_zero, bench_summary_run, wait_for

# Every test here starts a real Redis.
pytestmark = pytest.mark.redis

FAST = {"decode_rate": 4000.0, "tick_seconds": 0.005}
#: The seed's mix against an engine that admits on prompt length alone: it OOMs when overrun.
OOMING = {**FAST, "kv_tokens": 8192, "context_window": 4096, "mean_output_tokens": 1500.0,
          "admission": "prompt"}  # fmt: skip


def shared_reserved(redis_url: str, upstream_url: str) -> tuple[int, int]:
    """(tokens reserved, holders) in the shared ledger of ``upstream_url``, read from Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        tag = "{kvclient:" + public_url(upstream_url) + "}"
        reserved = int(client.get(f"{tag}:reserved") or 0)
        return reserved, int(client.hlen(f"{tag}:holders"))
    finally:
        client.close()


@contextmanager
def gateway_process(
    upstream: str, *extra: str, decode_rate: str | None = "4000"
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvclient gateway`` in its own process on a free loopback port, once it is healthy
    (``decode_rate``: its ``--decode-rate``, None: its default). Its log goes to a file, read
    if it dies: a pipe nobody reads would stop it once full."""
    port = llama_engine.free_port()
    rate = ["--decode-rate", decode_rate] if decode_rate is not None else []
    cmd = [sys.executable, "-m", "kvclient.cli", "gateway", "--upstream", upstream, "--port",
           str(port), *rate, "--log-level", "warning", *extra]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        try:

            def healthy() -> bool:
                if proc.poll() is not None:
                    log.seek(0)
                    raise AssertionError(log.read())
                try:
                    return httpx.get(url + "/health").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(healthy, timeout=30)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:  # it did not stop: it must not outlive the test
                proc.kill()
                proc.wait(15)


def _overload(urls: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    """The seed's mix at overload through every gateway at once (70 requests/s in all)."""
    results: list[dict[str, Any]] = []
    rate = str(70 // len(urls))

    def one(url: str) -> None:
        results.append(
            bench_summary_run(url, tmp_path, "--requests", "30", "--rate", rate)["summary"]
        )

    threads = [threading.Thread(target=one, args=(url,)) for url in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert len(results) == len(urls)
    return results


@pytest.mark.slow
def test_three_gateways_on_one_redis_never_oom_and_three_on_their_own_do(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with running_server(**OOMING) as upstream, ExitStack() as stack:
        urls = [
            stack.enter_context(
                gateway_process(
                    upstream.base_url, "--ledger", redis_server.url, "--max-queue-wait", "30"
                )
            )[1]
            for _ in range(3)
        ]
        summaries = _overload(urls, tmp_path)
        wait_for(lambda: at_zero(upstream), timeout=30)
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
        shared_ooms = upstream.metrics()["kv_oom_events_total"]
        assert all(s["failed"] == 0 for s in summaries), summaries
    with running_server(**OOMING) as upstream, ExitStack() as stack:
        urls = [
            stack.enter_context(gateway_process(upstream.base_url, "--max-queue-wait", "30"))[1]
            for _ in range(3)
        ]
        _overload(urls, tmp_path)
        wait_for(lambda: at_zero(upstream), timeout=30)
        alone_ooms = upstream.metrics()["kv_oom_events_total"]
    assert shared_ooms == 0
    assert alone_ooms > 0  # each believed it owned the whole pool


def _stream(url: str, max_tokens: int, results: list[int]) -> None:
    """One streamed request; its status is appended once the answer is whole (or broken: 0)."""
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", timeout=60,
            json={"prompt": "hi", "max_tokens": max_tokens, "stream": True},
        ) as response:  # fmt: skip
            for _ in response.iter_bytes():
                pass
            results.append(response.status_code)
    except httpx.HTTPError:
        results.append(0)


def _leases(redis_url: str, upstream_url: str) -> tuple[dict[str, int], int]:
    """Each gateway lease holding reservations for ``upstream_url`` in the shared ledger, with
    how many, and Redis's clock (ms), which times the leases."""
    client = redis.Redis.from_url(redis_url)
    try:
        tag = "{kvclient:" + public_url(upstream_url) + "}"
        held: dict[str, int] = {}
        for name in client.hkeys(f"{tag}:holders"):
            lease = name.decode().split(":", 1)[0]  # a reservation is lease:n:need
            held[lease] = held.get(lease, 0) + 1
        seconds, micros = client.time()
        return held, seconds * 1000 + micros // 1000
    finally:
        client.close()


def _lease_expiry(redis_url: str, upstream_url: str, lease: str) -> float | None:
    """When ``lease`` expires, in ms of Redis's clock (None: it is gone)."""
    client = redis.Redis.from_url(redis_url)
    try:
        tag = "{kvclient:" + public_url(upstream_url) + "}"
        expiry: float | None = client.zscore(f"{tag}:leases", lease)
        return expiry
    finally:
        client.close()


def test_a_killed_gateways_reservations_come_back_within_its_lease(
    redis_server: RedisServer,
) -> None:
    """Timed by Redis's clock, which times the leases, not by this test's: a loaded machine may
    run the survivors' renewals late, but the killed gateway's lease ends at most one lease
    after its last renewal (before the kill), and the first script after that gives its
    reservations back."""
    # The engine counts its pool in blocks: the gateway budgets all 7,000 tokens of it.
    slow = {"decode_rate": 100.0, "tick_seconds": 0.01, "kv_tokens": 7000,
            "context_window": 4096}  # fmt: skip
    lease_ms = 1000
    lease = ("--ledger", redis_server.url, "--lease-seconds", str(lease_ms / 1000),
             "--max-queue-wait", "10")  # fmt: skip
    with running_server(**slow) as upstream, ExitStack() as stack:
        a = stack.enter_context(gateway_process(upstream.base_url, *lease))[1]
        b = stack.enter_context(gateway_process(upstream.base_url, *lease))[1]
        doomed, c = stack.enter_context(gateway_process(upstream.base_url, *lease))
        cut: list[int] = []
        for _ in range(3):  # 3 x 1000 tokens at 100 tokens/s: 10 s each
            threading.Thread(target=_stream, args=(c, 1000, cut), daemon=True).start()
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 3, 30)
        (killed_lease,) = _leases(redis_server.url, upstream.base_url)[0]
        served: list[int] = []
        others = [threading.Thread(target=_stream, args=(url, 400, served)) for url in (a, b)]
        for thread in others:  # 4 s each, through the gateways that live on
            thread.start()
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 5, 30)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        held, killed_at = _leases(redis_server.url, upstream.base_url)
        expiry = _lease_expiry(redis_server.url, upstream.base_url, killed_lease)
        if expiry is not None:  # not swept yet: it lapses at most a lease after the kill
            assert held[killed_lease] == 3
            assert expiry <= killed_at + lease_ms
            # Once it has lapsed, any script (a survivor's renewal, an admission) sweeps it.
            wait_for(lambda: _leases(redis_server.url, upstream.base_url)[1] > expiry, 30)
        response = httpx.post(b + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert response.status_code == 200
        assert killed_lease not in _leases(redis_server.url, upstream.base_url)[0]
        for thread in others:
            thread.join(30)
        assert served == [200, 200]  # the others kept serving
        # Against the whole budget again: nothing of the killed gateway's is left.
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
        response = httpx.post(b + "/v1/completions", json={"prompt": "hi", "max_tokens": 20})
        assert response.status_code == 200
        wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
        assert cut.count(200) == 0  # the killed gateway's clients were cut


def test_redis_away_refuses_new_requests_lets_admitted_finish_and_recovers(
    redis_server: RedisServer,
) -> None:
    slow = {"decode_rate": 200.0, "tick_seconds": 0.01, "kv_tokens": 8192,
            "context_window": 4096}  # fmt: skip
    with running_server(**slow) as upstream:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), ledger=redis_server.url, lease_seconds=1.0,
            decode_rate=200.0,
        )  # fmt: skip
        with running_gateway(config) as gateway:
            url = gateway.base_url
            results: list[int] = []
            admitted = threading.Thread(target=_stream, args=(url, 600, results))  # 3 s
            admitted.start()
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 1)
            redis_server.stop()
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert refused.status_code == 503
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "ledger_unavailable"
            metrics = httpx.get(url + "/metrics").text
            assert "kv_ledger_unreachable 1.0" in metrics
            assert "kv_ledger_refused_total 1.0" in metrics
            redis_server.start()  # empty: it kept nothing in memory
            # The gateway puts back what it still holds: the engine still holds it.
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 1)
            assert admitted.is_alive()

            def served() -> bool:
                answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                return answer.status_code == 200

            wait_for(served, timeout=10)  # no restart
            admitted.join(30)
            assert results == [200]  # the admitted request finished
            assert "kv_ledger_unreachable 0.0" in httpx.get(url + "/metrics").text
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))


def test_two_gateways_configured_differently_for_one_upstream_say_so(
    redis_server: RedisServer,
) -> None:
    with running_server(**FAST, kv_tokens=8192, context_window=1024) as upstream:
        first = GatewayConfig(upstreams=(upstream.base_url,), ledger=redis_server.url)
        other = GatewayConfig(
            upstreams=(upstream.base_url,), kv_tokens=(4096,), ledger=redis_server.url
        )
        with running_gateway(first) as a, running_gateway(other) as b:
            ok = httpx.post(a.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert ok.status_code == 200
            no = httpx.post(b.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert no.status_code == 503
            problem = httpx.get(b.base_url + "/health").json()["upstreams"][0]["problem"]
            assert "configured differently" in problem


def test_workers_share_one_port_and_need_a_shared_ledger(redis_server: RedisServer) -> None:
    with running_server(**FAST, kv_tokens=8192, context_window=1024) as upstream:
        refused = subprocess.run(
            [sys.executable, "-m", "kvclient.cli", "gateway", "--upstream", upstream.base_url,
             "--workers", "2"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert refused.returncode == 2
        assert "--workers N > 1 needs --ledger" in refused.stderr
        with gateway_process(upstream.base_url, "--workers", "2", "--ledger", redis_server.url) as (
            proc,
            url,
        ):
            for _ in range(6):
                answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                assert answer.status_code == 200
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0


def test_a_gateway_whose_lease_lapsed_puts_its_streams_back_and_they_run_on(
    redis_server: RedisServer,
) -> None:
    # The engine counts its pool in blocks: the gateway budgets all 7,000 tokens of it.
    slow = {"decode_rate": 100.0, "tick_seconds": 0.01, "kv_tokens": 7000,
            "context_window": 4096}  # fmt: skip
    with running_server(**slow) as upstream:
        config = GatewayConfig(
            upstreams=(upstream.base_url,), ledger=redis_server.url, lease_seconds=0.6
        )
        with running_gateway(config) as gateway:
            chunks: list[bytes] = []

            def stream() -> None:
                with httpx.stream(
                    "POST", gateway.base_url + "/v1/completions", timeout=30,
                    json={"prompt": "hi", "max_tokens": 500, "stream": True},
                ) as response:  # fmt: skip
                    chunks.extend(response.iter_bytes())

            reader = threading.Thread(target=stream)
            reader.start()
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 1)
            # Its lease expires unrenewed (Redis cut off for longer than the lease): the next
            # script sweeps its reservation, though the engine still runs the request.
            client = redis.Redis.from_url(redis_server.url)
            tag = "{kvclient:" + public_url(upstream.base_url) + "}"
            for lease in client.zrange(f"{tag}:leases", 0, -1):
                client.zadd(f"{tag}:leases", {lease: 0})  # expired long ago
            client.close()

            def lapsed() -> bool:
                metrics = httpx.get(gateway.base_url + "/metrics").text
                return "kv_ledger_lease_lapses_total 1.0" in metrics

            wait_for(lapsed)
            # Put back by the next renewal: the request streams on to its end.
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url)[1] == 1)
            reader.join(30)
            assert not reader.is_alive()
            body = b"".join(chunks)
            assert b"data: [DONE]" in body
            assert b'"error"' not in body
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
        wait_for(lambda: at_zero(upstream))
    # The lease's thread stopped with the gateway.
    assert [t for t in threading.enumerate() if t.name.startswith("kvclient-lease-")] == []


def _gauge(metrics: str, name: str, upstream: str) -> float:
    prefix = f'{name}{{upstream="{public_url(upstream)}"}} '
    line = next(line for line in metrics.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_metrics_ratelimit_and_refusals_show_the_shared_room(redis_server: RedisServer) -> None:
    # The engine counts its pool in blocks: the gateway budgets all 7,000 tokens of it.
    slow = {"decode_rate": 100.0, "tick_seconds": 0.01, "kv_tokens": 7000,
            "context_window": 4096}  # fmt: skip
    with running_server(**slow) as upstream:
        config = GatewayConfig(upstreams=(upstream.base_url,), ledger=redis_server.url)
        with running_gateway(config) as a, running_gateway(config) as b:
            # 36 s of decoding (the engine's natural end held back)
            body = {"prompt": "hi", "max_tokens": 3600, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", a.base_url + "/v1/completions", json=body) as holding:
                pieces = holding.iter_bytes()  # kept: a generator closed closes the stream
                next(pieces)  # admitted through a, and decoding
                held, holders = shared_reserved(redis_server.url, upstream.base_url)
                assert holders == 1
                answer = httpx.post(
                    b.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}
                )
                assert answer.status_code == 200
                hint = parse_ratelimit(answer.headers)
                assert hint is not None
                assert hint.quota == 7000
                assert hint.remaining == hint.quota - held  # a's reservation, seen from b
                assert hint.reset is not None
                assert hint.reset > 0  # a's holder ends later; b holds nothing
                refused = httpx.post(
                    b.base_url + "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 4000},
                    headers={"Prefer": "wait=0"},
                )
                assert refused.status_code == 429
                message = refused.json()["error"]["message"]
                assert f"{held} of 7000 usable tokens are reserved by 1 in-flight" in message
                metrics = httpx.get(b.base_url + "/metrics").text
                shared = "kv_upstream_shared_reserved_tokens"
                assert _gauge(metrics, "kv_upstream_reserved_tokens", upstream.base_url) == 0
                assert _gauge(metrics, shared, upstream.base_url) == held
                assert (
                    _gauge(metrics, "kv_upstream_shared_inflight_requests", upstream.base_url) == 1
                )
                assert _gauge(metrics, "kv_upstream_shared_queued_tokens", upstream.base_url) == 0
            # The client went away: a cancels the request upstream and releases.
            wait_for(lambda: shared_reserved(redis_server.url, upstream.base_url) == (0, 0))
            metrics = httpx.get(b.base_url + "/metrics").text
            assert _gauge(metrics, shared, upstream.base_url) == 0


def _workers(parent: int) -> set[int]:
    """The worker processes of ``parent``: its children but multiprocessing's helper."""
    pids = set()
    with open(f"/proc/{parent}/task/{parent}/children") as listing:
        for pid in map(int, listing.read().split()):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"resource_tracker" not in cmdline.read():
                    pids.add(pid)
    return pids


def test_a_killed_worker_is_replaced_and_the_new_one_serves(redis_server: RedisServer) -> None:
    with running_server(**FAST, kv_tokens=8192, context_window=1024) as upstream:
        workers = ("--workers", "2", "--ledger", redis_server.url)
        with gateway_process(upstream.base_url, *workers) as (proc, url):
            wait_for(lambda: len(_workers(proc.pid)) == 2, timeout=30)
            first, second = sorted(_workers(proc.pid))
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: len(_workers(proc.pid) - {first, second}) == 1, timeout=30)
            # The other original worker cannot take connections while stopped: the new one
            # answers all of them.
            os.kill(second, signal.SIGSTOP)
            try:
                for _ in range(3):
                    answer = httpx.post(
                        url + "/v1/completions",
                        json={"prompt": "hi", "max_tokens": 5},
                        timeout=30,
                    )
                    assert answer.status_code == 200
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(second, signal.SIGCONT)
            assert proc.poll() is None


def test_a_gateway_on_a_redis_over_tls_with_its_own_ca(
    tls_redis: tuple[RedisServer, TLSFiles],
) -> None:
    server, tls = tls_redis
    files = {"ledger_ca_file": str(tls.ca), "ledger_client_cert": str(tls.client_cert),
             "ledger_client_key": str(tls.client_key)}  # fmt: skip
    with pytest.raises(ValueError, match="needs a rediss:// --ledger"):
        GatewayConfig(upstreams=("http://127.0.0.1:1",), ledger="redis://127.0.0.1:1/0", **files)
    with running_server(**FAST, kv_tokens=8192, context_window=1024) as upstream:
        config = GatewayConfig(upstreams=(upstream.base_url,), ledger=server.url, **files)
        with running_gateway(config) as gateway:
            answer = httpx.post(
                gateway.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}
            )
            assert answer.status_code == 200
            metrics = httpx.get(gateway.base_url + "/metrics").text
            assert "kv_ledger_unreachable 0.0" in metrics
            assert _gauge(metrics, "kv_upstream_shared_reserved_tokens", upstream.base_url) == 0
            assert gateway.gateway.shared is not None
            assert gateway.gateway.shared.wakeups.subscribed  # pub/sub over TLS too


def test_a_gateway_finds_its_ledger_through_sentinel(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with (
        RedisSentinel(tmp_path, master_port=redis_server.port) as sentinel,
        running_server(**FAST, kv_tokens=8192, context_window=1024) as upstream,
    ):
        config = GatewayConfig(upstreams=(upstream.base_url,), ledger=sentinel.url)
        with running_gateway(config) as gateway:
            answer = httpx.post(
                gateway.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}
            )
            assert answer.status_code == 200
            assert gateway.gateway.shared is not None
            assert gateway.gateway.shared.wakeups.subscribed
        # The reservations went to the master the Sentinel names.
        assert shared_reserved(redis_server.url, upstream.base_url) == (0, 0)
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert client.exists("{kvclient:" + public_url(upstream.base_url) + "}:leases")
        finally:
            client.close()


def test_each_gateway_measures_the_engines_speed_against_every_gateways_holders(
    redis_server: RedisServer,
) -> None:
    """One stream through a and two through b, together: a's own holder alone decoding the
    engine's three streams' tokens would make the engine look three times as fast."""
    with running_server(
        kv_tokens=65_536, context_window=8192, decode_rate=DECODE_RATE, mean_output_tokens=4000
    ) as engine:
        config = GatewayConfig(
            upstreams=(engine.base_url,), ledger=redis_server.url, speed_interval=0.2
        )
        with running_gateway(config) as a, running_gateway(config) as b:
            for gateway in (a, b):
                httpx.get(gateway.base_url + "/v1/models").raise_for_status()  # discovered
            threads = [
                threading.Thread(target=stream_some, args=(url, n, 2400))  # ~6 s each
                for url, n in ((a.base_url, 1), (b.base_url, 2))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for gateway in (a, b):
                upstream = gateway.gateway.upstreams[0]
                wait_for(lambda u=upstream: u.speed is not None, timeout=5)
                assert upstream.speed is not None
                assert upstream.speed.decode_rate == pytest.approx(DECODE_RATE, rel=0.3)
