"""Reading a ``/metrics`` page: the samples of a Prometheus text exposition (pure).

The one parser every reader of ``/metrics`` goes through (the load generator's report, the
contract's judge, the engines' dialects). The parsing is prometheus-client's own
(:func:`prometheus_client.parser.text_string_to_metric_families`): label values with escaped
quotes, braces or commas, ``NaN`` and ``+Inf``, timestamps and comments are read as Prometheus
writes them, never by a hand-made pattern.

    >>> parse_samples('# TYPE up gauge\\nup 1\\nkv{engine="vllm"} 2.5\\n')[1]
    Sample(name='kv', labels={'engine': 'vllm'}, value=2.5)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Sample", "parse_samples"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample: its full name (``x_total``, ``x_bucket``: as written), its labels (values
    unescaped) and its value (``nan``, ``inf`` and ``-inf`` as floats)."""

    name: str
    labels: Mapping[str, str]
    value: float


def _parse(text: str) -> Iterator[Sample]:
    # Imported at first use: prometheus_client's package import builds its default registry,
    # which nothing that never reads a /metrics page should pay for.
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield Sample(name=sample.name, labels=dict(sample.labels), value=float(sample.value))


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in the order written.

    A line the parser rejects (an engine's malformed sample) is skipped with nothing else lost:
    the text is then read one line at a time.
    """
    try:
        return list(_parse(text))
    except ValueError:
        pass
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            samples.extend(_parse(line + "\n"))
        except ValueError:
            continue
    return samples
