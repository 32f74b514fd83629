"""A client's replicas: what kvclient keeps per server, and where each attempt goes.

Each replica of ``base_url=[...]`` has its own cooldown, send window, pacer, health, and counts
of what is in flight there. :class:`Replicas` sends each attempt where its reservation fits best
(see :mod:`kvclient.routing`), fails an attempt over at once to an untried replica when its own
never answered, said it cannot serve (502/503/504) or is full (429), and notes the room each
answer advertises. A :class:`Call` is one call's retry state plus the replica its current
attempt goes to. With one replica all of this reduces to that replica's cooldown, window and
pacer.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from ._accounting import DEFAULT_BLOCK_SIZE
from ._exceptions import APIConnectionError, APIStatusError, APITimeoutError, InsufficientQuotaError
from ._http import redact_url
from ._models import RetryEvent
from ._pacing import DEFAULT_PACE_MAX_AGE, PACE_LAG, Cooldown, Pacer, SendWindow
from ._policy import RetryPolicy
from ._retry import RetryCall
from .headers import parse_ratelimit
from .routing import Endpoint, Health, pick

__all__ = [
    "REPLICA_FAILURES",
    "REPLICA_SET_ASIDE",
    "Call",
    "Replica",
    "Replicas",
    "normalize_base_url",
    "slot_outcome",
]

#: A replica that failed this many sends in a row (a connection refused: at once) is set aside
#: for this many seconds; then one request probes it.
REPLICA_FAILURES = 3
REPLICA_SET_ASIDE = 2.0

#: The request extension carrying the replica an attempt was sent to.
REPLICA_EXTENSION = "kvclient.replica"
#: The request extension carrying its send as the pacer counted it (see RetryCall.paced).
PACED_EXTENSION = "kvclient.paced"
#: The request extension carrying its call's size, as its send-window slot counts it.
SIZE_EXTENSION = "kvclient.size"


def normalize_base_url(base_url: str | httpx.URL) -> tuple[str, tuple[str, str] | None]:
    """The base URL without userinfo or ``/v1``, and the user and password it carried.

    The credentials leave the URL so that no error message, log line or ``RetryEvent`` can show
    them; they are sent as HTTP Basic auth, as httpx sends a URL's userinfo.
    """
    text = str(base_url).strip().rstrip("/")
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {redact_url(text)!r}")
    credentials: tuple[str, str] | None = None
    parsed = httpx.URL(text)
    if parsed.userinfo:
        credentials = (parsed.username, parsed.password)
        text = str(parsed.copy_with(username=None, password=None)).rstrip("/")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    return text, credentials


def base_urls(
    base_url: str | httpx.URL | Sequence[str | httpx.URL],
) -> tuple[list[str], tuple[str, str] | None]:
    """The replicas' normalized URLs, and the credentials they carry (the same for all)."""
    given = [base_url] if isinstance(base_url, (str, httpx.URL)) else list(base_url)
    if not given:
        raise ValueError("base_url must be a URL or a non-empty list of URLs")
    urls: list[str] = []
    found: list[tuple[str, str] | None] = []
    for url in given:
        if not isinstance(url, (str, httpx.URL)):
            raise TypeError(f"base_url entries must be str or httpx.URL, got {type(url).__name__}")
        text, credentials = normalize_base_url(url)
        if text in urls:
            raise ValueError(f"base_url lists {redact_url(text)!r} twice")
        urls.append(text)
        found.append(credentials)
    if any(c != found[0] for c in found):
        raise ValueError("the base_url replicas carry different credentials; pass api_key= instead")
    return urls, found[0]


def _unreachable(error: BaseException) -> bool:
    """The replica never answered (a connection failure or timeout before any byte) or said it
    cannot serve (502/503/504): the request may go elsewhere at once."""
    if isinstance(error, APIConnectionError):
        return error.retryable
    return (
        isinstance(error, APIStatusError)
        and error.status_code in (502, 503, 504)
        and not isinstance(error, InsufficientQuotaError)
    )


def _full(error: BaseException) -> bool:
    """A 429 that another replica may not give (not an exhausted quota)."""
    return (
        isinstance(error, APIStatusError)
        and error.status_code == 429
        and not isinstance(error, InsufficientQuotaError)
    )


def slot_outcome(error: BaseException) -> str:
    """How a failed attempt counts for the send window: a refusal narrows it."""
    if (
        isinstance(error, APIStatusError)
        and error.status_code in (429, 503)
        and not isinstance(error, InsufficientQuotaError)
    ):
        return "refused"
    return "other"


