"""Trace-and-guard: a chat template rendered once per conversation *shape*, replayed by filling.

A count's render is dominated by Jinja's interpreter, yet most of what a template computes
depends only on the conversation's shape (roles, names, tool calls, tools, which contents are
empty), not on the content strings. So a render is traced once per shape: each content string is
handed to the template as a :class:`_Taint`, a ``str`` subclass that carries its real value and
records what the template does with it:

- concatenation (``+``, ``~``, ``join``, captured blocks, macro output) builds a composite taint
  (a sequence of literal texts and content slots) instead of a plain string;
- ``strip`` / ``lstrip`` / ``rstrip`` (and ``| trim``) become recorded *transforms*, applied to
  the content at fill time;
- observations whose result is a bool or a number (``==``, ``<``, ``in``, ``startswith``,
  ``endswith``, ``is*``, ``find``, ``count``, ``len``, truth) are answered from the real value and
  recorded as *guards* with their outcome;
- everything else (indexing, iterating, hashing, ``split``, ``replace``, ``%``, ``format``,
  ``repr``, ``| tojson``, ``| upper``, other filters and calls given content, ``strftime_now``)
  raises :class:`_Uncacheable`: the shape (under the guards met so far) is always rendered in full.

The rendered output is then a composite: its literals and slots are the *skeleton*. A later
conversation of the same shape whose contents pass every guard renders as the skeleton filled
with its contents; a guard that fails means a full render (and, up to a bound, a new trace).

Each taint's ``str`` buffer holds private-use markers in place of content, so a C-level path that
reads a buffer without going through the taint's methods (``str.join``, ``json.dumps``, a plain
string's methods) leaves markers in plain strings; the environment checks every plain string that
reaches concatenation, a filter, a test, a comparison or a call for markers and gives up on the
shape if it finds one. Finally a trace is kept only if filling its skeleton with the traced
contents reproduces the full render exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MARK", "Skeleton", "Trace", "Uncacheable", "tracing_environment"]

#: Opens every marker; content never reaches a taint's buffer, only markers do.
MARK = "\U000f0000"
_MARK_END = "\U000f0001"
_SLOT_BASE = 0xF0100
_MAX_SLOTS = 0x10FFFF - _SLOT_BASE  # one private-use character names a slot
#: How deep :func:`_leaks` looks into containers before assuming the worst.
_SCAN_DEPTH = 32


class Uncacheable(BaseException):
    """The template used content in a way a skeleton cannot replay.

    A ``BaseException`` so that no ``except Exception`` in Jinja or a filter swallows it.
    """


#: A guard: (slot id or segments, function, arguments, outcome). Arguments that are themselves
#: content are ``_Sym`` (resolved at fill time).
Guard = tuple[Any, Callable[..., Any], tuple[Any, ...], Any]
Segments = tuple["str | int", ...]


class _Sym:
    """A guard argument that is content (a composite's segments)."""

    __slots__ = ("segs",)

    def __init__(self, segs: Segments) -> None:
        self.segs = segs


class Trace:
    """One traced render: content slots, their transforms, and the guards met."""

    __slots__ = ("contents", "guards", "reals", "slot_ids", "slots")

    def __init__(self) -> None:
        self.contents: list[str] = []
        #: Per slot id: (content index, transform chain); chain items are (function, chars).
        self.slots: list[tuple[int, tuple[tuple[Callable[..., str], Any], ...]]] = []
        self.reals: list[str] = []
        self.slot_ids: dict[tuple[int, tuple[Any, ...]], int] = {}
        self.guards: list[Guard] = []

    def content(self, text: str) -> Any:
        """The taint a content string is replaced by (content index = order of the calls)."""
        index = len(self.contents)
        self.contents.append(text)
        return _taint(self, (self._slot(index, (), text),), text)

    def _slot(self, index: int, chain: tuple[Any, ...], real: str) -> int:
        key = (index, chain)
        slot = self.slot_ids.get(key)
        if slot is None:
            if len(self.slots) >= _MAX_SLOTS:
                raise Uncacheable
            slot = len(self.slots)
            self.slots.append(key)
            self.reals.append(real)
            self.slot_ids[key] = slot
        return slot

    def derive(self, slot: int, fn: Callable[..., str], chars: Any) -> int:
        """A slot's content with one more transform."""
        index, chain = self.slots[slot]
        return self._slot(index, (*chain, (fn, chars)), fn(self.reals[slot], chars))

    def real(self, segs: Segments) -> str:
        if len(segs) == 1 and type(segs[0]) is int:
            return self.reals[segs[0]]
        return "".join(seg if isinstance(seg, str) else self.reals[seg] for seg in segs)

    def guard(self, segs: Segments, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Evaluate ``fn(real, *args)`` on the real value and record the outcome."""
        real_args = []
        symbolic = []
        for arg in args:
            if type(arg) is _Taint:
                real_args.append(arg._real)
                symbolic.append(_Sym(arg._segs))
            elif arg is None or type(arg) in (int, float, bool) or _strings(arg):
                real_args.append(arg)
                symbolic.append(arg)
            else:
                raise Uncacheable
        outcome = fn(self.real(segs), *real_args)
        if not (outcome is None or type(outcome) in (bool, int)):
            raise Uncacheable
        target: Any = segs[0] if len(segs) == 1 and type(segs[0]) is int else segs
        self.guards.append((target, fn, tuple(symbolic), outcome))
        return outcome


def _strings(value: Any) -> bool:
    """A plain string, or a tuple of them (``startswith``'s), free of markers."""
    if type(value) is str:
        return MARK not in value
    return type(value) is tuple and all(type(item) is str and MARK not in item for item in value)


def _marker(slot: int) -> str:
    return MARK + chr(_SLOT_BASE + slot) + _MARK_END


def _normalize(segs: Sequence[str | int]) -> list[str | int]:
    out: list[str | int] = []
    for seg in segs:
        if type(seg) is str:
            if not seg:
                continue
            if out and type(out[-1]) is str:
                out[-1] = str(out[-1]) + seg
                continue
        out.append(seg)
    return out


def _taint(trace: Trace, segs: Sequence[str | int], real: str) -> Any:
    """A composite of literal texts and slots; a plain ``str`` when no slot is left."""
    norm = _normalize(segs)
    if not any(type(seg) is int for seg in norm):
        return "".join(str(seg) for seg in norm)
    buffer = "".join(seg if isinstance(seg, str) else _marker(seg) for seg in norm)
    value = _Taint(buffer)
    value._trace = trace
    value._segs = tuple(norm)
    value._real = real
    return value


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise Uncacheable


def _strip_left(value: _Taint, chars: Any) -> Any:
    trace, segs = value._trace, list(value._segs)
    for i, seg in enumerate(segs):
        if isinstance(seg, str):
            seg = seg.lstrip(chars)
            segs[i] = seg
            if seg:
                break
        else:
            slot = trace.derive(seg, str.lstrip, chars)
            segs[i] = slot
            # Whether stripping stops here is content: a guard (not needed at the very end).
            if i == len(segs) - 1 or trace.guard((slot,), bool, ()):
                break
    return _taint(trace, segs, value._real.lstrip(chars))


def _strip_right(value: _Taint, chars: Any) -> Any:
    trace, segs = value._trace, list(value._segs)
    for i in range(len(segs) - 1, -1, -1):
        seg = segs[i]
        if isinstance(seg, str):
            seg = seg.rstrip(chars)
            segs[i] = seg
            if seg:
                break
        else:
            slot = trace.derive(seg, str.rstrip, chars)
            segs[i] = slot
            if i == 0 or trace.guard((slot,), bool, ()):
                break
    return _taint(trace, segs, value._real.rstrip(chars))


def _check_chars(chars: Any) -> None:
    if not (chars is None or type(chars) is str):
        raise Uncacheable
    if chars is not None and MARK in chars:
        raise Uncacheable


class _Taint(str):
    """Content as the template sees it during a trace (see the module docstring)."""

    __slots__ = ("_real", "_segs", "_trace")

    _trace: Trace
    _segs: Segments
    _real: str

    # Output: ``str(x)`` (every ``{{ }}``) keeps the taint, so the output stays a composite.
    def __str__(self) -> str:
        return self

    def __add__(self, other: Any) -> Any:
        if type(other) is _Taint:
            return _taint(self._trace, self._segs + other._segs, self._real + other._real)
        if type(other) is str:
            if MARK in other:
                raise Uncacheable
            return _taint(self._trace, (*self._segs, other), self._real + other)
        if isinstance(other, str):  # Markup and other subclasses have their own rules
            raise Uncacheable
        return NotImplemented

    def __radd__(self, other: Any) -> Any:
        if type(other) is str:
            if MARK in other:
                raise Uncacheable
            return _taint(self._trace, (other, *self._segs), other + self._real)
        if isinstance(other, str):
            raise Uncacheable
        return NotImplemented

    def __bool__(self) -> bool:
        return bool(self._trace.guard(self._segs, bool, ()))

    def __len__(self) -> int:
        return int(self._trace.guard(self._segs, len, ()))

    def __contains__(self, item: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.contains, (item,)))

    def __eq__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.eq, (other,)))

    def __ne__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.ne, (other,)))

    def __lt__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.lt, (other,)))

    def __le__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.le, (other,)))

    def __gt__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.gt, (other,)))

    def __ge__(self, other: object) -> bool:
        return bool(self._trace.guard(self._segs, operator.ge, (other,)))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            # What str does whatever the content (a sandbox's attribute fallback tries this).
            raise TypeError(f"string indices must be integers, not '{type(key).__name__}'")
        raise Uncacheable

    def strip(self, chars: Any = None) -> Any:
        _check_chars(chars)
        left = _strip_left(self, chars)
        return _strip_right(left, chars) if type(left) is _Taint else left.rstrip(chars)

    def lstrip(self, chars: Any = None) -> Any:
        _check_chars(chars)
        return _strip_left(self, chars)

    def rstrip(self, chars: Any = None) -> Any:
        _check_chars(chars)
        return _strip_right(self, chars)


