"""Bounds on what a DAG spec, its expressions and their evaluation may cost: every check here runs before the
expensive (or recursive) step it protects, and refuses with a ``LimitExceeded`` that names the limit.

- Text: JSON is scanned for its nesting (an iterative pass over its brackets outside strings) before ``json.loads``
  reads it; YAML is composed by a loader that counts its depth while composing, so ``[[[[...`` 10,000 deep is
  refused at level ``MAX_SPEC_DEPTH`` without recursing further. Integers past Python's 4,300 digits and other
  parser ``ValueError``s are refused, not raised.
- Values (``check_values``, iterative): at most ``MAX_SPEC_NODES`` of them, no NaN or infinity (``.nan``, ``1e400``)
  and no lone surrogate (``"\\ud800"``) in a string or a key: they would not survive JSON, so they are refused
  rather than silently changed (JSON's ``NaN`` and ``1e400`` are read, then refused here with their path).
- Expressions (``check_expression``, before ``jmespath.compile``): at most ``MAX_EXPRESSION_CHARS`` characters and a
  nesting under ``MAX_EXPRESSION_NESTING``, estimated from the text (brackets, plus the ``!``, ``&`` and projections
  that the parser recurses into); after compiling, a syntax tree at most ``MAX_EXPRESSION_TREE_DEPTH`` deep
  (``a | b | c ...`` is parsed by a loop but evaluated by recursion), and no literal that JSON cannot carry.
- Evaluation (``BoundedInterpreter``): each node visited, and each element, character (per 64) or entry a function
  returns, costs one value of a budget of ``MAX_EVALUATION_VALUES``; past it, ``ValueBudgetExceeded``. So
  ``l[*].[@,@,...] | [] | [*].[@,@,...] ...`` stops after ``MAX_EVALUATION_VALUES`` (a few tenths of a second), not
  after 10^7 or more. The evaluating thread gives up the GIL every few hundred values, so the loop keeps serving.
  A budget is shared by one evaluation pass (``value_budget``), or is one per search.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import yaml
from jmespath import functions as jmespath_functions
from jmespath import visitor as jmespath_visitor

if TYPE_CHECKING:
    from jmespath.visitor import _TreeNode

MAX_SPEC_DEPTH = 64
"""Nesting of a spec's text (each list or mapping inside another is one level)."""
MAX_SPEC_NODES = 100_000
"""Values (dicts, lists, scalars) a loaded spec may hold, counted with repeats: YAML aliases can make a small text
expand into a huge structure (the "billion laughs"), which the byte limit alone would not catch."""
MAX_EXPRESSION_CHARS = 4_096
MAX_EXPRESSION_NESTING = 40
MAX_EXPRESSION_TREE_DEPTH = 100
MAX_EVALUATION_VALUES = 300_000
"""Values one evaluation pass may produce: a 10,000-item fan-out rendering inputs of a few expressions each fits;
at about a microsecond a value, a pass past it stops within a few tenths of a second."""
MAX_LAUNCH_BYTES = 64 * 1024 * 1024
"""JSON bytes of input one step's jobs may carry together: an expression that copies a large value into each item
of a 10,000-item fan-out (``input: {all: "${input}"}``) would otherwise turn one request into gigabytes to publish."""
_YIELD_EVERY = 512  # values between two moments the evaluating thread lets the event loop's thread run

_STOPS = ("||", "&&", "==", "!=", "<=", ">=", "|", ",", ":", "<", ">")  # end a projection's or a `!`'s operand
_PROJECTIONS = ("[*]", "[]", "[?", ".*", "*")
_QUOTES = "'\"`"


