"""The shared ledger's Lua scripts: each operation is one script, run atomically by Redis.

Keys, per upstream (one hash tag, so they live on one node): ``holders`` (a hash: reservation ->
``"lease tokens cap admitted_ms"``), ``reserved`` (their tokens summed), ``queue`` (a sorted set of
waiting tickets in arrival order), ``queued`` (their needs summed), ``seq`` (the arrival counter),
``leases`` (a sorted set: lease -> expiry in ms of the Redis clock), ``occupancy`` (a hash: the
time integrals the speed measurement reads, see ``OCCUPANCY``), ``config`` (the budget's
fingerprint), ``gone`` (the leases swept for expiring, remembered for an hour); and one pub/sub
channel, ``released``, told of every change as ``"wake reserved holders queued"``: the totals after
it (tokens reserved, reservations, tokens the queue waits for), and ``wake`` 1 when the change may
let a waiter in (a release, a shrink, a lease swept, a ticket leaving the queue or admitted from
its head with others behind it), so that waiters in every process wake and every process knows the
shared room.

A reservation and a ticket are both named ``lease:n:need``, so the holders and waiters of a lease
are found by their prefix. Every script may run twice (a retry after a lost answer) and mean
the same as once. Every script first sweeps expired leases: their holders' tokens come
back and their tickets leave the queue, so a gateway that died cannot pin the budget. Times are
the Redis server's (``TIME``), so gateways on machines with different clocks agree.
"""

from __future__ import annotations

__all__ = [
    "ADMIT",
    "CONFIG",
    "DEFAULT_LEASE_SECONDS",
    "KEY_NAMES",
    "LEAVE",
    "OCCUPANCY",
    "RELEASE",
    "RENEW",
    "RESTORE",
    "SHRINK",
    "SNAPSHOT",
]

#: A lease not renewed for this long is expired: its reservations come back.
DEFAULT_LEASE_SECONDS = 5.0

KEY_NAMES = (
    "holders", "reserved", "queue", "seq", "leases", "config", "gone", "released", "queued",
    "occupancy",
)  # fmt: skip

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function enqueue(ticket)
  redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ticket)
  redis.call('INCRBY', KEYS[9], string.match(ticket, ':(%d+)$'))
end
local function dequeue(ticket)
  if redis.call('ZREM', KEYS[3], ticket) == 0 then
    return false
  end
  redis.call('DECRBY', KEYS[9], string.match(ticket, ':(%d+)$'))
  return true
