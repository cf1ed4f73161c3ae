"""What runs next: pure functions of ``(CompiledDag, RunState)``; no I/O. The caller stores the state they return
(atomically) and publishes the launches; job ids are deterministic, so a republish after a crash is harmless.

- ``new_run``: the initial state (every step ``pending``), the input checked against the DAG's input schema.
- ``advance``: launches the steps whose dependencies have all settled, in topological order, and returns them with
  the state that records them as launched, so a step is launched exactly once. A step is *skipped* when its
  ``when`` is false, and when any of its dependencies was skipped, unless its ``when`` reads the ``state`` of every
  such dependency (``when: "${steps.a.state == 'succeeded' || steps.b.state == 'succeeded'}"`` merges two
  branches): then its ``when`` alone decides. A ``for_each`` that is not a list, inputs over
  ``fleet.dags.limits.MAX_LAUNCH_BYTES`` together, or an input or ``when`` that raises, fails the step before any job;
  an empty list succeeds it at once with ``outputs: []``.
- ``apply_result``: one job's terminal record. A duplicate (the job already recorded, or its step settled) changes
  nothing. A step settles when all its jobs have: ``succeeded`` if they all succeeded, else ``failed`` (a job that
  failed or expired; the error is that of the lowest index, whatever the order of arrival) or ``cancelled``.
  ``on_error`` then decides: ``fail`` fails the run (once: the first failure is the run's error) and cancels its
  pending steps; ``continue`` lets the dependants run, the failed jobs' outputs being null.
- ``cancel``: ends a running run as ``cancelled`` or ``expired``; pending steps are not started.
- ``run_state``: ``running``, ``succeeded`` (every step settled; the DAG's ``output`` evaluated), ``failed``,
  ``cancelled`` or ``expired``, with the error; ``run_view`` the same with each step's state, job ids and error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

import orjson

from fleet.dags.expressions import ExpressionError, render, truthy
from fleet.dags.limits import MAX_LAUNCH_BYTES
from fleet.dags.state import MAX_FAN_OUT, RunState, StepRun, check_run_id, job_id
from fleet.dags.validate import CompiledDag, CompiledStep
from fleet.errors import InvalidInput
from fleet.schemas.jobs import JobState

FAILED_ITEM_STATES = frozenset({JobState.failed.value, JobState.expired.value})


@dataclass(frozen=True, slots=True)
class JobLaunch:
    job_id: str
    index: int
    item: Any
    input: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StepLaunch:
    """The jobs to publish for one step (one, or one per item of a fan-out), with the step's job settings."""

    step_id: str
    model: str
    jobs: tuple[JobLaunch, ...]
    timeout_s: float | None = None
    retries: int | None = None


@dataclass(frozen=True, slots=True)
class RunStatus:
    state: str  # running | succeeded | failed | cancelled | expired
    error: dict[str, Any] | None = None
    output: Any = None


def new_run(dag: CompiledDag, run_id: str, run_input: Any) -> RunState:
    """The state of a run not started yet; raises ``InvalidInput`` for a bad run id or an input that does not
    match the DAG's input schema."""
    check_run_id(run_id)
    if dag.input_validator is not None:
        errors = sorted(dag.input_validator.iter_errors(run_input), key=lambda e: list(e.absolute_path))
        if errors:
            details = [{"loc": ["input", *e.absolute_path], "msg": e.message} for e in errors]
            raise InvalidInput(f"the run input does not match the DAG's input schema: {errors[0].message}", details)
    return RunState(run_id, dag.name, run_input, {sid: StepRun() for sid in dag.steps})