class LimitExceeded(ValueError):
    """A spec, an expression or an evaluation over one of this module's limits (``limit`` names it). Internal:
    ``fleet.dags.spec`` turns it into ``DagInvalid``, ``fleet.dags.expressions`` into ``ExpressionError``."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit


class ValueBudgetExceeded(LimitExceeded):
    def __init__(self, budget: int) -> None:
        message = f"the evaluation produced over {budget:,} values (MAX_EVALUATION_VALUES)"
        super().__init__(message, "MAX_EVALUATION_VALUES")


# -- JSON text ------------------------------------------------------------------------------------------------
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def json_depth_problem(text: str, limit: int = MAX_SPEC_DEPTH) -> str | None:
    """Why ``text`` nests too deeply to be read as JSON, or None; iterative, and stops at the first level past."""
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return f"the JSON nests over {limit} levels deep (MAX_SPEC_DEPTH) at character {match.start()}"
        elif token in "]}":
            depth -= 1
    return None


def loads_json(text: str | bytes, depth: int = MAX_SPEC_DEPTH) -> Any:
    """``json.loads`` that refuses, as ``LimitExceeded``, text nested over ``depth`` (before parsing it) and
    integers past Python's digit limit. ``json.JSONDecodeError`` and ``UnicodeDecodeError`` pass through. NaN and
    infinities are read as floats: ``value_problem`` refuses them with their path."""
    if isinstance(text, bytes):
        text = text.decode()
    problem = json_depth_problem(text, depth)
    if problem is not None:
        raise LimitExceeded(problem, "MAX_SPEC_DEPTH")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as exc:  # 4,300 digits and more (sys.get_int_max_str_digits)
        raise _unreadable(exc) from None


# -- YAML text ------------------------------------------------------------------------------------------------
class _DepthLimit:
    """A composer mixin that counts the depth of the node it composes and refuses past the limit (the composer
    recurses once per level; the parser before it and the constructor after it do not)."""

    depth_limit = MAX_SPEC_DEPTH
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > self.depth_limit:
                mark = self.peek_event().start_mark  # type: ignore[attr-defined]
                where = f"line {mark.line + 1}, column {mark.column + 1}: "
                raise LimitExceeded(f"{where}the YAML nests over {self.depth_limit} levels deep", "MAX_SPEC_DEPTH")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


class _PureLoader(_DepthLimit, yaml.SafeLoader):
    pass


if yaml.__with_libyaml__:  # libyaml's parser (4x faster), the Python composer (which can count) and constructor
    from yaml._yaml import CParser
    from yaml.composer import Composer

    class _CLoader(_DepthLimit, Composer, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    _Loader: Any = _CLoader
else:  # pragma: no cover - PyYAML built without libyaml
    _Loader = _PureLoader


def load_yaml(text: str) -> Any:
    """One YAML document, safely, nested at most ``MAX_SPEC_DEPTH``; ``yaml.YAMLError`` passes through, a value
    that cannot be built (an integer of 5,000 digits) is ``LimitExceeded``."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    except (yaml.YAMLError, LimitExceeded):
        raise
    except (ValueError, OverflowError, RecursionError) as exc:
        raise _unreadable(exc) from None
    finally:
        loader.dispose()


# -- values ---------------------------------------------------------------------------------------------------
def value_problem(
    data: Any, limit: int | None = MAX_SPEC_NODES, depth: int = MAX_SPEC_DEPTH
) -> tuple[tuple[Any, ...], str] | None:
    """``(location, why)`` of the first value that cannot be kept as it is (a non-finite float, a lone surrogate), or
    of the whole when it holds over ``limit`` values (None: no limit) or nests over ``depth`` (a YAML alias can make a
    structure hold itself); None when all is well. Iterative, linear in the values it looks at."""
    count = 0
    stack: list[tuple[Any, _Loc, int]] = [(data, None, 0)]
    while stack:
        value, loc, level = stack.pop()
        count += 1
        if limit is not None and count > limit:
            return (), f"the spec holds over {limit} values (YAML aliases expand into copies) (MAX_SPEC_NODES)"
        if level > depth:
            return _unlinked(loc), f"the value nests over {depth} levels deep"
        if isinstance(value, float) and not math.isfinite(value):
            return _unlinked(loc), f"{value} is not a finite number (JSON has no NaN or infinity)"
        if isinstance(value, str) and _has_lone_surrogate(value):
            return _unlinked(loc), "the string holds a lone UTF-16 surrogate, which is not text"
        if isinstance(value, dict):
            for key, child in value.items():
                if isinstance(key, str) and _has_lone_surrogate(key):
                    return _unlinked(loc), "a key holds a lone UTF-16 surrogate, which is not text"
                stack.append((child, (loc, key), level + 1))
        elif isinstance(value, list):
            stack.extend((child, (loc, i), level + 1) for i, child in enumerate(value))
    return None


_Loc = tuple[Any, Any] | None  # (parent's location, key or index): a path shared with the parent, not copied


def _unlinked(loc: _Loc) -> tuple[Any, ...]:
    parts = []
    while loc is not None:
        loc, part = loc
        parts.append(part)
    return tuple(reversed(parts))


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


# -- expressions ----------------------------------------------------------------------------------------------
def check_expression(body: str) -> None:
    """Refuse a JMESPath expression (without its ``${ }``) that is too long or nests too deeply to be parsed by
    jmespath's recursive parser, before parsing it."""
    if len(body) > MAX_EXPRESSION_CHARS:
        raise LimitExceeded(
            f"the expression is {len(body):,} characters, over the limit of {MAX_EXPRESSION_CHARS:,} "
            "(MAX_EXPRESSION_CHARS)",
            "MAX_EXPRESSION_CHARS",
        )
    nesting = expression_nesting(body)
    if nesting > MAX_EXPRESSION_NESTING:
        raise LimitExceeded(
            f"the expression nests over {MAX_EXPRESSION_NESTING} levels deep (brackets, '!', '&' and projections; "
            "MAX_EXPRESSION_NESTING)",
            "MAX_EXPRESSION_NESTING",
        )


