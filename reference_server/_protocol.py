"""uvicorn's h11 protocol (the reference server's front), answering clients that half-close after
their request (the gateway's own front, ``_front``, does the same).

A client may shut down its sending side once its request is sent (``shutdown(SHUT_WR)``; RFC
9112 section 9.6 lets a client close its half and still read the answer). asyncio closes a
transport at end of file unless the protocol asks to keep it open, and uvicorn does not, so
such a client got no answer and its request was treated as a hang-up.

Here the connection stays open for writing while a fully received request is being answered,
and closes once that answer is complete. An end of file in the middle of a request body, or
between requests, still closes at once. The cost: a client that closes its socket (rather
than only its sending half) looks the same until a write to it fails, so a non-streamed
request whose client went away runs to its end (at most its output cap, what its reservation
was priced for) instead of being cancelled; a stream notices at its next write or two.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HalfCloseH11Protocol"]


class HalfCloseH11Protocol(H11Protocol):
    """:class:`H11Protocol` that keeps a half-closed connection open for the pending answer."""

    _half_closed = False

    def eof_received(self) -> bool | None:  # type: ignore[override]
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None  # idle, answered, or the request is incomplete: close as before
        self._half_closed = True
        return True  # keep writing; asyncio stops reading

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed and (self.cycle is None or self.cycle.response_complete):
            # Nothing more can arrive; a pipelined request already read is being answered
            # by a new cycle (not complete), and this runs again when it is.
            self.transport.close()
