from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvclient import TiktokenCounter
from kvclient.loadgen._metrics import SLO, Distribution, RequestRecord, percentile, summarize
from kvclient.loadgen._schedule import arrival_offsets
from kvclient.loadgen._sweep import SweepPoint
from kvclient.loadgen._workload import MIXED, Shape, SyntheticWorkload, load_jsonl, make_prompt

COUNTER = TiktokenCounter()


# --- schedules ---------------------------------------------------------------------------------


def test_constant_schedule() -> None:
    assert arrival_offsets(rate=4, kind="constant", num_requests=5) == [0, 0.25, 0.5, 0.75, 1.0]


def test_schedule_bounded_by_duration() -> None:
    offsets = arrival_offsets(rate=10, kind="constant", duration=1.0)
    assert offsets[-1] <= 1.0
    assert len(offsets) == 11


def test_schedule_bounded_by_whichever_comes_first() -> None:
    assert len(arrival_offsets(rate=10, kind="constant", num_requests=3, duration=100)) == 3
    assert len(arrival_offsets(rate=10, kind="constant", num_requests=300, duration=0.5)) == 6


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_random_schedules_have_the_asked_rate_and_are_seeded(kind: str) -> None:
    offsets = arrival_offsets(rate=50, kind=kind, num_requests=4000, seed=7)  # type: ignore[arg-type]
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert offsets == arrival_offsets(rate=50, kind=kind, num_requests=4000, seed=7)  # type: ignore[arg-type]
    assert offsets != arrival_offsets(rate=50, kind=kind, num_requests=4000, seed=8)  # type: ignore[arg-type]


def test_gamma_burstiness_changes_the_spread_not_the_mean() -> None:
    bursty = arrival_offsets(rate=20, kind="gamma", burstiness=0.25, num_requests=4000, seed=1)
    smooth = arrival_offsets(rate=20, kind="gamma", burstiness=4.0, num_requests=4000, seed=1)

    def cv(offsets: list[float]) -> float:
        gaps = [b - a for a, b in itertools.pairwise(offsets)]
        return statistics.stdev(gaps) / statistics.mean(gaps)

    assert cv(bursty) > 1.5 > 0.75 > cv(smooth)
    assert bursty[-1] == pytest.approx(smooth[-1], rel=0.15)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0, "num_requests": 1},
        {"rate": float("inf"), "num_requests": 1},
        {"rate": 1},
        {"rate": 1, "num_requests": -1},
        {"rate": 1, "duration": float("nan")},
        {"rate": 1, "num_requests": 1, "burstiness": 0},
        {"rate": 1, "num_requests": 1, "kind": "zipf"},
    ],
)
def test_schedule_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(**kwargs)  # type: ignore[arg-type]


@given(
    rate=st.floats(min_value=0.1, max_value=1000),
    n=st.integers(min_value=0, max_value=200),
    kind=st.sampled_from(["poisson", "constant", "gamma"]),
)
def test_schedule_is_sorted_and_starts_at_zero(rate: float, n: int, kind: str) -> None:
    offsets = arrival_offsets(rate=rate, kind=kind, num_requests=n)  # type: ignore[arg-type]
    assert len(offsets) == n
    assert offsets == sorted(offsets)
    assert not offsets or offsets[0] == 0.0


# --- metrics -----------------------------------------------------------------------------------


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(101)), 99) == 99
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _record(index: int, *, ok: bool, **kw: object) -> RequestRecord:
    r = RequestRecord(index=index, planned=0.0, prompt_tokens=10, max_tokens_requested=None)
    r.sent = 0.01
    r.ok = ok
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_summary_counts_add_up_and_hide_nothing() -> None:
    records = [
        _record(
            0,
            ok=True,
            attempts=1,
            first_token=0.1,
            end=0.5,
            output_tokens=5,
            token_times=[0.1, 0.2, 0.3, 0.4, 0.5],
        ),
        _record(
            1,
            ok=True,
            attempts=3,
            http_429=2,
            backoff=1.5,
            first_token=1.6,
            end=2.0,
            output_tokens=1,
        ),
        _record(2, ok=False, attempts=6, http_429=5, http_503=1, error="server_busy", end=9.0),
        _record(3, ok=False, attempts=1, error="prompt_too_long", end=0.01),
    ]
    unsent = RequestRecord(index=4, planned=9.0, prompt_tokens=1, max_tokens_requested=1)
    s = summarize([*records, unsent], duration=10.0, slo=SLO(ttft=1.0))
    assert (s.sent, s.completed, s.failed) == (4, 2, 2)
    assert s.completed + s.failed == s.sent
    assert s.failed_by_cause == {"prompt_too_long": 1, "server_busy": 1}
    assert (s.http_429, s.http_503, s.attempts) == (7, 1, 11)
    assert s.attempts_per_completed == 5.5
    assert s.backoff_seconds == 1.5
    assert s.request_throughput == pytest.approx(0.2)
    assert s.output_token_throughput == pytest.approx(0.6)
    assert s.goodput == pytest.approx(0.1)  # only the first meets TTFT <= 1 s
    assert s.latency.p50 == pytest.approx(1.25)
    assert s.tpot.count == 1
    assert s.tpot.p50 == pytest.approx(0.1)
    assert s.itl.count == 4
    json.dumps(s.to_json())  # serialisable as it is


