"""The one /metrics reader (kvclient._prometheus) and the two readers built on it."""

from __future__ import annotations

import math

from kvclient._prometheus import Sample, parse_samples
from kvclient.contract._judge import prometheus_value
from kvclient.loadgen._report import parse_prometheus_text

TEXT = """\
# HELP kv_rejected_total Requests answered 429 ("no room").
# TYPE kv_rejected_total counter
kv_rejected_total 3.0
kv_rejected_totally 9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0
kv_reason_total{reason="say \\"no\\", {twice}"} 2
kv_usable_tokens NaN
kv_ceiling +Inf
kv_floor -Inf
kv_stamped 7 1700000000000
"""


def test_every_sample_in_order_with_labels_unescaped() -> None:
    samples = parse_samples(TEXT)
    assert [s.name for s in samples] == [
        "kv_rejected_total",
        "kv_rejected_totally",
        "vllm:cache_config_info",
        "kv_reason_total",
        "kv_usable_tokens",
        "kv_ceiling",
        "kv_floor",
        "kv_stamped",
    ]
    assert samples[0] == Sample(name="kv_rejected_total", labels={}, value=3.0)
    assert samples[2].labels == {"block_size": "16", "num_gpu_blocks": "512"}
    assert samples[3].labels == {"reason": 'say "no", {twice}'}
    assert math.isnan(samples[4].value)
    assert samples[5].value == math.inf
    assert samples[6].value == -math.inf
    assert samples[7].value == 7.0  # the timestamp is not the value


def test_comments_and_blank_lines_are_no_samples() -> None:
    assert parse_samples("# HELP x y\n#\n\n# a comment\n") == []
    assert parse_samples("") == []


def test_a_malformed_line_is_skipped_and_nothing_else_lost() -> None:
    text = 'ok 1\nbroken line here\nbad{a=1} 2\n# TYPE odd weird\nalso_ok{x="y"} 2\n'
    assert parse_samples(text) == [
        Sample(name="ok", labels={}, value=1.0),
        Sample(name="also_ok", labels={"x": "y"}, value=2.0),
    ]


def test_report_reads_unlabelled_samples_by_name() -> None:
    samples = parse_prometheus_text(TEXT)
    assert samples["kv_rejected_total"] == 3.0
    assert samples["kv_rejected_totally"] == 9.0  # a name that starts the same is its own
    assert "vllm:cache_config_info" not in samples
    assert "kv_reason_total" not in samples
    assert math.isnan(samples["kv_usable_tokens"])
    assert samples["kv_ceiling"] == math.inf
    assert parse_prometheus_text("x 1\nx 2\n") == {"x": 2.0}  # the last one written


def test_judge_reads_one_finite_unlabelled_value() -> None:
    assert prometheus_value(TEXT, "kv_rejected_total") == 3.0
    assert prometheus_value(TEXT, "kv_rejected_totally") == 9.0
    assert prometheus_value(TEXT, "kv_rejected") is None  # a prefix of two names is neither
    assert prometheus_value(TEXT, "kv_reason_total") is None  # labelled only
    assert prometheus_value(TEXT, "kv_usable_tokens") is None  # NaN
    assert prometheus_value(TEXT, "kv_ceiling") is None  # +Inf
    assert prometheus_value(TEXT, "kv_stamped") == 7.0
    assert prometheus_value("x 1\nx 2\n", "x") == 1.0  # the first one written