#: Methods answered from the real value and recorded as guards (they return bools or numbers).
_OBSERVERS = (
    "startswith",
    "endswith",
    "find",
    "rfind",
    "count",
    "isalnum",
    "isalpha",
    "isascii",
    "isdecimal",
    "isdigit",
    "isidentifier",
    "islower",
    "isnumeric",
    "isprintable",
    "isspace",
    "istitle",
    "isupper",
)
#: Dunders the interpreter needs to handle the object itself.
_KEPT = frozenset(
    {
        "__class__",
        "__new__",
        "__init__",
        "__getattribute__",
        "__setattr__",
        "__delattr__",
        "__init_subclass__",
        "__subclasshook__",
        "__doc__",
        "__dir__",
        "__sizeof__",
    }
)


def _observer(name: str) -> Callable[..., Any]:
    fn = getattr(str, name)

    def method(self: _Taint, *args: Any) -> Any:
        return self._trace.guard(self._segs, fn, args)

    method.__name__ = name
    return method


def _install() -> None:
    defined = set(vars(_Taint))
    for name in dir(str):
        if name in _KEPT or name in defined:
            continue
        if name in _OBSERVERS:
            setattr(_Taint, name, _observer(name))
        else:
            # split, replace, upper, format, __getitem__, __iter__, __mod__, __hash__, ...
            setattr(_Taint, name, _raise)
    for name in ("__rmod__", "__rmul__", "__format__", "__repr__", "__hash__", "__reversed__"):
        setattr(_Taint, name, _raise)


