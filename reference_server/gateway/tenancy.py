"""Tenants at the gateway's door: :class:`TenantMiddleware` verifies who each request is (by
:class:`~.tenants.TenantResolver`) before anything else reads it, and :func:`with_tenant` gives a
planned request its tenant and the priority class its tenant is granted.

The middleware answers a request it refuses (401, or 400 for a trusted header given twice or
naming an unknown tenant) itself; the one it lets in goes on without the credentials it checked
and without the proxy's header, with its verdict in the scope (:data:`SCOPE_KEY`), and its
answer says so when the class it asked for was not granted (``X-Priority-Granted``).
``/health`` and ``/metrics`` stay open, as with ``--api-key``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..admission.fairness import DEFAULT_TENANT, FairScheduler, Tenant
from ..http.errors import APIError
from ..http.generation import Plan
from ..http.requests import scope_header
from .tenants import PRIORITY_GRANTED_HEADER, TenantResolver, parse_priority

__all__ = ["SCOPE_KEY", "Identity", "TenantMiddleware", "with_tenant"]

#: Where the verdict is kept in an ASGI scope.
SCOPE_KEY = "kvclient.tenant"
_GRANTED = PRIORITY_GRANTED_HEADER.lower().encode("latin-1")


@dataclass(slots=True)
class Identity:
    """A request's verified tenant and its terms; the class it asked for and the one it was
    granted, once read (:func:`with_tenant`)."""

    tenant: str
    terms: Tenant
    asked: int | None = None
    granted: int | None = None


class TenantMiddleware:
    """Refuses a request whose identity the gateway cannot verify; records the tenant of one
    it can (see the module)."""

    def __init__(
        self,
        app: ASGIApp,
        resolver: TenantResolver,
        exempt: tuple[str, ...] = ("/health", "/metrics"),
    ) -> None:
        self.app = app
        self.resolver = resolver
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith(("http://", "https://")):  # absolute form, routed by its path
            path = urllib.parse.urlsplit(path).path or "/"
        if path in self.exempt:
            await self.app(scope, receive, send)
            return
        headers: Sequence[tuple[bytes, bytes]] = scope["headers"]
        try:
            tenant = self.resolver.resolve(headers)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        identity = Identity(tenant=tenant, terms=self.resolver.policy.terms(tenant))
        private = self.resolver.private
        scope = {
            **scope,
            "headers": [(k, v) for k, v in headers if k not in private],
            SCOPE_KEY: identity,
        }

        async def send_granted(message: Message) -> None:
            asked, granted = identity.asked, identity.granted
            if (
                message["type"] == "http.response.start"
                and asked is not None
                and granted is not None
                and granted != asked
            ):
                extra = (_GRANTED, str(granted).encode("latin-1"))
                message = {**message, "headers": [*message.get("headers", []), extra]}
            await send(message)

        await self.app(scope, receive, send_granted)


def with_tenant(scope: Scope, plan: Plan, fair: Sequence[FairScheduler], need: int) -> Plan:
    """``plan`` with its verified tenant and the class it is granted (``X-Priority`` within its
    tenant's grant, else the nearest granted, see :meth:`.Tenant.grant`); a 400 naming the tenant
    when it needs more than its tenant may ever hold on any upstream (a 429 would send it round
    for ever), or when ``X-Priority`` is not a class."""
    identity = scope.get(SCOPE_KEY)
    if not isinstance(identity, Identity):
        identity = Identity(tenant=DEFAULT_TENANT, terms=Tenant())  # nobody verified: no grant
    tenant = identity.tenant
    if fair and all(f.never_within(tenant, need) for f in fair):
        most = max(f.limit(f.resolve(tenant)) for f in fair)
        raise APIError(
            400,
            f"This request can never be admitted: it needs {need} KV tokens and its tenant "
            f"{tenant!r} may hold at most {most} at once; ask for fewer output tokens.",
            code="tenant_share_exceeded",
            param="max_tokens",
        )
    asked = parse_priority(scope_header(scope, b"x-priority"))
    granted = identity.terms.grant(0 if asked is None else asked)
    identity.asked, identity.granted = asked, granted
    return replace(plan, tenant=tenant, priority=granted)
