"""Dependencies whose internals the code reads are bounded above by what was tested: a new
minor release may change what is read, and the pin makes that an upgrade to test, not a break."""

from __future__ import annotations

import ast
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

#: Distribution -> the file that reads its internals (modules below its public surface).
READS_INTERNALS = {"uvicorn": "reference_server/http/serving.py"}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        found.extend(extra)
    return {r.name: r for r in map(Requirement, found)}


@pytest.mark.parametrize(("name", "reader"), sorted(READS_INTERNALS.items()))
def test_a_dependency_whose_internals_are_read_is_bounded_above(name: str, reader: str) -> None:
    tree = ast.parse((ROOT / reader).read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert any(m.startswith(f"{name}.protocols") for m in modules), f"{reader} reads no internals"
    requirement = _requirements()[name]
    uppers = [s for s in requirement.specifier if s.operator in ("<", "<=")]
    assert uppers, f"{requirement} has no upper bound"
    installed = Version(version(name))
    assert installed in requirement.specifier, f"{name} {installed} is outside {requirement}"
