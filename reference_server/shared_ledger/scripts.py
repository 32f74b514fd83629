"""The shared ledger's Lua scripts: each operation is one script, run atomically by Redis.

Keys, per upstream (one hash tag, so they live on one node): ``holders`` (a hash: reservation ->
``"lease tokens cap admitted_ms"``), ``reserved`` (their tokens summed), ``queue`` (a sorted set of
waiting tickets in arrival order), ``queued`` (their needs summed), ``seq`` (the arrival counter),
``leases`` (a sorted set: lease -> expiry in ms of the Redis clock), ``occupancy`` (a hash: the
time integrals the speed measurement reads, see ``OCCUPANCY``), ``config`` (the budget's
fingerprint), ``gone`` (the leases swept for expiring, remembered for an hour), ``version`` (bumped
by every change), ``progress`` and ``grown`` for the peak rule, ``prefixes``, ``blocks`` and
``tainted`` for its shared prefix blocks (see below), and for fair shares
``fair`` and ``tickets`` (see further below), ``let_go`` and ``let_go_records`` (the holders
released lately, see :mod:`.let_go`); and one pub/sub
channel, ``released``, told of every change as ``"wake reserved holders queued"``: the totals after
it (tokens reserved, reservations, tokens the queue waits for), and ``wake`` 1 when the change may
let a waiter in (a release, a lease swept, a ticket leaving the queue or admitted from
its head with others behind it), so that waiters in every process wake and every process knows the
shared room.

A reservation and a ticket are both named ``lease:n:need``, so the holders and waiters of a lease
are found by their prefix. Every script may run twice (a retry after a lost answer) and mean
the same as once. Every script first sweeps expired leases: their holders' tokens come
back and their tickets leave the queue, so a gateway that died cannot pin the budget. Times are
the Redis server's (``TIME``), so gateways on machines with different clocks agree.
"""

from __future__ import annotations

from .let_go import LET_GO_SECONDS
from .lua import KEY_NAMES, PRELUDE

__all__ = [
    "ADMIT",
    "BREAK",
    "CONFIG",
    "DEFAULT_LEASE_SECONDS",
    "FAIR_COMMIT",
    "FAIR_SNAPSHOT",
    "KEY_NAMES",
    "LEAVE",
    "LET_GO_SECONDS",
    "OCCUPANCY",
    "PEAK_SNAPSHOT",
    "PROGRESS",
    "RELEASE",
    "RENEW",
    "RESTORE",
    "SNAPSHOT",
]

#: A lease not renewed for this long is expired: its reservations come back. Kubernetes'
#: leader election holds its leases as long; a whole gateway process was measured to stall for up
#: to 14 s on a 2-core machine that a CPU vLLM kept busy (the renewal thread included), where a
#: lease of 5 s lapsed in 8 of 9 runs of the contract suite through two gateways.
DEFAULT_LEASE_SECONDS = 15.0