class Replica:
    """One server of a client: its URL and what kvclient keeps per server (cooldown, send
    window, pacing hints, health, what is in flight there)."""

    __slots__ = (
        "base_url", "context_window", "cooldown", "health", "hint_free", "hint_until", "index",
        "pacer", "quota", "requests", "sent_since", "tokens", "window",
    )  # fmt: skip

    def __init__(self, index: int, base_url: str, *, window_reset: float) -> None:
        self.index = index
        self.base_url = base_url
        self.cooldown = Cooldown()
        self.pacer = Pacer()
        self.window = SendWindow(reset=window_reset)
        self.health = Health(threshold=REPLICA_FAILURES, cooldown=REPLICA_SET_ASIDE)
        self.requests = 0  # in flight
        self.tokens = 0  # KV tokens in flight (prompt + output cap)
        # The free budget it last advertised, until when that is trusted, what went since.
        self.hint_free = 0
        self.hint_until = -math.inf
        self.sent_since = 0
        self.quota: int | None = None
        # The context window it reported (discovery; None: not asked, or it did not say).
        self.context_window: int | None = None

    def __repr__(self) -> str:
        return f"Replica({self.base_url!r}, requests={self.requests}, tokens={self.tokens})"

    def view(self, now: float, *, in_service: bool) -> Endpoint:
        """The replica as the router sees it: the room it advertised less what went since,
        else its whole budget (or its send window) less what is in flight there."""
        free: int | None = None
        if now < self.hint_until:
            free = self.hint_free - self.sent_since
        elif self.quota is not None:
            free = self.quota - self.tokens
        elif self.window.limit != math.inf:
            free = int(self.window.limit) - self.window.in_flight
        if self.cooldown.remaining(now) > 0:
            free = min(free, 0) if free is not None else 0  # it said to wait: nothing fits now
        return Endpoint(
            free=free, in_flight=self.requests, in_service=in_service, in_flight_tokens=self.tokens
        )


