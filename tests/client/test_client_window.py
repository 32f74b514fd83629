"""The send window: after a refusal, one client keeps no more in flight than the server held.

It counts KV tokens (prompt + output cap); a request without a known size counts 1.
"""

from __future__ import annotations

import math
import threading
import time

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient import AsyncClient, Client, RetryPolicy, ServerBusyError
from kvclient._pacing import SendWindow
from kvclient.testing import FakeClock
from tests.helpers.client import BASE_URL, CONTEXT, COUNTER, MODEL, busy, ok_completion

PROMPT = "hello world"


# --- the pure window ---------------------------------------------------------------------------


def test_open_until_the_first_refusal() -> None:
    window = SendWindow()
    assert all(window.try_acquire(0.0) for _ in range(1000))
    assert window.limit == math.inf


def test_a_refusal_narrows_to_the_others_in_flight() -> None:
    window = SendWindow()
    for _ in range(5):
        assert window.try_acquire(0.0)
    window.release("refused", 0.0)  # 4 others still in flight: the server holds 4
    assert window.limit == 4
    assert window.in_flight == 4
    assert not window.try_acquire(0.1)
    window.release("ok", 0.2)  # one finished: room for one more, and a little wider
    assert window.limit == pytest.approx(4.25)
    assert window.try_acquire(0.3)
    assert not window.try_acquire(0.3)


def test_never_below_one_and_reopens_after_quiet_time() -> None:
    window = SendWindow(reset=10.0)
    assert window.try_acquire(0.0)
    window.release("refused", 0.0)
    assert window.limit == 1
    assert window.try_acquire(1.0)
    assert not window.try_acquire(1.0)
    window.release("other", 2.0)  # neither refusal nor success: unchanged
    assert window.limit == 1
    assert window.try_acquire(10.5)
    assert window.limit == math.inf  # ten seconds without a refusal


def test_counted_in_tokens_the_room_of_a_large_request_takes_several_small_ones() -> None:
    window = SendWindow()
    assert window.try_acquire(0.0, 4000)
    assert window.try_acquire(0.0, 2000)
    assert window.try_acquire(0.0, 1000)
    window.release("refused", 0.1, 1000)  # the server holds the other 6,000 tokens
    assert window.limit == 6000
    assert (window.in_flight, window.requests) == (6000, 2)
    assert not window.try_acquire(0.2, 500)
    window.release("ok", 0.3, 4000)  # the large one finished
    assert window.limit == pytest.approx(6000 + 4000 * 4000 / 6000)
    assert all(window.try_acquire(0.4, 1000) for _ in range(4))  # four small ones in its room
    assert window.in_flight == 6000
    assert window.try_acquire(0.4, 2600)  # and the additive increase: one more of about its size
    assert not window.try_acquire(0.4, 100)


def test_a_request_alone_in_flight_always_goes() -> None:
    window = SendWindow()
    assert window.try_acquire(0.0, 500)
    window.release("refused", 0.0, 500)  # nothing else in flight: the floor is its own size
    assert window.limit == 500
    assert window.try_acquire(0.1, 8000)  # larger than the window, but alone
    assert not window.try_acquire(0.1, 1)
    window.release("ok", 0.2, 8000)
    assert (window.in_flight, window.requests) == (0, 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["acquire", "ok", "refused", "other"]),
            st.floats(0, 0.5),
            st.integers(1, 8192),
        ),
        max_size=200,
    )
)
def test_window_invariants_in_tokens(ops: list[tuple[str, float, int]]) -> None:
    window = SendWindow(reset=5.0)
    now = 0.0
    held: list[int] = []
    for op, step, size in ops:
        now += step
        if op == "acquire":
            alone = not held
            fits = window.in_flight + size <= window.limit
            reopens = now - window._last_refusal >= window.reset  # open again: fits anything
            goes = window.try_acquire(now, size)
            assert goes == (alone or fits or reopens)
            if goes:
                held.append(size)
        elif held:
            window.release(op, now, held.pop(0))
        assert window.in_flight == sum(held)
        assert window.requests == len(held)
        assert window.limit >= 1


@given(
    st.lists(
        st.tuples(st.sampled_from(["acquire", "ok", "refused", "other"]), st.floats(0, 0.5)),
        max_size=200,
    )
)
def test_window_invariants(ops: list[tuple[str, float]]) -> None:
    window = SendWindow(reset=5.0)
    now, held = 0.0, 0
    for op, step in ops:
        now += step
        if op == "acquire":
            if window.try_acquire(now):
                held += 1
        elif held:
            window.release(op, now)
            held -= 1
        assert window.in_flight == held
        assert window.limit >= 1


# --- through the clients -----------------------------------------------------------------------


