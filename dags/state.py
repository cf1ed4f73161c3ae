"""The state of one DAG run, JSON-friendly: ``RunState.to_dict()`` / ``RunState.from_dict()`` round-trip exactly.

Shape (what ``to_dict`` gives)::

    {"run_id": str, "dag": str, "input": <JSON>,
     "outcome": null | "failed" | "cancelled" | "expired",   # set once; "succeeded" is derived (every step settled)
     "error": null | {"step": str | null, "type": str, "message": str},
     "steps": {<id>: {"state": "pending" | "running" | "succeeded" | "failed" | "skipped" | "cancelled",
                      "items": ["pending" | <job record state>, ...],   # one per job; [] until launched
                      "outputs": [<JSON> | null, ...],                   # one per job; null unless it succeeded
                      "errors": [null | {"type", "message"}, ...],       # one per job
                      "error": null | {"type", "message", "index"?}}}}   # why the step failed

A step is launched exactly once: ``pending -> running`` (its jobs listed in ``items``) or straight to a settled
state (skipped, an empty fan-out, a failure before any job). Values are never changed in place: every change makes
a new ``RunState`` (copy-on-write).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fleet.errors import InvalidInput
from schemas.dags import RUN_ID_PATTERN

StepStatus = Literal["pending", "running", "succeeded", "failed", "skipped", "cancelled"]
SETTLED: frozenset[str] = frozenset({"succeeded", "failed", "skipped", "cancelled"})
RUN_OUTCOMES = ("failed", "cancelled", "expired")

RUN_ID_RE = re.compile(RUN_ID_PATTERN)
MAX_FAN_OUT = 10_000
"""Items one ``for_each`` may expand to (their indices, up to 4 digits, are part of the job ids)."""


@dataclass(frozen=True, slots=True)
class StepRun:
    """One step of a run: its state and, once launched, one entry per job in ``items``, ``outputs``, ``errors``."""

    state: StepStatus = "pending"
    items: tuple[str, ...] = ()
    outputs: tuple[Any, ...] = ()
    errors: tuple[dict[str, Any] | None, ...] = ()
    error: dict[str, Any] | None = None

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "items": list(self.items),
            "outputs": list(self.outputs),
            "errors": list(self.errors),
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRun:
        return cls(
            state=data["state"],
            items=tuple(data.get("items", ())),
            outputs=tuple(data.get("outputs", ())),
            errors=tuple(data.get("errors", ())),
            error=data.get("error"),
        )


@dataclass(frozen=True, slots=True)
class RunState:
    run_id: str
    dag: str
    input: Any
    steps: Mapping[str, StepRun] = field(default_factory=dict)
    outcome: str | None = None
    error: dict[str, Any] | None = None

    def with_steps(self, changes: Mapping[str, StepRun]) -> RunState:
        return replace(self, steps={**self.steps, **changes})

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "dag": self.dag,
            "input": self.input,
            "outcome": self.outcome,
            "error": self.error,
            "steps": {sid: run.to_dict() for sid, run in self.steps.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunState:
        steps = {sid: StepRun.from_dict(run) for sid, run in data["steps"].items()}
        return cls(data["run_id"], data["dag"], data.get("input"), steps, data.get("outcome"), data.get("error"))


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise InvalidInput(
            f"run id {run_id!r} is not allowed: use 1-58 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return run_id


def job_id(run_id: str, step_id: str, index: int) -> str:
    """The deterministic id of a step's job: ``<run>.<step>.<index>`` (a republish is de-duplicated)."""
    return f"{run_id}.{step_id}.{index}"


def parse_job_id(value: str) -> tuple[str, str, int] | None:
    """``(run, step, index)`` of a DAG job id, or None for an id that is not one."""
    parts = value.split(".")
    if len(parts) != 3 or not parts[2].isdigit() or not RUN_ID_RE.match(parts[0]):
        return None
    return parts[0], parts[1], int(parts[2])
