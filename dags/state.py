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

Job ids: ``job_id`` gives ``<run>.<step>.<index>.<key>``, where ``key`` is the run's secret (``new_key``: 64
random bits made when the run is created and kept in its document, so a republish gives the same ids), so no
client can guess a step's id; the gateway also refuses every id of that shape at submit
(``fleet.schemas.dags.STEP_JOB_ID_PATTERN``). A run written before keys (its document has none) keeps the ids
``<run>.<step>.<index>`` it started with. ``RunState.key`` travels beside ``to_dict()`` (the document's ``key``),
not in it.

A step is launched exactly once: ``pending -> running`` (its jobs listed in ``items``) or straight to a settled
state (skipped, an empty fan-out, a failure before any job). Values are never changed in place: every change makes
a new ``RunState`` (copy-on-write).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fleet import tenancy
from fleet.errors import InvalidInput
from fleet.schemas.dags import RUN_ID_PATTERN, STEP_JOB_ID_PATTERN

StepStatus = Literal["pending", "running", "succeeded", "failed", "skipped", "cancelled"]
SETTLED: frozenset[str] = frozenset({"succeeded", "failed", "skipped", "cancelled"})
RUN_OUTCOMES = ("failed", "cancelled", "expired")

RUN_ID_RE = re.compile(RUN_ID_PATTERN)
STEP_JOB_ID_RE = re.compile(STEP_JOB_ID_PATTERN)
KEY_RE = re.compile(r"^[0-9a-f]{16}$")
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
    key: str | None = None  # the run's secret part of its job ids (None: a run from before keys)

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
    def from_dict(cls, data: Mapping[str, Any], key: str | None = None) -> RunState:
        """The state ``to_dict`` gave, with the run's ``key`` (its document's, kept beside the state)."""
        steps = {sid: StepRun.from_dict(run) for sid, run in data["steps"].items()}
        outcome, error = data.get("outcome"), data.get("error")
        return cls(data["run_id"], data["dag"], data.get("input"), steps, outcome, error, key)


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise InvalidInput(
            f"run id {run_id!r} is not allowed: use 1-58 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return run_id


def new_key() -> str:
    """A run's key: the secret part of its job ids (64 random bits as 16 hex digits)."""
    return secrets.token_hex(8)


def job_id(run_id: str, step_id: str, index: int, key: str | None = None) -> str:
    """The deterministic id of a step's job: ``<run>.<step>.<index>.<key>`` (a republish is de-duplicated), or
    ``<run>.<step>.<index>`` for a run without a key (started before keys)."""
    base = f"{run_id}.{step_id}.{index}"
    return base if key is None else f"{base}.{key}"


def parse_job_id(value: str) -> tuple[str, str, int] | None:
    """``(run, step, index)`` of a DAG job id (with or without its run's key), or None for an id that is not one."""
    parts = value.split(".")
    if len(parts) not in (3, 4) or not parts[2].isdigit() or not RUN_ID_RE.match(parts[0]):
        return None
    if len(parts) == 4 and not KEY_RE.match(parts[3]):
        return None
    return parts[0], parts[1], int(parts[2])


def has_key(value: str) -> bool:
    """True for the job id of a step of a run with a key (``<run>.<step>.<index>.<key>``)."""
    parts = value.split(".")
    return len(parts) == 4 and parse_job_id(value) is not None


def is_reserved(value: str) -> bool:
    """True for an id of the shape reserved for DAG steps, which no client may submit a job under."""
    return STEP_JOB_ID_RE.match(value) is not None


def scoped(name: str, tenant: str | None) -> str:
    """Where a tenant's DAG ``name`` or run id lives in the DAG store: ``<tenant>:<name>``, or ``name`` itself for
    the default tenant (and for ``tenant=None`` read as every tenant's: the name is already scoped). Names, run ids
    and tenants have no ':', so two tenants' names never meet."""
    stored = tenancy.stored(tenant)
    return name if stored is None else f"{stored}:{name}"
