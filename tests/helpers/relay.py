"""A holder's progress as its own gateway relays it to the shared ledger, for the pure
properties of the shared peak (plain and fair): the engine's counts reach the relay some steps
late, and the gateway publishes them at its interval, or sooner once ``PUBLISH_TOKENS`` behind
(as its publisher does); the shared ledger keeps the newest count it was given (``PROGRESS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from reference_server.shared_ledger.view import PUBLISH_TOKENS, Record
from tests.helpers.lockstep import Seq

__all__ = ["Relay", "publish", "relay_step"]


@dataclass
class Relay:
    """One holder's relay: its reservation's ``name``, how many steps its counts are ``late``,
    and its gateway's publishing interval (``every`` steps at most)."""

    name: str
    late: int
    every: int
    history: list[int] = field(default_factory=list)  # the engine's count each step (-1: none)
    read: int | None = None
    read_at: float = 0.0
    first_at: float = 0.0
    published: int | None = None

    def saw(self, generated: int | None) -> None:
        """The engine's count after this step (None: it does not run the sequence now)."""
        self.history.append(-1 if generated is None else generated)

    def publishes(self, step: int, now: float, *, ended: bool) -> bool:
        """Whether the gateway publishes the count it has read by ``now`` (``read``, stamped
        ``read_at``; its first at ``first_at``) at ``step``."""
        count = self.history[-1 - self.late] if len(self.history) > self.late else 0
        if count > 0 and not ended and count > (self.read or 0):
            if self.read is None:
                self.first_at = now
            self.read, self.read_at = count, now
        if self.read is None or self.read == self.published:
            return False
        due = step % self.every == 0 or self.published is None
        if due or self.read - (self.published or 0) >= PUBLISH_TOKENS:
            self.published = self.read
            return True
        return False


def publish(
    records: MutableMapping[str, Record],
    relay: Relay,
    **changes: object,
) -> None:
    """``PROGRESS`` of ``relay``'s count into ``records``: stamped when the count was read, its
    first count's time kept; an older count never replaces a newer one. ``changes``: what else
    the script sets on the record."""
    kept = records.get(relay.name)
    assert relay.read is not None
    if kept is None or (kept.generated is not None and kept.generated >= relay.read):
        return
    first = kept.first_seen_at if kept.generated is not None else relay.first_at
    records[relay.name] = dataclasses.replace(
        kept, generated=relay.read, seen_at=relay.read_at, first_seen_at=first, start_by=None,
        **changes,  # type: ignore[arg-type]
    )  # fmt: skip


def relay_step(
    relays: dict[int, Relay],
    running: Mapping[int, Seq],
    ended: Mapping[int, int],
    *,
    step: int,
    now: float,
    release_delay: int,
    release: Callable[[str], None],
    records: MutableMapping[str, Record],
    **changes: object,
) -> None:
    """After the engine's ``step`` (its ``running`` sequences, the step each of those ``ended``
    ended in), every relay of ``relays`` (engine sequence -> its relay): its holder released
    ``release_delay`` steps after its end (and dropped from ``relays``), or its count published
    into ``records`` when due (``changes``: see :func:`publish`)."""
    for sid, relay in list(relays.items()):
        seq = running.get(sid)
        relay.saw(seq.generated if seq is not None else None)
        if sid in ended and step - ended[sid] > release_delay:
            release(relay.name)
            del relays[sid]
        elif relay.publishes(step, now, ended=sid in ended):
            publish(records, relay, **changes)
