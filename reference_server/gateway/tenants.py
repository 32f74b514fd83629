"""Whose request it is and how urgent: the gateway's tenants (``--tenants FILE``,
``--tenant-header``) and the ``X-Priority`` header. Reading the file and the headers only; the
shares are :mod:`reference_server.admission.fairness`'s.

The tenants file (TOML)::

    max_queued = 256            # at most this many requests wait at once (optional)

    [default]                   # every tenant not listed below, together
    weight = 1
    max_share = 0.5             # the most of the KV budget it may hold at once
    max_queue_wait = 30         # seconds its requests may wait for room

    [tenants.chat]
    weight = 3

    [tenants.key-5e884898da280471]   # a client known by its API key's id (key_tenant)
    max_share = 0.25

A request's tenant is the value of the header the operator names (``--tenant-header``), else
its API key (``Authorization: Bearer``) as ``key-`` and the first 16 hex digits of its SHA-256:
the key itself is never kept, shown nor logged. A request with neither, or a tenant the file
does not list, is the ``default`` tenant's.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from starlette.types import Scope

from kvclient.headers import PRIORITY_HEADER

from ..admission.fairness import DEFAULT_TENANT, FairPolicy, Tenant
from ..http.errors import APIError
from ..http.requests import scope_header

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["key_tenant", "load_policy", "priority_of", "tenant_of"]

#: Priority classes accepted: a bound that keeps the header's value a small integer.
PRIORITY_RANGE = range(-1000, 1001)

_TERMS = {"weight", "max_share", "max_queue_wait"}
_TOP = {"max_queued", "default", "tenants"}


def key_tenant(key: str) -> str:
    """The tenant an API key stands for: ``key-`` and 16 hex digits of its SHA-256.

    >>> key_tenant("password")
    'key-5e884898da280471'
    """
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _terms(where: str, table: Any) -> Tenant:
    if not isinstance(table, dict):
        raise ValueError(f"--tenants: {where} must be a table of {', '.join(sorted(_TERMS))}")
    unknown = set(table) - _TERMS
    if unknown:
        raise ValueError(f"--tenants: {where}: unknown setting {sorted(unknown)[0]!r}")
    for name, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--tenants: {where}: {name} must be a number, got {value!r}")
    try:
        return Tenant(**{k: float(v) for k, v in table.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--tenants: {where}: {exc}") from None


def load_policy(path: str | Path) -> FairPolicy:
    """The fair-share policy in the TOML file at ``path``; ValueError says what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--tenants: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--tenants: {path} is not TOML: {exc}") from None
    unknown = set(data) - _TOP
    if unknown:
        raise ValueError(f"--tenants: unknown setting {sorted(unknown)[0]!r}")
    listed = data.get("tenants", {})
    if not isinstance(listed, dict):
        raise ValueError("--tenants: [tenants] must be a table of tables")
    if DEFAULT_TENANT in listed:
        raise ValueError(f"--tenants: give the default tenant's terms as [{DEFAULT_TENANT}]")
    tenants = {str(name): _terms(f"[tenants.{name}]", t) for name, t in listed.items()}
    default = _terms(f"[{DEFAULT_TENANT}]", data.get(DEFAULT_TENANT, {}))
    max_queued = data.get("max_queued")
    if max_queued is not None and (isinstance(max_queued, bool) or not isinstance(max_queued, int)):
        raise ValueError(f"--tenants: max_queued must be an integer, got {max_queued!r}")
    try:
        return FairPolicy(tenants=tenants, default=default, max_queued=max_queued)
    except ValueError as exc:
        raise ValueError(f"--tenants: {exc}") from None


def tenant_of(scope: Scope, header: str | None) -> str | None:
    """The tenant a request says it is: ``header``'s value when the operator names one, else its
    API key's id (:func:`key_tenant`); None when it gives neither."""
    if header is not None:
        value = scope_header(scope, header.lower().encode("latin-1"))
        return (value.strip() or None) if value is not None else None
    authorization = scope_header(scope, b"authorization")
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key_tenant(key.strip())


def priority_of(scope: Scope) -> int:
    """The request's priority class (``X-Priority``; 0 when absent), or a 400."""
    value = scope_header(scope, PRIORITY_HEADER.lower().encode("latin-1"))
    if value is None:
        return 0
    try:
        priority = int(value.strip())
    except ValueError:
        priority = None
    if priority is None or priority not in PRIORITY_RANGE:
        raise APIError(
            400,
            f"{PRIORITY_HEADER} must be an integer from {PRIORITY_RANGE.start} to "
            f"{PRIORITY_RANGE.stop - 1} (lower is served first), got {value[:40]!r}",
            code="invalid_priority",
            param=PRIORITY_HEADER,
        )
    return priority