class Call(RetryCall):
    """One call: its retry state, the replica its current attempt goes to, and the replicas
    already tried in this attempt.

    ``pinned``: a probe of one replica's discovery stays there (no routing, no fail-over).
    ``idempotency_key`` is the same on every attempt, so a server that dedupes can.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        replica: Replica,
        *,
        size: int | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        pinned: bool = False,
    ) -> None:
        super().__init__(
            policy, replica.cooldown, size=size, on_retry=on_retry, pacer=replica.pacer
        )
        self.replica = replica
        self.pinned = pinned
        self.tried: set[int] = set()
        self.sending = False
        # Whether the call paces (sized, pacing on): then the pacer follows the replica.
        self.paces = self.pacer is not None
        self.idempotency_key = str(uuid.uuid4())

    def extensions(self) -> dict[str, Any]:
        """The request extensions that tie an attempt's answer back to this call's replica."""
        return {
            REPLICA_EXTENSION: self.replica,
            PACED_EXTENSION: self.paced,
            SIZE_EXTENSION: self.size,
        }


class Replicas:
    """The replicas of one client, and every decision about them (thread-safe).

    Iterating, indexing and ``len()`` give the :class:`Replica` objects in the order given.
    """

    def __init__(self, urls: Sequence[str], policy: RetryPolicy) -> None:
        self._all = tuple(
            Replica(i, url, window_reset=policy.window_reset) for i, url in enumerate(urls)
        )
        self._policy = policy
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, index: int) -> Replica:
        return self._all[index]

    def __repr__(self) -> str:
        return f"Replicas({list(self._all)!r})"

    @property
    def several(self) -> bool:
        return len(self._all) > 1

    def new_call(
        self, size: int | None, on_retry: Callable[[RetryEvent], None] | None = None
    ) -> Call:
        """A call of ``size`` KV tokens (None: unknown, a probe), routed over the replicas."""
        call = Call(self._policy, self._all[0], size=size, on_retry=on_retry)
        call.hold_refusals = not self.several  # several: the retry is routed afresh
        return call

    def probe_call(self, replica: Replica, on_retry: Callable[[RetryEvent], None] | None) -> Call:
        """A discovery probe of ``replica`` alone, tried once (one that does not answer is
        asked no further)."""
        once = dataclasses.replace(self._policy, max_attempts=1)
        return Call(once, replica, on_retry=on_retry, pinned=True)

    def route(self, call: Call, *, again: bool = False) -> None:
        """Send ``call``'s next try where its reservation fits best among the replicas in
        service that it has not tried in this attempt (``again``: a fail-over within it; else
        a new attempt, which may go anywhere) (see :func:`kvclient.routing.pick`); its
        cooldown and pacing become that replica's."""
        if not self.several or call.pinned:
            return
        if not again:
            call.tried.clear()
        now = self._policy.clock()
        replicas = self._all
        with self._lock:
            views = [
                r.view(now, in_service=r.index not in call.tried and r.health.in_service(now))
                for r in replicas
            ]
            index = pick(views, call.size)
            if index is None:  # every untried replica is set aside: try one anyway
                untried = [r for r in replicas if r.index not in call.tried] or list(replicas)
                index = min(untried, key=lambda r: (r.health.out_until or 0.0, r.index)).index
        replica = replicas[index]
        call.replica = replica
        call.cooldown = replica.cooldown
        call.pacer = replica.pacer if call.paces else None

    def sending(self, call: Call) -> None:
        """``call`` goes to its replica now: count it in flight there."""
        if not self.several:
            return
        replica = call.replica
        with self._lock:
            replica.requests += 1
            replica.tokens += call.size
            replica.sent_since += call.size
            replica.health.begin(self._policy.clock())
        call.tried.add(replica.index)
        call.sending = True

    def answered(self, call: Call) -> None:
        """``call``'s replica answered (a stream: its first event came)."""
        if self.several:
            with self._lock:
                call.replica.health.succeeded()

    def released(self, outcome: str, call: Call, *, streamed: bool = False) -> bool:
        """``call``'s send ended (``outcome`` as :meth:`SendWindow.release` takes it; ``streamed``:
        its answer streamed and is now closed): no longer in flight. True when the send window
        changed (waiting sends should look again)."""
        if self._policy.pace and (streamed or outcome == "other"):
            call.replica.pacer.released_unseen()  # no answer showed the room it held
        if call.sending:
            call.sending = False
            replica = call.replica
            with self._lock:
                replica.requests -= 1
                replica.tokens -= call.size
        if not self._policy.window:
            return False
        call.replica.window.release(outcome, self._policy.clock(), call.size)
        return True

    def fail_over(self, call: Call, error: BaseException) -> bool:
        """After a failed send: note it in the replica's health; True when the call goes again
        at once to another replica: the replica never answered, answered 502/503/504, or is
        full (429), and another one in service (and, after a 429, not cooling down) has not
        been tried in this attempt. Not a retry: the attempt count stays."""
        if not self.several:
            return False
        now = self._policy.clock()
        replica = call.replica
        down = _unreachable(error)
        full = _full(error)
        with self._lock:
            if down:
                refused = isinstance(error, APIConnectionError) and not isinstance(
                    error, APITimeoutError
                )
                replica.health.failed(now, at_once=refused)
            elif isinstance(error, APIStatusError):
                replica.health.succeeded()  # it answered: a 429 or a 400 says nothing against it
            else:
                replica.health.abandoned()  # cancelled or a bad answer: no verdict
            if not (down or full) or call.pinned or call.time_left() <= 0:
                return False
            others = [
                r
                for r in self._all
                if r.index not in call.tried
                and r.health.in_service(now)
                and not (full and r.cooldown.remaining(now) > 0)
            ]
            if not others:
                return False
        if full and isinstance(error, APIStatusError) and error.retry_after:
            # What the retry policy would have done with the 429: that replica cools down.
            size = call.size if self._policy.cooldown_by_size else None
            replica.cooldown.extend(now, error.retry_after, size)
        return True

    def _ours(self, replica: Replica, response: httpx.Response) -> int | None:
        """At most how many KV tokens this client's requests hold at ``replica`` besides the one
        ``response`` answers, by its send window (None: the window is off, nothing counted).
        The answered request's slot is still taken: it holds nothing there unless its answer
        streams on (a whole answer's reservation is released as it goes; a 429 reserved none)."""
        if not self._policy.window:
            return None
        window = replica.window
        tokens, requests = window.in_flight, window.requests
        size = response.request.extensions.get(SIZE_EXTENSION)
        streams = response.status_code < 400 and response.headers.get(
            "content-type", ""
        ).startswith("text/event-stream")
        if isinstance(size, int) and not streams:
            tokens, requests = tokens - size, requests - 1
        # The server reserves in whole KV blocks, and may count a prompt a little differently.
        return max(0, tokens) + DEFAULT_BLOCK_SIZE * max(0, requests)

    def note_room(self, response: httpx.Response) -> None:
        """Note the room ``response`` advertises, if any (see :class:`kvclient._pacing.Pacer`),
        for its replica's pacing and for routing."""
        pace = self._policy.pace
        if not (pace or self.several):
            return
        hint = parse_ratelimit(response.headers)
        if hint is None:
            return
        extensions = response.request.extensions
        replica = extensions.get(REPLICA_EXTENSION)
        if not isinstance(replica, Replica):
            replica = self._all[0]
        now = self._policy.clock()
        if pace:
            refused = response.status_code == 429  # its round trip times the way in
            replica.pacer.observe(
                now,
                hint,
                extensions.get(PACED_EXTENSION),
                refused=refused,
                ours=self._ours(replica, response),
            )
        if self.several:
            with self._lock:
                replica.hint_free = hint.remaining
                replica.hint_until = now + min(
                    DEFAULT_PACE_MAX_AGE, (hint.reset or math.inf) + PACE_LAG
                )
                replica.sent_since = 0
                if hint.quota is not None:
                    replica.quota = hint.quota