end
local function drop_lease(lease)
  local prefix = lease .. ':'
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, #prefix) == prefix then
      local tokens = string.match(all[i + 1], '^%S+ (%d+)')
      redis.call('HDEL', KEYS[1], all[i])
      redis.call('DECRBY', KEYS[2], tokens)
    end
  end
  local tickets = redis.call('ZRANGE', KEYS[3], 0, -1)
  for _, ticket in ipairs(tickets) do
    if string.sub(ticket, 1, #prefix) == prefix then
      dequeue(ticket)
    end
  end
end
local function state()
  return (redis.call('GET', KEYS[2]) or '0') .. ' ' .. redis.call('HLEN', KEYS[1]) .. ' '
    .. (redis.call('GET', KEYS[9]) or '0')
end
local function tell(wake)
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
  local dead = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
  for _, lease in ipairs(dead) do
    drop_lease(lease)
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

#: ARGV: lease, ticket, need, cap, usable, max_concurrency (0: none), enqueue (1/0).
#: Returns {1, now, state} admitted, {0, now, state} not now (queued when asked), {-1, now, state}
#: the lease is gone; ``state`` is ``"reserved holders queued"`` after it.
ADMIT = (
    _PRELUDE
    + """
local now = now_ms()
sweep(now)
local lease, ticket, need = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not redis.call('ZSCORE', KEYS[5], lease) then
  return {-1, now, state()}
end
if redis.call('HEXISTS', KEYS[1], ticket) == 1 then
  return {1, now, state()}  -- admitted already: this is a retry whose first answer was lost
end
local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
if head == nil or head == ticket then
  local reserved = tonumber(redis.call('GET', KEYS[2]) or '0')
  local most = tonumber(ARGV[6])
  if reserved + need <= tonumber(ARGV[5])
      and (most == 0 or redis.call('HLEN', KEYS[1]) < most) then
    redis.call('HSET', KEYS[1], ticket, lease .. ' ' .. need .. ' ' .. ARGV[4] .. ' ' .. now)
    redis.call('HINCRBY', KEYS[10], 'admitted', 1)
    redis.call('INCRBY', KEYS[2], need)
    local next_may_fit = dequeue(ticket) and redis.call('ZCARD', KEYS[3]) > 0
    tell(next_may_fit and 1 or 0)
    return {1, now, state()}
  end
end
if ARGV[7] == '1' and not redis.call('ZSCORE', KEYS[3], ticket) then
  enqueue(ticket)
  tell(0)
end
return {0, now, state()}
"""
)

#: ARGV: reservation. Returns the tokens given back; 0 when it was not held (released already,
#: or swept with its lease): a reservation is never released twice.
RELEASE = (
    _PRELUDE
    + """
local _, tokens = holder(ARGV[1])
if not tokens then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], tokens)
tell(1)
return tokens
"""
)

#: ARGV: reservation, tokens now needed. Returns the tokens given back (never raises one).
SHRINK = (
    _PRELUDE
    + """
local lease, tokens, rest = holder(ARGV[1])
if not tokens then
  return 0
end
local freed = tokens - tonumber(ARGV[2])
if freed <= 0 then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], lease .. ' ' .. ARGV[2] .. ' ' .. rest)
redis.call('DECRBY', KEYS[2], freed)
tell(1)
return freed
"""
)

#: ARGV: ticket. A waiter that gives up leaves the queue.
LEAVE = (
    _PRELUDE
    + """
sweep(now_ms())
if dequeue(ARGV[1]) then
  tell(1)
  return 1
end
return 0
"""
)

#: ARGV: lease, ttl_ms. Extends the lease (and the config's life with it). Returns 1 when the
#: lease was still valid, 0 when it had lapsed: its holders are gone (swept here if they were
#: not yet) and it starts afresh; 2 when Redis does not know the lease at all (it lost its data,
#: a restart without persistence): the caller restores what it holds.
RENEW = (
    _PRELUDE
    + """
local now = now_ms()
local expiry = redis.call('ZSCORE', KEYS[5], ARGV[1])
sweep(now)
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[6], 4 * tonumber(ARGV[2]))
if expiry and tonumber(expiry) > now then
  return 1
end
if not expiry and redis.call('SISMEMBER', KEYS[7], ARGV[1]) == 0 then
  return 2
end
return 0
"""
)

#: ARGV: field, value, field, value...: reservations put back after Redis lost its data. The
#: engine still holds them, so they count even past the budget (nothing more is admitted until
#: they end).
RESTORE = (
    _PRELUDE
    + """
tick(now_ms())
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('INCRBY', KEYS[2], string.match(ARGV[i + 1], '^%S+ (%d+)'))
  end
end
return 1
"""
)

#: ARGV: fingerprint, ttl_ms. Returns the fingerprint in force: ours, or another gateway's.
CONFIG = """
local have = redis.call('GET', KEYS[6])
if have and have ~= ARGV[1] then
  return have
end
redis.call('SET', KEYS[6], ARGV[1], 'PX', 4 * tonumber(ARGV[2]))
return ARGV[1]
"""

#: Returns {now, reserved, holders (flat field/value list), waiting tickets in order}.
SNAPSHOT = (
    _PRELUDE
    + """
local now = now_ms()
sweep(now)
return {now, tonumber(redis.call('GET', KEYS[2]) or '0'), redis.call('HGETALL', KEYS[1]),
        redis.call('ZRANGE', KEYS[3], 0, -1)}
"""
)

#: Returns {reservation-ms, busy ms, admitted}: since the upstream's keys began, the time
#: integral of the reservations held, the time any was held, and the reservations admitted, by
#: every gateway (what the gateway's speed measurement reads, as the in-process ledger's
#: ``occupancy``).
OCCUPANCY = (
    _PRELUDE
    + """
sweep(now_ms())
local held, busy, admitted = unpack(redis.call('HMGET', KEYS[10], 'held', 'busy', 'admitted'))
return {tonumber(held or '0'), tonumber(busy or '0'), tonumber(admitted or '0')}
"""
)