def advance(dag: CompiledDag, state: RunState) -> tuple[RunState, list[StepLaunch]]:
    """Launch every step that can start now; see the module docstring for the rules."""
    if state.outcome is not None:
        return state, []
    steps = dict(state.steps)
    launches: list[StepLaunch] = []
    views: dict[str, Any] | None = None
    for sid, step in dag.steps.items():
        if steps[sid].state != "pending" or not all(steps[d].settled for d in step.deps):
            continue
        if views is None:
            views = {other: _view(dag.steps[other], run) for other, run in steps.items()}
        run, launch = _start(dag, step, state, steps, views)
        steps[sid], views[sid] = run, _view(step, run)
        if launch is not None:
            launches.append(launch)
        if run.state in ("failed", "cancelled") and step.spec.on_error == "fail":
            launched = {launch.step_id for launch in launches}
            return _fail(replace(state, steps=steps), sid, run.error, also=launched), []
    if views is None:  # nothing could start: the same state, so a caller can tell nothing changed
        return state, []
    return replace(state, steps=steps), launches


def ready_steps(dag: CompiledDag, state: RunState) -> list[StepLaunch]:
    """The launches ``advance`` would make (without the state that records them)."""
    return advance(dag, state)[1]


def apply_result(
    dag: CompiledDag,
    state: RunState,
    step_id: str,
    index: int,
    record_state: str,
    output: Any = None,
    error: Mapping[str, Any] | None = None,
) -> RunState:
    """Record one job's terminal record (``record_state`` is a terminal ``JobState``; ``error`` its JobError as a
    dict). Unchanged for a duplicate or a step that has settled. ``advance`` afterwards launches what follows."""
    if step_id not in dag.steps:
        raise ValueError(f"DAG {dag.name!r} has no step {step_id!r}")
    if not JobState(record_state).terminal:
        raise ValueError(f"{record_state!r} is not a terminal job state")
    run = state.steps[step_id]
    if run.state == "running" and not 0 <= index < len(run.items):
        raise ValueError(f"step {step_id!r} has {len(run.items)} jobs, so no index {index}")
    if run.state != "running" or run.items[index] != "pending":
        return state
    succeeded = record_state == JobState.succeeded.value
    run = replace(
        run,
        items=_set(run.items, index, record_state),
        outputs=_set(run.outputs, index, output if succeeded else None),
        errors=_set(run.errors, index, None if succeeded else _job_error(record_state, error)),
    )
    if "pending" not in run.items:
        run = _settle(run)
    state = state.with_steps({step_id: run})
    if run.state in ("failed", "cancelled") and dag.steps[step_id].spec.on_error == "fail":
        return _fail(state, step_id, run.error)
    return state


def cancel(state: RunState, outcome: str = "cancelled", message: str = "the run was cancelled") -> RunState:
    """End a run that is not over as ``cancelled`` or ``expired``; its pending steps are never started."""
    if outcome not in ("cancelled", "expired"):
        raise ValueError(f"a run is ended as cancelled or expired, not {outcome!r}")
    if state.outcome is not None or all(run.settled for run in state.steps.values()):
        return state
    cancelled = {sid: StepRun("cancelled") for sid, run in state.steps.items() if run.state == "pending"}
    error = {"step": None, "type": outcome, "message": message}
    return replace(state.with_steps(cancelled), outcome=outcome, error=error)


def run_state(dag: CompiledDag, state: RunState) -> RunStatus:
    """Where the run stands; a run whose steps have all settled succeeds with its ``output`` evaluated."""
    if state.outcome is not None:
        return RunStatus(state.outcome, state.error)
    if not all(run.settled for run in state.steps.values()):
        return RunStatus("running")
    context = {"input": state.input, "steps": {sid: _view(dag.steps[sid], run) for sid, run in state.steps.items()}}
    try:
        return RunStatus("succeeded", output=render(dag.spec.output, context, dag.expressions, "output"))
    except ExpressionError as exc:
        return RunStatus("failed", {"step": None, "type": "dag_output", "message": exc.message})


