"""A DAG's ``input_schema``, checked with bounded regular expressions.

A spec is a tenant's text, and JSON Schema's ``pattern`` and ``patternProperties`` are regular expressions that
jsonschema runs with Python's ``re``: a backtracking pattern such as ``^(a|aa)+$`` against 40 characters runs for
minutes, holding the GIL, so even in a thread it would stall the gateway or the worker that checks a run's input.
Here both keywords run on the ``regex`` package instead, with ``timeout=MAX_PATTERN_SECONDS`` (past it the value
does not validate, and the message names the limit) and ``concurrent=True`` (the GIL is released while it
matches). A pattern that does not compile is refused when the spec is registered (the schema's own check, by
``re``, whose syntax ``regex`` reads the same).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

MAX_PATTERN_SECONDS = 0.1
"""Time one ``pattern`` may take on one value (or one property name)."""

_BOUNDED: dict[type, type] = {}


def bounded_validator(schema: Mapping[str, Any]) -> Any:
    """A jsonschema validator of ``schema`` (its own draft) whose patterns run within ``MAX_PATTERN_SECONDS``."""
    cls = jsonschema.validators.validator_for(schema)
    if cls not in _BOUNDED:
        keywords = {"pattern": _pattern, "patternProperties": _pattern_properties}
        _BOUNDED[cls] = jsonschema.validators.extend(cls, keywords)
    return _BOUNDED[cls](schema)


def _search(source: str, text: str) -> bool:
    """Whether ``source`` matches somewhere in ``text``; ``TimeoutError`` past ``MAX_PATTERN_SECONDS``."""
    return regex.search(source, text, timeout=MAX_PATTERN_SECONDS, concurrent=True) is not None


def _too_slow(source: str, what: str) -> ValidationError:
    return ValidationError(
        f"the pattern {source!r} took over {MAX_PATTERN_SECONDS}s on {what} (MAX_PATTERN_SECONDS): "
        "a pattern that backtracks this much cannot be checked; simplify it"
    )


def _pattern(validator: Any, source: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    try:
        matched = _search(source, instance)
    except TimeoutError:
        yield _too_slow(source, "this value")
        return
    if not matched:
        yield ValidationError(f"{instance!r} does not match {source!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for source, subschema in patterns.items():
        for name, value in instance.items():
            try:
                matched = _search(source, name)
            except TimeoutError:
                yield _too_slow(source, f"the property name {name!r}")
                continue
            if matched:
                yield from validator.descend(value, subschema, path=name, schema_path=source)
