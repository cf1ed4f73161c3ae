"""Runs started by publishing on ``fleet.req._dagrun``: good messages start runs (idempotently), hostile ones are
dead-lettered once each with the reason, and the starter keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.dags.starter import DAG_START_DLQ_MODEL, DagStarter
from fleet.schemas.wire import DeadLetter
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.infra import connected_pair, drain_subject, eventually, settings_for

HOSTILE = [
    b"not json at all",
    b"[" * 5000 + b"]" * 5000,
    b'{"dag": ' + b"9" * 5000 + b"}",
    b'{"dag": "nope-never-registered", "input": {}}',
    b'{"dag": 7, "input": {}}',
    b'{"dag": "D", "input": {}, "timeout_s": -1}',
    b'{"dag": "D", "input": {}, "run_id": "has.dots.not.allowed"}',
    b"\xff\xfe\x00",
]


@pytest.fixture(params=["memory", "nats+redis"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Broker, ResultStore]]:
    urls = {k: request.getfixturevalue(f"{k}_url") for k in ("nats", "redis") if k in request.param}
    async with connected_pair(settings_for(request.param, urls)) as infra:
        yield infra


async def test_hostile_start_messages_are_dead_lettered_and_good_ones_start_runs(pair, unique) -> None:
    broker, store = pair
    model = f"echo-{unique}"
    runner = DagRunner(broker, store, Stores.beside(store).dags, {model: with_name(EchoHandler, model).spec})
    dag = f"d-{unique}"
    spec = {
        "name": dag,
        "steps": [{"id": "a", "model": model, "input": {"x": "${input.x}"}}],
        "output": "${steps.a.output}",
    }
    await runner.register(spec)
    worker = Worker(with_name(EchoHandler, model)(), broker, store, settings=settings_for("memory", {}))
    worker.settler.on_settled.append(runner.on_settled)
    starter = DagStarter(runner, "test")
    await starter.start()
    try:
        async with worker:
            bodies = [body.replace(b'"D"', f'"{dag}"'.encode()) for body in HOSTILE]
            for body in bodies:
                await broker.publish(c.DAG_START_SUBJECT, body)
            good = f'{{"dag": "{dag}", "input": {{"x": 1}}, "run_id": "r{unique}"}}'.encode()
            await broker.publish(c.DAG_START_SUBJECT, good)
            await broker.publish(c.DAG_START_SUBJECT, good)  # the same run again: started once

            async def done() -> bool:
                doc = await runner.dags.get_run(f"r{unique}")
                return doc is not None and doc.get("finished_at") is not None

            await eventually(done, 30, "the published run to finish")
            view = await runner.view(f"r{unique}")
            letters = await drain_subject(broker, c.dlq_subject(DAG_START_DLQ_MODEL), f"dlq-{unique}", timeout_s=5)
    finally:
        await starter.stop()
    assert view["state"] == "succeeded" and view["output"] == {"x": 1}
    got = [DeadLetter.model_validate_json(d.data) for d in letters]
    raws = [x.raw for x in got]
    for body in bodies:  # each hostile message dead-lettered exactly once, with its body
        assert raws.count(body.decode("utf-8", "replace")) == 1, body[:60]
    mine = [x for x in got if x.raw in {b.decode("utf-8", "replace") for b in bodies}]
    assert all(x.error.type == "invalid_dag_start" and x.error.message for x in mine)
    assert any("nope-never-registered" in x.error.message for x in mine), "an unknown DAG is named"
