"""A griffe extension: the docstrings' Sphinx habits, rendered as Markdown for mkdocstrings; and a
public module's reference limited to its ``__all__``.

The package's docstrings are written for ``help()`` and Sphinx: ``:class:`~kvclient.Client```
roles, ``>>>`` examples, ``::`` before an indented block. Markdown would print the roles as
they are and read ``>>>`` as nested quotes, so before rendering, each role becomes inline code
(its last part with ``~``, as Sphinx shows it), each run of ``>>>`` lines a ``pycon`` block,
and ``::`` a colon. The source stays as it is.

A public module that declares ``__all__`` shows only those names (and its submodules): the
names it imports for its own use (``uvicorn``, a constant its signatures mention) are not part
of its API. mkdocstrings' ``public`` filter would do the same for modules, but it also shows
every class's dunders; the site's filter hides names starting with an underscore instead.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(~?)\.?([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _fence_examples(text: str) -> str:
    """Wrap each run of ``>>>`` lines (with their outputs, up to a blank line) in a fence."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if out and out[-1].strip():
            out.append("")
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


def markdown(text: str) -> str:
    text = _ROLE.sub(_role, text)
    text = re.sub(r"(?m)(\S)::$", r"\1:", text)
    text = re.sub(r"(?m)^(\s*)::$", "", text)
    return _fence_examples(text)


class SphinxText(griffe.Extension):
    """Rewrite every loaded object's docstring once (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)


class ExportsOnly(griffe.Extension):
    """Drop what a public module (no ``_`` in its path) defines or imports beyond ``__all__``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._trim(pkg)

    def _trim(self, module: griffe.Module) -> None:
        for member in list(module.members.values()):
            if isinstance(member, griffe.Module):
                self._trim(member)
        if module.exports is None or any(p.startswith("_") for p in module.path.split(".")):
            return
        exported = {str(name) for name in module.exports}
        for name, member in list(module.members.items()):
            if name.startswith("_") or name in exported:
                continue
            if not member.is_alias and isinstance(member, griffe.Module):
                continue
            module.del_member(name)