def expression_nesting(body: str) -> int:
    """An upper bound of how deep jmespath's parser recurses for ``body``: each open bracket is a level, and so
    is each ``!``, ``&`` or projection until an operator that ends its operand (``|``, ``||``, ``,``, ...) at
    the same bracket level. Literals and quoted names are skipped."""
    levels = [0]  # per open bracket: the operators still open at that level
    deepest, i = 0, 0
    while i < len(body):
        char = body[i]
        if char in _QUOTES:
            i = _after_quoted(body, i)
            continue
        stop = next((s for s in _STOPS if body.startswith(s, i)), None)
        if stop is not None:
            levels[-1] = 0
            i += len(stop)
            continue
        projection = next((p for p in _PROJECTIONS if body.startswith(p, i)), None)
        if projection is not None or char in "!&":
            levels[-1] += 1
        if char in "([{":
            levels.append(0)
        elif char in ")]}" and len(levels) > 1:
            levels.pop()
        deepest = max(deepest, len(levels) - 1 + sum(levels))
        i += len(projection) if projection in ("[*]", "[]", ".*") else 1
    return deepest


def _after_quoted(body: str, start: int) -> int:
    quote, i = body[start], start + 1
    while i < len(body) and body[i] != quote:
        i += 2 if body[i] == "\\" else 1
    return i + 1


def check_tree(tree: _TreeNode) -> None:
    """Refuse a parsed expression whose syntax tree is deeper than ``MAX_EXPRESSION_TREE_DEPTH`` (iteratively), or
    that holds a literal which JSON cannot carry (`` `NaN` ``, `` `1e400` ``, a lone surrogate)."""
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_EXPRESSION_TREE_DEPTH:
            raise LimitExceeded(
                f"the expression nests over {MAX_EXPRESSION_TREE_DEPTH} operations deep (MAX_EXPRESSION_TREE_DEPTH)",
                "MAX_EXPRESSION_TREE_DEPTH",
            )
        if node.get("type") == "literal":
            problem = value_problem(node.get("value"), None)
            if problem is not None:
                raise LimitExceeded(f"a literal cannot be kept as it is: {problem[1]}", "literal")
        stack.extend((child, depth + 1) for child in node.get("children", ()) if isinstance(child, dict))


# -- evaluation -----------------------------------------------------------------------------------------------
class _Budget:
    __slots__ = ("left", "limit", "next_yield")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit
        self.next_yield = limit - _YIELD_EVERY

    def charge(self, cost: int) -> None:
        self.left -= cost
        if self.left < self.next_yield:
            # A thread holding the GIL keeps the loop's thread waiting up to the switch interval (5 ms) at each
            # hand-over, and a request needs several: giving the GIL up now and then keeps /healthz fast.
            self.next_yield = self.left - _YIELD_EVERY
            time.sleep(0)
        if self.left < 0:
            raise ValueBudgetExceeded(self.limit)


_current: ContextVar[_Budget | None] = ContextVar("dag_value_budget", default=None)


@contextmanager
def value_budget(limit: int = MAX_EVALUATION_VALUES) -> Iterator[None]:
    """Every search inside shares one budget of ``limit`` values (one evaluation pass: a run's start, a settle)."""
    token = _current.set(_Budget(limit))
    try:
        yield
    finally:
        _current.reset(token)


_FUNCTIONS = jmespath_functions.Functions()  # jmespath's built-ins (stateless), as its interpreter calls them


class BoundedInterpreter(jmespath_visitor.TreeInterpreter):
    """jmespath's interpreter charging the current budget (``value_budget``, else one of its own) for each node
    it visits and for the size of what each function returns; ``join`` and ``to_string`` are charged for the
    size of their argument before they build it."""

    def __init__(self) -> None:
        super().__init__()
        self._budget = _current.get() or _Budget(MAX_EVALUATION_VALUES)

    def visit(self, node: _TreeNode, *args: Any, **kwargs: Any) -> Any:
        self._budget.charge(1)
        return super().visit(node, *args, **kwargs)

    def visit_function_expression(self, node: _TreeNode, value: Any) -> Any:
        args = [self.visit(child, value) for child in node["children"]]
        if node["value"] in ("join", "to_string", "to_array", "merge"):
            for arg in args:
                self._charge_size(arg)
        result = _FUNCTIONS.call_function(node["value"], args)
        if isinstance(result, list | dict):
            self._budget.charge(len(result))
        elif isinstance(result, str):
            self._budget.charge(len(result) // 64)
        return result

    def _charge_size(self, value: Any) -> None:
        stack = [value]
        while stack:
            item = stack.pop()
            self._budget.charge(1 + (len(item) // 64 if isinstance(item, str) else 0))
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def _unreadable(exc: BaseException) -> LimitExceeded:
    text = " ".join(str(exc).split())
    if "integer string conversion" in text:  # sys.get_int_max_str_digits(): 4,300 unless the process changed it
        limit = f"{sys.get_int_max_str_digits():,}"
        return LimitExceeded(
            f"an integer has over {limit} digits, the limit for reading one; send it as a string", "digits"
        )
    return LimitExceeded(f"a value cannot be read: {text}", "value")
