"""The pytest plugin, run inside a throwaway pytest session (``pytester``) against live servers."""

from __future__ import annotations

import pytest

from kvclient.contract import CHECK_NAMES

pytest_plugins = ["pytester"]

reference_server = pytest.importorskip("reference_server")
from reference_server import running_server  # noqa: E402

FAST = {"context_window": 1024, "kv_tokens": 4096, "decode_rate": 2000.0, "mean_output_tokens": 1e6}
ARGS = ("--kv-contract-burst", "8", "--kv-contract-timeout", "15", "-p", "no:cacheprovider")

USES_FIXTURE = """
def test_custom(kv_contract_report):
    assert kv_contract_report.ok
    assert kv_contract_report["saturation"].status.value == "pass"
"""


def test_inert_without_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_FIXTURE)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)  # the fixture skips; no contract test is added
    result.stdout.fnmatch_lines(["*no --kv-contract-url given*"])


def test_one_test_per_check_against_the_reference_server(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_FIXTURE)
    with running_server(**FAST) as server:
        result = pytester.runpytest("--kv-contract-url", server.base_url, *ARGS, "-v")
    # Eight contract tests plus the custom one, which shares the same session's runs.
    result.assert_outcomes(passed=len(CHECK_NAMES) + 1)
    result.stdout.fnmatch_lines([f"*kv_contract[[]{name}[]] PASSED*" for name in CHECK_NAMES])


def test_a_failed_check_fails_its_test_with_the_evidence(pytester: pytest.Pytester) -> None:
    with running_server(**FAST) as server:
        result = pytester.runpytest(
            "--kv-contract-url",
            server.base_url,
            "--kv-contract-context-window",
            "16",  # not the server's window: the checks would test the wrong limit
            *ARGS,
            "-m",
            "kv_contract",
            "-k",
            "unset_max_tokens or context_window",
        )
    # The mismatch fails context_window; unset_max_tokens is then judged on the server's window.
    result.assert_outcomes(passed=1, failed=1, deselected=len(CHECK_NAMES) - 2)
    result.stdout.fnmatch_lines(
        ["*context_window: advertises its context window*", "*--context-window 16 disagrees*"]
    )
