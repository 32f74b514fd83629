"""The routing rules (kvclient.routing), shared by the multi-replica client and the gateway."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient.routing import Endpoint, Health, pick, ranked

endpoints = st.lists(
    st.builds(
        Endpoint,
        free=st.none() | st.integers(-100, 10_000),
        in_flight=st.integers(0, 20),
        in_service=st.booleans(),
        in_flight_tokens=st.integers(0, 50_000),
    ),
    min_size=1,
    max_size=6,
)
needs = st.integers(1, 5_000)


def fits(e: Endpoint, need: int) -> bool:
    return e.free is None or e.free >= need


def left(e: Endpoint, need: int) -> float:
    return float("inf") if e.free is None else e.free - need


@settings(max_examples=100, deadline=None)
@given(endpoints, needs)
def test_pick_never_takes_an_endpoint_set_aside_while_another_serves(
    views: list[Endpoint], need: int
) -> None:
    chosen = pick(views, need)
    if any(e.in_service for e in views):
        assert chosen is not None
        assert views[chosen].in_service
    else:
        assert chosen is None


@settings(max_examples=100, deadline=None)
@given(endpoints, needs)
def test_the_choice_fits_when_anything_fits(views: list[Endpoint], need: int) -> None:
    chosen = pick(views, need)
    fitting = [i for i, e in enumerate(views) if e.in_service and fits(e, need)]
    if fitting:
        assert chosen in fitting
        assert chosen == ranked(views, need)[0]
        # ... and nothing that fits leaves more room after it.
        assert left(views[chosen], need) == max(left(views[i], need) for i in fitting)
    else:
        assert ranked(views, need) == []
        if chosen is not None:  # the least bad in service: the most room
            frees = [e.free for e in views if e.in_service and e.free is not None]
            assert views[chosen].free == max(frees)


def test_unknown_room_goes_by_tokens_in_flight_then_requests() -> None:
    views = [
        Endpoint(free=None, in_flight=1, in_flight_tokens=900),
        Endpoint(free=None, in_flight=3, in_flight_tokens=300),
        Endpoint(free=None, in_flight=2, in_flight_tokens=300),
    ]
    assert ranked(views, 100) == [2, 1, 0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["begin", "ok", "fail", "down", "abandon"]), st.floats(0, 1)),
        max_size=40,
    )
)
def test_health_sets_aside_and_probes_one_at_a_time(steps: list[tuple[str, float]]) -> None:
    health = Health(threshold=2, cooldown=1.0)
    now = 0.0
    probes = 0
    for action, dt in steps:
        now += dt
        if action == "begin":
            if not health.in_service(now):
                continue  # the router sends nothing there
            was_aside = health.set_aside
            health.begin(now)
            if was_aside:
                probes += 1
                assert health.probing
                assert not health.in_service(now)  # one probe at a time
        elif action == "ok":
            health.succeeded()
            assert health.in_service(now)
        elif action == "fail":
            before = health.failures
            health.failed(now)
            if before + 1 >= 2:
                assert not health.in_service(now)  # set aside for the cooldown
        elif action == "down":
            health.failed(now, at_once=True)
            assert not health.in_service(now)
            assert health.in_service(now + 1.0)  # probed back after the cooldown
        else:
            health.abandoned()
        if health.set_aside and health.out_until is not None and now < health.out_until:
            assert not health.in_service(now)


def test_health_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threshold"):
        Health(threshold=0)
