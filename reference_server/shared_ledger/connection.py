"""Reaching the shared ledger's Redis: a URL (``redis://``, ``rediss://`` with TLS, or
``redis+sentinel://`` through Sentinel) made into a client with short timeouts, what a Redis that
is away raises, and closing the client. The clients are asyncio's, but for the lease's thread
(:mod:`.lease`), whose client is synchronous, made from the same settings
(:func:`connect_sync`)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.exceptions
import redis.retry
from redis.backoff import NoBackoff

__all__ = [
    "COMMAND_TIMEOUT",
    "LEDGER_ERRORS",
    "SENTINEL_SCHEME",
    "close",
    "close_sync",
    "connect",
    "connect_sync",
    "reply_text",
]

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
    options = _options(url, ca_file, client_cert, client_key, environ)
    options["retry"] = redis.asyncio.retry.Retry(NoBackoff(), 1)
    if url.startswith(SENTINEL_SCHEME):
        from redis.asyncio.sentinel import Sentinel

        sentinels, service, db, sockets = _sentinel(url, options)
        sentinel = Sentinel(sentinels, sentinel_kwargs=sockets, **sockets)
        master: aioredis.Redis = sentinel.master_for(service, db=db, **options)
        return master
    return aioredis.from_url(url, **options)


def connect_sync(
    url: str,
    *,
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    environ: dict[str, str] | None = None,
) -> redis.Redis:
    """:func:`connect`'s synchronous twin, from the same settings (for a thread of its own)."""
    options = _options(url, ca_file, client_cert, client_key, environ)
    options["retry"] = redis.retry.Retry(NoBackoff(), 1)
    if url.startswith(SENTINEL_SCHEME):
        from redis.sentinel import Sentinel

        sentinels, service, db, sockets = _sentinel(url, options)
        sentinel = Sentinel(sentinels, sentinel_kwargs=sockets, **sockets)
        master: redis.Redis = sentinel.master_for(service, db=db, **options)
        return master
    return redis.Redis.from_url(url, **options)


def _options(
    url: str,
    ca_file: str | None,
    client_cert: str | None,
    client_key: str | None,
    environ: dict[str, str] | None,
) -> dict[str, Any]:
    """The settings of a client for ``url`` (see :func:`connect`), but its retry, which is the
    client's own kind."""
    if not url.startswith(("redis://", "rediss://", SENTINEL_SCHEME)):
        raise ValueError(
            f"--ledger must be a redis://, rediss:// or {SENTINEL_SCHEME} URL, "
            f"got {url.split('@')[-1]!r}"
        )
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {
        "socket_timeout": COMMAND_TIMEOUT,
        "socket_connect_timeout": COMMAND_TIMEOUT,
        # One retry on a fresh connection (the caller adds it): a pooled one may have died with
        # a Redis restart (or a failover). The scripts are idempotent, so one that ran before
        # its answer was lost may run again.
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
    return options


def _sentinel(
    url: str, options: dict[str, Any]
) -> tuple[list[tuple[str, int]], str, int, dict[str, Any]]:
    """A ``redis+sentinel://`` URL's Sentinels, service, database and the Sentinels' socket
    settings (see :func:`connect`); the master's user and password go into ``options``."""
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
    return sentinels, service, int(db or 0), sockets


async def close(client: aioredis.Redis) -> None:
    """Close a client from :func:`connect`, and the Sentinels' connections with it."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    await client.aclose()
    if isinstance(client.connection_pool, SentinelConnectionPool):
        for sentinel in client.connection_pool.sentinel_manager.sentinels:
            await sentinel.aclose()


def close_sync(client: redis.Redis) -> None:
    """Close a client from :func:`connect_sync`, and the Sentinels' connections with it."""
    from redis.sentinel import SentinelConnectionPool

    client.close()
    if isinstance(client.connection_pool, SentinelConnectionPool):
        for sentinel in client.connection_pool.sentinel_manager.sentinels:
            sentinel.close()


def reply_text(value: Any) -> str:
    """A Redis reply (bytes from a client that does not decode) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
