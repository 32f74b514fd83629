"""Who a request is and what its tenant may ask: the gateway's tenants file (``--tenants FILE``),
the keys it lists, and the header a trusted proxy sets (``--tenant-header``). Pure: reading the
file and resolving a request's headers into the tenant the gateway verified; the middleware that
applies it is :mod:`.tenancy`, the shares :mod:`reference_server.admission.fairness`.

The tenants file (TOML)::

    max_queued = 256            # at most this many requests wait at once (optional)
    unlisted = "refuse"         # a key the file does not list: "refuse" (401; the default)
                                # or "default" (counted as the default tenant)

    [default]                   # every request without a listed key, together
    weight = 1
    max_share = 0.5             # the most of the KV budget (and of max_queued) it may hold
    max_queue_wait = 30         # seconds its requests may wait for room
    priorities = [0]            # the X-Priority classes it may ask for (the default: 0 alone)

    [tenants.chat]
    weight = 3
    priorities = [-1, 0]
    key_hashes = ["sha256:9c1d...:41f0..."]   # salted hashes of its API keys (hash_key)
    keys = ["sk-chat-1"]        # or the keys themselves (the file is then a secret)

**Who a request is**, in this order (an authenticated identity first, then an opted-in trusted
header, as SGLang's model gateway resolves tenants): the tenant whose listed key it sends
(``Authorization: Bearer`` or ``api-key``); else, where the gateway checks keys (the file lists
some, or ``--api-key`` is given: that key is the ``default`` tenant's), a request with another
key or none is refused with 401, unless the file says ``unlisted = "default"``; else the tenant
named by ``--tenant-header``, which the operator declares a proxy it trusts sets (one field: two
are refused, as a proxy that appends its value to the client's would lose to it; a name the file
does not list is refused with 400, or counted as ``default`` under ``unlisted = "default"``);
else ``default``. Keys are kept as digests only (an HMAC under a secret of the process, or the
file's salted hashes), never shown nor logged; ``/metrics`` names tenants as the file does.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from ..admission.fairness import DEFAULT_TENANT, PRIORITY_RANGE, FairPolicy, Tenant
from ..http.errors import APIError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "PRIORITY_GRANTED_HEADER",
    "TenantKeys",
    "TenantResolver",
    "TenantsFile",
    "Unlisted",
    "check_tenant_header",
    "hash_key",
    "load_tenants",
    "parse_priority",
]

#: What a key (or a trusted header's tenant) the file does not list gets.
Unlisted = Literal["refuse", "default"]
#: The class a request was served in, on its answer, when it asked (``X-Priority``) for one its
#: tenant is not granted.
PRIORITY_GRANTED_HEADER = "X-Priority-Granted"

_TERMS = {"weight", "max_share", "max_queue_wait", "priorities"}
_IDENTITY = {"keys", "key_hashes"}
_TOP = {"max_queued", "unlisted", "default", "tenants"}
#: Names kept apart: ``default`` is the tenant of everyone unlisted, ``other`` the label
#: ``/metrics`` sums the tenants past its top ten under.
_RESERVED = {DEFAULT_TENANT, "other"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: RFC 9110 5.6.2: a field name is a token.
_FIELD_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: Headers a tenant header may not be: credentials, the class, framing, hop-by-hop.
_NOT_A_TENANT_HEADER = {
    "authorization", "api-key", "x-priority", "content-type", "content-length", "host",
    "connection", "transfer-encoding", "cookie", "te", "upgrade", "prefer",
}  # fmt: skip
_CREDENTIALS = (b"authorization", b"api-key")
_HASH_SCHEME = "sha256"


def hash_key(key: str, salt: bytes | None = None) -> str:
    """A salted hash of an API key for the tenants file's ``key_hashes``:
    ``sha256:<salt, hex>:<SHA-256 of the salt and the key, hex>``; a random salt by default.

    >>> hash_key("sk-chat-1", salt=bytes(4))
    'sha256:00000000:e2b92a1cdf68a7ef5ff2afacf0919e0c2f0a645993bb18497c605c0e48de6f15'
    """
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.sha256(salt + key.encode("utf-8")).hexdigest()
    return f"{_HASH_SCHEME}:{salt.hex()}:{digest}"


@dataclass(frozen=True, slots=True, eq=False)
class TenantKeys:
    """The API keys the tenants file lists, by tenant, kept as digests only, and what a key it
    does not list gets (``unlisted``)."""

    unlisted: Unlisted = "refuse"
    _secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _plain: Mapping[bytes, str] = field(default_factory=dict, repr=False)
    _salted: tuple[tuple[bytes, bytes, str], ...] = field(default=(), repr=False)

    @classmethod
    def build(
        cls,
        plain: Iterable[tuple[str, str]] = (),
        salted: Iterable[tuple[bytes, bytes, str]] = (),
        *,
        unlisted: Unlisted = "refuse",
    ) -> TenantKeys:
        """From (key, tenant) pairs and (salt, digest, tenant) triples."""
        secret = secrets.token_bytes(32)
        table = {_mac(secret, key): tenant for key, tenant in plain}
        return cls(unlisted=unlisted, _secret=secret, _plain=table, _salted=tuple(salted))

    @property
    def listed(self) -> bool:
        """Whether the file lists any key (the gateway then checks every request's)."""
        return bool(self._plain or self._salted)

    def tenant_of(self, key: str) -> str | None:
        """The tenant ``key`` is listed for, None when it is not."""
        found = self._plain.get(_mac(self._secret, key))
        raw = key.encode("utf-8")
        for salt, digest, tenant in self._salted:  # each compared, in constant time
            if hmac.compare_digest(hashlib.sha256(salt + raw).digest(), digest):
                found = found or tenant
        return found


def _mac(secret: bytes, key: str) -> bytes:
    return hmac.new(secret, key.encode("utf-8"), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class TenantsFile:
    """A tenants file read: the fair shares' ``policy`` and the ``keys`` that name tenants."""

    policy: FairPolicy
    keys: TenantKeys


# --- the file -----------------------------------------------------------------------------------


def _terms(where: str, table: Any, *, identity: bool) -> tuple[Tenant, dict[str, Any]]:
    """The terms in ``table`` and, where keys may be given, its identity fields."""
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table of {', '.join(sorted(_TERMS))}")
    allowed = _TERMS | _IDENTITY if identity else _TERMS
    unknown = set(table) - allowed
    if unknown:
        name = sorted(unknown)[0]
        why = " (the default tenant is everyone unlisted: no keys)" if name in _IDENTITY else ""
        raise ValueError(f"{where}: unknown setting {name!r}{why}")
    terms: dict[str, Any] = {}
    for name in ("weight", "max_share", "max_queue_wait"):
        if name in table:
            value = table[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {name} must be a number, got {value!r}")
            terms[name] = float(value)
    if "priorities" in table:
        classes = table["priorities"]
        if not isinstance(classes, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in classes
        ):
            raise ValueError(f"{where}: priorities must be a list of integers, got {classes!r}")
        terms["priorities"] = tuple(sorted(set(classes)))
    try:
        tenant = Tenant(**terms)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return tenant, {k: table[k] for k in _IDENTITY if k in table}


def _key_list(where: str, name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k.strip() for k in value):
        raise ValueError(f"{where}: {name} must be a list of non-empty strings")
    return [k.strip() for k in value]


def _salted(where: str, text: str) -> tuple[bytes, bytes]:
    scheme, _, rest = text.partition(":")
    salt, _, digest = rest.partition(":")
    try:
        parsed = bytes.fromhex(salt), bytes.fromhex(digest)
    except ValueError:
        parsed = None
    if scheme != _HASH_SCHEME or parsed is None or len(parsed[1]) != 32 or not parsed[0]:
        raise ValueError(
            f"{where}: a key hash must read 'sha256:<salt hex>:<64 hex digits>' (hash_key "
            f"writes one), got {text[:24]!r}..."
        )
    return parsed


def _read(path: Path, where: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        data: dict[str, Any] = tomllib.loads(text)
        return data
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where} is not TOML: {exc}") from None


def load_tenants(path: str | Path) -> TenantsFile:
    """The tenants file at ``path``; a ValueError naming ``--tenants``, the file and what is
    wrong (the tenant, the setting) otherwise."""
    where = f"--tenants {path}"
    data = _read(Path(path), where)
    unknown = set(data) - _TOP
    if unknown:
        raise ValueError(f"{where}: unknown setting {sorted(unknown)[0]!r}")
    unlisted = data.get("unlisted", "refuse")
    if unlisted not in get_args(Unlisted):
        raise ValueError(f'{where}: unlisted must be "refuse" or "default", got {unlisted!r}')
    listed = data.get("tenants", {})
    if not isinstance(listed, dict):
        raise ValueError(f"{where}: [tenants] must be a table of tables")
    tenants: dict[str, Tenant] = {}
    plain: list[tuple[str, str]] = []
    salted: list[tuple[bytes, bytes, str]] = []
    owner: dict[str, str] = {}
    for name, table in listed.items():
        if name in _RESERVED:
            raise ValueError(
                f"{where}: [tenants.{name}]: {name!r} is reserved; give the default tenant's "
                f"terms as [{DEFAULT_TENANT}]"
            )
        if not _NAME.match(name):
            raise ValueError(
                f"{where}: tenant {name!r}: a name is 1 to 64 letters, digits, '.', '_' or '-'"
            )
        here = f"{where}: [tenants.{name}]"
        tenants[name], identity = _terms(here, table, identity=True)
        for key in _key_list(here, "keys", identity.get("keys", [])):
            if key in owner:
                raise ValueError(f"{here}: a key of it is listed for {owner[key]!r} too")
            owner[key] = name
            plain.append((key, name))
        for text in _key_list(here, "key_hashes", identity.get("key_hashes", [])):
            salt, digest = _salted(here, text)
            salted.append((salt, digest, name))
    default_table = data.get(DEFAULT_TENANT, {})
    default, _ = _terms(f"{where}: [{DEFAULT_TENANT}]", default_table, identity=False)
    max_queued = data.get("max_queued")
    if max_queued is not None and (isinstance(max_queued, bool) or not isinstance(max_queued, int)):
        raise ValueError(f"{where}: max_queued must be an integer, got {max_queued!r}")
    try:
        policy = FairPolicy(tenants=tenants, default=default, max_queued=max_queued)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return TenantsFile(policy=policy, keys=TenantKeys.build(plain, salted, unlisted=unlisted))


def check_tenant_header(name: str) -> str:
    """``name`` as a ``--tenant-header``, or a ValueError naming the option: a field name
    (RFC 9110's token), not one the gateway reads for anything else."""
    if not _FIELD_NAME.match(name):
        raise ValueError(
            f"--tenant-header: {name!r} is not a header field name (letters, digits and "
            "!#$%&'*+-.^_`|~, no spaces)"
        )
    if name.lower() in _NOT_A_TENANT_HEADER:
        raise ValueError(f"--tenant-header: {name!r} means something else; name another header")
    return name


# --- a request ----------------------------------------------------------------------------------


def _values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in headers if k == name]


def _refused(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class TenantResolver:
    """Resolves a request's headers into the tenant the gateway verified (see the module), by
    the file's ``policy`` and ``keys``, the gateway's own ``api_key`` and the trusted
    ``header``."""

    def __init__(
        self,
        policy: FairPolicy,
        keys: TenantKeys | None = None,
        *,
        api_key: str | None = None,
        header: str | None = None,
    ) -> None:
        self.policy = policy
        self.keys = keys or TenantKeys()
        self.api_key = api_key
        self.header = header.lower().encode("latin-1") if header is not None else None
        self.header_name = header
        #: Whether every request's key is checked.
        self.authenticates = self.keys.listed or api_key is not None
        #: Headers no one past the gateway sees: the credentials it checked, the proxy's header.
        private = [*(_CREDENTIALS if self.authenticates else ()), self.header]
        self.private = frozenset(h for h in private if h is not None)

    def _key(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        bearer = _values(headers, b"authorization")
        if len(bearer) > 1:
            raise APIError(400, "more than one Authorization field", code="invalid_api_key")
        scheme, _, token = (bearer[0] if bearer else "").strip().partition(" ")
        if scheme.lower() != "bearer":
            token = next(iter(_values(headers, b"api-key")), "")
        # The header's bytes (ASGI's latin-1) as the UTF-8 text a key is written in.
        return token.strip().encode("latin-1").decode("utf-8", "replace") or None

    def resolve(self, headers: Sequence[tuple[bytes, bytes]]) -> str:
        """The tenant of a request with ``headers`` (ASGI's: lower-case names, bytes), or the
        :class:`APIError` that refuses it (401: a key not accepted; 400: a trusted header given
        twice, or naming a tenant the file does not list)."""
        key = self._key(headers)
        if key is not None:
            tenant = self.keys.tenant_of(key)
            if tenant is not None:
                return tenant
        accepted = (
            key is not None
            and self.api_key is not None
            and hmac.compare_digest(key.encode("utf-8"), self.api_key.encode("utf-8"))
        )
        if self.authenticates and not accepted and self.keys.unlisted == "refuse":
            what = "Incorrect" if key is not None else "Missing"
            raise _refused(
                f"{what} API key: send 'Authorization: Bearer <key>' with a key the gateway's "
                "tenants file lists."
            )
        if self.header is None:
            return DEFAULT_TENANT
        values = _values(headers, self.header)
        if len(values) > 1:
            raise APIError(
                400,
                f"more than one {self.header_name} field: it is set by the gateway's trusted "
                "proxy, which must replace a client's, not add to it",
                code="invalid_tenant",
                param=self.header_name,
            )
        name = values[0].strip() if values else ""
        if not name or name == DEFAULT_TENANT or name in self.policy.tenants:
            return name or DEFAULT_TENANT
        if self.keys.unlisted == "default":
            return DEFAULT_TENANT
        raise APIError(
            400,
            f"tenant {name[:64]!r} (from {self.header_name}) is not in the gateway's tenants file",
            code="unknown_tenant",
            param=self.header_name,
        )


def parse_priority(value: str | None) -> int | None:
    """The class ``X-Priority`` asks for (None when absent), or a 400."""
    if value is None:
        return None
    try:
        priority = int(value.strip())
    except ValueError:
        priority = None
    if priority is None or priority not in PRIORITY_RANGE:
        raise APIError(
            400,
            f"X-Priority must be an integer from {PRIORITY_RANGE.start} to "
            f"{PRIORITY_RANGE.stop - 1} (lower is served first), got {value[:40]!r}",
            code="invalid_priority",
            param="X-Priority",
        )
    return priority


if __name__ == "__main__":  # pragma: no cover - a helper for operators
    import getpass

    given = getpass.getpass("API key (not echoed): ").strip()
    if not given:
        sys.exit("no key given")
    print(hash_key(given))