_install()


def _leaks(value: Any, depth: int = 0, *, taints: bool = True) -> bool:
    """Whether ``value`` holds content: a plain string with a marker in it (a leak), or, unless
    ``taints`` is false, a taint (which code other than the taint's own methods might read)."""
    kind = type(value)
    if kind is _Taint:
        return taints
    if isinstance(value, str):
        return MARK in value
    if value is None or kind in (int, float, bool):
        return False
    if depth > _SCAN_DEPTH:
        return True
    if isinstance(value, dict):
        return any(
            _leaks(k, depth + 1, taints=taints) or _leaks(v, depth + 1, taints=taints)
            for k, v in value.items()
        )
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_leaks(item, depth + 1, taints=taints) for item in value)
    import jinja2.utils

    if isinstance(value, jinja2.utils.Namespace):
        attrs = object.__getattribute__(value, "_Namespace__attrs")
        return _leaks(attrs, depth + 1, taints=taints)
    import jinja2

    # Anything else might hold content: assume it does.
    return not isinstance(value, jinja2.Undefined)


def _check(values: Any, *, taints: bool = True) -> None:
    for value in values:
        if _leaks(value, taints=taints):
            raise Uncacheable


def concat(parts: Any) -> Any:
    """``environment.concat`` while tracing: output buffers, captured blocks, macro results."""
    parts = list(parts)
    trace = None
    for part in parts:
        if type(part) is _Taint:
            trace = part._trace
        elif type(part) is not str or MARK in part:
            raise Uncacheable
    if trace is None:
        return "".join(parts)
    segs: list[str | int] = []
    real = []
    for part in parts:
        if type(part) is _Taint:
            segs.extend(part._segs)
            real.append(part._real)
        else:
            segs.append(part)
            real.append(part)
    return _taint(trace, segs, "".join(real))


