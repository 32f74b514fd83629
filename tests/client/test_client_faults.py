"""Any Retry-After a server may send, property-based: the wait stays within the advice and the
cap. The other faults, on both clients: tests/client/_async/test_faults.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvclient import (
    ServerBusyError,
    parse_retry_after,
)
from tests.helpers.client import (
    busy,
    make_client,
    new_server,
)

PROMPT = "hello"
YEAR = 365 * 24 * 3600


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(header=st.text(max_size=40) | st.from_regex(r"\d{1,6}(\.\d{1,3})?", fullmatch=True))
def test_any_retry_after_waits_within_advice_and_cap(header: str) -> None:
    """Whatever the header: the wait is >= the server's advice and <= the cap, or no wait."""
    server = new_server()
    try:
        response = busy(header)
    except (UnicodeEncodeError, ValueError):
        return  # not a header httpx can even send
    server.add("/v1/completions", response)
    policy = server.clock.policy(max_wait=30.0)
    advice = parse_retry_after(response.headers, now=server.clock.wall())
    if advice is not None and advice > 30.0:
        with make_client(server, retry=policy) as client, pytest.raises(ServerBusyError) as info:
            client.complete(PROMPT)
        assert server.clock.sleeps == []
        assert info.value.retry_after == advice
        return
    with make_client(server, retry=policy) as client:
        result = client.complete(PROMPT)
    (wait,) = server.clock.sleeps
    assert math.isfinite(wait)
    assert 0 < wait <= 30.0
    if advice:
        assert wait >= advice
    assert result.attempts == 2


# --- async ---------------------------------------------------------------------------------
