"""``fleet.finite.non_finite_at``: the worker's check that an output holds no NaN or infinity before it is stored.

Generated JSON-like values (hypothesis) against the standard library's own refusal (``json.dumps(allow_nan=False)``),
and the path it names leads to the very number.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fleet.finite import non_finite_at

leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=4), children, max_size=6),
    max_leaves=40,
)


def at(value: Any, path: str) -> Any:
    """The value the path ``output.a.3`` names."""
    node = value
    for part in path.split(".")[1:]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def json_refuses(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return True
    return False


@given(values)
def test_it_finds_a_non_finite_number_exactly_when_json_refuses_the_value(value: Any) -> None:
    where = non_finite_at(value)
    assert (where is not None) == json_refuses(value), (value, where)
    if where is not None and "." not in where.removeprefix("output"):  # keys with dots make a path ambiguous
        found = at(value, where)
        assert isinstance(found, float) and not math.isfinite(found), (value, where, found)


def test_the_path_names_the_place_in_dicts_and_lists() -> None:
    entities = [{"label": "PER", "score": 0.5, "text": "Ada", "start": 0, "end": 3} for _ in range(12)]
    assert non_finite_at({"entities": entities, "tokens": 9}) is None
    entities[7]["score"] = float("nan")
    assert non_finite_at({"entities": entities, "tokens": 9}) == "output.entities.7.score"
    assert non_finite_at({"a": [1.0, [2.0, float("-inf")]]}) == "output.a.1.1"
    assert non_finite_at(float("inf"), "x") == "x"


def test_float_subclasses_numpy_arrays_and_huge_integers() -> None:
    class Score(float):
        pass

    assert non_finite_at({"a": [Score(1.0), Score("inf")]}) == "output.a.1"
    assert non_finite_at({"a": Score("nan")}) == "output.a"
    assert non_finite_at({"v": np.array([1.0, np.nan], dtype=np.float32)}) == "output.v"
    assert non_finite_at({"v": np.array([1.0, 2.0], dtype=np.float32)}) is None
    assert non_finite_at({"n": [1, 10**400, 2.5]}) is None  # an integer past a float's range is still JSON
