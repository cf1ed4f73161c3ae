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
    """The path of a NaN or infinite number in ``value`` (``output.vectors.3``), or None when it has none."""
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
