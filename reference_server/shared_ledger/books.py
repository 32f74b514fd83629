"""The engine's books read once per upstream, for every gateway on the shared ledger.

One process scrapes an upstream engine's ``/metrics``: whoever finds the ``scraper`` key free
takes it (its lease's id, with a TTL of a few scrapes) and renews it at each scrape; when it
dies, the key lapses and the next process to look takes over. The scraper writes the page it
read to ``books`` (a hash: ``by``, ``started`` and ``read`` on the Redis clock in ms, ``text``);
the others read it instead of scraping, and scrape themselves when no new page comes within a
bound (see ``gateway/watch.py``). The page is stored as the engine gave it, so that every
process judges it with the same code as its own scrape: lockstep, KV books, speed.

A lockstep break that any process sees is every process's already (``BREAK``, see
:mod:`.scripts`): nothing of that changes here.

>>> # books = EngineBooks(client, name="http://engine:8000", lease_id=lease.id, ttl=5.0)
>>> # if await books.claim(): ...scrape, then await books.write(text, started_age, read_age)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from ..admission.queue import LedgerUnavailable
from .connection import LEDGER_ERRORS, reply_text

__all__ = ["BOOKS_KEYS", "EngineBooks", "Page"]

#: The keys, under the upstream's hash tag: who scrapes, and what it read.
BOOKS_KEYS = ("scraper", "books")
#: Seconds a page is kept after it was written: long enough for any reader's bound, short
#: enough that a ledger left behind does not keep it.
_KEEP_MS = 60_000

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: ARGV: lease, ttl_ms. Takes the scraper's key when free (or renews it when ours); returns
#: {1 or 0, now_ms, the scraper's lease}.
CLAIM = (
    _NOW
    + """
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, now, ARGV[1]}
end
return {0, now, holder}
"""
)

#: ARGV: lease, ms since the scrape began, ms since it was read, the page. Written only by the
#: scraper of now; returns 1, or 0 when another has taken over.
WRITE = (
    _NOW
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'by', ARGV[1], 'started', now - tonumber(ARGV[2]),
           'read', now - tonumber(ARGV[3]), 'text', ARGV[4])
redis.call('PEXPIRE', KEYS[2], """
    + str(_KEEP_MS)
    + """)
return 1
"""
)

#: ARGV: after_ms. Returns {now_ms, scraper ('' none), by, started_ms, read_ms, text}: the
#: page only when its scrape began at ``after_ms`` or later ('' else; -1: no page).
READ = (
    _NOW
    + """
local scraper = redis.call('GET', KEYS[1]) or ''
local f = redis.call('HMGET', KEYS[2], 'by', 'started', 'read')
local text = ''
if f[2] and tonumber(f[2]) >= tonumber(ARGV[1]) then
  text = redis.call('HGET', KEYS[2], 'text')
end
return {now, scraper, f[1] or '', f[2] or '-1', f[3] or '-1', text}
"""
)


#: ARGV: lease. Frees the scraper's key when it is ours (a gateway that stops), so that the
#: next to look takes over at once rather than when it lapses; returns 1 or 0.
GIVE_BACK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Page:
    """A scrape as another process read it: by whose lease, begun and read when (the Redis
    clock, seconds), and the page."""

    by: str
    started: float
    read: float
    text: str


class EngineBooks:
    """One upstream's scraper key and last page in Redis, for the process of ``lease_id``.
    Methods raise :class:`LedgerUnavailable` when Redis is away."""

    def __init__(self, client: aioredis.Redis, *, name: str, lease_id: str, ttl: float) -> None:
        tag = "{kvclient:" + name + "}"
        self._keys = [f"{tag}:{key}" for key in BOOKS_KEYS]
        self.lease_id = lease_id
        self.ttl_ms = max(1, round(ttl * 1000))
        self._scripts = {s: client.register_script(s) for s in (CLAIM, WRITE, READ, GIVE_BACK)}
        #: The scraper's lease as last heard (None: none, or not asked yet).
        self.scraper: str | None = None

    async def _run(self, script: str, *args: Any) -> Any:
        try:
            return await self._scripts[script](keys=self._keys, args=list(args))
        except LEDGER_ERRORS as exc:
            raise LedgerUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc

    @property
    def mine(self) -> bool:
        """Whether this process was the scraper when last asked."""
        return self.scraper == self.lease_id

    async def claim(self) -> bool:
        """Take (or keep) the scraper's key when it is free or ours: whether this process
        scrapes."""
        taken, _, holder = await self._run(CLAIM, self.lease_id, self.ttl_ms)
        self.scraper = reply_text(holder)
        return bool(int(taken))

    async def write(self, text: str, *, started_age: float, read_age: float) -> bool:
        """The page read ``read_age`` seconds ago, by a scrape begun ``started_age`` ago;
        False when another process scrapes now (nothing written)."""
        started_ms, read_ms = (max(0, round(a * 1000)) for a in (started_age, read_age))
        return bool(int(await self._run(WRITE, self.lease_id, started_ms, read_ms, text)))

    async def give_back(self) -> None:
        """Free the scraper's key if this process holds it (it stops scraping)."""
        await self._run(GIVE_BACK, self.lease_id)
        self.scraper = None

    async def read(self, after: float | None = None) -> tuple[float, Page | None]:
        """(the Redis clock now, the page whose scrape began at ``after`` or later, or None);
        ``after`` None: only the clock."""
        after_ms = 2**52 if after is None else round(after * 1000)  # None: no page is late enough
        now, scraper, by, started, read, text = await self._run(READ, after_ms)
        self.scraper = reply_text(scraper) or None
        if after is None or int(started) < 0 or not text:
            return int(now) / 1000, None
        page = Page(
            by=reply_text(by),
            started=int(started) / 1000,
            read=int(read) / 1000,
            text=reply_text(text),
        )
        return int(now) / 1000, page
