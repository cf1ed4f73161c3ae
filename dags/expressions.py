"""Expressions in a DAG spec: a string that is wholly ``${...}`` is a JMESPath expression (the ``jmespath`` package).

It is evaluated over the context ``{input, steps: {<id>: {output, outputs, state}}, item, index}``; every other
value is literal (a string with ``${`` inside it is not interpolated; for a literal string that starts with ``${``,
write a JMESPath raw string: ``"${'${not an expression}'}"``). ``when`` uses JMESPath truthiness: ``false``,
``null``, ``""``, ``[]`` and ``{}`` are false, everything else (``0`` included) is true.

The parsed syntax tree says which context paths an expression reads (``paths``), from which a DAG's dependencies
and its validation come: JMESPath has no reference to the root inside a projection, a filter or a ``&expref``, so
only the spine of the expression, and function arguments, read the context.

Expressions are bounded (``fleet.dags.limits``): their length and nesting are checked before jmespath's recursive parser
sees them, their syntax tree's depth after, and a search runs with a budget of values (``limits.value_budget``);
each refusal is an ``ExpressionError`` naming the limit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jmespath
from jmespath import exceptions as jmespath_errors
from jmespath.functions import Functions
from jmespath.parser import ParsedResult

from fleet.dags import limits
from fleet.dags.spec import format_path

PREFIX, SUFFIX = "${", "}"
CONTEXT_NAMES = ("input", "steps", "item", "index")
STEP_FIELDS = ("output", "outputs", "state")
FUNCTIONS: Mapping[str, Any] = Functions().FUNCTION_TABLE

Path = tuple[str, ...]
_OVERFLOWING = frozenset({"sum", "avg"})  # the functions that make a new float of finite ones
_COMPILING = threading.Lock()  # jmespath's parser cache is a dict pruned without a lock; specs compile in threads


class ExpressionError(ValueError):
    """An expression that does not parse, or that raised while being evaluated."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class Expression:
    """A compiled ``${...}``: ``paths`` are the context paths it reads (``()`` is the whole context), e.g.
    ``("steps", "split", "output")``; ``calls`` the functions it calls, with their argument counts."""

    source: str
    parsed: ParsedResult
    paths: tuple[Path, ...]
    calls: tuple[tuple[str, int], ...]

    def search(self, context: Mapping[str, Any]) -> Any:
        try:
            result = limits.BoundedInterpreter().visit(self.parsed.parsed, context)
        except jmespath_errors.JMESPathError as exc:
            raise ExpressionError(f"{self.source}: {exc}") from None
        except limits.LimitExceeded as exc:
            raise ExpressionError(f"{_head(self.source)}: {exc.message}") from None
        if any(name in _OVERFLOWING for name, _ in self.calls):  # sum([`1e308`, `1e308`]) is inf
            problem = limits.value_problem(result, None, depth=1_000_000)
            if problem is not None:
                raise ExpressionError(f"{_head(self.source)}: {problem[1]}")
        return result

    def references(self) -> set[tuple[str, str | None]]:
        """``(step id, field)`` for each ``steps.<id>[.<field>]`` read; field is None for the whole step."""
        return {(p[1], p[2] if len(p) > 2 else None) for p in self.paths if len(p) >= 2 and p[0] == "steps"}

    def roots(self) -> set[str]:
        return {p[0] for p in self.paths if p}


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and len(value) >= 3 and value.startswith(PREFIX) and value.endswith(SUFFIX)


def compile_expression(source: str) -> Expression:
    """Parse ``${...}``; raises ``ExpressionError`` with JMESPath's message when it does not parse, or naming the
    limit (``fleet.dags.limits``) it is over."""
    if not is_expression(source):
        raise ExpressionError(f"{_head(source)!r} is not an expression: write it as '${{...}}'")
    try:
        body = source[len(PREFIX) : -len(SUFFIX)]
        limits.check_expression(body)
        with _COMPILING:
            parsed = jmespath.compile(body)
        limits.check_tree(parsed.parsed)
    except jmespath_errors.JMESPathError as exc:
        raise ExpressionError(f"{source!r} does not parse: {_one_line(exc)}") from None
    except limits.LimitExceeded as exc:
        raise ExpressionError(f"{_head(source)!r}: {exc.message}") from None
    except RecursionError:  # a shape the nesting estimate missed: refused all the same
        message = f"{_head(source)!r} nests too deeply to be parsed (MAX_EXPRESSION_NESTING)"
        raise ExpressionError(message) from None
    tree: dict[str, Any] = dict(parsed.parsed)
    return Expression(source, parsed, tuple(_closed(*_paths(tree))), tuple(_calls(tree)))


