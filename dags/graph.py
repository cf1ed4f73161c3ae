"""A compiled DAG as a graph for people: nodes and edges (for the API) and Mermaid text (for a browser or docs)."""

from __future__ import annotations

from typing import Any

from fleet.dags.expressions import expressions_in
from fleet.dags.validate import CompiledDag, CompiledStep


def nodes(dag: CompiledDag) -> list[dict[str, Any]]:
    """One node per step, in topological order."""
    return [
        {
            "id": step.id,
            "model": step.spec.model,
            "for_each": step.spec.for_each,
            "when": step.spec.when,
            "on_error": step.spec.on_error,
        }
        for step in dag.steps.values()
    ]


def edges(dag: CompiledDag) -> list[dict[str, str]]:
    """``{from, to, kind}`` for each dependency: ``data`` when ``to`` reads ``from`` in an expression, ``after``
    when it only waits for it."""
    return [
        {"from": dep, "to": step.id, "kind": "data" if dep in _reads(dag, step) else "after"}
        for step in dag.steps.values()
        for dep in step.deps
    ]


def graph(dag: CompiledDag) -> dict[str, Any]:
    return {"nodes": nodes(dag), "edges": edges(dag), "mermaid": mermaid(dag)}


def mermaid(dag: CompiledDag) -> str:
    """A Mermaid flowchart: fan-out steps as subroutines, conditional ones as hexagons, ``after`` edges dotted.
    Node ids are ``s<n>`` (a step id such as ``end`` is a Mermaid keyword); labels are the step ids."""
    ids = {sid: f"s{i}" for i, sid in enumerate(dag.steps)}
    lines = ["flowchart TD"]
    for step in dag.steps.values():
        lines.append(f"    {ids[step.id]}{_shape(step)}")
    for edge in edges(dag):
        arrow = "-->" if edge["kind"] == "data" else "-.->"
        lines.append(f"    {ids[edge['from']]} {arrow} {ids[edge['to']]}")
    return "\n".join(lines) + "\n"


def _shape(step: CompiledStep) -> str:
    label = f"{step.id}<br/>{step.spec.model}"
    if step.fan_out:
        return f'[["{label} (for each)"]]'
    if step.spec.when is not None:
        return f'{{{{"{label} (when)"}}}}'
    return f'["{label}"]'


def _reads(dag: CompiledDag, step: CompiledStep) -> set[str]:
    sources = [s for _, s in expressions_in(step.spec.input)]
    sources += [s for s in (step.spec.for_each, step.spec.when) if s is not None]
    return {sid for source in sources for sid, _ in dag.expressions[source].references()}
