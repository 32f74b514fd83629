"""The holders let go lately, kept a while in Redis, and the Lua that keeps and forgets them.

A holder released (``RELEASE``) is kept ``LET_GO_SECONDS``: ``let_go`` (a sorted set:
reservation -> when it was released, ms of the Redis clock) and ``let_go_records`` (a hash:
reservation -> its ``progress`` value and its ``holders`` value, a line each), forgotten by the
sweep once older (both keys expire with the last). A short holder that lived wholly between two
of a gateway's reads of the holders is in neither, while the engine's page taken between them
may show it: ``PEAK_SNAPSHOT`` gives the holders let go when asked, and the engine's books
count them until the page is newer than their release, as the in-process ledger counts its own
(``engine_used``). Not the holders of a lease swept: their records are up to a lease older than
the sweep, and a gateway cut off from Redis may still run them (KV that nobody explains is the
truth then); nor one that ``LEAVE`` releases (admitted for a waiter that had gone, it never
reached the engine).
"""

from __future__ import annotations

__all__ = ["LET_GO_SECONDS", "let_go_lua"]

#: How long a holder released is kept (see the module): longer than from the start of an
#: engine's page to a gateway's read of the holders after it (two scrape intervals of at most a
#: second, or the scrape's 2 s timeout) and the relay's margin before it. One older is not
#: explained: whole caps for a page, the safe way.
LET_GO_SECONDS = 10.0


def let_go_lua(*, let_go: str, records: str, progress: str, holders: str) -> str:
    """The Lua functions the scripts share for the holders let go, over the given keys
    (``KEYS[n]`` expressions): ``remember(field, now)`` keeps a holder being released (before
    its ``progress`` and ``holders`` values go), ``forget(now)`` drops those kept too long."""
    return f"""
local LET_GO_MS = {round(LET_GO_SECONDS * 1000)}
local function remember(field, now)
  local progress = redis.call('HGET', {progress}, field) or ''
  redis.call('ZADD', {let_go}, now, field)
  redis.call('HSET', {records}, field, progress .. '\\n' .. redis.call('HGET', {holders}, field))
  redis.call('PEXPIRE', {let_go}, LET_GO_MS)
  redis.call('PEXPIRE', {records}, LET_GO_MS)
end
local function forget(now)
  local older = '(' .. (now - LET_GO_MS)
  local old = redis.call('ZRANGEBYSCORE', {let_go}, '-inf', older)
  for _, field in ipairs(old) do
    redis.call('HDEL', {records}, field)
  end
  if #old > 0 then
    redis.call('ZREMRANGEBYSCORE', {let_go}, '-inf', older)
  end
end
"""