def run_view(dag: CompiledDag, state: RunState) -> dict[str, Any]:
    """What ``GET /v1/runs/{id}`` shows (without timestamps, which live in the job records):
    ``{run_id, dag, state, error, output, steps: {<id>: {state, job_ids, error}}}``."""
    status = run_state(dag, state)
    steps = {
        sid: {
            "state": run.state,
            "job_ids": [job_id(state.run_id, sid, i, state.key) for i in range(len(run.items))],
            "error": run.error,
        }
        for sid, run in state.steps.items()
    }
    return {
        "run_id": state.run_id,
        "dag": state.dag,
        "state": status.state,
        "error": status.error,
        "output": status.output,
        "steps": steps,
    }


def context(dag: CompiledDag, state: RunState) -> dict[str, Any]:
    """The expression context of a run: ``{input, steps: {<id>: {state, output | outputs}}}``."""
    return {"input": state.input, "steps": {sid: _view(dag.steps[sid], run) for sid, run in state.steps.items()}}


def outstanding(dag: CompiledDag, state: RunState) -> list[StepLaunch]:
    """The launches of every running step's jobs that have no result yet, rendered again from the run's state.

    Publishing them again is harmless (job ids are deterministic, so the broker or the store drops a repeat) and
    repairs a launch whose publish was lost: a worker that stored the state recording a launch and died before it
    published leaves its message unacked, and its redelivery publishes what is outstanding.
    """
    if state.outcome is not None:
        return []
    views = {sid: _view(dag.steps[sid], run) for sid, run in state.steps.items()}
    ctx = {"input": state.input, "steps": views}
    launches = []
    for sid, run in state.steps.items():
        if run.state != "running":
            continue
        step = dag.steps[sid]
        try:
            items = _items(dag, step, ctx)
            jobs = tuple(
                JobLaunch(job_id(state.run_id, sid, i, state.key), i, item, _input(dag, step, ctx, i, item))
                for i, item in enumerate(items)
                if i < len(run.items) and run.items[i] == "pending"
            )
        except _LaunchError:  # rendered once already, so this cannot happen unless the spec changed under us
            continue
        if jobs:
            launches.append(StepLaunch(sid, step.spec.model, jobs, step.spec.timeout_s, step.spec.retries))
    return launches


# -- launching ------------------------------------------------------------------------------------------------
def _start(
    dag: CompiledDag, step: CompiledStep, state: RunState, steps: Mapping[str, StepRun], views: dict[str, Any]
) -> tuple[StepRun, StepLaunch | None]:
    skipped = {d for d in step.deps if steps[d].state == "skipped"}
    if skipped and not skipped <= step.when_reads_state:
        return StepRun("skipped"), None
    ctx = {"input": state.input, "steps": views}
    try:
        if step.spec.when is not None and not truthy(_search(dag, step.spec.when, ctx, "when")):
            return StepRun("skipped"), None
        items = _items(dag, step, ctx)
        inputs = _inputs(dag, step, ctx, items)
    except _LaunchError as exc:
        return StepRun("failed", error={"type": exc.kind, "message": exc.message}), None
    if not items:
        return StepRun("succeeded"), None
    key = state.key
    jobs = tuple(JobLaunch(job_id(state.run_id, step.id, i, key), i, item, inputs[i]) for i, item in enumerate(items))
    n = len(jobs)
    run = StepRun("running", ("pending",) * n, (None,) * n, (None,) * n)
    return run, StepLaunch(step.id, step.spec.model, jobs, step.spec.timeout_s, step.spec.retries)


class _LaunchError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _items(dag: CompiledDag, step: CompiledStep, ctx: Mapping[str, Any]) -> list[Any]:
    if step.spec.for_each is None:
        return [None]
    value = _search(dag, step.spec.for_each, ctx, "for_each")
    if not isinstance(value, list):
        kind = "null" if value is None else type(value).__name__
        raise _LaunchError("dag_for_each", f"for_each: {step.spec.for_each} gave {kind}, not a list")
    if len(value) > MAX_FAN_OUT:
        raise _LaunchError("dag_for_each", f"for_each gave {len(value)} items, over the limit of {MAX_FAN_OUT}")
    return value


