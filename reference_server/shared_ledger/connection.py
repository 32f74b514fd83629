"""Reaching the shared ledger's Redis: a URL (``redis://``, ``rediss://`` with TLS, or
``redis+sentinel://`` through Sentinel) made into a client with short timeouts, what a Redis that
is away raises, and closing the client."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["COMMAND_TIMEOUT", "LEDGER_ERRORS", "SENTINEL_SCHEME", "close", "connect"]

#: The scheme of a ledger found through Redis Sentinel (see :func:`connect`).
SENTINEL_SCHEME = "redis+sentinel://"

#: Seconds any one Redis command may take before the ledger counts as away.
COMMAND_TIMEOUT = 1.0

#: What a Redis that is away raises.
LEDGER_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)


def connect(
    url: str,
    *,
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    environ: dict[str, str] | None = None,
) -> aioredis.Redis:
    """A Redis client for ``redis://HOST:PORT/DB``, ``rediss://`` (TLS), or
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``: the master of ``SERVICE`` as
    those Sentinels name it, found again after a failover. A password missing from the URL is
    taken from ``$KVCLIENT_LEDGER_PASSWORD`` when set (with Sentinel: the master's; the
    Sentinels themselves are asked without one).

    Over TLS, Redis's certificate is verified (host name included) against ``ca_file`` (PEM;
    default: the system's CAs); ``client_cert`` (with its key in ``client_key`` or in the same
    file) is shown to a Redis that asks for one (``tls-auth-clients``, on by default)."""
    if not url.startswith(("redis://", "rediss://", SENTINEL_SCHEME)):
        raise ValueError(
            f"--ledger must be a redis://, rediss:// or {SENTINEL_SCHEME} URL, "
            f"got {url.split('@')[-1]!r}"
        )
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {
        "socket_timeout": COMMAND_TIMEOUT,
        "socket_connect_timeout": COMMAND_TIMEOUT,
        # One retry on a fresh connection: a pooled one may have died with a Redis restart (or
        # a failover). The scripts are idempotent, so one that ran before its answer was lost
        # may run again.
        "retry": Retry(NoBackoff(), 1),
        "retry_on_error": [redis.exceptions.ConnectionError],
    }
    password = env.get("KVCLIENT_LEDGER_PASSWORD")
    if password and "@" not in url:
        options["password"] = password
    tls = {"ssl_ca_certs": ca_file, "ssl_certfile": client_cert, "ssl_keyfile": client_key}
    if any(tls.values()):
        if not url.startswith("rediss://"):
            raise ValueError("TLS files need a rediss:// URL")
        options.update({key: value for key, value in tls.items() if value is not None})
    if url.startswith(SENTINEL_SCHEME):
        return _sentinel_master(url, options)
    return aioredis.from_url(url, **options)


def _sentinel_master(url: str, options: dict[str, Any]) -> aioredis.Redis:
    """The client of a ``redis+sentinel://`` URL's master (see :func:`connect`)."""
    from redis.asyncio.sentinel import Sentinel

    rest = url[len(SENTINEL_SCHEME) :]
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    if userinfo:
        user, _, password = userinfo.partition(":")
        options["password"] = unquote(password)
        if user:
            options["username"] = unquote(user)
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"--ledger: a Sentinel must be HOST:PORT, got {host!r}")
        sentinels.append((name.strip("[]"), int(port)))
    service, _, db = path.strip("/").partition("/")
    if not service or (db and not db.isdigit()):
        raise ValueError(
            f"--ledger: {SENTINEL_SCHEME}HOST:PORT[,HOST:PORT...]/SERVICE[/DB], got "
            f"{url.split('@')[-1]!r}"
        )
    sockets = {key: value for key, value in options.items() if key.startswith("socket_")}
    sentinel = Sentinel(sentinels, sentinel_kwargs=sockets, **sockets)
    master: aioredis.Redis = sentinel.master_for(service, db=int(db or 0), **options)
    return master


async def close(client: aioredis.Redis) -> None:
    """Close a client from :func:`connect`, and the Sentinels' connections with it."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    await client.aclose()
    if isinstance(client.connection_pool, SentinelConnectionPool):
        for sentinel in client.connection_pool.sentinel_manager.sentinels:
            await sentinel.aclose()
