"""A holder's records on the shared ledger: written where it is admitted, charged where it goes.
The Lua the scripts share for both, and the charge's formula in Python beside it.

**Admitted** (``hold``, in ADMIT and FAIR_COMMIT alike, so that every gateway counts a holder
the same whichever script admitted it): its ``holders`` value (``"lease tokens cap
admitted_ms"``, then its tenant under fair shares); given its prompt, its ``progress`` record
(``"prompt counted tracked -1 admitted_ms admitted_ms start_by_ms"``, see :mod:`.scripts`):
counted to its forecast (``counted``, '' its cap) and, admitted on the engine's clock, the
deadline of its first token (''/0: none); where the engine shares prefix blocks, its prefix
record (:mod:`.prefixes`); and the counters: ``grown``, the admissions, the tokens reserved.

**Charged** (fair shares, :mod:`..admission.fairness`): the KV a holder holds, integrated over
the time it holds it: its whole reservation until its first relayed count; then its prompt and
the tokens it has made, taken to grow evenly from one token at its first count to its latest
count, and flat at that count from then on. Without a progress record, or before a count, its
whole reservation throughout. The scripts charge a holder that goes by :func:`charged_lua`'s
``charge`` (its tenant's ``taken:`` in ``fair``); a gateway restoring the fair scheduler
charges each live holder by :func:`charged` up to the moment it read: the same formula, so
that a tenant's token-seconds do not jump when its holder goes (a test holds the two to the
same answers).

>>> charged(1000, 0.0, 1.0)  # no progress record: its whole reservation for a second
1000.0
>>> charged(1000, 0.0, 3.0, prompt=100, generated=101, seen=2.0, first=1.0)  # 1000 + 151 + 201
1352.0
"""

from __future__ import annotations

__all__ = ["charged", "holding_lua"]


def charged(
    tokens: int,
    admitted: float,
    now: float,
    *,
    prompt: int | None = None,
    generated: int | None = None,
    seen: float = 0.0,
    first: float = 0.0,
) -> float:
    """Token-seconds a holder of ``tokens`` admitted at ``admitted`` has been charged by ``now``
    (see the module): ``prompt`` and ``generated`` (None: no progress record, or no count yet),
    its latest count read at ``seen`` and its first at ``first``."""
    if prompt is None or generated is None or generated < 0:
        return tokens * max(0.0, now - admitted)
    first = max(admitted, min(first, now))
    seen = max(first, min(seen, now))
    return (
        tokens * (first - admitted)
        + (prompt + (1 + generated) / 2) * (seen - first)
        + (prompt + generated) * (now - seen)
    )


def holding_lua(
    *, holders: str, progress: str, fair: str, grown: str, occupancy: str, reserved: str
) -> str:
    """The Lua functions ``hold(ticket, lease, need, cap, now, tenant, prompt, tracked, start,
    counted, lending)`` and ``charge(field, now)``, over the given keys (``KEYS[n]``
    expressions); after the prefix records' functions (``lend``, :mod:`.prefixes`)."""
    return (
        f"""
local HOLDERS, HELD_PROGRESS, FAIR = {holders}, {progress}, {fair}
local GROWN, OCCUPANCY, RESERVED = {grown}, {occupancy}, {reserved}
"""
        + """
local function hold(ticket, lease, need, cap, now, tenant, prompt, tracked, start, counted,
                    lending)
  local value = lease .. ' ' .. need .. ' ' .. cap .. ' ' .. now
  if tenant ~= '' then
    value = value .. ' ' .. tenant
  end
  redis.call('HSET', HOLDERS, ticket, value)
  if prompt ~= '' then
    if start == '' then
      start = '0'
    end
    if counted == '' then
      counted = cap
    end
    redis.call('HSET', HELD_PROGRESS, ticket, prompt .. ' ' .. counted .. ' ' .. tracked
               .. ' -1 ' .. now .. ' ' .. now .. ' ' .. start)
  end
  lend(ticket, lending, now)
  redis.call('INCR', GROWN)
  redis.call('HINCRBY', OCCUPANCY, 'admitted', 1)
  redis.call('INCRBY', RESERVED, need)
end
local function charged(tokens, admitted, progress, now)
  local prompt, generated, seen, first
  if progress then
    prompt, generated, seen, first = string.match(progress, '^(%d+) %S+ %S+ (%-?%d+) (%d+) (%d+)')
  end
  if not first or tonumber(generated) < 0 then
    return tokens * math.max(0, now - admitted)
  end
  prompt, generated = tonumber(prompt), tonumber(generated)
  first = math.max(admitted, math.min(tonumber(first), now))
  seen = math.max(first, math.min(tonumber(seen), now))
  return tokens * (first - admitted) + (prompt + (1 + generated) / 2) * (seen - first)
    + (prompt + generated) * (now - seen)
end
local function charge(field, now)
  local value = redis.call('HGET', HOLDERS, field)
  local tokens, admitted, tenant
  if value then
    tokens, admitted, tenant = string.match(value, '^%S+ (%d+) %d+ (%d+) (.+)$')
  end
  if tenant then
    local spent = charged(tonumber(tokens), tonumber(admitted),
                          redis.call('HGET', HELD_PROGRESS, field), now)
    redis.call('HINCRBY', FAIR, 'taken:' .. tenant, string.format('%.0f', spent))
  end
end
"""
    )
