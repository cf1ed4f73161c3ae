"""Successors published before the run's document records their launch (``DagRunner(speculate=True)``, as
``fleet worker`` runs it), over memory, NATS + Redis and Kafka + Redis.

A settling worker publishes a chain's next job while the update that records its launch is still on its way, with
``dag.trigger`` naming the job it follows. These tests put such a job on the broker in the two situations where
that update did not happen first, as a settle racing a cancel or dying would leave it, and check the admission
check: a run that ended meanwhile does not compute it (its record is cancelled, its message acked); a run that is
still going records the launch from the trigger's stored result, and the job computes once.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from consumers.handlers import with_name
from dags.runner import DagRunner
from fleet import constants as c
from fleet.store.base import Finish
from schemas.jobs import JobState
from schemas.wire import DagContext, RequestMessage
from tests.dag_fixtures import fleet_fixture, infra_fixture, settings_fixture  # noqa: F401  (fixtures)
from tests.dagkit import DagFleet, all_job_ids, terminal_once
from tests.handlers_for_tests import Steps
from tests.infra import eventually


def key() -> str:
    return uuid.uuid4().hex[:12]


def chain(name: str, first_model: str, model: str, first: dict[str, Any]) -> dict[str, Any]:
    """first -> s2 -> s3, keyed ``<key>-s2`` / ``<key>-s3`` in ``Steps.runs``; ``first`` is the first input."""
    s2 = {"key": "${join('-', [input.key, 's2'])}", "after": "${steps.first.output.key}"}
    s3 = {"key": "${join('-', [input.key, 's3'])}", "x": "${steps.s2.output.key}"}
    return {
        "name": name,
        "steps": [
            {"id": "first", "model": first_model, "input": first},
            {"id": "s2", "model": model, "input": s2},
            {"id": "s3", "model": model, "input": s3},
        ],
        "output": "${steps.s3.output}",
    }


async def publish_early(fleet: DagFleet, run: str, name: str, version: int, payload: dict[str, Any]) -> str:
    """Publish ``<run>.s2.0`` as a settle of ``<run>.first.0`` publishes it early; its job id."""
    job_id = f"{run}.s2.0"
    ctx = DagContext(run=run, dag=name, version=version, step="s2", trigger=f"{run}.first.0")
    message = RequestMessage(job_id=job_id, model=fleet.model, input=payload, dag=ctx)
    await fleet.broker.publish(c.request_subject(fleet.model), message.model_dump_json().encode(), msg_id=job_id)
    return job_id


async def test_an_early_job_of_a_run_cancelled_before_its_launch_was_recorded_is_not_computed(
    fleet: DagFleet, unique: str
) -> None:
    k = key()
    first = {"key": "${input.key}", "sleep_ms": 1500}
    name, version, _ = await fleet.runner.register(chain(f"early-cancel-{unique}", fleet.model, fleet.model, first))
    _, doc = await fleet.runner.start(name, {"key": k})
    run = doc["run"]["run_id"]

    async def first_running() -> bool:
        record = await fleet.store.get(f"{run}.first.0")
        return record is not None and record.state is JobState.running

    await eventually(first_running, 15, "the first step running")
    await fleet.runner.cancel(run)
    # What a settle of the first step that raced the cancel would have published before its update lost.
    s2 = await publish_early(fleet, run, name, version, {"key": f"{k}-s2", "after": k})

    async def refused() -> bool:
        record = await fleet.store.get(s2)
        return record is not None and record.terminal

    await eventually(refused, 15, "the early job settled")
    record = await fleet.store.get(s2)
    assert record is not None and record.state is JobState.cancelled, record
    assert record.error is not None and "ended before step 's2' was launched" in record.error.message
    await asyncio.sleep(2.0)  # the first step finishes computing (its result loses to the cancel); nothing follows
    assert fleet.runs_of(f"{k}-s2") == 0 and fleet.runs_of(f"{k}-s3") == 0
    assert await fleet.store.get(f"{run}.s3.0") is None
    view = await fleet.runner.view(run)
    assert view["state"] == "cancelled" and view["steps"]["s2"]["state"] in ("pending", "cancelled"), view
    await terminal_once(fleet, [f"{run}.first.0", s2])


async def test_an_early_job_whose_trigger_died_before_recording_records_the_launch_and_runs_once(
    fleet: DagFleet, unique: str
) -> None:
    k = key()
    ghost = f"ghost-{unique}"  # no worker serves the first step: this test plays the worker that settled it
    models = {fleet.model: Steps.spec, ghost: with_name(Steps, ghost).spec}
    registrar = DagRunner(fleet.broker, fleet.store, fleet.dags, models)  # type: ignore[arg-type]
    await fleet.broker.ensure_model(ghost)
    name, version, _ = await registrar.register(
        chain(f"early-crash-{unique}", ghost, fleet.model, {"key": "${input.key}"})
    )
    _, doc = await fleet.runner.start(name, {"key": k})
    run = doc["run"]["run_id"]
    # The first step's result is stored, and its worker dies after publishing s2 early, before the run's update.
    first = Finish(f"{run}.first.0", JobState.succeeded, ghost, output={"key": k}, worker_id="gone")
    await fleet.store.finish_many([first])
    assert (await fleet.runner.get(run))["run"]["steps"]["s2"]["state"] == "pending"
    s2 = await publish_early(fleet, run, name, version, {"key": f"{k}-s2", "after": k})

    doc = await fleet.runner.wait(run, 20)
    view = await fleet.runner.view(run)
    assert view["state"] == "succeeded", view
    assert view["output"] == {"key": f"{k}-s3", "x": f"{k}-s2"}
    assert fleet.runs_of(f"{k}-s2") == 1 and fleet.runs_of(f"{k}-s3") == 1
    await terminal_once(fleet, [s2, f"{run}.s3.0"])
    assert set(all_job_ids(view)) == {f"{run}.first.0", s2, f"{run}.s3.0"}
