"""What a request spends: the fields that set its output length and its number of sequences, in
every engine's dialect, and :func:`request_spend`, which prices them (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LENGTH_FIELDS",
    "MIN_LENGTH_FIELDS",
    "SCHEDULING_FIELDS",
    "SEQUENCE_FIELDS",
    "UNLIMITED_WHEN_NOT_POSITIVE",
    "UNPRICED_FIELDS",
    "Spend",
    "SpendError",
    "request_spend",
]

#: Fields that set how many tokens a sequence may generate, in any engine's dialect: OpenAI's
#: ``max_tokens`` and ``max_completion_tokens`` (vLLM, SGLang, TGI, llama.cpp), llama.cpp's
#: ``n_predict`` (it wins over ``max_tokens`` there; ``-1`` or ``0``: until the context is full)
#: and TGI's ``max_new_tokens``. An engine obeys one of them; which one differs, so all are set.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens")
#: Fields that set how many tokens a sequence must generate at least (vLLM's and SGLang's
#: ``min_tokens``): above the output cap the engine refuses the request (400), so a cap lowered
#: to what can be reserved lowers them too.
MIN_LENGTH_FIELDS = ("min_tokens",)
#: Fields whose non-positive value means "no limit" rather than an error.
UNLIMITED_WHEN_NOT_POSITIVE = frozenset({"n_predict"})
#: Fields that set how many sequences one request generates: ``n`` (OpenAI, vLLM, llama.cpp),
#: llama.cpp's alias ``n_cmpl``, vLLM's ``best_of`` (it generates that many, returns ``n``).
SEQUENCE_FIELDS = ("n", "n_cmpl", "best_of")
#: Fields that spend KV in ways the reservation cannot price, each with why: beam search holds
#: a changing set of beams whose count the request does not bound; vLLM's
#: ``kv_transfer_params`` (disaggregated prefill) has the engine load KV computed elsewhere or
#: keep the request's blocks after it ends for another engine to fetch, KV no request holds.
UNPRICED_FIELDS: dict[str, str] = {
    "use_beam_search": "beam search holds a set of beams the request does not bound",
    "beam_width": "beam search holds a set of beams the request does not bound",
    "kv_transfer_params": (
        "it has the engine take KV from elsewhere or keep the request's blocks after it ends"
    ),
}
#: Fields by which a client would set the engine's own scheduling order: vLLM's ``priority``
#: (under ``--scheduling-policy priority`` a request of a higher one preempts those running,
#: which no admission can allow for). Taken out of what goes to the engine: the order is the
#: admission's (a gateway's priority classes, granted per tenant).
SCHEDULING_FIELDS = ("priority",)


@dataclass(frozen=True, slots=True)
class Spend:
    """What a request may make an engine hold: each sequence's output cap (None: unset, so up
    to the context window) and how many sequences."""

    max_tokens: int | None
    sequences: int = 1


class SpendError(ValueError):
    """A field that sets what a request spends is malformed, or cannot be priced."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


_JSON_TYPES = {bool: "a boolean", str: "a string", float: "a fraction", list: "an array"}


def _whole(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e3 is an integer in JSON's eyes
    if isinstance(value, bool) or not isinstance(value, int):
        kind = _JSON_TYPES.get(type(value), "an object")
        raise SpendError(f"{name} must be an integer, got {kind}", name)
    return value


def request_spend(body: Mapping[str, Any]) -> Spend:
    """The largest output any of the request's length fields allows, and its number of
    sequences, in every engine's dialect at once (an engine obeys one of them: the reservation
    covers whichever). Raises :class:`SpendError` naming the field."""
    for name, why in UNPRICED_FIELDS.items():
        value = body.get(name)
        off = value is None or value is False or (type(value) is int and value <= 1)
        if not off:
            raise SpendError(f"{name} cannot be priced by a KV reservation: {why}", name)
    caps: list[int] = []
    unlimited = False
    for name in LENGTH_FIELDS:
        value = _whole(body, name)
        if value is None:
            continue
        if value < 1:
            if name not in UNLIMITED_WHEN_NOT_POSITIVE:
                raise SpendError(f"{name} must be at least 1, got {value}", name)
            unlimited = True
        else:
            caps.append(value)
    sequences = 1
    for name in SEQUENCE_FIELDS:
        value = _whole(body, name)
        if value is None:
            continue
        if value < 1:
            raise SpendError(f"{name} must be at least 1, got {value}", name)
        sequences = max(sequences, value)
    return Spend(max_tokens=None if unlimited or not caps else max(caps), sequences=sequences)