class Gate:
    """A scripted server: the first ``hold`` requests stay open until released, the next one
    is refused with 429, and any later request is answered at once and recorded."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.arrivals = 0
        self.order: list[str] = []


def policy() -> RetryPolicy:
    # A tiny Retry-After so the cooldown is over at once and only the window holds sends.
    return FakeClock().policy(window_reset=60.0)


@pytest.mark.anyio
async def test_async_requests_wait_for_a_slot_after_a_refusal() -> None:
    released = anyio.Event()
    gate = Gate(hold=3)

    async def handler(request: httpx.Request) -> httpx.Response:
        gate.arrivals += 1
        n = gate.arrivals
        if n <= gate.hold:
            await released.wait()
            return ok_completion()
        if n == gate.hold + 1:
            return busy(None, ms="1")
        gate.order.append(f"request {n} after release: {released.is_set()}")
        return ok_completion()

    transport = httpx.MockTransport(handler)
    client = AsyncClient(
        base_url=BASE_URL, model=MODEL, context_window=CONTEXT, counter=COUNTER,
        retry=policy(), transport=transport,
    )  # fmt: skip
    async with client, anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(client.complete, PROMPT)
        while gate.arrivals < 3:  # noqa: ASYNC110 - polling a plain counter
            await anyio.sleep(0.001)
        # The fourth is refused: 3 others in flight, so the window closes at their tokens
        # (each reserves the whole context: the cap is unset).
        tg.start_soon(client.complete, PROMPT)
        while gate.arrivals < 4:  # noqa: ASYNC110 - polling a plain counter
            await anyio.sleep(0.001)
        tg.start_soon(client.complete, PROMPT)
        await anyio.sleep(0.01)  # an unheld send would arrive within microseconds
        # Nothing else reached the server while the three held their slots.
        assert gate.arrivals == 4
        assert client._window.limit == 3 * CONTEXT
        released.set()
    assert gate.order == ["request 5 after release: True", "request 6 after release: True"]
    assert gate.arrivals == 6  # the refused one retried, and the waiting one went
    assert client._window.in_flight == 0


def test_sync_threads_wait_for_a_slot_after_a_refusal() -> None:
    released = threading.Event()
    lock = threading.Lock()
    gate = Gate(hold=2)

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            gate.arrivals += 1
            n = gate.arrivals
        if n <= gate.hold:
            released.wait(5)
            return ok_completion()
        if n == gate.hold + 1:
            return busy(None, ms="1")
        return ok_completion()

    client = Client(
        base_url=BASE_URL, model=MODEL, context_window=CONTEXT, counter=COUNTER,
        retry=policy(), transport=httpx.MockTransport(handler),
    )  # fmt: skip
    threads = [threading.Thread(target=client.complete, args=(PROMPT,)) for _ in range(2)]
    for t in threads:
        t.start()
    while gate.arrivals < 2:
        threading.Event().wait(0.001)
    late = [threading.Thread(target=client.complete, args=(PROMPT,)) for _ in range(2)]
    late[0].start()  # refused: the window closes at the 2 others in flight
    deadline = time.monotonic() + 10
    while gate.arrivals < 3 and time.monotonic() < deadline:
        threading.Event().wait(0.001)
    late[1].start()
    threading.Event().wait(0.01)  # an unheld send would arrive within microseconds
    assert gate.arrivals == 3  # the refused one; the other waits for a slot
    assert client._window.limit == 2 * CONTEXT
    released.set()
    for t in threads + late:
        t.join(5)
    assert gate.arrivals == 5
    assert client._window.in_flight == 0
    client.close()


@pytest.mark.anyio
async def test_a_send_still_waiting_for_room_at_its_deadline_gives_up() -> None:
    released = anyio.Event()
    arrivals = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            await released.wait()
            return ok_completion()
        return busy(None, ms="1") if arrivals == 2 else ok_completion()

    clock = FakeClock()
    client = AsyncClient(
        base_url=BASE_URL, model=MODEL, context_window=CONTEXT, counter=COUNTER,
        retry=clock.policy(window_reset=60.0, deadline=30.0),
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    gave_up: list[ServerBusyError] = []

    async def refused_then_waits() -> None:
        with pytest.raises(ServerBusyError, match="no room freed") as info:
            await client.complete(PROMPT)
        gave_up.append(info.value)

    async with client, anyio.create_task_group() as tg:
        tg.start_soon(client.complete, PROMPT)  # stays in flight
        while arrivals < 1:  # noqa: ASYNC110 - polling a plain counter
            await anyio.sleep(0.001)
        tg.start_soon(refused_then_waits)  # refused; its retry waits for room in the window
        while not client._window_changed.waiters:  # noqa: ASYNC110 - polling a plain list
            await anyio.sleep(0.001)
        clock.advance(31.0)  # past its deadline
        for event in client._window_changed.waiters:
            event.set()
        while not gave_up:  # noqa: ASYNC110 - polling a plain list
            await anyio.sleep(0.001)
        released.set()
    assert arrivals == 2  # the waiting send never reached the server
    assert gave_up[0].attempts == 1
    assert client._window.in_flight == 0


@pytest.mark.anyio
async def test_window_off_sends_everything() -> None:
    arrivals = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal arrivals
        arrivals += 1
        return busy(None, ms="1") if arrivals == 1 else ok_completion()

    async with AsyncClient(
        base_url=BASE_URL, model=MODEL, context_window=CONTEXT, counter=COUNTER,
        retry=FakeClock().policy(window=False), transport=httpx.MockTransport(handler),
    ) as client:  # fmt: skip
        await client.complete(PROMPT)
        assert client._window.in_flight == 0
        assert client._window.limit == math.inf
