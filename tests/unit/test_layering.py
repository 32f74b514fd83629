"""How the two halves may import each other, and that no files import each other in a circle.

Read from the source with ``ast``, without importing anything:

- ``reference_server`` uses kvclient through declared modules only: ``kvclient``'s public names,
  its public modules (``kvclient.engines``, ``kvclient.routing``, ...), and the few private ones
  listed in :data:`DECLARED_PRIVATE`, each with its reason;
- ``kvclient`` imports ``reference_server`` only inside a function of its commands, so that the
  SDK installs and imports without the server's dependencies;
- the module-level imports of both packages form no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvclient", "reference_server")

#: The private kvclient modules the server half may import, and why. Short on purpose: what the
#: server needs from kvclient is declared in a public module instead.
DECLARED_PRIVATE: dict[str, str] = {}

#: Where kvclient may import reference_server: inside a function of these files only.
SERVER_IMPORTERS = {"kvclient/cli.py", "kvclient/demo.py"}


def _files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The absolute name of a ``from ... import`` statement's module."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imported(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> list[str]:
    """Every name an import statement may load: modules, or ``module.name`` for each name taken
    from a module (a submodule, or an attribute: the caller tells which)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _absolute(node, module, package)
    return [f"{base}.{alias.name}" for alias in node.names]


def _all_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(
    body: list[ast.stmt], *, typing: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: not those inside functions, nor under
    ``if TYPE_CHECKING:`` (unless ``typing``: those a type checker reads too)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typing:
            yield from _module_level_imports(node.orelse, typing=typing)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _module_level_imports(
                        [s for s in inner if isinstance(s, ast.stmt)]
                        + [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body],
                        typing=typing,
                    )


def _parsed() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(path): (path, ast.parse(path.read_text(), str(path))) for path in _files()}


def _private_part(name: str) -> str | None:
    """The first private part of a kvclient module path (``kvclient._retry.x`` -> ``_retry``)."""
    parts = name.split(".")
    if parts[0] != "kvclient":
        return None
    return next((part for part in parts[1:] if part.startswith("_")), None)


def test_the_server_half_imports_only_declared_kvclient_modules() -> None:
    found: list[str] = []
    used: set[str] = set()
    for module, (path, tree) in _parsed().items():
        if not module.startswith("reference_server"):
            continue
        for node in _all_imports(tree):
            for name in _imported(node, module, _is_package(path)):
                private = _private_part(name)
                if private is None:
                    continue
                if private in DECLARED_PRIVATE:
                    used.add(private)
                else:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, "private kvclient modules imported by reference_server:\n" + "\n".join(found)
    # A declared module no longer used leaves the list.
    assert used == set(DECLARED_PRIVATE)


def test_kvclient_imports_the_server_only_inside_its_commands() -> None:
    found: list[str] = []
    for module, (path, tree) in _parsed().items():
        if not module.startswith("kvclient"):
            continue
        where = str(path.relative_to(ROOT))
        in_functions = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in _all_imports(function)
        }
        for node in _all_imports(tree):
            names = _imported(node, module, _is_package(path))
            if not any(n.split(".")[0] == "reference_server" for n in names):
                continue
            if id(node) not in in_functions or where not in SERVER_IMPORTERS:
                found.append(f"{where}:{node.lineno}")
    assert not found, "kvclient imports reference_server at: " + ", ".join(found)


def _graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of both packages its module-level imports load (``typing``: and
    those imported for annotations only)."""
    parsed = _parsed()
    graph: dict[str, set[str]] = {module: set() for module in parsed}
    for module, (path, tree) in parsed.items():
        for node in _module_level_imports(tree.body, typing=typing):
            for name in _imported(node, module, _is_package(path)):
                # ``from package import name``: the submodule when there is one, else the
                # package's ``__init__`` (and likewise up the dotted path).
                while name and name not in parsed:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_files_import_each_other_in_a_circle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_gateway_has_no_circle_even_for_annotations() -> None:
    """The gateway's modules do not lean on one another in a circle, not even for types only
    (its state holds counters the relay writes and ``/metrics`` reads, rather than the relay)."""
    graph = _graph(typing=True)
    gateway = {m: {t for t in graph[m] if t.startswith("reference_server.gateway")} for m in graph}
    cycles = [c for c in _cycles(gateway) if c[0].startswith("reference_server.gateway")]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_relative_imports_are_resolved() -> None:
    tree = ast.parse("from ..http.errors import APIError\nfrom . import state\n")
    first, second = tree.body
    assert isinstance(first, ast.ImportFrom)
    assert isinstance(second, ast.ImportFrom)
    assert _imported(first, "reference_server.gateway.app", False) == [
        "reference_server.http.errors.APIError"
    ]
    assert _imported(second, "reference_server.gateway", True) == ["reference_server.gateway.state"]