def references(source: str) -> set[tuple[str, str | None]]:
    """The ``(step id, field)`` pairs an expression reads; see ``Expression.references``."""
    return compile_expression(source).references()


def truthy(value: Any) -> bool:
    """JMESPath truthiness (false, null, empty string, list and object are false; 0 is true)."""
    return not (value is None or value is False or value in ("", [], {}))


def expressions_in(template: Any, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Every ``(path, expression source)`` in a template (dicts and lists, recursively)."""
    if is_expression(template):
        yield loc, template
    elif isinstance(template, dict):
        for key, value in template.items():
            yield from expressions_in(value, (*loc, key))
    elif isinstance(template, list):
        for i, value in enumerate(template):
            yield from expressions_in(value, (*loc, i))


def render(template: Any, context: Mapping[str, Any], compiled: Mapping[str, Expression], path: str = "") -> Any:
    """The template with each expression replaced by its value; ``ExpressionError`` names the failing path."""
    if is_expression(template):
        try:
            return compiled[template].search(context)
        except ExpressionError as exc:
            raise ExpressionError(f"{path}: {exc.message}" if path else exc.message) from None
    if isinstance(template, dict):
        return {k: render(v, context, compiled, format_path([*_split(path), k])) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, context, compiled, format_path([*_split(path), i])) for i, v in enumerate(template)]
    return template


def _split(path: str) -> list[Any]:
    return [path] if path else []


# -- reading the syntax tree ----------------------------------------------------------------------------------
_PROJECTIONS = ("index_expression", "projection", "value_projection", "filter_projection", "flatten", "pipe")


def _paths(node: dict[str, Any]) -> tuple[list[Path], Path | None]:
    """For a node evaluated against the context: the paths read inside it, and the path that is its own value
    (None when its value is not a plain path, e.g. a function's result)."""
    kind = node["type"]
    children = [c for c in node.get("children", []) if isinstance(c, dict)]
    if kind == "field":
        return [], (node["value"],)
    if kind in ("current", "identity"):
        return [], ()
    if kind == "subexpression":
        return _chain(children)
    if kind in _PROJECTIONS:  # only the left side reads the context; the rest reads its elements
        return _closed(*_paths(children[0])), None
    if kind in ("literal", "index", "slice", "expref"):
        return [], None
    found: list[Path] = []  # functions, comparisons, and/or/not, multi-selects: every child reads the context
    for child in children:
        if child["type"] != "expref":
            found += _closed(*_paths(child))
    return found, None


def _chain(children: list[dict[str, Any]]) -> tuple[list[Path], Path | None]:
    found, value = _paths(children[0])
    for child in children[1:]:
        if value is None:
            break
        names, still_open = _relative(child)
        value = (*value, *names)
        if not still_open:
            found, value = [*found, value], None
    return found, value


def _relative(node: dict[str, Any]) -> tuple[Path, bool]:
    """The field names a node evaluated against a value adds to that value's path, and whether the path goes on."""
    kind = node["type"]
    if kind == "field":
        return (node["value"],), True
    if kind == "subexpression":
        names: Path = ()
        for child in node["children"]:
            more, still_open = _relative(child)
            names = (*names, *more)
            if not still_open:
                return names, False
        return names, True
    if kind in _PROJECTIONS:
        return _relative(node["children"][0])[0], False
    return (), False


def _closed(found: list[Path], value: Path | None) -> list[Path]:
    return found if value is None else [*found, value]


def _calls(node: dict[str, Any]) -> Iterator[tuple[str, int]]:
    if node["type"] == "function_expression":
        yield node["value"], len(node["children"])
    for child in node.get("children", []):
        if isinstance(child, dict):
            yield from _calls(child)


def check_call(name: str, count: int) -> str | None:
    """Why a call of ``name`` with ``count`` arguments would fail, or None."""
    entry = FUNCTIONS.get(name)
    if entry is None:
        return f"unknown function {name}()"
    signature = entry["signature"]
    variadic = bool(signature) and signature[-1].get("variadic", False)
    if count < len(signature) or (count > len(signature) and not variadic):
        wanted = f"at least {len(signature)}" if variadic else str(len(signature))
        return f"{name}() takes {wanted} argument(s), given {count}"
    return None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _head(source: str, chars: int = 80) -> str:
    """An expression as a message may quote it: a long one is cut (a refusal should not echo 200 KB)."""
    return source if len(source) <= chars else f"{source[:chars]}... ({len(source):,} characters)"
