"""``Prefer: wait=N`` (RFC 7240): a client bounds its own time in a server's admission queue."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from reference_server import running_server
from reference_server.http.requests import preferred_wait


def scope(*values: str) -> dict[str, object]:
    return {"headers": [(b"prefer", v.encode()) for v in values]}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ((), None),
        (("wait=0",), 0.0),
        (("respond-async, wait=10",), 10.0),
        (("WAIT = 7; foo=bar",), 7.0),
        (('wait="5"',), 5.0),
        (("wait=9", "wait=4"), 4.0),  # the shortest
        (("wait=-1",), None),
        (("wait=1.5",), None),  # not delta-seconds: ignored
        (("wait=soon",), None),
        (("waiting=3",), None),
        (("wait=1234567890123",), None),
    ],
)
def test_the_wait_preference_is_read_as_rfc_7240_writes_it(
    values: tuple[str, ...], expected: float | None
) -> None:
    assert preferred_wait(scope(*values)) == expected  # type: ignore[arg-type]


def test_a_client_that_will_not_wait_is_refused_at_once_by_a_queueing_server() -> None:
    # One holder takes the whole budget for ~2 s; the server queues others up to 30 s.
    with running_server(
        kv_tokens=1024, context_window=1024, decode_rate=400.0, max_queue_wait=30.0,
        mean_output_tokens=10_000,
    ) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:  # fmt: skip
        body = {"model": "kvclient-sim", "prompt": "hi", "max_tokens": 800, "stream": True}
        held = threading.Event()

        def hold() -> None:
            with http.stream("POST", "/v1/completions", json=body) as answer:
                held.set()
                answer.read()

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        started = time.monotonic()
        refused = http.post("/v1/completions", json=body, headers={"Prefer": "wait=0"})
        assert refused.status_code == 429
        assert time.monotonic() - started < 1.5  # at once, not after the queue's 30 s
        assert int(refused.headers["retry-after"]) >= 1
        waited = http.post("/v1/completions", json=body, headers={"Prefer": "wait=20"})
        assert waited.status_code == 200  # queued until the holder's release, then admitted
        holder.join(10)
