"""``fleet.dags.input_schema``: a DAG's input schema checks ``pattern`` and ``patternProperties`` as jsonschema does,
but
with a time limit per match; a pattern that does not compile is refused at registration."""

from __future__ import annotations

import time
from typing import Any

import jsonschema
import pytest

from fleet.dags.input_schema import MAX_PATTERN_SECONDS, bounded_validator
from fleet.dags.spec import load_spec
from fleet.dags.validate import validate
from fleet.errors import DagInvalid
from fleet.schemas.models import BUILTIN_SPECS

SCHEMAS: list[dict[str, Any]] = [
    {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    {"type": "object", "patternProperties": {"^x-": {"type": "integer"}, "^y": {"type": "string"}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"id": {"pattern": "^[0-9a-f]{4}$"}}},
]
VALUES: list[Any] = ["abc-12", "abc-1", "", 7, {"x-a": 1, "yes": "no"}, {"x-a": "one"}, {"id": "00ff"}, {"id": "zz"}]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("value", VALUES)
def test_patterns_judge_values_as_jsonschema_does(schema: dict[str, Any], value: Any) -> None:
    expected = [e.message for e in jsonschema.validators.validator_for(schema)(schema).iter_errors(value)]
    assert [e.message for e in bounded_validator(schema).iter_errors(value)] == expected


@pytest.mark.parametrize(
    "schema, value",
    [
        ({"pattern": "^(a|aa)+$"}, "a" * 40 + "b"),
        ({"type": "object", "patternProperties": {"^(a|aa)+$": {}}}, {"a" * 40 + "b": 1}),
    ],
    ids=["pattern", "patternProperties"],
)
def test_a_backtracking_pattern_is_cut_off_and_named(schema: dict[str, Any], value: Any) -> None:
    started = time.monotonic()
    errors = [e.message for e in bounded_validator(schema).iter_errors(value)]
    assert time.monotonic() - started < 20 * MAX_PATTERN_SECONDS
    assert len(errors) == 1 and "MAX_PATTERN_SECONDS" in errors[0]


def test_a_pattern_that_does_not_compile_is_a_problem_of_the_spec() -> None:
    spec = {
        "name": "bad-pattern",
        "input_schema": {"type": "object", "properties": {"a": {"pattern": "(?<n>a)(?&n)(?P>"}}},
        "steps": [{"id": "s", "model": "echo", "input": {"n": 1}}],
        "output": "${steps.s.output}",
    }
    with pytest.raises(DagInvalid) as caught:
        validate(load_spec(spec), BUILTIN_SPECS)
    (problem,) = caught.value.problems
    assert problem["path"] == "input_schema.properties.a.pattern" and "is not a 'regex'" in problem["message"]
