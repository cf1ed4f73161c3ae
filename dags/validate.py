"""Validation: a ``DagSpec`` and the models it may use become a ``CompiledDag``, or one ``DagInvalid`` listing every
problem, each naming its step and path (``step 'collect': input.n: unknown step 'embed_eachh'``).

Refused: duplicate step ids; an unknown model; ``for_each`` or ``when`` that is not ``${...}``; an expression that
does not parse, calls an unknown function or with the wrong number of arguments, reads the whole context, an unknown
name, ``steps`` as a whole, an unknown step, a step's own output, an unknown field of a step, ``item`` or ``index``
outside the input of a ``for_each`` step; ``outputs`` of a step without ``for_each`` and ``output`` of one with it
(a fan-out step has ``outputs``, one per item; any other step has ``output``); an ``after`` naming an unknown step or
the step itself; a cycle (named: ``a -> b -> a``); an input schema that is not a JSON Schema (its patterns are
checked within a time limit: ``fleet.dags.input_schema``); and a static input that does not match the model's input
schema. Values that are expressions are unknown until the run, so the static check drops every top-level field
holding one and ignores what their absence alone explains (missing fields, and the model's whole-input checks).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from pydantic import ValidationError

from fleet.dags.expressions import (
    CONTEXT_NAMES,
    STEP_FIELDS,
    Expression,
    ExpressionError,
    check_call,
    compile_expression,
    expressions_in,
    is_expression,
)
from fleet.dags.input_schema import bounded_validator
from fleet.dags.spec import DagSpec, StepSpec, format_path
from fleet.errors import DagInvalid
from fleet.schemas.models import ModelSpec


@dataclass(frozen=True, slots=True)
class CompiledStep:
    """A step with its dependencies (``deps``, in the DAG's order) and the ones whose state its ``when`` reads."""

    spec: StepSpec
    deps: tuple[str, ...]
    when_reads_state: frozenset[str]

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def fan_out(self) -> bool:
        return self.spec.for_each is not None


@dataclass(frozen=True, slots=True)
class CompiledDag:
    """A valid DAG: steps in a topological order (ties kept in spec order), expressions compiled once."""

    spec: DagSpec
    steps: Mapping[str, CompiledStep]
    expressions: Mapping[str, Expression]
    input_validator: Any = None  # a jsonschema validator of the run's input, when the spec has an input schema

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.steps)

    def dependents(self, step_id: str) -> tuple[str, ...]:
        return tuple(s.id for s in self.steps.values() if step_id in s.deps)


def validate(spec: DagSpec, models: Mapping[str, ModelSpec]) -> CompiledDag:
    """Check a spec against the models it may use (name -> ``ModelSpec``); raises ``DagInvalid`` with every
    problem found."""
    checker = _Checker(spec, models)
    checker.check()
    if checker.problems:
        raise DagInvalid(checker.problems)
    return checker.compiled()


