"""Tenants a hostile client cannot fake, through the gateway in front of the reference server:
a forged tenant header, two header fields, an unlisted key, a class above the tenant's grant, a
class flood from a tenant over its limit against a paying tenant's queue; the peak rule's gain
kept with ``--tenants``; ``/metrics`` naming tenants as the file does; and a bad tenants file
or header name refused at the command line by name. Loads are bounded in count and time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from reference_server import RunningServer, running_server
from reference_server.admission.fair_queue import FairQueue
from reference_server.admission.fairness import FairPolicy, Tenant, Waiter
from reference_server.gateway import GatewayConfig
from reference_server.gateway.cli import main
from reference_server.gateway.tenants import TenantKeys, hash_key
from reference_server.testing import running_gateway
from tests.gateway.test_gateway_fairness import ENGINE
from tests.gateway.test_gateway_peak import _complete, _config, _Engine
from tests.helpers.servers import wait_for
from tests.helpers.upstreams import scripted_upstream

KEYS = TenantKeys.build([("sk-chat", "chat"), ("sk-batch", "batch")])
#: A request of 990 tokens holds 992 KV tokens (a 1-token prompt and its cap, in blocks of 16):
#: four fill the budget of 4,096, leaving 128; one of 200 (208) does not fit beside them.
CAP = 990
SMALL = 200


def _queue(gateway: RunningServer) -> FairQueue:
    known = gateway.app.state.gateway.known
    assert known, "not discovered yet"
    queue = known[0].queue
    assert isinstance(queue, FairQueue)
    return queue


def _held(gateway: RunningServer) -> int:
    known = gateway.app.state.gateway.known
    return known[0].ledger.stats().reserved_tokens if known else -1


@contextmanager
def _stack(
    policy: FairPolicy, keys: TenantKeys | None = KEYS, **gw: Any
) -> Iterator[RunningServer]:
    with (
        running_server(**ENGINE, kv_tokens=4096, decode_rate=400.0) as upstream,
        running_gateway(
            GatewayConfig(
                upstreams=(upstream.base_url,),
                safety_fraction=1.0,
                decode_rate=400.0,
                max_queue_wait=30.0,
                fairness=policy,
                tenant_keys=keys,
                **gw,
            )
        ) as gateway,
    ):
        httpx.get(gateway.base_url + "/v1/models", headers=_auth("sk-chat"), timeout=10)
        yield gateway
        wait_for(lambda: _held(gateway) == 0, timeout=30)


def _auth(key: str | None, **more: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update({k.replace("_", "-"): v for k, v in more.items()})
    return headers


def _post(base: str, cap: int, headers: dict[str, str] | list[tuple[str, str]]) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": cap},
        headers=headers,
        timeout=60,
    )


def _in_thread(results: list[httpx.Response], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(_post(*args)), daemon=True)
    thread.start()
    return thread


def _recording(queue: FairQueue, monkeypatch: pytest.MonkeyPatch) -> list[Waiter]:
    admitted: list[Waiter] = []
    dispatch = queue.fair.dispatch

    def recording(now: float, try_admit: Any) -> Any:
        done = dispatch(now, try_admit)
        admitted.extend(w for w, _ in done)
        return done

    monkeypatch.setattr(queue.fair, "dispatch", recording)
    return admitted


def test_a_forged_tenant_header_is_not_read(tmp_path: Path) -> None:
    """Batch may hold a fifth of 4,096 tokens: 992 is past it, a 400 naming batch, whatever
    tenant its header claims; with a trusted header configured too, the key comes first."""
    policy = FairPolicy(tenants={"chat": Tenant(), "batch": Tenant(max_share=0.2)})
    for header in (None, "X-Team"):
        with _stack(policy, tenant_header=header) as gateway:
            forged = _post(gateway.base_url, CAP, _auth("sk-batch", X_Team="chat"))
            own = _post(gateway.base_url, CAP, _auth("sk-chat", X_Team="batch"))
        assert forged.status_code == 400, forged.text
        error = forged.json()["error"]
        assert error["code"] == "tenant_share_exceeded"
        assert "'batch' may hold at most 819" in error["message"]
        assert own.status_code == 200, own.text


def test_two_trusted_header_fields_are_refused() -> None:
    policy = FairPolicy(tenants={"chat": Tenant(), "batch": Tenant()})
    with _stack(policy, keys=None, tenant_header="X-Team") as gateway:
        twice = _post(gateway.base_url, 5, [("X-Team", "batch"), ("X-Team", "chat")])
        unknown = _post(gateway.base_url, 5, {"X-Team": "chta"})
        once = _post(gateway.base_url, 5, {"X-Team": "chat"})
        admitted = {s.tenant: s.admitted for s in _queue(gateway).tenants()}
    assert twice.status_code == 400
    assert "more than one X-Team field" in twice.json()["error"]["message"]
    assert unknown.status_code == 400
    assert "'chta'" in unknown.json()["error"]["message"]
    assert once.status_code == 200
    assert admitted == {"chat": 1}


@pytest.mark.parametrize("unlisted", ["refuse", "default"])
def test_an_unlisted_key_is_refused_or_default_and_never_shown(unlisted: str) -> None:
    salted = (b"salt", bytes.fromhex(hash_key("sk-chat", b"salt")[-64:]), "chat")
    keys = TenantKeys.build(
        [("sk-batch", "batch")],
        [salted],
        unlisted=unlisted,  # type: ignore[arg-type]
    )
    policy = FairPolicy(tenants={"chat": Tenant(), "batch": Tenant()})
    with _stack(policy, keys=keys) as gateway:
        stranger = _post(gateway.base_url, 5, _auth("password"))
        nobody = _post(gateway.base_url, 5, {})
        chat = _post(gateway.base_url, 5, _auth("sk-chat"))
        models = httpx.get(gateway.base_url + "/v1/models", headers=_auth("password"))
        metrics = httpx.get(gateway.base_url + "/metrics").text
        health = httpx.get(gateway.base_url + "/health").json()
    assert chat.status_code == 200
    if unlisted == "refuse":
        assert (stranger.status_code, nobody.status_code, models.status_code) == (401, 401, 401)
        assert stranger.headers["WWW-Authenticate"] == "Bearer"
    else:
        assert (stranger.status_code, nobody.status_code, models.status_code) == (200, 200, 200)
        assert 'kv_tenant_admitted_total{tenant="default"} 2.0' in metrics
    assert 'kv_tenant_admitted_total{tenant="chat"} 1.0' in metrics
    assert "password" not in metrics
    assert "key-" not in metrics
    assert health["fairness"] == {"enabled": True, "tenants": 2, "tenant_from": "keys"}


def test_a_class_above_the_grant_is_served_at_the_best_granted_and_the_answer_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch (granted class 0 alone) fills the budget; chat waits in class -1 (granted), then
    batch asks for -1000: it is served in class 0, after chat, and its answer says so."""
    policy = FairPolicy(tenants={"chat": Tenant(priorities=(-1, 0)), "batch": Tenant()})
    with _stack(policy) as gateway:
        queue = _queue(gateway)
        admitted = _recording(queue, monkeypatch)
        held: list[httpx.Response] = []
        threads = [_in_thread(held, gateway.base_url, CAP, _auth("sk-batch")) for _ in range(4)]
        wait_for(lambda: len(admitted) == 4, timeout=10)
        chat: list[httpx.Response] = []
        asks = _auth("sk-chat", X_Priority="-1")
        threads.append(_in_thread(chat, gateway.base_url, SMALL, asks))
        wait_for(lambda: queue.waiting == 1, timeout=10)
        pushy = _post(gateway.base_url, SMALL, _auth("sk-batch", X_Priority="-1000"))
        for thread in threads:
            thread.join(60)
    assert pushy.status_code == 200, pushy.text
    assert pushy.headers["X-Priority-Granted"] == "0"
    assert chat[0].status_code == 200
    assert "X-Priority-Granted" not in chat[0].headers
    assert [(w.tenant, w.priority) for w in admitted[4:]] == [("chat", -1), ("batch", 0)]


