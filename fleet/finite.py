"""Whether JSON-ready data holds a number JSON cannot carry (NaN, Infinity), and where.

JSON has no such numbers: orjson and pydantic write them as ``null``, so an output holding one would be stored
changed. The worker fails such a job instead (``invalid_output``, naming the place), before anything is stored.
The common outputs cost little: a list of floats is summed in C (a finite sum means finite items; a sum that
overflows is looked at item by item), a numpy array is checked by numpy (only a process that made one has numpy
imported: an ``echo`` worker never imports it).
"""

from __future__ import annotations

import math
import sys
from typing import Any


def non_finite_at(value: Any, path: str = "output") -> str | None:
    """The path of a NaN or infinite number in ``value`` (``output.vectors.3``), or None when it has none.

    Outputs nearly always hold none: a first walk looks without naming places (a token-classification output of
    dozens of entities costs a third of the walk that names each one), and only an output that holds one is walked
    again for its path."""
    if _all_finite(value):
        return None
    return _first_non_finite(value, path)


def _all_finite(value: Any) -> bool:
    """True when nothing in ``value`` is a NaN or an infinity (exact types first: the common JSON values)."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            for child in node.values():
                child_kind = type(child)
                if child_kind is float:
                    if not math.isfinite(child):
                        return False
                elif child_kind not in _LEAVES:
                    stack.append(child)
        elif kind is list:
            if not _finite_floats(node):
                stack.extend(child for child in node if type(child) not in _LEAVES)
        elif kind in _LEAVES:
            continue
        elif isinstance(node, float):
            if not math.isfinite(node):
                return False
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif _non_finite_array(node):
            return False
    return True


_LEAVES = frozenset({str, int, bool, type(None)})  # JSON values that hold no float


def _first_non_finite(value: Any, path: str) -> str | None:
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return where
        elif isinstance(node, dict):
            stack.extend((child, f"{where}.{key}") for key, child in node.items() if not isinstance(child, str))
        elif isinstance(node, list):
            if _finite_floats(node):
                continue
            stack.extend((child, f"{where}.{i}") for i, child in enumerate(node) if not isinstance(child, str))
        elif _non_finite_array(node):
            return where
    return None


def _non_finite_array(node: Any) -> bool:
    """``node`` is a numpy array or scalar holding a NaN or an infinity."""
    np = sys.modules.get("numpy")  # an array exists only where numpy was imported
    return np is not None and isinstance(node, (np.ndarray, np.floating)) and not bool(np.isfinite(node).all())


def _finite_floats(items: list[Any]) -> bool:
    """True when ``items`` are all floats (or ints) with a finite sum: then none is NaN or infinite."""
    try:
        return math.isfinite(sum(items))
    except (TypeError, OverflowError, ValueError):  # not all numbers, or a sum past a float's range
        return False
