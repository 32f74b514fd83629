"""The gateway's tenants file, the tenant and priority a request gives, and the settings that
cannot go together."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvclient.headers import PRIORITY_HEADER
from reference_server.admission.fairness import FairPolicy, Tenant, TenantStats
from reference_server.gateway.cli import build_parser, config_from_args
from reference_server.gateway.config import GatewayConfig
from reference_server.gateway.metrics import OTHER_TENANTS, tenant_rows
from reference_server.gateway.tenants import (
    key_tenant,
    load_policy,
    priority_of,
    tenant_of,
)
from reference_server.http.errors import APIError

GOOD = """
max_queued = 64

[default]
max_share = 0.5
max_queue_wait = 30

[tenants.chat]
weight = 3

[tenants.key-5e884898da280471]
max_share = 0.25
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_a_tenants_file_gives_weights_limits_and_waits(tmp_path: Path) -> None:
    policy = load_policy(_file(tmp_path, GOOD))
    assert policy.max_queued == 64
    assert policy.default == Tenant(max_share=0.5, max_queue_wait=30.0)
    assert policy.tenants["chat"] == Tenant(weight=3.0)
    assert policy.terms(key_tenant("password")).max_share == 0.25
    assert policy.resolve("someone else") == "default"


def test_an_empty_tenants_file_gives_classes_alone(tmp_path: Path) -> None:
    """The way to priority classes without tenants (the guide says so): one default tenant."""
    policy = load_policy(_file(tmp_path, ""))
    assert policy == FairPolicy()
    assert policy.resolve("anyone") == policy.resolve(None) == "default"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a]\nweight = 0\n", "weight"),
        ("[tenants.a]\nmax_share = 1.5\n", "max_share"),
        ("[tenants.a]\nspeed = 1\n", "unknown setting 'speed'"),
        ("[tenants.default]\nweight = 2\n", "[default]"),
        ("colour = 1\n", "unknown setting 'colour'"),
        ("max_queued = 0\n", "max_queued"),
        ("[tenants\n", "not TOML"),
    ],
)
def test_a_bad_tenants_file_says_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--tenants") as error:
        load_policy(_file(tmp_path, text))
    assert says in str(error.value)


def _scope(*headers: tuple[str, str]) -> dict[str, object]:
    return {"headers": [(k.lower().encode(), v.encode()) for k, v in headers]}


def test_a_request_is_known_by_its_header_or_its_hashed_key() -> None:
    bearer = ("Authorization", "Bearer password")
    assert tenant_of(_scope(bearer), None) == "key-5e884898da280471"
    assert "password" not in (tenant_of(_scope(bearer), None) or "")
    assert tenant_of(_scope(bearer, ("X-Team", " chat ")), "X-Team") == "chat"
    assert tenant_of(_scope(bearer), "X-Team") is None
    assert tenant_of(_scope(("Authorization", "Basic abc")), None) is None
    assert tenant_of(_scope(), None) is None


def test_priority_is_a_small_integer_or_a_400() -> None:
    assert priority_of(_scope()) == 0
    assert priority_of(_scope((PRIORITY_HEADER, " -3 "))) == -3
    for bad in ("high", "1.5", "100000"):
        with pytest.raises(APIError) as error:
            priority_of(_scope((PRIORITY_HEADER, bad)))
        assert error.value.status == 400


def test_tenants_refuse_settings_they_cannot_keep(tmp_path: Path) -> None:
    path = str(_file(tmp_path, GOOD))
    parse = build_parser().parse_args
    upstream = ["--upstream", "http://127.0.0.1:1"]
    config = config_from_args(parse([*upstream, "--tenants", path, "--tenant-header", "X-T"]))
    assert config.fairness is not None
    assert config.tenant_header == "X-T"
    shared = config_from_args(parse([*upstream, "--tenants", path, "--ledger", "redis://h:1/0"]))
    assert shared.fairness is not None  # fair shares across gateways, in the shared ledger
    with pytest.raises(ValueError, match="needs --tenants"):
        GatewayConfig(upstreams=("http://127.0.0.1:1",), tenant_header="X-T")
    with pytest.raises(ValueError, match="--tenant-header"):
        GatewayConfig(upstreams=("http://127.0.0.1:1",), fairness=FairPolicy(), api_key="k")


def test_metrics_name_the_top_tenants_and_sum_the_rest() -> None:
    def row(name: str, seconds: float) -> TenantStats:
        return TenantStats(
            tenant=name, weight=1.0, held=1, token_seconds=seconds, waiting=1, admitted=1,
            refused=0,
        )  # fmt: skip

    rows = tenant_rows([row(f"t{i}", float(i)) for i in range(5)] + [row("t4", 1.0)], top=2)
    assert [(r.tenant, r.token_seconds, r.held) for r in rows] == [
        ("t4", 5.0, 2),
        ("t3", 3.0, 1),
        (OTHER_TENANTS, 3.0, 3),
    ]