def _str_join(values: Any) -> Any:
    """The ``~`` operator: ``str()`` of each operand, concatenated."""
    parts = []
    for value in values:
        if type(value) is _Taint or isinstance(value, str):
            parts.append(value)
        else:
            _check((value,))
            parts.append(str(value))
    return concat(parts)


def _compare(left: Any, op: str, right: Any) -> Any:
    # Containers compare (and look up) their items through the taints' dunders; only a plain
    # string holding a marker, compared at C level, would go unseen.
    if op in ("in", "notin"):
        if type(right) is _Taint:
            found = right.__contains__(left)
        elif type(left) is _Taint and type(right) is str:
            if MARK in right:
                raise Uncacheable
            found = left._trace.guard(left._segs, _within, (right,))
        else:
            _check((left, right), taints=False)
            if type(left) is _Taint and isinstance(right, str):
                raise Uncacheable  # a str subclass's __contains__ reads the buffer
            found = left in right
        return found if op == "in" else not found
    _check((left, right), taints=False)
    return _COMPARISONS[op](left, right)


def _within(real: str, container: str) -> bool:
    return real in container


_COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "lteq": operator.le,
    "gt": operator.gt,
    "gteq": operator.ge,
}


def compare(left: Any, ops: tuple[tuple[str, Any], ...]) -> Any:
    """A (possibly chained) comparison, as Python evaluates it, with content observed."""
    result: Any = True
    for op, right in ops:
        result = _compare(left, op, right)
        if not result:
            return result
        left = right
    return result


#: Filters that only move objects around or call the taint's own methods: safe on a taint (or
#: on containers of taints: they never read a string's characters themselves).
_STRUCTURAL_FILTERS = frozenset(
    {
        "length",
        "count",
        "list",
        "first",
        "last",
        "default",
        "d",
        "selectattr",
        "rejectattr",
        "select",
        "reject",
        "map",
        "reverse",
        "items",
        "batch",
        "slice",
    }
)
#: Filters safe on a taint itself (they call its methods) but not on containers of them.
_STRING_FILTERS = frozenset({"trim", "string"})
#: Tests that look at type or identity only, or call comparison dunders.
_SAFE_TESTS = frozenset(
    {
        "boolean",
        "callable",
        "defined",
        "undefined",
        "none",
        "string",
        "mapping",
        "number",
        "integer",
        "float",
        "false",
        "true",
        "iterable",
        "sequence",
        "escaped",
        "filter",
        "test",
        "lower",
        "upper",
        "divisibleby",
        "odd",
        "even",
        "eq",
        "equalto",
        "==",
        "ne",
        "!=",
        "lt",
        "lessthan",
        "<",
        "le",
        "<=",
        "gt",
        "greaterthan",
        ">",
        "ge",
        ">=",
    }
)