@dataclass
class _Checker:
    spec: DagSpec
    models: Mapping[str, ModelSpec]
    problems: list[dict[str, Any]] = field(default_factory=list)
    expressions: dict[str, Expression] = field(default_factory=dict)
    edges: dict[str, dict[str, str]] = field(default_factory=dict)  # step -> {dependency: path of the reference}
    steps: dict[str, StepSpec] = field(default_factory=dict)
    validator: Any = None

    def check(self) -> None:
        self._index_steps()
        for step in self.steps.values():
            self._check_step(step)
        for loc, source in expressions_in(self.spec.output, ("output",)):
            self._expression(None, format_path(loc), source, item=False)
        self._check_input_schema()
        if not self.problems:
            self._check_cycles()

    def compiled(self) -> CompiledDag:
        order = _topological(list(self.steps), self.edges)
        steps = {sid: self._compiled_step(self.steps[sid], order) for sid in order}
        return CompiledDag(self.spec, steps, dict(self.expressions), self.validator)

    def problem(self, step: str | None, path: str, message: str) -> None:
        self.problems.append({"step": step, "path": path, "message": message})

    # -- steps --------------------------------------------------------------------------------------------------
    def _index_steps(self) -> None:
        first: dict[str, int] = {}
        for i, step in enumerate(self.spec.steps):
            if step.id in first:
                self.problem(step.id, "id", f"duplicate step id (steps[{first[step.id]}] and steps[{i}])")
                continue
            first[step.id] = i
            self.steps[step.id] = step
            self.edges[step.id] = {}

    def _check_step(self, step: StepSpec) -> None:
        model = self.models.get(step.model)
        if model is None:
            self.problem(step.id, "model", f"unknown model {step.model!r}; known models: {_names(self.models)}")
        for name in ("for_each", "when"):
            source = getattr(step, name)
            if source is not None and not is_expression(source):
                self.problem(step.id, name, f"must be an expression '${{...}}', not {source!r}")
            elif source is not None:
                self._expression(step, name, source, item=False)
        for loc, source in expressions_in(step.input, ("input",)):
            self._expression(step, format_path(loc), source, item=step.fan_out)
        for i, dep in enumerate(step.after):
            self._after(step, f"after[{i}]", dep)
        if model is not None:
            for path, message in _static_input_problems(step.input, model):
                self.problem(step.id, path, message)

    def _after(self, step: StepSpec, path: str, dep: str) -> None:
        if dep == step.id:
            self.problem(step.id, path, "a step cannot wait for itself")
        elif dep not in self.steps:
            self.problem(step.id, path, _unknown_step(dep, self.steps))
        else:
            self.edges[step.id].setdefault(dep, path)

    def _compiled_step(self, step: StepSpec, order: list[str]) -> CompiledStep:
        deps = tuple(sid for sid in order if sid in self.edges[step.id])
        reads: frozenset[str] = frozenset()
        if step.when is not None:
            paths = self.expressions[step.when].paths
            reads = frozenset(p[1] for p in paths if len(p) >= 3 and p[0] == "steps" and p[2] == "state")
        return CompiledStep(step, deps, reads)

    # -- expressions --------------------------------------------------------------------------------------------
    def _expression(self, step: StepSpec | None, path: str, source: str, *, item: bool) -> None:
        sid = step.id if step is not None else None
        try:
            expression = self.expressions.get(source) or compile_expression(source)
        except ExpressionError as exc:
            self.problem(sid, path, exc.message)
            return
        self.expressions[source] = expression
        for name, count in expression.calls:
            why = check_call(name, count)
            if why is not None:
                self.problem(sid, path, why)
        for read in expression.paths:
            why = self._read_problem(step, read, item)
            if why is not None:
                self.problem(sid, path, why)
            elif step is not None and read[0] == "steps":
                self.edges[step.id].setdefault(read[1], path)

    def _read_problem(self, step: StepSpec | None, read: tuple[str, ...], item: bool) -> str | None:
        if not read:
            return "reads the whole context ('@' or '*' at the top): start from input, steps, item or index"
        root = read[0]
        if root not in CONTEXT_NAMES:
            return f"unknown name {root!r}: the context has {', '.join(CONTEXT_NAMES)}"
        if root in ("item", "index") and not item:
            return f"{root!r} is only defined in the input of a for_each step"
        if root != "steps":
            return None
        if len(read) == 1:
            return "reads steps as a whole: name one step, e.g. steps.<id>.output"
        return self._step_read_problem(step, read[1], read[2] if len(read) > 2 else None)

    def _step_read_problem(self, step: StepSpec | None, target: str, attr: str | None) -> str | None:
        if step is not None and target == step.id:
            return "a step cannot read itself"
        other = self.steps.get(target)
        if other is None:
            return _unknown_step(target, self.steps)
        if attr is None or attr == "state":
            return None
        if attr not in STEP_FIELDS:
            return f"unknown field {attr!r} of step {target!r}: a step has {', '.join(STEP_FIELDS)}"
        if attr == "outputs" and not other.fan_out:
            return f"step {target!r} has no for_each, so no outputs: use steps.{target}.output"
        if attr == "output" and other.fan_out:
            return f"step {target!r} is a fan-out (for_each): use steps.{target}.outputs, one output per item"
        return None

    # -- the spec as a whole ------------------------------------------------------------------------------------
    def _check_input_schema(self) -> None:
        schema = self.spec.input_schema
        if schema is None:
            return
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = format_path(["input_schema", *exc.absolute_path])
            self.problem(None, where, f"not a valid JSON Schema: {exc.message}")
            return
        self.validator = bounded_validator(schema)

    def _check_cycles(self) -> None:
        graph = {sid: list(deps) for sid, deps in self.edges.items()}
        for component in _cycles(list(self.steps), graph):
            start, second = component[0], component[1]
            names = " -> ".join([*component, start])
            self.problem(start, self.edges[start][second], f"cycle: {names}")


def _static_input_problems(template: Any, model: ModelSpec) -> list[tuple[str, str]]:
    if is_expression(template):
        return []
    if not isinstance(template, dict):
        return [("input", f"must be an object (the model's input), not {type(template).__name__}")]
    static = {k: v for k, v in template.items() if next(expressions_in(v), None) is None}
    dropped = set(template) - set(static)
    try:
        model.input_model.model_validate(static)
    except ValidationError as exc:
        return [
            (format_path(["input", *e["loc"]]), str(e["msg"]))
            for e in exc.errors()
            if not (dropped and (not e["loc"] or (e["type"] == "missing" and e["loc"][0] in dropped)))
        ]
    return []


def _unknown_step(name: str, steps: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(steps), n=1)
    return f"unknown step {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _names(models: Mapping[str, Any]) -> str:
    return ", ".join(sorted(models)) or "(none)"


def _topological(ids: list[str], edges: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Kahn's order, each round taking the earliest step in spec order whose dependencies are placed."""
    placed: list[str] = []
    left = list(ids)
    while left:
        ready = next(sid for sid in left if all(dep in placed for dep in edges[sid]))
        placed.append(ready)
        left.remove(ready)
    return placed


def _cycles(ids: list[str], graph: Mapping[str, list[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one step, starting at its earliest step."""
    cycles = []
    for component in _components(ids, graph):
        if len(component) > 1:
            start = min(component, key=ids.index)
            cycles.append(_cycle_from(start, graph, set(component)))
    return cycles


def _cycle_from(start: str, graph: Mapping[str, list[str]], within: set[str]) -> list[str]:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen = {start}
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return path
            if nxt in within and nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    raise AssertionError("a strongly connected component has a cycle through each of its steps")


def _components(ids: list[str], graph: Mapping[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (a DAG may have hundreds of steps)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in ids:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = graph[node]
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out