def test_distribution_of_nothing() -> None:
    assert Distribution.of([]).p99 is None


# --- workloads ---------------------------------------------------------------------------------


def test_make_prompt_is_exact_for_cl100k() -> None:
    import random

    for n in (1, 17, 500):
        assert COUNTER.count(make_prompt(n, random.Random(n))) == n


def test_synthetic_workload_is_seeded_and_in_range() -> None:
    items = SyntheticWorkload(seed=3).items(200, COUNTER)
    assert [i.prompt for i in items] == [
        i.prompt for i in SyntheticWorkload(seed=3).items(200, COUNTER)
    ]
    short = [i for i in items if i.prompt_tokens <= 300]
    long = [i for i in items if i.prompt_tokens >= 1500]
    assert len(short) + len(long) == 200
    assert any(i.max_tokens is None for i in short)  # unset caps: the big promises
    assert all(i.max_tokens is not None and i.max_tokens <= 300 for i in long)
    assert all(i.max_tokens is None or 1000 <= i.max_tokens <= 4000 for i in short)
    assert len(MIXED) == 2


def test_synthetic_chat_counts_framing() -> None:
    item = SyntheticWorkload(shapes=[Shape((5, 5), (10, 10))], chat=True).items(1, COUNTER)[0]
    assert item.is_chat
    assert item.messages is not None
    assert item.prompt_tokens == 5 + 1 + 3 + 3  # words + "user" + framing + priming


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        Shape((10, 5), (1, 1))
    with pytest.raises(ValueError, match="unset_cap_share"):
        Shape((1, 1), (1, 1), unset_cap_share=2)


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello world", "max_tokens": 5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hello world"}]})
        + "\n"
    )
    items = load_jsonl(path, COUNTER)
    assert [(i.prompt_tokens, i.max_tokens, i.is_chat) for i in items] == [
        (2, 5, False),
        (9, None, True),
    ]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{oops", "line 1: not JSON"),
        ("[1]", "line 1: expected an object"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": 5}', "'prompt' or a list"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        load_jsonl(path, COUNTER)


def test_refused_locally_is_counted_apart_from_sent() -> None:
    refused = _record(0, ok=False, error="prompt_too_long", end=0.01, refused_locally=True)
    refused.message = "prompt of 9000 tokens leaves no room for output; nothing was sent"
    done = _record(1, ok=True, attempts=1, admitted=True, end=0.5)
    busy = _record(2, ok=False, attempts=6, error="server_busy", end=3.0, message="told 9 s")
    s = summarize([refused, done, busy], duration=3.0, deadline=60.0)
    assert (s.offered, s.refused_locally, s.sent, s.admitted, s.completed) == (3, 1, 2, 1, 1)
    assert s.failed == 1  # of the sent ones
    assert s.failed_by_cause == {"prompt_too_long": 1, "server_busy": 1}
    assert s.failure_rate == pytest.approx(2 / 3)
    assert [(g.cause, g.message) for g in s.failures] == [
        ("prompt_too_long", refused.message),
        ("server_busy", "told 9 s"),
    ]


def test_latency_over_all_requests_counts_failures_at_the_deadline() -> None:
    fast = [_record(i, ok=True, end=0.2) for i in range(8)]
    failed = [_record(8 + i, ok=False, error="http_429", end=0.05) for i in range(2)]
    s = summarize([*fast, *failed], duration=1.0, deadline=30.0)
    assert s.latency.p99 == pytest.approx(0.2)  # completed only: the refusals dropped out
    assert s.latency_all.count == 10
    assert s.latency_all.max == 30.0
    assert s.latency_all.p50 == pytest.approx(0.2)
    (warning,) = s.warnings
    assert "2 of 10 requests did not complete" in warning
    assert "looks better than it is" in warning
    # Nothing failed: no warning, and both views agree.
    clean = summarize(fast, duration=1.0, deadline=30.0)
    assert clean.warnings == ()
    assert clean.latency_all == clean.latency


def test_goodput_and_attainment_over_offered() -> None:
    records = [_record(i, ok=True, end=0.1 * (i + 1)) for i in range(4)]
    records.append(_record(4, ok=False, error="timeout", end=9.0))
    s = summarize(records, duration=2.0, slo=SLO(latency=0.25))
    assert s.slo_met == 2
    assert s.goodput == pytest.approx(1.0)
    assert s.slo_attainment == pytest.approx(2 / 5)


def test_report_rows_show_causes_messages_and_dashes() -> None:
    from kvclient.loadgen._report import format_seconds, summary_rows

    failed = _record(0, ok=False, error="http_404:model_not_found", end=0.1)
    failed.message = "POST /v1/completions -> 404: The model `x` does not exist."
    rows = dict(summary_rows(summarize([failed], duration=1.0, deadline=10.0)))
    assert rows["  http_404:model_not_found ×1"] == failed.message
    assert rows["time per output token (after the first)"] == "-"  # not "0 ms"
    assert "the 10 s deadline" in "".join(rows)
    assert format_seconds(0.00025) == "0.25 ms"


# --- the sweep ---------------------------------------------------------------------------------


def _point(rate: float, passed: bool) -> SweepPoint:
    return SweepPoint(rate, summarize([], duration=1.0), passed)


def test_sweep_grid_then_bisection() -> None:
    from kvclient.loadgen._sweep import GRID, knee, next_rate

    points: list[SweepPoint] = []
    verdicts = {6.0: True, 9.0: True, 12.0: False}
    assert GRID[:3] == (0.6, 0.9, 1.2)
    for expected in (6.0, 9.0, 12.0, 10.5, 9.75):
        rate = next_rate(points, capacity=10.0, budget=5)
        assert rate == pytest.approx(expected)
        assert rate is not None
        points.append(_point(rate, verdicts.get(rate, rate < 10.0)))
    assert next_rate(points, capacity=10.0, budget=5) is None
    assert knee(points) == pytest.approx(9.75)


def test_sweep_extends_up_or_down_and_knee_ignores_passes_above_a_failure() -> None:
    from kvclient.loadgen._sweep import knee, next_rate

    all_pass = [_point(r, True) for r in (6.0, 9.0, 12.0, 16.0)]
    assert next_rate(all_pass, capacity=10.0, budget=9) == pytest.approx(20.8)
    first_fails = [_point(6.0, False)]
    assert next_rate(first_fails, capacity=10.0, budget=9) == pytest.approx(3.0)
    assert knee(first_fails) is None
    noisy = [_point(6.0, True), _point(9.0, False), _point(12.0, True)]
    assert knee(noisy) == 6.0


# --- the HTML page -----------------------------------------------------------------------------


def test_html_page_is_self_contained_with_every_part() -> None:
    import re

    from kvclient.loadgen._html import render_html

    records = [
        _record(i, ok=True, admitted=True, end=0.2 + i / 10, http_429=i % 2) for i in range(5)
    ]
    records.append(_record(5, ok=False, error="oom", end=1.0, message="KV <cache> & OOM"))
    summary = summarize(records, duration=1.5, deadline=5.0)
    page = render_html(
        title="run <1>",
        summary=summary,
        records=records,
        sweep=[(1.0, 1.0, 1.0), (2.0, 1.5, 0.5)],
        knee_rate=1.0,
    )
    assert page.count("<svg") == 3
    assert "knee 1 req/s" in page
    assert "run &lt;1&gt;" in page
    assert "KV &lt;cache&gt; &amp; OOM" in page  # failure messages, escaped, in full
    assert "warning:" in page
    assert not re.search(r"<script|\bsrc=|\bhref=|url\(|@import", page)


@pytest.mark.parametrize("refusals", [0, 1, 3, 12])
def test_the_timelines_429_axis_counts_in_whole_numbers(refusals: int) -> None:
    import re

    from kvclient.loadgen._html import timeline_chart
    from kvclient.loadgen._results import Sample

    records = [_record(i, ok=True, admitted=True, end=0.2 + i / 10) for i in range(5)]
    samples = [Sample(t=i / 10, kv_reserved=100.0 * i, refused_total=0.0) for i in range(5)]
    samples.append(Sample(t=0.5, kv_reserved=0.0, refused_total=float(refusals)))
    chart = timeline_chart(records, samples)
    area = re.search(r'class="plot-area" x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', chart)
    assert area is not None
    right = float(area[1]) + float(area[2]) + 8  # where the right axis's labels start
    labels = re.findall(rf'<text x="{right:g}" y="[\d.]+" font-size="\d+">([^<]*)</text>', chart)
    assert labels  # the right axis is drawn
    assert all(re.fullmatch(r"\d[\d,]*", label) for label in labels), labels


def test_a_stream_cut_by_a_kv_oom_event_is_an_oom() -> None:
    from kvclient._exceptions import APIResponseError
    from kvclient.loadgen._kvsender import failure_cause

    oom = "server reported an error mid-stream: KV cache out of memory: 4112 tokens in use ..."
    assert failure_cause(APIResponseError(oom)) == "oom"
    llama = "server reported an error mid-stream: Context size has been exceeded."
    assert failure_cause(APIResponseError(llama)) == "oom"
    other = "server reported an error mid-stream: injected fault"
    assert failure_cause(APIResponseError(other)) == "bad_response"
