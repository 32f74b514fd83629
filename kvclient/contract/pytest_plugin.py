"""pytest plugin: the admission contract as tests, for a server project's own CI.

Installed with kvclient (entry point ``pytest11``), inert until given a URL::

    pytest --kv-contract-url http://127.0.0.1:8000 -m kv_contract

adds one test per check, ``kv_contract[saturation]`` and so on, marked ``kv_contract``. A failed
check fails its test with the evidence; an unsupported one is skipped with its reason. The suite
runs once per session (only the selected checks) and is shared with the session fixture
``kv_contract_report`` (a :class:`~kvclient.contract.ContractReport`), which skips when no URL was
given, so custom tests can assert more::

    def test_no_5xx_under_saturation(kv_contract_report):
        assert kv_contract_report["saturation"].status.value == "pass"

Without ``--kv-contract-url`` the plugin adds no test and sends nothing, and the fixture skips.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from . import CheckResult, ContractReport

__all__ = ["ContractCheckFailed", "ContractItem", "kv_contract_report"]

MARKER = "kv_contract"
_REPORTS = pytest.StashKey[dict[tuple[str, ...] | None, "ContractReport"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-contract", "KV admission contract (kvclient)")
    group.addoption(
        "--kv-contract-url",
        metavar="URL",
        help="check the server at URL against the KV admission contract (one test per check)",
    )
    group.addoption(
        "--kv-contract-context-window",
        type=int,
        metavar="TOKENS",
        help="the model's context window, when /v1/models has no max_model_len",
    )
    group.addoption("--kv-contract-api-key", metavar="KEY", help="sent as a Bearer token")
    group.addoption("--kv-contract-model", metavar="NAME", help="model name to send")
    group.addoption("--kv-contract-burst", type=int, metavar="N", help="requests in a burst")
    group.addoption(
        "--kv-contract-timeout", type=float, metavar="SECONDS", help="time budget per check"
    )
    group.addoption(
        "--kv-contract-chat",
        action="store_true",
        help="send /v1/chat/completions requests (default: /v1/completions)",
    )
    group.addoption(
        "--kv-contract-allow-missing-retry-after",
        action="store_true",
        help="report 429s without Retry-After as unsupported instead of failed",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a check of the KV admission contract")


class ContractCheckFailed(AssertionError):
    """A contract check failed; carries its result."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(f"{result.name}: {result.evidence}")
        self.result = result


def _run(config: pytest.Config, only: tuple[str, ...] | None) -> ContractReport:
    """The suite's report for ``only`` (None: every check), run at most once per session."""
    reports = config.stash.setdefault(_REPORTS, {})
    if only not in reports:
        from . import ContractOptions, run_contract

        overrides: dict[str, Any] = {
            "context_window": config.getoption("kv_contract_context_window"),
            "api_key": config.getoption("kv_contract_api_key"),
            "model": config.getoption("kv_contract_model"),
            "burst": config.getoption("kv_contract_burst"),
            "timeout": config.getoption("kv_contract_timeout"),
        }
        options = ContractOptions(
            **{k: v for k, v in overrides.items() if v is not None},
            require_retry_after=not config.getoption("kv_contract_allow_missing_retry_after"),
            api="chat" if config.getoption("kv_contract_chat") else "completions",
            only=only,
        )
        reports[only] = run_contract(config.getoption("kv_contract_url"), options=options)
    return reports[only]


class ContractItem(pytest.Item):
    """One check of the contract, as a test."""

    def __init__(self, *, check: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.add_marker(MARKER)

    def runtest(self) -> None:
        from ._results import CHECK_NAMES

        chosen = {item.check for item in self.session.items if isinstance(item, ContractItem)}
        selected = tuple(name for name in CHECK_NAMES if name in chosen)
        # Every check selected: share the run with the kv_contract_report fixture.
        result = _run(self.config, None if selected == CHECK_NAMES else selected)[self.check]
        if result.status.value in ("unsupported", "skipped"):
            pytest.skip(f"{result.status.value}: {result.evidence}")
        if result.failed:
            raise ContractCheckFailed(result)

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, ContractCheckFailed):
            result = excinfo.value.result
            return f"{result.name}: {result.title}\n  evidence: {result.evidence}"
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"kv_contract[{self.check}]"


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not config.getoption("kv_contract_url"):
        return
    from ._results import CHECK_NAMES

    for check in CHECK_NAMES:
        items.append(ContractItem.from_parent(session, name=f"kv_contract[{check}]", check=check))


@pytest.fixture(scope="session")
def kv_contract_report(pytestconfig: pytest.Config) -> ContractReport:
    """The whole suite's report against ``--kv-contract-url``; skips when none was given."""
    if not pytestconfig.getoption("kv_contract_url"):
        pytest.skip("no --kv-contract-url given")
    return _run(pytestconfig, None)
