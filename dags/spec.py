"""Loading the DAG DSL: ``load_spec`` from YAML text, JSON text or a dict into a ``DagSpec`` (whose shape, with
``StepSpec``'s, lives in ``fleet.schemas.dags``).

Loading checks the shape only (types, names, sizes); what the steps mean together (references, cycles, models,
inputs) is ``fleet.dags.validate``. Every refusal is one ``DagInvalid`` listing all the problems found. Text is read
within
``fleet.dags.limits``: nested at most ``MAX_SPEC_DEPTH`` (checked before the parser recurses), holding at most
``MAX_SPEC_NODES`` values, none of them NaN, an infinity, an integer past 4,300 digits or a lone surrogate.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from fleet.dags import limits
from fleet.dags.limits import MAX_SPEC_NODES, LimitExceeded
from fleet.errors import DagInvalid
from fleet.schemas.dags import MAX_STEPS, NAME_PATTERN, DagSpec, OnError, StepSpec

__all__ = ["MAX_STEPS", "NAME_PATTERN", "DagSpec", "OnError", "StepSpec", "load_spec", "parse_text"]

NAME_RE = re.compile(NAME_PATTERN)

MAX_SPEC_BYTES = 256 * 1024


def load_spec(source: str | bytes | Mapping[str, Any]) -> DagSpec:
    """Parse a DAG from YAML or JSON text (bytes are UTF-8) or from a mapping of the same structure.

    Raises ``DagInvalid`` for text that does not parse (with the line and column), is over ``MAX_SPEC_BYTES``, has
    over ``MAX_STEPS`` steps, or does not have the DSL's shape (each problem with its path).
    """
    data = _parse(source) if isinstance(source, str | bytes) else dict(source)
    _check_size(data)
    try:
        return DagSpec.model_validate(data)
    except ValidationError as exc:
        raise DagInvalid([_problem(data, error) for error in exc.errors()]) from None


def parse_text(source: str | bytes) -> dict[str, Any]:
    """The mapping in YAML or JSON text, before any shape check (the gateway answers these refusals 400, the shape's
    422). Raises ``DagInvalid`` for text over ``MAX_SPEC_BYTES``, not UTF-8, that does not parse (with the line and
    column) or that is not a mapping."""
    data: dict[str, Any] = _parse(source)
    return data


def _parse(source: str | bytes) -> Any:
    raw = source.encode() if isinstance(source, str) else source
    if len(raw) > MAX_SPEC_BYTES:
        raise _invalid(f"the spec is {len(raw)} bytes, over the limit of {MAX_SPEC_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise _invalid(f"the spec is not UTF-8 text (byte {exc.start})") from None
    data = _parse_json(text) if text.lstrip().startswith("{") else _parse_yaml(text)
    if not isinstance(data, dict):
        raise _invalid(f"the spec must be a mapping with name, steps and output, not {_kind(data)}")
    return data


def _parse_json(text: str) -> Any:
    try:
        return limits.loads_json(text)
    except LimitExceeded as exc:
        raise _invalid(exc.message) from None
    except json.JSONDecodeError as exc:
        error = _invalid(f"line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}")
    try:  # a YAML flow mapping ({name: x, ...}) starts like JSON
        return _parse_yaml(text)
    except DagInvalid:
        raise error from None


def _parse_yaml(text: str) -> Any:
    try:
        return limits.load_yaml(text)
    except LimitExceeded as exc:
        raise _invalid(exc.message) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise _invalid(f"{where}invalid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise _invalid(f"invalid YAML: {exc}") from None


def _check_size(data: Any) -> None:
    steps = data.get("steps") if isinstance(data, dict) else None
    if isinstance(steps, list) and len(steps) > MAX_STEPS:
        raise _invalid(f"the spec has {len(steps)} steps, over the limit of {MAX_STEPS}", "steps")
    problem = limits.value_problem(data, MAX_SPEC_NODES)
    if problem is not None:
        loc, why = problem
        step = _step_id(data, loc[1]) if len(loc) > 2 and loc[0] == "steps" and isinstance(loc[1], int) else None
        raise DagInvalid([{"step": step, "path": format_path(loc[2:] if step else loc), "message": why}])


def _problem(data: Any, error: Any) -> dict[str, Any]:
    """A pydantic error as a problem: ``steps[2].model`` becomes step 'embed', path ``model`` when the step has
    a usable id, else the path stays whole."""
    loc = list(error["loc"])
    step = None
    if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int):
        candidate = _step_id(data, loc[1])
        if candidate is not None and loc[2:] != ["id"]:
            step, loc = candidate, loc[2:]
    return {"step": step, "path": format_path(loc), "message": _message(error)}


def _step_id(data: Any, index: int) -> str | None:
    try:
        candidate = data["steps"][index]["id"]
    except (KeyError, IndexError, TypeError):
        return None
    return candidate if isinstance(candidate, str) and NAME_RE.match(candidate) else None


def _message(error: Any) -> str:
    if error["type"] == "string_pattern_mismatch":
        return f"{error['input']!r} is not a valid name: use 1-63 of a-z, 0-9, '_' or '-', starting with a-z or 0-9"
    if error["type"] == "string_type" and isinstance(error["input"], bool):
        return f"{error['msg']}: YAML reads an unquoted yes/no/on/off/true/false as a boolean; quote it"
    if error["type"] == "extra_forbidden":
        return "unknown field"
    return str(error["msg"])


def format_path(loc: list[Any] | tuple[Any, ...]) -> str:
    """``['input', 'texts', 0]`` -> ``input.texts[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _invalid(message: str, path: str = "") -> DagInvalid:
    return DagInvalid([{"step": None, "path": path, "message": message}])
