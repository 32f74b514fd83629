"""The Retry-After estimate's command-line switch."""

from __future__ import annotations

import pytest

from reference_server.simulated.cli import build_parser, config_from_args
from reference_server.simulated.config import DEFAULT_RETRY_AFTER_QUANTILE, ServerConfig


def test_default_is_the_worst_case_never_a_quantile() -> None:
    # By default no refused request is told less than the real wait, so the advice
    # comes from every holder's cap, not from a quantile of recent outputs (a bet).
    config = config_from_args(build_parser().parse_args([]))
    assert config.retry_after_quantile is DEFAULT_RETRY_AFTER_QUANTILE is None
    assert ServerConfig().retry_after_quantile is None


@pytest.mark.parametrize(("arg", "value"), [("none", None), ("NONE", None), ("0.5", 0.5)])
def test_quantile_or_worst_case(arg: str, value: float | None) -> None:
    config = config_from_args(build_parser().parse_args(["--retry-after-quantile", arg]))
    assert config.retry_after_quantile == value


@pytest.mark.parametrize("arg", ["0", "1.5", "soon"])
def test_bad_quantile_is_a_usage_error(arg: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--retry-after-quantile", arg])


def test_the_api_key_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``kvclient gateway`` reads ``$KVCLIENT_GATEWAY_API_KEY``, ``kvclient serve`` reads
    ``$KVCLIENT_SERVE_API_KEY``; the option wins over it, and --help names it."""
    monkeypatch.setenv("KVCLIENT_SERVE_API_KEY", "from-env")
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).api_key == "from-env"
    assert config_from_args(parser.parse_args(["--api-key", "given"])).api_key == "given"
    assert "$KVCLIENT_SERVE_API_KEY" in parser.format_help()
    monkeypatch.delenv("KVCLIENT_SERVE_API_KEY")
    assert config_from_args(build_parser().parse_args([])).api_key is None
