"""Shared prefix blocks on the shared ledger: each holder's prefix record, written and read, and
the Lua that keeps, in the script where a holder goes, what its going leaves behind.

Where the engine shares the KV blocks of identical prompt prefixes (see
:mod:`..admission.peak`), the in-process ledger counts a block once for each live holder that
computed it and at least once while any has it; a newcomer borrows the leading blocks that a
holder past its prefill has; and a block of which a copy was let go while another is held is
*tainted*: its borrowers count one copy more (:func:`..admission.holders.tainted_after`).
Across gateways the same facts are kept in Redis, per upstream:

``prefixes``  a hash: reservation -> ``"borrowed unkeyed admitted_ms keys"``: the keys of its
              shareable prompt blocks (:func:`~..admission.peak.prefix_blocks`: 16 bytes each,
              written as 32 hex digits run together; ``-`` for none); the first ``borrowed`` of
              them lent by holders past their prefill in the snapshot its gateway admitted it
              on (who lent them cannot be worked out again once they have gone); ``unkeyed`` 1
              for a holder of full prompt blocks the ledger has no keys of; when it was
              admitted (ms of the Redis clock). Written with its admission (ADMIT), only where
              there is something to record.
``tainted``   a set of keys: the in-process ledger's set of that name.
``blocks``    a hash: per key, ``held:<key>`` the holders that have the block and ``made:<key>``
              those that computed it, so that a holder's going costs its own keys, not every
              holder's.

``tainted`` is worked out by the script in which a holder goes (release, leave, its lease
swept: a lease swept has no gateway left to do it), as ``tainted_after`` works it out: a block
the holder gone computed while another holder alive computed it too has left a freed copy; so
has, for an unkeyed holder gone, every block computed by a holder whose prefill overlapped its
own (a prefill ends at the first token in the holder's ``progress`` record; none yet: not
over); a block no holder has any more is forgotten. Tests hold the two to the same answers.

A holder without a record counts its whole prompt wherever it is read (admitted by a gateway
that writes none), and its going taints nothing. A holder put back (RESTORE: its lease had
lapsed, or Redis lost its data) comes back with the record its gateway admitted it with.

>>> prefix_record((bytes(16),), 1, False)
'1 0 00000000000000000000000000000000'
>>> read_record("1 0 1700000000000 " + "00" * 16) == ((bytes(16),), 1, False)
True
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["KEY_DIGITS", "lending_lua", "prefix_record", "read_record"]

#: Hex digits of one block's key in a record (:func:`~..admission.peak.prefix_blocks`: 16 bytes).
KEY_DIGITS = 32


def prefix_record(prefix: Sequence[Hashable], borrowed: int, unkeyed: bool) -> str:
    """A newcomer's record as ADMIT takes it, ``"borrowed unkeyed keys"`` (its admission's time
    is Redis's to add); '' when there is nothing to record (no keys, and no blocks of unknown
    keys). Keys that are not 16 bytes each are not recorded: the holder is taken as unkeyed."""
    if not all(isinstance(k, bytes) and len(k) * 2 == KEY_DIGITS for k in prefix):
        prefix, borrowed, unkeyed = (), 0, True
    if not prefix and not unkeyed:
        return ""
    keys = "".join(k.hex() for k in prefix if isinstance(k, bytes)) or "-"
    return f"{min(max(0, borrowed), len(prefix))} {int(unkeyed)} {keys}"


def read_record(value: str | None) -> tuple[tuple[bytes, ...], int, bool]:
    """(keys, borrowed, unkeyed) from a ``prefixes`` value; one that does not read as this
    version writes it counts as none (its holder's whole prompt counts)."""
    fields = (value or "").split(" ")
    if len(fields) != 4 or fields[1] not in ("0", "1"):
        return (), 0, False
    borrowed, unkeyed, _, keys = fields
    digits = "" if keys == "-" else keys
    try:
        if len(digits) % KEY_DIGITS:
            raise ValueError(keys)
        prefix = tuple(
            bytes.fromhex(digits[i : i + KEY_DIGITS]) for i in range(0, len(digits), KEY_DIGITS)
        )
        lent = min(max(0, int(borrowed)), len(prefix))
    except ValueError:
        return (), 0, False
    return prefix, lent, unkeyed == "1"


def lending_lua(*, prefixes: str, blocks: str, tainted: str, progress: str) -> str:
    """The Lua functions the scripts share for prefix records, over the given keys (``KEYS[n]``
    expressions): ``lend(field, record, now)`` writes a newcomer's record (ADMIT's ARGV: see
    :func:`prefix_record`; '' none) and ``unlend(field)`` lets a holder's go, before its
    ``progress`` record goes."""
    return (
        f"""
local PREFIXES, BLOCKS, TAINTED, PROGRESS = {prefixes}, {blocks}, {tainted}, {progress}
local DIGITS = {KEY_DIGITS}
"""
        + """
local function lent(value)
  local borrowed, unkeyed, admitted, keys = string.match(value, '^(%d+) ([01]) (%d+) (%S+)$')
  if not keys then
    return nil
  end
  if keys == '-' then
    keys = ''
  end
  return tonumber(borrowed), unkeyed == '1', tonumber(admitted), keys
end
local function lend(field, record, now)
  local borrowed, unkeyed, keys = string.match(record, '^(%d+) ([01]) (%S+)$')
  if not keys then
    return
  end
  redis.call('HSET', PREFIXES, field, borrowed .. ' ' .. unkeyed .. ' ' .. now .. ' ' .. keys)
  if keys == '-' then
    return
  end
  for i = 1, #keys, DIGITS do
    local key = string.sub(keys, i, i + DIGITS - 1)
    redis.call('HINCRBY', BLOCKS, 'held:' .. key, 1)
    if i > tonumber(borrowed) * DIGITS then
      redis.call('HINCRBY', BLOCKS, 'made:' .. key, 1)
    end
  end
end
local function prefill_end(field)
  local kept = redis.call('HGET', PROGRESS, field)
  if kept then
    local generated, first = string.match(kept, '^%S+ %S+ %S+ (%S+) %S+ (%S+)')
    if generated and tonumber(generated) >= 0 then
      return tonumber(first)
    end
  end
  return math.huge
end
local function unlend(field)
  local value = redis.call('HGET', PREFIXES, field)
  if not value then
    return
  end
  redis.call('HDEL', PREFIXES, field)
  local borrowed, unkeyed, admitted, keys = lent(value)
  if not keys then
    return
  end
  if unkeyed then
    local ends = prefill_end(field)
    local all = redis.call('HGETALL', PREFIXES)
    for i = 1, #all, 2 do
      local b, _, a, k = lent(all[i + 1])
      if k and a <= ends and admitted <= prefill_end(all[i]) then
        for j = b * DIGITS + 1, #k, DIGITS do
          redis.call('SADD', TAINTED, string.sub(k, j, j + DIGITS - 1))
        end
      end
    end
  end
  for i = 1, #keys, DIGITS do
    local key = string.sub(keys, i, i + DIGITS - 1)
    if i > borrowed * DIGITS and redis.call('HINCRBY', BLOCKS, 'made:' .. key, -1) > 0 then
      redis.call('SADD', TAINTED, key)
    end
    if redis.call('HINCRBY', BLOCKS, 'held:' .. key, -1) <= 0 then
      redis.call('HDEL', BLOCKS, 'held:' .. key, 'made:' .. key)
      redis.call('SREM', TAINTED, key)
    end
  end
end
"""
    )
