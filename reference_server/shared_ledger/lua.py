"""The Lua every shared-ledger script begins with (:mod:`.scripts`): the order of an upstream's
keys (``KEYS[n]``) and the functions the scripts share: the Redis clock, the queue, the sweep of
expired leases, telling every process of a change, the occupancy integrals, and the functions of
the holders let go (:mod:`.let_go`), of the prefix records (:mod:`.prefixes`) and of a holder's
records at admission and its charge (:mod:`.holding`).
"""

from __future__ import annotations

from .holding import holding_lua
from .let_go import let_go_lua
from .prefixes import lending_lua

__all__ = ["KEY_NAMES", "PRELUDE", "ticket_need"]

KEY_NAMES = (
    "holders", "reserved", "queue", "seq", "leases", "config", "gone", "released", "queued",
    "occupancy", "version", "fair", "tickets", "progress", "grown", "draining", "drain",
    "let_go", "let_go_records", "prefixes", "blocks", "tainted",
)  # fmt: skip


def ticket_need(ticket: str) -> int:
    """The tokens a queue ticket (``lease:n:need``, :meth:`.ledger.RedisLedger.ticket`) waits
    for: the scripts read it from the ticket's last field as well."""
    return int(ticket.rsplit(":", 1)[1])


def _key(name: str) -> str:
    """The ``KEYS[n]`` expression of key ``name``."""
    return f"KEYS[{KEY_NAMES.index(name) + 1}]"


#: The prefix records' functions (:mod:`.prefixes`), over this tuple's keys.
_LENDING = lending_lua(
    prefixes=_key("prefixes"), blocks=_key("blocks"), tainted=_key("tainted"),
    progress=_key("progress"),
)  # fmt: skip

#: The holders let go (:mod:`.let_go`): kept by ``RELEASE``, forgotten by every sweep.
_LET_GO = let_go_lua(
    let_go=_key("let_go"), records=_key("let_go_records"), progress=_key("progress"),
    holders=_key("holders"),
)  # fmt: skip

#: A holder's records written at its admission, and what it is charged (:mod:`.holding`).
_HOLDING = holding_lua(
    holders=_key("holders"), progress=_key("progress"), fair=_key("fair"), grown=_key("grown"),
    occupancy=_key("occupancy"), reserved=_key("reserved"),
)  # fmt: skip

PRELUDE = (
    _LET_GO
    + _LENDING
    + _HOLDING
    + """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function enqueue(ticket)
  redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ticket)
  redis.call('INCRBY', KEYS[9], string.match(ticket, ':(%d+)$'))
end
local function let_go(field)
  unlend(field)
  redis.call('HDEL', KEYS[14], field)
  if redis.call('SREM', KEYS[16], field) == 1 and redis.call('SCARD', KEYS[16]) == 0 then
    redis.call('DEL', KEYS[17])
  end
end
local function dequeue(ticket)
  if redis.call('ZREM', KEYS[3], ticket) == 0 then
    return false
  end
  redis.call('DECRBY', KEYS[9], string.match(ticket, ':(%d+)$'))
  return true
end
local function drop_lease(lease, now)
  local prefix = lease .. ':'
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, #prefix) == prefix then
      local tokens = string.match(all[i + 1], '^%S+ (%d+)')
      charge(all[i], now)
      redis.call('HDEL', KEYS[1], all[i])
      let_go(all[i])
      redis.call('DECRBY', KEYS[2], tokens)
    end
  end
  local tickets = redis.call('ZRANGE', KEYS[3], 0, -1)
  for _, ticket in ipairs(tickets) do
    if string.sub(ticket, 1, #prefix) == prefix then
      dequeue(ticket)
    end
  end
  local metas = redis.call('HKEYS', KEYS[13])
  for _, ticket in ipairs(metas) do
    if string.sub(ticket, 1, #prefix) == prefix then
      redis.call('HDEL', KEYS[13], ticket)
    end
  end
end
local function state()
  return (redis.call('GET', KEYS[2]) or '0') .. ' ' .. redis.call('HLEN', KEYS[1]) .. ' '
    .. (redis.call('GET', KEYS[9]) or '0')
end
local function tell(wake)
  redis.call('INCR', KEYS[11])
  redis.call('PUBLISH', KEYS[8], wake .. ' ' .. state())
end
local function tick(now)
  local at = tonumber(redis.call('HGET', KEYS[10], 'at') or now)
  if now > at then
    local holders = redis.call('HLEN', KEYS[1])
    redis.call('HINCRBY', KEYS[10], 'held', (now - at) * holders)
    if holders > 0 then
      redis.call('HINCRBY', KEYS[10], 'busy', now - at)
    end
  end
  redis.call('HSET', KEYS[10], 'at', math.max(now, at))
end
local function sweep(now)
  tick(now)
  forget(now)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
  for _, lease in ipairs(dead) do
    drop_lease(lease, now)
    redis.call('ZREM', KEYS[5], lease)
    redis.call('SADD', KEYS[7], lease)
    redis.call('PEXPIRE', KEYS[7], 3600000)
  end
  if #dead > 0 then
    tell(1)
  end
end
local function holder(field)
  sweep(now_ms())
  local held = redis.call('HGET', KEYS[1], field)
  if not held then
    return nil
  end
  local lease, tokens, rest = string.match(held, '^(%S+) (%d+) (.*)$')
  return lease, tonumber(tokens), rest
end
"""
)
