"""The peak of the sum: the most KV cache a set of running sequences can ever hold at once.

Pure arithmetic, no I/O, no clock. The ledger's ``peak`` rule admits a request when this peak,
with the request added, fits the usable budget (see ``docs/peak.md``).

**The argument.** A sequence that has produced its first token holds its prompt and what it
has generated so far, and grows by one token per decode step until its output cap, when it
frees everything. While the engine runs every admitted sequence in lockstep (one token each per
step), the KV in use ``s`` steps from now is the sum over the sequences still running then of
``min(held + s, most)``, in whole blocks. Each term only grows until its sequence ends, so the
sum only grows between two ends and only falls at one: its maximum over all future steps is
reached on the last step before some sequence ends (or now). Checking those few steps is
checking every future step, and admission by that maximum can never overflow, whatever the
sequences' real lengths, as long as:

- ``held`` is never less than what the sequence really holds (the gateway adds the tokens the
  engine may have made since the last one it relayed), and ``steps_left`` never less than the
  steps it may still run (counted from the tokens relayed, which are never more than made);
- the engine advances every one of them each step (no waiting, no preemption): a sequence that
  has not started yet is counted :attr:`Holder.flat`, at its whole worst case until released.

**Shared prefixes.** Where the engine shares the KV blocks of identical prompt prefixes among
running sequences (vLLM's prefix cache), a block is held once while anyone holds it, and twice
only while two sequences each computed their own copy (both were in prefill at once). A
holder's ``prefix`` names its shareable blocks (full blocks before its last prompt token, by a
chained hash of their tokens); the first ``borrowed`` of them it did not compute itself but took
from a sequence that had. A block is counted once for each holder alive that computed it, and
at least once while any holder has it. One case more: once one of two copies has been let go by
its holders, the engine keeps it cached and may hand that freed copy, not the one in use, to
the next sequence that asks for the block (vLLM hands out the oldest cached copy). For such a
``tainted`` block the borrowers together count one copy more.

>>> ends_soon = Holder(held=700, most=720, steps_left=20)
>>> starts_now = Holder(held=110, most=900, steps_left=790)
>>> peak([ends_soon, starts_now], block_size=1)   # step 19: 719 + 129; step 789: 899 alone
899
>>> peak([ends_soon, starts_now, Holder.flat(500)], block_size=1)   # against 720 + 900 + 500
1399
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Holder", "peak", "prefix_blocks"]


@dataclass(frozen=True, slots=True)
class Holder:
    """One admitted request as the peak sees it, in tokens.

    ``held`` is what it holds now at most, ``most`` what it may ever hold (prompt + cap, or its
    whole reservation), ``steps_left`` the decode steps after which it has certainly ended
    (None: it is counted at ``most`` until it is released).
    """

    held: int
    most: int
    steps_left: int | None
    prefix: tuple[Hashable, ...] = ()
    borrowed: int = 0

    @classmethod
    def flat(cls, most: int, prefix: tuple[Hashable, ...] = (), borrowed: int = 0) -> Holder:
        """A holder counted at its whole worst case until it is released."""
        return cls(held=most, most=most, steps_left=None, prefix=prefix, borrowed=borrowed)

    def at(self, step: int) -> int:
        """Tokens it may hold ``step`` steps from now (0 once it has ended)."""
        if self.steps_left is None:
            return self.most
        if step >= self.steps_left:
            return 0
        return min(self.held + step, self.most)


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def _total_at(
    holders: Iterable[Holder], step: int, block_size: int, tainted: Collection[Hashable]
) -> int:
    total = 0
    borrowed: set[Hashable] = set()
    computed: dict[Hashable, int] = {}
    for holder in holders:
        tokens = holder.at(step)
        if tokens == 0:
            continue
        total += _blocks(tokens, block_size) - block_size * len(holder.prefix)
        for index, key in enumerate(holder.prefix):
            if index < holder.borrowed:
                borrowed.add(key)
            else:
                computed[key] = computed.get(key, 0) + 1
    copies = 0
    for key in borrowed | computed.keys():
        made = computed.get(key, 0)
        copies += max(1, made + (key in borrowed and key in tainted))
    return total + block_size * copies


def peak(
    holders: Sequence[Holder],
    *,
    block_size: int,
    after: int = 0,
    tainted: Collection[Hashable] = (),
) -> int:
    """The most the ``holders`` can hold together at any step from ``after`` steps on.

    Checked on ``after`` and on the last step before each end after it: in between the sum
    only grows (see the module's argument). ``tainted``: prefix blocks of which a freed copy
    may be handed to a borrower (see the module).
    """
    steps = {after}
    for holder in holders:
        if holder.steps_left is not None and holder.steps_left - 1 > after:
            steps.add(holder.steps_left - 1)
    return max(_total_at(holders, step, block_size, tainted) for step in steps)


def prefix_blocks(
    token_ids: Sequence[int], block_size: int, salt: Hashable = None
) -> tuple[Hashable, ...]:
    """The chained keys of a prompt's shareable blocks: the full blocks before its last token
    (an engine computes at least that one token itself). Equal keys mean equal whole prefixes
    (each key is a 128-bit hash of its block's tokens and the key before it); ``salt`` (the
    model, say) keeps prompts that no engine would share apart.

    >>> len(prefix_blocks(list(range(48)), 16)), len(prefix_blocks(list(range(49)), 16))
    (2, 3)
    """
    keys: list[bytes] = []
    previous = hashlib.blake2b(repr(salt).encode(), digest_size=16).digest()
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        block = token_ids[start : start + block_size]
        previous = hashlib.blake2b(previous + array("q", block).tobytes(), digest_size=16).digest()
        keys.append(previous)
    return tuple(keys)
