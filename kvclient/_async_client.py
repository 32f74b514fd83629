"""The async shells, ``AsyncClient`` and ``AsyncStream``: they only send, read and sleep.

Every decision is :class:`~kvclient._client.BaseClient`'s. This file is the source of
``kvclient/_sync_client.py``: ``python scripts/unasync.py`` writes the sync shells from it
(``python scripts/unasync.py --check`` fails when they differ), so edit this one and regenerate.
Where sync and async differ in more than ``async``/``await`` and names, the difference is a pair
in :mod:`kvclient._shims`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from ._client import (
    DEFAULT_SAFETY_MARGIN,
    DEFAULT_TIMEOUT,
    STALE_RESENDS,
    WINDOW_POLL,
    BaseClient,
    Prepared,
)
from ._exceptions import APIResponseError, KVClientError
from ._http import Bounded, stale_connection, transport_error
from ._models import Completion, CompletionChunk, RetryEvent
from ._policy import RetryPolicy
from ._replicas import Call, Replica, slot_outcome
from ._shims import AsyncLock, AsyncSignal, async_close_chain, async_drop, async_eager
from ._streaming import StreamBase
from ._tokens import Message, TokenCounter
from .engines.discovery import Answer, Discovery, Probe
from .sse import AsyncLines, aiter_events

__all__ = ["AsyncClient", "AsyncStream"]


class AsyncStream(StreamBase):
    """A streamed answer: ``async with client.chat_stream(...) as stream: async for chunk in
    stream: ...``.

    Opening it sends the request and waits for the first event, retrying as a plain call would;
    once an event arrived nothing is retried.
    """

    _client: AsyncClient

    def __init__(
        self, client: AsyncClient, prepare: Callable[[], Awaitable[Prepared]], *, chat: bool
    ) -> None:
        super().__init__(
            async_eager(prepare),
            chat=chat,
            read_timeout=client._base_timeout.read,
            clock=client.retry.clock,
        )
        self._prepare = prepare
        self._client = client
        self._response: httpx.Response | None = None
        self._events: Any = None
        # httpx's byte iterator under our line and event parsers: when the parser ends on an
        # error (a server's error event), the iterator is left suspended and must be finished.
        self._lines: Any = None

    async def __aenter__(self) -> AsyncStream:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _open(self) -> None:
        if self._call is not None:
            return
        client = self._client
        if self._prepared_value is None:
            # Discovery and counting happen here, so `async with client.chat_stream(...)` works.
            self._prepared_value = await self._prepare()
        prepared = self._prepared_value
        self._call = call = client.new_call(prepared.size)

        async def first_event(
            response: httpx.Response,
        ) -> tuple[httpx.Response, Any, Any, dict[str, Any] | None]:
            lines = response.aiter_bytes()
            events = aiter_events(AsyncLines(lines), max_events=self._max_events())
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                await async_close_chain(response, events, lines)
                raise APIResponseError(
                    "the stream ended before its first event", response=response
                ) from None
            except httpx.HTTPError as exc:
                await async_close_chain(response, events, lines)
                # No event yet: nothing delivered, so this is as retryable as a refused connection.
                raise transport_error(exc, response.request, answered=False) from exc
            except BaseException:
                await async_close_chain(response, events, lines)
                raise
            return response, events, lines, first

        opened = await client._run(
            call, lambda call: client._request(prepared, call), stream=True, opened=first_event
        )
        self._response, self._events, self._lines, first = opened
        self._opened(self._response)
        self._feed(first)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> CompletionChunk:
        await self._open()
        while not self._pending:
            if self._acc.done:
                await self.aclose()
                raise StopAsyncIteration
            self._wait_for_event()
            try:
                payload = await self._events.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                self._end(saw_done=False)
                continue
            except httpx.HTTPError as exc:
                await self.aclose()
                raise self._broken(exc, self._response.request if self._response else None) from exc
            except BaseException:
                await self.aclose()
                raise
            self._feed(payload)
        return self._pending.popleft()

    async def aclose(self) -> None:
        events, self._events = self._events, None
        lines, self._lines = self._lines, None
        try:
            if self._response is not None:
                await async_close_chain(self._response, events, lines)
        finally:
            self._give_back_slot()

    def __del__(self) -> None:
        # Dropped unclosed (``async for chunk in client.chat_stream(...): break``).
        if getattr(self, "_bounded", None) is not None:
            with contextlib.suppress(Exception):
                async_drop(self)


class AsyncClient(BaseClient):
    """Asynchronous client, on asyncio or trio (anyio underneath). Share one per server.

    >>> async with AsyncClient(base_url="http://127.0.0.1:8000") as c:  # doctest: +SKIP
    ...     (await c.chat([{"role": "user", "content": "hi"}])).text
    """

    _http: httpx.AsyncClient

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | Sequence[str | httpx.URL] | None = None,
        model: str | None = None,
        context_window: int | None = None,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        safety_margin_tokens: int = 0,
        http_client: httpx.AsyncClient | None = None,
        priority: int | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            model=model,
            context_window=context_window,
            api_key=api_key,
            counter=counter,
            retry=retry,
            timeout=timeout,
            headers=headers,
            safety_margin=safety_margin,
            on_retry=on_retry,
            safety_margin_tokens=safety_margin_tokens,
            priority=priority,
        )
        if http_client is not None and transport is not None:
            raise ValueError("pass transport= or http_client=, not both")
        self._owns_http = http_client is None
        if http_client is None:
            http_client = httpx.AsyncClient(transport=transport, timeout=timeout)
        self._http = http_client
        self._discovery_lock = AsyncLock()
        # Wakes the sends waiting for a send-window slot whenever one is given back.
        self._window_changed = AsyncSignal()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (not those of an ``http_client`` passed in)."""
        if self._owns_http:
            await self._http.aclose()

    # --- I/O ---------------------------------------------------------------------------------

    async def discover(self, *, verify: bool = False) -> None:
        """Learn the model and the context window, whichever was not given, from the server
        (once; every replica's window with several: the smallest counts).

        ``verify``: when both were given, still check that the server answers, takes the key
        and serves the model. Raises :class:`KVClientError` saying what is missing.
        """
        if not self._needs_discovery():
            if verify:
                self._adopt_discovery(await self._discover_at(None), verify=True)
            return
        async with self._discovery_lock:
            if not self._needs_discovery():
                return
            if len(self._replicas) > 1:
                # Each replica once (one attempt: a dead one must not hold the others up);
                # when none answered, again as any request would go (routed, retried).
                found: list[Discovery | KVClientError] = []
                for replica in self._replicas:
                    if not self._needs_discovery():
                        break
                    try:
                        found.append(await self._discover_at(replica))
                    except KVClientError as error:
                        found.append(error)
                    self._adopt_replica_discovery(replica, found[-1])
                if self._adopt_discoveries(found):
                    return
            self._adopt_discovery(await self._discover_at(None))

    async def send(
        self, call: Call, build: Callable[[Call], httpx.Request], *, stream: bool = False
    ) -> httpx.Response:
        """Send ``call`` on the one send path (see :mod:`kvclient._client`): each attempt's
        request is ``build(call)``, for ``call.replica``.

        Returns the admitted answer (status < 400), read and closed; with ``stream`` unread,
        its body holding the call's send-window slot until it is closed. Raises the call's
        final :class:`KVClientError` (the server's error, ``ServerBusyError`` when retries ran
        out, a connection error).
        """
        response: httpx.Response = await self._run(call, build, stream=stream)
        return response

    # --- I/O ---------------------------------------------------------------------------------

    async def _run(
        self,
        call: Call,
        build: Callable[[Call], httpx.Request],
        *,
        stream: bool,
        opened: Callable[[httpx.Response], Awaitable[Any]] | None = None,
    ) -> Any:
        """Attempts until one succeeds or the policy gives up; with ``opened``, an attempt
        succeeds when ``opened(response)`` does (a stream's first event)."""
        result: Any = None
        async for attempt in call:
            with attempt:
                result = await self._attempt(call, build, stream, opened)
        return result

    async def _attempt(
        self,
        call: Call,
        build: Callable[[Call], httpx.Request],
        stream: bool,
        opened: Callable[[httpx.Response], Awaitable[Any]] | None,
    ) -> Any:
        """One attempt: go to the replica that fits it best, hold out that replica's cooldown
        and pacing, take a send-window slot, send. A connection failure or a 503 before any
        byte goes again at once to another replica, if there is one in service."""
        again = False
        while True:
            self._replicas.route(call, again=again)
            await self._hold(call)
            await self._acquire_slot(call)
            if not again:
                call.begin_attempt()  # a fail-over is the same attempt, somewhere else
            self._replicas.sending(call)
            try:
                response = await self._send_request(build(call), call, stream=stream)
                result = response if opened is None else await opened(response)
            except BaseException as exc:
                self._release_slot(slot_outcome(exc), call)
                if self._replicas.fail_over(call, exc):
                    again = True
                    continue
                raise
            self._replicas.answered(call)
            body = response.stream
            if stream and not response.is_closed and isinstance(body, Bounded):
                # Handed on unread: httpx's read timeout bounds each chunk from here (a
                # client's stream bounds each event), and closing the body gives the slot back.
                body.deadline = None
                body.on_close(lambda: self._release_slot("ok", call, streamed=True))
            else:
                self._release_slot("ok", call)
            return result

    async def _send_request(
        self, request: httpx.Request, call: Call, *, stream: bool
    ) -> httpx.Response:
        request = self._stamp(request, call)
        while True:
            try:
                response = await self._http.send(request, stream=True)
                break
            except httpx.HTTPError as exc:
                if call.resends < STALE_RESENDS and stale_connection(exc):
                    call.resends += 1
                    continue
                raise transport_error(exc, request, answered=False) from exc
        self._bound(response)
        if stream and response.status_code < 400:
            return response
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise transport_error(exc, request, answered=True) from exc
        finally:
            await response.aclose()
        if response.status_code >= 400:
            raise self._status_error(response)
        return response

    async def _hold(self, call: Call) -> None:
        for _ in call.hold_rounds():
            wait = call.hold_time()
            if wait <= 0:
                return
            await self.retry.async_sleep(wait)
            call.held(wait)
        raise self._stuck(call)

    async def _acquire_slot(self, call: Call) -> None:
        clock = self.retry.clock
        size = call.size
        window = call.replica.window
        if not self.retry.window or window.try_acquire(clock(), size):
            return
        started = time.monotonic()
        async with self._window_changed:
            while not window.try_acquire(clock(), size):
                left = call.time_left()
                if left <= 0:
                    raise self._window_busy(call)
                await self._window_changed.wait(min(left, WINDOW_POLL))
        call.held(time.monotonic() - started)

    def _release_slot(self, outcome: str, call: Call, *, streamed: bool = False) -> None:
        if self._replicas.released(outcome, call, streamed=streamed):
            self._window_changed.notify_all()

    async def _discover_at(self, replica: Replica | None) -> Discovery:
        """Run the dialects' discovery against ``replica`` (None: wherever requests go)."""
        driver = self._discovery()
        probe = next(driver)
        while True:
            answer = await self._probe(probe, replica)
            try:
                probe = driver.send(answer)
            except StopIteration as stop:
                found: Discovery = stop.value
                return found

    async def _probe(self, probe: Probe, replica: Replica | None) -> Answer:
        call = self._probe_call(replica)
        try:
            response = await self._run(
                call, lambda call: self._probe_request(probe, call), stream=False
            )
        except KVClientError as error:
            return self._probe_answer(None, error)
        return self._probe_answer(response, None)

    async def _call(self, prepared: Prepared) -> Completion:
        call = self.new_call(prepared.size)

        async def parsed(response: httpx.Response) -> dict[str, Any]:
            return self._json(response)

        payload = await self._run(
            call, lambda call: self._request(prepared, call), stream=False, opened=parsed
        )
        return self._completion(payload, prepared, call)

    # --- API ---------------------------------------------------------------------------------

    async def complete(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        priority: int | None = None,
        **params: Any,
    ) -> Completion:
        """``POST /v1/completions`` with an explicit, clamped ``max_tokens``.

        ``priority``: this call's priority class (``X-Priority``, lower served first; None:
        the client's). ``params`` go into the request body as they are."""
        await self.discover()
        prepared = self._prepare_completion(
            prompt, max_tokens, params, stream=False, priority=priority
        )
        return await self._call(prepared)

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int | None = None,
        priority: int | None = None,
        **params: Any,
    ) -> Completion:
        """``POST /v1/chat/completions`` with an explicit, clamped ``max_tokens``; ``priority``
        as :meth:`complete` takes it."""
        await self.discover()
        prepared = self._prepare_chat(messages, max_tokens, params, stream=False, priority=priority)
        return await self._call(prepared)

    def complete_stream(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        priority: int | None = None,
        **params: Any,
    ) -> AsyncStream:
        """Stream ``/v1/completions``: ``async with client.complete_stream(...) as stream``.

        The request is counted, clamped and sent when the stream is entered (or first iterated).
        """

        async def prepare() -> Prepared:
            await self.discover()
            return self._prepare_completion(
                prompt, max_tokens, params, stream=True, priority=priority
            )

        return AsyncStream(self, prepare, chat=False)

    def chat_stream(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int | None = None,
        priority: int | None = None,
        **params: Any,
    ) -> AsyncStream:
        """Stream ``/v1/chat/completions``: ``async with client.chat_stream(...) as stream``.

        The request is counted, clamped and sent when the stream is entered (or first iterated).
        """

        async def prepare() -> Prepared:
            await self.discover()
            return self._prepare_chat(messages, max_tokens, params, stream=True, priority=priority)

        return AsyncStream(self, prepare, chat=True)