def test_a_class_flood_over_its_limit_cannot_refuse_a_paying_tenants_waiters() -> None:
    """At most two wait. Batch (half the budget) and chat hold two each: full. Chat's next two
    wait, within its limit; batch, at its limit, sends two asking for class -1000: they are
    refused (429), and both of chat's are served."""
    policy = FairPolicy(tenants={"chat": Tenant(), "batch": Tenant(max_share=0.5)}, max_queued=2)
    with _stack(policy) as gateway:
        queue = _queue(gateway)
        running: list[httpx.Response] = []
        threads = []
        for key in ("sk-batch", "sk-batch", "sk-chat", "sk-chat"):
            threads.append(_in_thread(running, gateway.base_url, CAP, _auth(key)))
            holding = len(threads)
            wait_for(lambda n=holding: queue.ledger.stats().inflight == n, timeout=10)
        waiting: list[httpx.Response] = []
        for _ in range(2):
            threads.append(_in_thread(waiting, gateway.base_url, SMALL, _auth("sk-chat")))
        wait_for(lambda: queue.waiting == 2, timeout=10)
        pushy = _auth("sk-batch", X_Priority="-1000")
        flood = [_post(gateway.base_url, SMALL, pushy) for _ in range(2)]
        for thread in threads:
            thread.join(60)
    assert [r.status_code for r in flood] == [429, 429]
    assert [r.status_code for r in waiting] == [200, 200]
    assert [r.status_code for r in running] == [200] * 4


def test_tenants_keep_the_peak_rules_gain() -> None:
    """As ``test_gateway_peak``'s newcomer test, with an empty tenants file (one tenant allowed
    the whole budget): C runs beside A and B, as without ``--tenants``."""
    scripted = _Engine()
    answers: dict[str, Any] = {}
    with (
        scripted_upstream(scripted.app()) as up,
        running_gateway(_config(up.base_url, relay_lag=0.1, fairness=FairPolicy())) as gw,
    ):
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
    assert all(answers[n].status_code == 200 for n in "ABC")
    # How far A had got when C started: well before its end (0.3 s of its tokens).
    assert scripted.made_at_start["C"]["A"] < 400 - 60


@pytest.mark.parametrize(
    ("file", "flags", "says"),
    [
        (b"\xff\xfe", (), "is not UTF-8"),
        (b"[tenants.a]\ncolour = 1\n", (), "[tenants.a]: unknown setting 'colour'"),
        (b"", ("--tenant-header", ""), "--tenant-header: '' is not a header field name"),
        (b"", ("--tenant-header", "X Team"), "--tenant-header: 'X Team'"),
    ],
)
def test_a_bad_tenants_setting_stops_the_gateway_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], file: bytes, flags: tuple[str, ...],
    says: str,
) -> None:  # fmt: skip
    path = tmp_path / "tenants.toml"
    path.write_bytes(file)
    with pytest.raises(SystemExit) as stopped:
        main(["--upstream", "http://127.0.0.1:1", "--tenants", str(path), *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    if not flags:
        assert f"--tenants {path}" in err
