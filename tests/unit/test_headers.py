"""The headers' syntax (kvclient.headers): Retry-After read, RateLimit written and read, and the
one reader of header values both use."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient import parse_retry_after
from kvclient.headers import RoomHint, format_ratelimit, header_values, parse_ratelimit

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def http_date(offset: float) -> str:
    return format_datetime(datetime.fromtimestamp(NOW + offset, tz=timezone.utc), usegmt=True)


# --- parse_retry_after -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "2"}, 2.0),
        ({"Retry-After": "0"}, 0.0),
        ({"Retry-After": " 7 "}, 7.0),
        ({"Retry-After": "1.5"}, 1.5),
        ({"retry-after": "3"}, 3.0),
        ({"RETRY-AFTER": "4"}, 4.0),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "250.5"}, 0.2505),
        # retry-after-ms is the more precise advice and wins.
        ({"retry-after-ms": "1500", "Retry-After": "2"}, 1.5),
        # A garbage retry-after-ms falls back to Retry-After.
        ({"retry-after-ms": "soon", "Retry-After": "2"}, 2.0),
        ({"retry-after-ms": "-5", "Retry-After": "2"}, 2.0),
        ({}, None),
        ({"Retry-After": ""}, None),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "-1"}, None),
        ({"Retry-After": "-0.5"}, None),
        ({"Retry-After": "NaN"}, None),
        ({"Retry-After": "nan"}, None),
        ({"Retry-After": "inf"}, None),
        ({"Retry-After": "Infinity"}, None),
        ({"Retry-After": "1e3"}, None),
        ({"Retry-After": "0x10"}, None),
        # Two headers, joined by a comma: the server's floor is the larger.
        ({"Retry-After": "2, 3"}, 3.0),
        ({"Retry-After": "9" * 10_000}, None),
        ({"Retry-After": "1" * 1_000_000}, None),
        ({"retry-after-ms": "NaN"}, None),
        ({"retry-after-ms": "inf"}, None),
    ],
)
def test_parse_retry_after_delta_seconds_and_garbage(
    headers: dict[str, str], expected: float | None
) -> None:
    assert parse_retry_after(headers, now=NOW) == expected


def test_parse_retry_after_http_date() -> None:
    assert parse_retry_after({"Retry-After": http_date(30)}, now=NOW) == pytest.approx(30)
    # RFC 850 and asctime forms are HTTP-dates too.
    assert parse_retry_after(
        {"Retry-After": "Thursday, 01-Jan-26 12:00:10 GMT"}, now=NOW
    ) == pytest.approx(10)
    assert parse_retry_after({"Retry-After": "Thu Jan  1 12:00:20 2026"}, now=NOW) == 20


def test_parse_retry_after_date_in_the_past_means_now() -> None:
    assert parse_retry_after({"Retry-After": http_date(-3600)}, now=NOW) == 0.0


def test_parse_retry_after_date_a_year_ahead_is_reported_as_is() -> None:
    year = 365 * 24 * 3600
    assert parse_retry_after({"Retry-After": http_date(year)}, now=NOW) == pytest.approx(year)


@pytest.mark.parametrize(
    "value",
    [
        "Mon, 99 Foo 2026 99:99:99 GMT",
        "Wed, 21 Oct 99999999 07:28:00 GMT",
        "tomorrow",
        "\x00\x01",
    ],
)
def test_parse_retry_after_malformed_dates(value: str) -> None:
    assert parse_retry_after({"Retry-After": value}, now=NOW) is None


def test_parse_retry_after_takes_httpx_headers_and_bytes() -> None:
    assert parse_retry_after(httpx.Headers({"Retry-After": "5"})) == 5.0
    assert parse_retry_after({"Retry-After": b"6"}) == 6.0  # type: ignore[dict-item]
    assert parse_retry_after(None) is None
    assert parse_retry_after(42) is None


def test_repeated_retry_after_headers_count_their_largest_valid_value() -> None:
    # httpx keeps repeats apart (get_list) and joins them for .get(): "1, 2".
    repeated = httpx.Headers([("Retry-After", "1"), ("Retry-After", "2"), ("Retry-After", "x")])
    assert repeated.get("retry-after") == "1, 2, x"
    assert parse_retry_after(repeated) == 2.0
    assert parse_retry_after({"Retry-After": "3, 1.5, soon"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "10, 2500", "Retry-After": "1"}) == 2.5
    ms = httpx.Headers([("retry-after-ms", "1"), ("retry-after-ms", "700")])
    assert parse_retry_after(ms) == 0.7
    # An HTTP-date keeps its own comma; joined with a number or another date, the later wins.
    date = format_datetime(datetime.fromtimestamp(NOW + 30, tz=timezone.utc), usegmt=True)
    later = format_datetime(datetime.fromtimestamp(NOW + 90, tz=timezone.utc), usegmt=True)
    assert parse_retry_after({"Retry-After": f"2, {date}"}, now=NOW) == 30.0
    assert parse_retry_after({"Retry-After": f"{later}, {date}"}, now=NOW) == 90.0
    assert parse_retry_after({"Retry-After": ", ".join(["1"] * 200)}) is None  # too long


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["Retry-After", "retry-after", "retry-after-ms", "Retry-After-Ms", "x"]),
        st.one_of(st.text(), st.from_regex(r"-?\d{0,30}(\.\d{0,12})?", fullmatch=True)),
    ),
    st.floats(allow_nan=True, allow_infinity=True) | st.none(),
)
def test_parse_retry_after_never_raises_and_is_finite(
    headers: dict[str, str], now: float | None
) -> None:
    value = parse_retry_after(headers, now=now)
    assert value is None or (math.isfinite(value) and value >= 0)


@settings(deadline=None)
@given(st.datetimes(timezones=st.just(timezone.utc)), st.floats(0, 2e9))
def test_parse_retry_after_any_http_date(when: datetime, now: float) -> None:
    value = parse_retry_after({"Retry-After": format_datetime(when, usegmt=True)}, now=now)
    assert value is None or (math.isfinite(value) and value >= 0)


# --- the header syntax -----------------------------------------------------------------------


@given(
    quota=st.integers(0, 10**12),
    remaining=st.integers(0, 10**12),
    reset=st.floats(0, 1e6, allow_nan=False),
)
def test_what_the_server_writes_the_client_reads(quota: int, remaining: int, reset: float) -> None:
    policy, current = format_ratelimit(quota=quota, remaining=remaining, reset=reset)
    hint = parse_ratelimit(httpx.Headers({"RateLimit-Policy": policy, "RateLimit": current}))
    assert hint is not None
    assert hint.quota == quota
    assert hint.remaining == remaining
    assert hint.reset == math.ceil(reset * 1000) / 1000  # tms: milliseconds, rounded up
    assert current.split(";")[2] == f"t={math.ceil(reset)}"  # the draft's whole seconds


@given(st.text(max_size=300), st.text(max_size=300))
def test_the_parser_never_raises(policy: str, current: str) -> None:
    hint = parse_ratelimit({"RateLimit-Policy": policy, "RateLimit": current})
    assert hint is None or hint.remaining >= 0


@pytest.mark.parametrize(
    ("policy", "current", "expected"),
    [
        # Other policies beside ours, a Token for the name, parameters in any order.
        ('"burst";q=10;w=1, kv;kvtok;q=500', 'other;r=1, "kv";t=3;r=40', (500, 40, 3)),
        ('"kv";q=500;kvtok=?1', '"kv";r=0', (500, 0, None)),
        ('"kv";q=500;kvtok', '"kv";r=9;t=2;tms=1500', (500, 9, 1.5)),  # tms wins over t
        ('"kv";q=500;kvtok', '"kv";r=9;t=2;tms=x', (500, 9, 2.0)),
        ('"kv";q=500', '"kv";r=40;t=3', None),  # no kvtok: not in KV tokens
        ('"kv";q=500;kvtok=?0', '"kv";r=40;t=3', None),
        ('"kv";q=500;kvtok', '"default";r=40;t=3', None),  # no "kv" item in RateLimit
        ('"kv";q=500;kvtok', '"kv";r=-1;t=3', None),
        ('"kv";q=500;kvtok', '"kv";r=1.5', None),
        ('"kv";q=500;kvtok', '"kv";t=3', None),
        ('"kv";q=500;kvtok', "", None),
    ],
)
def test_only_our_policy_in_kv_tokens_is_read(
    policy: str, current: str, expected: tuple[int, int, float | None] | None
) -> None:
    hint = parse_ratelimit({"ratelimit-policy": policy, "ratelimit": current})
    if expected is None:
        assert hint is None
    else:
        assert hint == RoomHint(quota=expected[0], remaining=expected[1], reset=expected[2])


def test_a_list_split_over_several_lines_is_one_list() -> None:
    headers = httpx.Headers(
        [("RateLimit-Policy", '"a";q=1'), ("RateLimit-Policy", '"kv";q=9;kvtok'),
         ("RateLimit", '"a";r=0'), ("RateLimit", '"kv";r=7;t=1')]
    )  # fmt: skip
    assert parse_ratelimit(headers) == RoomHint(quota=9, remaining=7, reset=1)


def test_no_headers_no_hint() -> None:
    assert parse_ratelimit(httpx.Headers({"Retry-After": "1"})) is None
    assert (
        parse_ratelimit({"RateLimit": '"kv";r=1' * 200, "RateLimit-Policy": '"kv";kvtok'}) is None
    )


# --- the one reader ---------------------------------------------------------------------------


def test_one_reader_for_httpx_headers_and_plain_mappings() -> None:
    repeated = httpx.Headers([("RateLimit", "a"), ("ratelimit", "b"), ("Retry-After", "1")])
    assert header_values(repeated, "RateLimit") == ["a", "b"]
    assert header_values({"RATELIMIT": "a", "x": "y", "ratelimit": b"b"}, "RateLimit") == ["a", "b"]
    assert header_values({"RateLimit": 7}, "RateLimit") == []
    assert header_values(None, "RateLimit") == []
    # Both parsers read through it: a plain mapping in any case, httpx repeats kept apart.
    assert parse_retry_after({"RETRY-AFTER-MS": "1500"}) == 1.5
    assert parse_ratelimit({"RATELIMIT-POLICY": '"kv";q=9;kvtok', "ratelimit": '"kv";r=7'}) == (
        RoomHint(quota=9, remaining=7, reset=None)
    )