def _inputs(dag: CompiledDag, step: CompiledStep, ctx: Mapping[str, Any], items: list[Any]) -> list[dict[str, Any]]:
    """Each item's input, together at most ``MAX_LAUNCH_BYTES`` of JSON (counted as they are rendered, so a step
    over it stops after about that many bytes, not after all of its items)."""
    inputs, size = [], 0
    for i, item in enumerate(items):
        value = _input(dag, step, ctx, i, item)
        size += _json_size(value)
        if size > MAX_LAUNCH_BYTES:
            raise _LaunchError(
                "dag_input",
                f"input: the step's jobs would carry over {MAX_LAUNCH_BYTES:,} bytes of input together "
                f"(MAX_LAUNCH_BYTES; over it at item {i} of {len(items)})",
            )
        inputs.append(value)
    return inputs


def _json_size(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:  # an integer past 64 bits, which orjson does not write
        return len(json.dumps(value))


def _input(dag: CompiledDag, step: CompiledStep, ctx: Mapping[str, Any], index: int, item: Any) -> dict[str, Any]:
    scope = {**ctx, "item": item, "index": index} if step.fan_out else ctx
    try:
        value = render(step.spec.input, scope, dag.expressions, "input")
    except ExpressionError as exc:
        raise _LaunchError("dag_input", exc.message) from None
    if not isinstance(value, dict):
        kind = "null" if value is None else type(value).__name__
        where = f" (item {index})" if step.fan_out else ""
        raise _LaunchError("dag_input", f"input{where} evaluated to {kind}, not an object")
    return value


def _search(dag: CompiledDag, source: str, ctx: Mapping[str, Any], name: str) -> Any:
    try:
        return dag.expressions[source].search(ctx)
    except ExpressionError as exc:
        raise _LaunchError(f"dag_{name}", f"{name}: {exc.message}") from None


def _view(step: CompiledStep, run: StepRun) -> dict[str, Any]:
    done = run.state in ("succeeded", "failed")
    if step.fan_out:
        return {"state": run.state, "outputs": list(run.outputs) if done else None}
    return {"state": run.state, "output": run.outputs[0] if done and run.outputs else None}


# -- settling -------------------------------------------------------------------------------------------------
def _settle(run: StepRun) -> StepRun:
    failed = [i for i, s in enumerate(run.items) if s in FAILED_ITEM_STATES]
    if failed:
        return replace(run, state="failed", error=_step_error(run, failed[0]))
    cancelled = [i for i, s in enumerate(run.items) if s == JobState.cancelled.value]
    if cancelled:
        return replace(run, state="cancelled", error=_step_error(run, cancelled[0]))
    return replace(run, state="succeeded")


def _step_error(run: StepRun, index: int) -> dict[str, Any]:
    error = dict(run.errors[index] or {"type": run.items[index], "message": f"the job ended {run.items[index]}"})
    return {**error, "index": index} if len(run.items) > 1 else error


def _fail(
    state: RunState, step_id: str, error: dict[str, Any] | None, also: AbstractSet[str] = frozenset()
) -> RunState:
    """The run fails (the first failure only); pending steps, and those launched in the same pass (never
    published), become cancelled."""
    if state.outcome is not None:
        return state
    stopped = {sid: StepRun("cancelled") for sid, run in state.steps.items() if run.state == "pending" or sid in also}
    message = (error or {}).get("message", "the step failed")
    run_error = {"step": step_id, "type": (error or {}).get("type", "failed"), "message": message}
    return replace(state.with_steps(stopped), outcome="failed", error=run_error)


def _job_error(record_state: str, error: Mapping[str, Any] | None) -> dict[str, Any]:
    if error is None:
        return {"type": record_state, "message": f"the job ended {record_state}"}
    return {"type": str(error.get("type", record_state)), "message": str(error.get("message", ""))}


def _set(values: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    copy = list(values)
    copy[index] = value
    return tuple(copy)