#: ARGV: lease, ticket, need, cap, usable, max_concurrency (0: none), enqueue (1/0), and for the
#: peak rule: prompt tokens ('' for none: no progress record), tracked (1/0), and ``grown`` as
#: read by the snapshot on which the admitting gateway found that it fits ('': it did not, or
#: whole caps), and the deadline of its first token when that snapshot counted it on the
#: engine's clock (ms of the Redis clock; '': not on the clock), and the output it is counted to
#: when that is its forecast ('': its cap). Admitted when the whole caps
#: fit, or when the peak did and no holder has come since that snapshot (see
#: ``PEAK_SNAPSHOT``); the ticket must be at the head of the queue either way. Then, where the
#: engine shares prefix blocks, its prefix record (``"borrowed unkeyed keys"``, see
#: :mod:`.prefixes`; '' or absent: none). Returns {1, now, state} admitted, {0, now, state} not
#: now (queued when asked), {2, now, state} a holder came since the snapshot (read again),
#: {-1, now, state} the lease is gone; ``state`` is ``"reserved holders queued"`` after it.
ADMIT = (
    PRELUDE
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
  local read = ARGV[10] or ''
  local fits = reserved + need <= tonumber(ARGV[5])
  if not fits and read ~= '' then
    if (redis.call('GET', KEYS[15]) or '0') ~= read then
      return {2, now, state()}
    end
    fits = true
  end
  if fits and (most == 0 or redis.call('HLEN', KEYS[1]) < most) then
    hold(ticket, lease, need, ARGV[4], now, '', ARGV[8] or '', ARGV[9] or '', ARGV[11] or '',
         ARGV[12] or '', ARGV[13] or '')
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
#: or swept with its lease): a reservation is never released twice. It is kept as let go.
RELEASE = (
    PRELUDE
    + """
local _, tokens = holder(ARGV[1])
if not tokens then
  return 0
end
charge(ARGV[1], now_ms())
remember(ARGV[1], now_ms())
redis.call('HDEL', KEYS[1], ARGV[1])
let_go(ARGV[1])
redis.call('DECRBY', KEYS[2], tokens)
tell(1)
return tokens
"""
)

#: ARGV: ticket, refused (1/0: count a 429 for a fair waiter's tenant). A waiter that goes away:
#: out of the queue; its refusal read (fair shares); or, admitted meanwhile (by another gateway,
#: or by a first try whose answer was lost), released. Returns 1 left the queue, 2 it had been
#: refused, 3 released, 0 none of these.
LEAVE = (
    PRELUDE
    + """
local now = now_ms()
sweep(now)
local ticket = ARGV[1]
local meta = redis.call('HGET', KEYS[13], ticket)
local tenant = meta and string.match(meta, '^%S+ %S+ %S+ %S+ %S+ ([^\\n]+)')
if tenant and ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[12], 'refused:' .. tenant, 1)
end
redis.call('HDEL', KEYS[13], ticket)
if dequeue(ticket) then
  tell(1)
  return 1
end
if meta then
  return 2
end
local held = redis.call('HGET', KEYS[1], ticket)
if held then
  charge(ticket, now)
  redis.call('HDEL', KEYS[1], ticket)
  let_go(ticket)
  redis.call('DECRBY', KEYS[2], string.match(held, '^%S+ (%d+)'))
  tell(1)
  return 3
end
return 0
"""
)

#: ARGV: lease, ttl_ms. Extends the lease (and the config's life with it). Returns 1 when the
#: lease was still valid, 0 when it had lapsed: its holders are gone (swept here if they were
#: not yet) and it starts afresh; 2 when Redis does not know the lease at all (it lost its data,
#: a restart without persistence). Either way the caller puts back what it holds (RESTORE).
RENEW = (
    PRELUDE
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

#: ARGV, four per holder: reservation, its ``holders`` value, its ``progress`` value ('': none)
#: and its prefix record as ADMIT takes it ('': none, see :mod:`.prefixes`). Reservations put
#: back after Redis swept them with a lapsed lease, or lost its data: the engine still holds
#: them, so they count even past the budget (nothing more is admitted until they end). One held
#: already is left as it is. A fair holder (its value ends with its tenant) comes back as
#: admitted now: the sweep charged its tenant what it held until then, and it is charged from
#: here on, not twice. Returns how many were put back.
RESTORE = (
    PRELUDE
    + """
local now = now_ms()
tick(now)
local back = 0
for i = 1, #ARGV, 4 do
  local field, held, progress = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local head, tenant = string.match(held, '^(%S+ %d+ %d+) %d+ (.+)$')
  if tenant then
    held = head .. ' ' .. now .. ' ' .. tenant
    if progress ~= '' then
      progress = string.match(progress, '^%S+ %S+ %S+ %S+') .. ' ' .. now .. ' ' .. now .. ' 0'
    end
  end
  if redis.call('HSETNX', KEYS[1], field, held) == 1 then
    redis.call('INCRBY', KEYS[2], string.match(held, '^%S+ (%d+)'))
    if progress ~= '' then
      redis.call('HSET', KEYS[14], field, progress)
    end
    lend(field, ARGV[i + 3], string.match(held, '^%S+ %d+ %d+ (%d+)'))
    back = back + 1
  end
end
if back > 0 then
  redis.call('INCR', KEYS[15])
  tell(0)
end
return back
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
    PRELUDE
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
    PRELUDE
    + """
sweep(now_ms())
local held, busy, admitted = unpack(redis.call('HMGET', KEYS[10], 'held', 'busy', 'admitted'))
return {tonumber(held or '0'), tonumber(busy or '0'), tonumber(admitted or '0')}
"""
)

# --- fair shares (``--tenants``): the order is the fair scheduler's, decided in a gateway -------
#
# ``tickets`` (a hash: waiting ticket -> ``"W priority bypassed lower_passes cap tenant"``, and on
# a second line what the peak rule needs of its request, ``"prompt follow keys model"``, see
# ``fair.py``; or ``"R 0 0 0 0 tenant"`` once refused to keep the queue within its bound, until
# its owner reads it), ``fair`` (a hash: ``taken:<tenant>`` token-milliseconds its ended
# holdings took, ``offset:`` what lifts added to its counter, ``admitted:`` and ``refused:`` its
# counts, ``vtime`` the system virtual time a tenant becoming backlogged is lifted to) and
# ``version`` (bumped by every change, in ``tell``). A fair holder's value ends with its tenant;
# releasing or sweeping it charges the tenant what it held (``charge``, see :mod:`.holding`). A
# gateway reads the state (FAIR_SNAPSHOT), runs the fair scheduler on it (by the peak of every
# holder, or by whole caps: see ``fair.py``), and writes what it decided (FAIR_COMMIT) only if
# nothing changed meanwhile (the version, and under the peak ``grown`` as ADMIT has it):
# optimistic, as Redis's WATCH, in one script. An admitted holder gets the records ADMIT writes
# (``hold``), so every gateway counts it alike.

#: Returns {now, version, reserved, holders (flat), tickets with their sequence numbers (flat),
#: their metas (flat), the fair hash (flat), and what PEAK_SNAPSHOT gives besides: grown,
#: progress (flat), drain ('' when none), prefix records (flat), tainted keys}.
FAIR_SNAPSHOT = (
    PRELUDE
    + """
local now = now_ms()
sweep(now)
return {now, tonumber(redis.call('GET', KEYS[11]) or '0'),
        tonumber(redis.call('GET', KEYS[2]) or '0'), redis.call('HGETALL', KEYS[1]),
        redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[13]),
        redis.call('HGETALL', KEYS[12]), tonumber(redis.call('GET', KEYS[15]) or '0'),
        redis.call('HGETALL', KEYS[14]), redis.call('GET', KEYS[17]) or '',
        redis.call('HGETALL', PREFIXES), redis.call('SMEMBERS', TAINTED)}
"""
)

#: ARGV: version read, lease, usable, max_concurrency (0: none), ``grown`` as read when the
#: decision was by the peak ('': by whole caps), then five counted lists: tickets joining the
#: queue (ticket, meta), admitted (ticket, cap, tenant, and its records as ADMIT takes them:
#: prompt ('': none), tracked, start_by ms, counted, prefix record), refused (ticket, tenant),
#: waiters passed (ticket, meta) and the counter offsets (tenant, offset); last, the system
#: virtual time (the start tag of the last waiter admitted; '' when unchanged). Returns
#: {1, now, state} written, {0, now, state} the state changed since it was read (read it
#: again), {-1, now, state} the lease is gone.
FAIR_COMMIT = (
    PRELUDE
    + """
local now = now_ms()
sweep(now)
if (redis.call('GET', KEYS[11]) or '0') ~= ARGV[1] then
  return {0, now, state()}
end
local peak = ARGV[5]
if peak ~= '' and (redis.call('GET', KEYS[15]) or '0') ~= peak then
  return {0, now, state()}  -- a lockstep break, or holders put back: not seen by the decision
end
local lease = ARGV[2]
if not redis.call('ZSCORE', KEYS[5], lease) then
  return {-1, now, state()}
end
local i = 6
local function list(width)
  local n = tonumber(ARGV[i])
  local first = i + 1
  i = first + n * width
  return first, first + n * width - 1
end
local join_a, join_b = list(2)
local admit_a, admit_b = list(8)
local refuse_a, refuse_b = list(2)
local pass_a, pass_b = list(2)
local offset_a, offset_b = list(2)
local vtime = ARGV[i]
-- the budget once more (the version says nothing changed; a wrong decision must not land): the
-- running cap, and on whole caps their sum (by the peak, the sum may be past the budget)
local reserved = tonumber(redis.call('GET', KEYS[2]) or '0')
local holders = redis.call('HLEN', KEYS[1])
for j = admit_a, admit_b, 8 do
  reserved = reserved + tonumber(string.match(ARGV[j], ':(%d+)$'))
  holders = holders + 1
end
local most = tonumber(ARGV[4])
local over = peak == '' and reserved > tonumber(ARGV[3])
if admit_b >= admit_a and (over or (most > 0 and holders > most)) then
  return redis.error_reply('fair commit past the budget')
end
for j = join_a, join_b, 2 do
  enqueue(ARGV[j])
  redis.call('HSET', KEYS[13], ARGV[j], ARGV[j + 1])
end
for j = admit_a, admit_b, 8 do
  local ticket, need = ARGV[j], string.match(ARGV[j], ':(%d+)$')
  local owner = string.match(ticket, '^(.*):%d+:%d+$')
  dequeue(ticket)
  redis.call('HDEL', KEYS[13], ticket)
  hold(ticket, owner, need, ARGV[j + 1], now, ARGV[j + 2], ARGV[j + 3], ARGV[j + 4],
       ARGV[j + 5], ARGV[j + 6], ARGV[j + 7])
  redis.call('HINCRBY', KEYS[12], 'admitted:' .. ARGV[j + 2], 1)
end
for j = refuse_a, refuse_b, 2 do
  dequeue(ARGV[j])
  redis.call('HSET', KEYS[13], ARGV[j], 'R 0 0 0 0 ' .. ARGV[j + 1])
end
for j = pass_a, pass_b, 2 do
  redis.call('HSET', KEYS[13], ARGV[j], ARGV[j + 1])
end
for j = offset_a, offset_b, 2 do
  redis.call('HSET', KEYS[12], 'offset:' .. ARGV[j], ARGV[j + 1])
end
if vtime and vtime ~= '' then
  redis.call('HSET', KEYS[12], 'vtime', vtime)
end
tell((admit_b >= admit_a or refuse_b >= refuse_a) and 1 or 0)
return {1, now, state()}
"""
)

# --- the peak rule (``--admission-rule peak``): the holders' progress, shared ------------------
#
# ``progress`` (a hash: reservation -> ``"prompt counted tracked generated seen_ms first_ms
# start_by_ms"``, the last the deadline of a newcomer admitted on the engine's clock, 0 for none):
# what the peak rule needs of a holder besides its reservation: its prompt, the output it is
# counted to, whether its progress is followed (1/0), the tokens relayed so far (-1: none yet),
# when the latest and the first of them were read (ms of the Redis clock). Written at admission
# (ADMIT, given the prompt), then by the process that relays the holder (PROGRESS), in batches;
# it goes with its holder (release, leave, lease swept). A holder without one counts whole.
# ``grown`` counts admissions and restores (the set of holders grew), and lockstep breaks: a
# gateway admits by the peak on a snapshot (PEAK_SNAPSHOT) and ADMIT lands it only if ``grown``
# has not moved since. Releases and progress do not move it, for they only make a stale view
# safer: a holder gone since holds nothing, and one whose progress the view missed is counted by
# the view at most the relay's margin past its count from the time it was read (the margin
# covers what it made since), and with as many steps left as from that count, never fewer than
# it really has (its count only grows): so the peak the view computed bounds the truth.
# ``drain`` (``"grown reason"``) and ``draining`` (a set of reservations): a gateway saw the
# engine out of lockstep (BREAK), so every gateway counts whole caps until the holders live
# then have gone.
#
# Shared prefix blocks, where the engine shares them: ``prefixes`` (a hash: reservation -> its
# prefix record), ``blocks`` and ``tainted``, written at admission (ADMIT's last ARGV) and
# kept where a holder goes (``let_go``: release, leave, lease swept): see :mod:`.prefixes`.

#: ARGV: let go (1/0, none: 0). Returns {now, grown, reserved, holders (flat), progress (flat),
#: waiting tickets in order, drain ('' when none), the holders let go (flat: reservation,
#: released_ms, its ``holders`` value, its ``progress`` value ('' when none), oldest first;
#: empty unless asked: only the engine's books need them), prefix records (flat), tainted
#: keys}.
PEAK_SNAPSHOT = (
    PRELUDE
    + """
local now = now_ms()
sweep(now)
local let_go = {}
if ARGV[1] == '1' then
  local gone = redis.call('ZRANGE', KEYS[18], 0, -1, 'WITHSCORES')
  for i = 1, #gone, 2 do
    local kept = redis.call('HGET', KEYS[19], gone[i]) or ''
    local progress, held = string.match(kept, '^([^\\n]*)\\n(.*)$')
    if held then
      table.insert(let_go, gone[i])
      table.insert(let_go, gone[i + 1])
      table.insert(let_go, held)
      table.insert(let_go, progress)
    end
  end
end
return {now, tonumber(redis.call('GET', KEYS[15]) or '0'),
        tonumber(redis.call('GET', KEYS[2]) or '0'), redis.call('HGETALL', KEYS[1]),
        redis.call('HGETALL', KEYS[14]), redis.call('ZRANGE', KEYS[3], 0, -1),
        redis.call('GET', KEYS[17]) or '', let_go, redis.call('HGETALL', PREFIXES),
        redis.call('SMEMBERS', TAINTED)}
"""
)

#: ARGV: reason. A gateway saw the engine out of lockstep: every gateway counts whole caps
#: until the holders live now have gone (said again, until those live then). It bumps
#: ``grown``: a decision by the peak read before it does not land. Returns 1, or 0 when no
#: holder is live (nothing to wait for).
BREAK = (
    PRELUDE
    + """
sweep(now_ms())
local fields = redis.call('HKEYS', KEYS[1])
redis.call('DEL', KEYS[16])
if #fields == 0 then
  redis.call('DEL', KEYS[17])
  return 0
end
for _, field in ipairs(fields) do
  redis.call('SADD', KEYS[16], field)
end
local grown = redis.call('INCR', KEYS[15])
redis.call('SET', KEYS[17], grown .. ' ' .. ARGV[1])
return 1
"""
)

#: ARGV: lease, then per holder: reservation, prompt, counted, tracked (1/0), generated (-1:
#: none), age_ms of that count, age_ms of the first count (the ages on the publisher's own
#: clock: durations, which every clock agrees on; the stamps are the Redis clock's ``now`` less
#: them). A holder of another lease, or gone, is skipped; an older count than the one kept
#: never replaces it (a retry, or batches crossing). Returns how many holders had their first
#: count published; then waiters everywhere are woken (a holder past its first token counts
#: less), without bumping ``version``: progress decides nothing for the fair shares.
PROGRESS = (
    PRELUDE
    + """
local now = now_ms()
sweep(now)
local prefix = ARGV[1] .. ':'
local first = 0
for i = 2, #ARGV, 7 do
  local field = ARGV[i]
  if string.sub(field, 1, #prefix) == prefix and redis.call('HEXISTS', KEYS[1], field) == 1 then
    local kept = redis.call('HGET', KEYS[14], field)
    local had, tracked_before = -1, '1'
    if kept then
      local t, g = string.match(kept, '^%S+ %S+ (%S+) (%S+)')
      had, tracked_before = tonumber(g), t
    end
    local generated = tonumber(ARGV[i + 4])
    if generated > had or ARGV[i + 3] ~= tracked_before then
      local seen = now - math.max(0, tonumber(ARGV[i + 5]))
      local first_at = now - math.max(0, tonumber(ARGV[i + 6]))
      if had >= 0 then
        first_at = tonumber(string.match(kept, '^%S+ %S+ %S+ %S+ %S+ (%S+)'))
      elseif generated >= 0 then
        first = first + 1
      end
      local start = kept and string.match(kept, '^%S+ %S+ %S+ %S+ %S+ %S+ (%S+)$') or '0'
      redis.call('HSET', KEYS[14], field, ARGV[i + 1] .. ' ' .. ARGV[i + 2] .. ' '
                 .. ARGV[i + 3] .. ' ' .. math.max(generated, had) .. ' ' .. seen .. ' '
                 .. first_at .. ' ' .. start)
    end
  end
end
if first > 0 then
  redis.call('PUBLISH', KEYS[8], '1 ' .. state())
end
return first
"""
)
