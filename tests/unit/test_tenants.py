"""The gateway's tenants file, who a request is (its listed key, then a trusted proxy's header),
the classes its tenant is granted, and every bad file, header name or tenant named by what it
is."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_server.admission.fairness import FairPolicy, Tenant, TenantStats
from reference_server.gateway.cli import build_parser, config_from_args
from reference_server.gateway.config import GatewayConfig
from reference_server.gateway.metrics import OTHER_TENANTS, tenant_rows
from reference_server.gateway.tenants import (
    TenantKeys,
    TenantResolver,
    check_tenant_header,
    hash_key,
    load_tenants,
    parse_priority,
)
from reference_server.http.errors import APIError

CHAT_HASH = hash_key("sk-chat", salt=b"pepper")

GOOD = f"""
max_queued = 64

[default]
max_share = 0.5
max_queue_wait = 30

[tenants.chat]
weight = 3
priorities = [0, -1]
key_hashes = ["{CHAT_HASH}"]

[tenants.batch]
max_share = 0.25
keys = ["sk-batch"]
"""


def _file(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "tenants.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_a_tenants_file_gives_terms_grants_and_keys(tmp_path: Path) -> None:
    read = load_tenants(_file(tmp_path, GOOD))
    policy = read.policy
    assert policy.max_queued == 64
    assert policy.default == Tenant(max_share=0.5, max_queue_wait=30.0)
    assert policy.tenants["chat"] == Tenant(weight=3.0, priorities=(-1, 0))
    assert read.keys.tenant_of("sk-chat") == "chat"  # by its salted hash
    assert read.keys.tenant_of("sk-batch") == "batch"
    assert read.keys.tenant_of("sk-batch ") is None
    assert read.keys.tenant_of("password") is None
    assert read.keys.unlisted == "refuse"
    assert "sk-batch" not in repr(read.keys)


def test_an_empty_tenants_file_gives_one_default_tenant_in_class_0(tmp_path: Path) -> None:
    read = load_tenants(_file(tmp_path, ""))
    assert read.policy == FairPolicy()
    assert not read.keys.listed
    assert read.policy.default.grant(-1000) == 0  # classes are off until granted


def test_a_class_outside_the_grant_is_served_in_the_nearest_granted_no_more_urgent() -> None:
    chat = Tenant(priorities=(-1, 0, 10))
    assert [chat.grant(p) for p in (-1000, -1, 0, 5, 10, 1000)] == [-1, -1, 0, 10, 10, 10]
    assert Tenant().grant(-1000) == Tenant().grant(1000) == 0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"[tenants.a]\nweight = 2 \xff\n", "is not UTF-8 text (byte 23)"),
        ("[tenants\n", "is not TOML"),
        ("colour = 1\n", "unknown setting 'colour'"),
        ("[tenants.a]\nspeed = 1\n", "[tenants.a]: unknown setting 'speed'"),
        ("[default]\nkeys = ['k']\n", "[default]: unknown setting 'keys'"),
        ("[tenants.a]\nweight = 0\n", "[tenants.a]: weight"),
        ("[tenants.a]\nmax_share = 1.5\n", "[tenants.a]: max_share"),
        ("[tenants.a]\npriorities = [2000]\n", "[tenants.a]: priorities"),
        ("[tenants.a]\npriorities = []\n", "[tenants.a]: priorities"),
        ("[tenants.a]\npriorities = 1\n", "[tenants.a]: priorities"),
        ("[tenants.default]\nweight = 2\n", "[default]"),
        ("[tenants.other]\nweight = 2\n", "'other' is reserved"),
        ('[tenants."a b"]\nweight = 2\n', "tenant 'a b'"),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", "listed for 'a' too"),
        ("[tenants.a]\nkeys = ['']\n", "[tenants.a]: keys"),
        ("[tenants.a]\nkey_hashes = ['md5:00:11']\n", "[tenants.a]: a key hash"),
        ("unlisted = 'allow'\n", "unlisted must be"),
        ("max_queued = 0\n", "max_queued"),
    ],
)
def test_a_bad_tenants_file_names_the_option_the_file_and_what_is_wrong(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ValueError, match=r"^--tenants ") as error:
        load_tenants(path)
    assert str(path) in str(error.value)
    assert says in str(error.value)
    assert "'k'" not in str(error.value)  # a key is never quoted back


def test_an_unreadable_tenants_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--tenants .*cannot read it"):
        load_tenants(tmp_path)  # a directory


@pytest.mark.parametrize("name", ["", "X Team", "X-Team:", "Authorization", "x-priority"])
def test_a_bad_tenant_header_name_is_refused_by_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"^--tenant-header"):
        check_tenant_header(name)
    args = build_parser().parse_args(
        ["--upstream", "http://127.0.0.1:1", "--tenants", str(_file(tmp_path, "")),
         "--tenant-header", name]
    )  # fmt: skip
    with pytest.raises(ValueError, match="--tenant-header"):
        config_from_args(args)


def test_tenant_settings_that_cannot_go_together_are_refused() -> None:
    upstream = ("http://127.0.0.1:1",)
    with pytest.raises(ValueError, match="needs --tenants"):
        GatewayConfig(upstreams=upstream, tenant_header="X-T")
    with pytest.raises(ValueError, match='unlisted = "default"'):
        GatewayConfig(
            upstreams=upstream,
            fairness=FairPolicy(),
            tenant_keys=TenantKeys(unlisted="default"),
            api_key="k",
        )
    # --api-key with --tenants and no header: the key is the default tenant's
    GatewayConfig(upstreams=upstream, fairness=FairPolicy(), api_key="k")


# --- who a request is ---------------------------------------------------------------------------


def _headers(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in pairs]


def _resolver(tmp_path: Path, text: str = GOOD, **kwargs: str) -> TenantResolver:
    read = load_tenants(_file(tmp_path, text))
    return TenantResolver(read.policy, read.keys, **kwargs)


def _status(resolver: TenantResolver, *pairs: tuple[str, str]) -> tuple[int, str]:
    with pytest.raises(APIError) as error:
        resolver.resolve(_headers(*pairs))
    return error.value.status, str(error.value.message)


def test_a_listed_key_names_its_tenant_and_a_forged_header_is_not_read(tmp_path: Path) -> None:
    resolver = _resolver(tmp_path)
    assert resolver.resolve(_headers(("Authorization", "Bearer sk-chat"))) == "chat"
    assert resolver.resolve(_headers(("api-key", "sk-batch"))) == "batch"
    forged = _headers(("Authorization", "Bearer sk-batch"), ("X-Team", "chat"))
    assert resolver.resolve(forged) == "batch"  # no --tenant-header: never read
    trusted = _resolver(tmp_path, header="X-Team")
    assert trusted.resolve(forged) == "batch"  # the authenticated identity comes first
    assert resolver.private == {b"authorization", b"api-key"}  # never sent on


def test_an_unlisted_key_is_refused_or_default_as_the_file_says(tmp_path: Path) -> None:
    refusing = _resolver(tmp_path)
    status, message = _status(refusing, ("Authorization", "Bearer password"))
    assert status == 401
    assert "password" not in message
    assert _status(refusing)[0] == 401  # no key at all
    lenient = _resolver(tmp_path, 'unlisted = "default"\n' + GOOD)
    assert lenient.resolve(_headers(("Authorization", "Bearer password"))) == "default"
    assert lenient.resolve([]) == "default"


def test_a_key_is_read_as_the_utf8_text_it_was_written_in(tmp_path: Path) -> None:
    resolver = _resolver(tmp_path, '[tenants.chat]\nkeys = ["sk-grüße"]\n', api_key="sésame")
    raw = [(b"authorization", "Bearer sk-grüße".encode())]
    assert resolver.resolve(raw) == "chat"
    assert resolver.resolve([(b"api-key", "sésame".encode())]) == "default"
    with pytest.raises(APIError):  # the same text sent as latin-1 is another key
        resolver.resolve([(b"authorization", "Bearer sk-grüße".encode("latin-1"))])


def test_the_gateways_own_key_is_the_default_tenants(tmp_path: Path) -> None:
    resolver = _resolver(tmp_path, api_key="sesame")
    assert resolver.resolve(_headers(("Authorization", "Bearer sesame"))) == "default"
    assert resolver.resolve(_headers(("Authorization", "Bearer sk-chat"))) == "chat"
    assert _status(resolver, ("Authorization", "Bearer sesame2"))[0] == 401


def test_a_trusted_header_names_a_listed_tenant_once(tmp_path: Path) -> None:
    resolver = _resolver(tmp_path, "[tenants.chat]\n[tenants.batch]\n", header="X-Team")
    assert not resolver.authenticates
    assert resolver.private == {b"x-team"}  # the client's own credentials go on
    assert resolver.resolve(_headers(("X-Team", " chat "))) == "chat"
    assert resolver.resolve(_headers(("X-Team", "default"))) == "default"
    assert resolver.resolve([]) == "default"
    status, message = _status(resolver, ("X-Team", "batch"), ("X-Team", "chat"))
    assert status == 400
    assert "more than one X-Team field" in message
    status, message = _status(resolver, ("X-Team", "chta"))
    assert (status, message) == (
        400,
        "tenant 'chta' (from X-Team) is not in the gateway's tenants file",
    )
    lenient = _resolver(tmp_path, 'unlisted = "default"\n[tenants.chat]\n', header="X-Team")
    assert lenient.resolve(_headers(("X-Team", "chta"))) == "default"


def test_priority_is_a_small_integer_or_a_400() -> None:
    assert parse_priority(None) is None
    assert parse_priority(" -3 ") == -3
    for bad in ("high", "1.5", "100000"):
        with pytest.raises(APIError) as error:
            parse_priority(bad)
        assert error.value.status == 400


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