def _checked(fn: Callable[..., Any], *, string_only: bool) -> Callable[..., Any]:
    # A filter given the context, eval context or environment first (jinja_pass_arg).
    skip = 1 if hasattr(fn, "jinja_pass_arg") else 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = [*args[skip:], *kwargs.values()]
        if string_only:
            values = [v for v in values if type(v) is not _Taint]
        _check(values)
        return fn(*args, **kwargs)

    wrapper.__dict__.update(getattr(fn, "__dict__", {}))  # jinja_pass_arg
    wrapper.__name__ = getattr(fn, "__name__", "filter")
    return wrapper


def _join(value: Any, d: Any = "", attribute: Any = None) -> Any:
    items = list(value)
    if attribute is not None or not any(type(v) is _Taint for v in [*items, d]):
        _check([*items, d])
        return str(d).join(item if isinstance(item, str) else str(item) for item in items)
    parts: list[Any] = []
    for i, item in enumerate(items):
        if i:
            parts.append(d if isinstance(d, str) else str(d))
        parts.append(item if isinstance(item, str) else _str_join((item,)))
    return concat(parts)


def tracing_environment(base: Any) -> Any:
    """A sandboxed environment like ``base`` (same options, filters, globals) that traces."""
    import jinja2.compiler
    import jinja2.ext
    import jinja2.runtime
    import jinja2.sandbox
    import jinja2.utils

    class _Generator(jinja2.compiler.CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.trace_str_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def visit_Compare(self, node: Any, frame: Any) -> None:
            self.write("environment.trace_compare(")
            self.visit(node.expr, frame)
            self.write(", (")
            for operand in node.ops:
                self.write(f"({operand.op!r}, ")
                self.visit(operand.expr, frame)
                self.write("), ")
            self.write("))")

    pure = {
        jinja2.utils.Namespace,
        jinja2.utils.Cycler,
        jinja2.utils.Joiner,
        dict,
        jinja2.sandbox.safe_range,
        base.globals.get("raise_exception"),
    }

    class _Tracing(type(base)):  # type: ignore[misc]
        code_generator_class = _Generator
        concat = staticmethod(concat)
        trace_str_join = staticmethod(_str_join)
        trace_compare = staticmethod(compare)

        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is not _Taint and isinstance(obj, str) and MARK in obj:
                raise Uncacheable
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            if type(obj) is not _Taint and isinstance(obj, str) and MARK in obj:
                raise Uncacheable
            return super().getitem(obj, argument)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            owner = getattr(__obj, "__self__", None)
            if type(owner) is _Taint:
                pass  # its own methods record or refuse
            elif isinstance(owner, str):
                _check((owner, *args, *kwargs.values()))  # str methods read their arguments
            elif isinstance(__obj, jinja2.runtime.Macro) or __obj in pure:
                pass  # template code, or pure constructors
            elif isinstance(owner, (dict, list, tuple, jinja2.runtime.LoopContext)):
                pass  # lookups and comparisons go through the taint's dunders
            elif isinstance(owner, jinja2.ext.Extension):
                pass  # {% generation %}
            else:
                raise Uncacheable  # strftime_now, lipsum, anything unknown
            return super().call(__context, __obj, *args, **kwargs)

    env = _Tracing(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        extensions=[type(extension) for extension in base.extensions.values()],
    )
    env.globals.update(base.globals)
    for name, fn in base.filters.items():
        if name == "join":
            env.filters[name] = _join
        elif name in _STRUCTURAL_FILTERS:
            env.filters[name] = fn
        else:
            env.filters[name] = _checked(fn, string_only=name in _STRING_FILTERS)
    for name, fn in base.tests.items():
        if name == "in":
            env.tests[name] = lambda value, seq: _compare(value, "in", seq)
        elif name in _SAFE_TESTS:
            env.tests[name] = fn
        else:
            env.tests[name] = _checked(fn, string_only=False)
    return env


def _fused(chain: tuple[tuple[Callable[..., str], Any], ...]) -> tuple[Any, ...]:
    """``lstrip(c)`` then ``rstrip(c)`` is ``strip(c)``: one call instead of two at fill time."""
    out: list[tuple[Callable[..., str], Any]] = []
    for fn, chars in chain:
        if fn is str.rstrip and out and out[-1] == (str.lstrip, chars):
            out[-1] = (str.strip, chars)
        else:
            out.append((fn, chars))
    return tuple(out)


class Skeleton:
    """A traced render: the guards it holds under, and the output as literals and slots.

    ``output`` is None for a shape that cannot be cached under these guards (always rendered in
    full). Only the slots the output or a guard uses are kept, renumbered.
    """

    __slots__ = ("guards", "output", "positions", "slots")

    def __init__(self, trace: Trace, output: Any) -> None:
        segs: Segments = ()
        if output is not None:
            segs = output._segs if type(output) is _Taint else (output,)
        used: set[int] = {seg for seg in segs if type(seg) is int}
        for target, _, args, _ in trace.guards:
            used.update([target] if type(target) is int else [s for s in target if type(s) is int])
            for arg in args:
                if type(arg) is _Sym:
                    used.update(s for s in arg.segs if type(s) is int)
        renumber = {old: new for new, old in enumerate(sorted(used))}

        def mapped(segments: Segments) -> Segments:
            return tuple(s if isinstance(s, str) else renumber[s] for s in segments)

        self.slots = tuple(
            (trace.slots[old][0], _fused(trace.slots[old][1])) for old in sorted(used)
        )
        guards: list[tuple[int, Segments | None, Callable[..., Any], tuple[Any, ...], bool, Any]]
        guards = []
        for target, fn, args, outcome in trace.guards:
            symbolic = any(type(arg) is _Sym for arg in args)
            if symbolic:
                args = tuple(_Sym(mapped(a.segs)) if type(a) is _Sym else a for a in args)
            if type(target) is int:
                guards.append((renumber[target], None, fn, args, symbolic, outcome))
            else:
                guards.append((-1, mapped(target), fn, args, symbolic, outcome))
        self.guards = tuple(guards)
        self.output: list[str] | None = None
        self.positions: tuple[tuple[int, int], ...] = ()
        if output is not None:
            self.output = [seg if isinstance(seg, str) else "" for seg in segs]
            self.positions = tuple(
                (i, renumber[seg]) for i, seg in enumerate(segs) if type(seg) is int
            )

    def reals(self, contents: Sequence[str]) -> list[str]:
        """The slots' values for these contents (transforms applied)."""
        reals = []
        for index, chain in self.slots:
            value = contents[index]
            for fn, chars in chain:
                value = fn(value, chars)
            reals.append(value)
        return reals

    def holds(self, reals: list[str]) -> bool:
        """Whether every guard has the outcome it had when traced."""
        for target, segs, fn, args, symbolic, outcome in self.guards:
            value = reals[target] if segs is None else _joined(segs, reals)
            if symbolic:
                args = tuple(_joined(a.segs, reals) if type(a) is _Sym else a for a in args)
            if fn(value, *args) != outcome:
                return False
        return True

    def replay(self, contents: Sequence[str]) -> str | None:
        """The rendered text for these contents, or None if a guard fails (or no output)."""
        if self.output is None:
            return None
        reals = self.reals(contents)
        if self.guards and not self.holds(reals):
            return None
        out = self.output.copy()
        for position, slot in self.positions:
            out[position] = reals[slot]
        return "".join(out)

    def fill(self, reals: list[str]) -> str:
        """The rendered text for these slot values."""
        assert self.output is not None
        out = self.output.copy()
        for position, slot in self.positions:
            out[position] = reals[slot]
        return "".join(out)


def _joined(segs: Segments, reals: list[str]) -> str:
    return "".join(s if isinstance(s, str) else reals[s] for s in segs)


def verified(output: Any) -> bool:
    """The output's buffer holds exactly its slots' markers, and no other marker."""
    if type(output) is not _Taint:
        return isinstance(output, str) and MARK not in output
    expected = "".join(s if isinstance(s, str) else _marker(s) for s in output._segs)
    return str.__str__(output) == expected and expected.count(MARK) == sum(
        type(s) is int for s in output._segs
    )
