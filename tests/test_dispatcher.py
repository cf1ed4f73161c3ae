"""The live dispatcher over the in-memory broker, NATS JetStream and Kafka (with Redis): direct assignment to
worker inboxes, idle tokens, reassignment when a worker goes, and what stays on the broker when no worker lives."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.dispatcher.http import create_status_app
from fleet.dispatcher.policies import make_policy
from fleet.dispatcher.service import Dispatcher
from fleet.schemas.jobs import JobState
from fleet.schemas.wire import DeadLetter
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items
from tests.infra import PAIRS, connected_pair, drain_subject, eventually, publish_requests, settings_for, wait_terminal


@pytest.fixture(params=PAIRS)
async def infra(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Broker, ResultStore, FleetSettings]]:
    pair: str = request.param
    urls = {kind: request.getfixturevalue(f"{kind}_url") for kind in ("nats", "kafka", "redis") if kind in pair}
    settings = settings_for(pair, urls)
    async with connected_pair(settings) as (broker, store):
        yield broker, store, settings


def dispatch_worker(broker: Broker, store: ResultStore, settings: FleetSettings, model: str, **kw: Any) -> Worker:
    handler = with_name(Items, model)()
    return Worker(handler, broker, store, settings=settings, routing="dispatch", max_batch=1, max_wait_ms=0, **kw)


@contextlib.asynccontextmanager
async def running(*parts: Worker | Dispatcher) -> AsyncIterator[None]:
    try:
        await asyncio.gather(*(p.start() for p in parts))
        yield
    finally:
        await asyncio.gather(*(p.stop() for p in parts), return_exceptions=True)


async def live_workers(dispatcher: Dispatcher, count: int) -> None:
    async def enough() -> bool:
        return len(dispatcher.state.live) >= count

    await eventually(enough, timeout_s=20, what=f"{count} live workers at the dispatcher")


async def test_requests_reach_workers_through_their_inboxes_and_idle_tokens(infra, unique) -> None:
    broker, store, settings = infra
    model = f"dsp-{unique}"
    workers = [dispatch_worker(broker, store, settings, model) for _ in range(2)]
    dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("jiq-amnesia"))
    async with running(dispatcher, *workers):
        await live_workers(dispatcher, 2)
        await eventually(lambda: _idle_tokens(dispatcher, 1), timeout_s=10, what="an idle announcement")
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 20} for i in range(24)], unique)
        records = await wait_terminal(store, ids, timeout_s=60)
        assert [records[j].output["value"] for j in ids] == [2 * i for i in range(24)]
        assert {records[j].worker_id for j in ids} == {w.worker_id for w in workers}, "both workers served"
        assert dispatcher.routes.get("idle", 0) > 0, f"idle tokens were used: {dispatcher.routes}"
        await eventually(lambda: _completed(dispatcher, 24), what="results seen by the dispatcher")
        await eventually(lambda: _lag_is(broker, model, 0), what="every request acked on the broker")
        status = dispatcher.status()
        assert status["policy"] == "jiq-amnesia" and status["outstanding"] == 0
        assert sum(w["assigned"] for w in status["workers"]) == 24
        assert sum(status["assignments"].values()) == 24


async def test_a_worker_that_goes_silent_has_its_work_reassigned(infra, unique) -> None:
    broker, store, settings = infra
    model = f"dsp-gone-{unique}"
    stuck = dispatch_worker(broker, store, settings, model)
    healthy = dispatch_worker(broker, store, settings, model)
    dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("round-robin"))
    async with running(dispatcher, stuck, healthy):
        await live_workers(dispatcher, 2)
        await _freeze(stuck)  # a hung or partitioned process: no heartbeats, no progress, nothing settled
        ids = await publish_requests(broker, model, [{"value": i} for i in range(10)], unique)
        records = await wait_terminal(store, ids, timeout_s=60)
        assert all(r.state is JobState.succeeded for r in records.values())
        assert {r.worker_id for r in records.values()} == {healthy.worker_id}
        assert dispatcher.routes.get("reassigned", 0) >= 1, dispatcher.routes
        assert not dispatcher.state.is_live(stuck.worker_id)
    if stuck._sub is not None:
        await stuck._sub.close()


async def test_requests_wait_on_the_broker_until_a_worker_is_live(infra, unique) -> None:
    broker, store, settings = infra
    model = f"dsp-wait-{unique}"
    dispatcher = Dispatcher(broker, store, model=model, settings=settings)
    async with running(dispatcher):
        ids = await publish_requests(broker, model, [{"value": i} for i in range(5)], unique)
        await asyncio.sleep(1.0)
        assert await broker.lag(c.request_subject(model), c.consumer_name(model)) == 5
        assert [await store.get(j) for j in ids] == [None] * 5, "nothing ran without a worker"
        async with running(dispatch_worker(broker, store, settings, model)):
            records = await wait_terminal(store, ids, timeout_s=60)
    assert all(r.state is JobState.succeeded for r in records.values())


async def test_a_message_without_a_job_id_is_dead_lettered_and_the_dispatcher_goes_on(infra, unique) -> None:
    broker, store, settings = infra
    model = f"dsp-bad-{unique}"
    dispatcher = Dispatcher(broker, store, model=model, settings=settings)
    async with running(dispatcher, dispatch_worker(broker, store, settings, model)):
        await live_workers(dispatcher, 1)
        await broker.publish(c.request_subject(model), b"not json at all")
        ids = await publish_requests(broker, model, [{"value": 7}, {"nope": True}], unique)
        records = await wait_terminal(store, ids, timeout_s=60)
        letters = [DeadLetter.model_validate_json(d.data) for d in await _dead_letters(broker, model, 2)]
    assert records[ids[0]].state is JobState.succeeded and records[ids[0]].output["value"] == 14
    assert records[ids[1]].state is JobState.failed and "input" in records[ids[1]].error.message
    raw = [letter for letter in letters if letter.job_id is None]
    assert raw and raw[0].raw == "not json at all" and "job id" in raw[0].error.message
    assert any(letter.job_id == ids[1] for letter in letters), "the invalid input is dead-lettered by the worker"


async def test_a_draining_worker_gets_no_new_work(infra, unique) -> None:
    broker, store, settings = infra
    model = f"dsp-drain-{unique}"
    leaving = dispatch_worker(broker, store, settings, model)
    staying = dispatch_worker(broker, store, settings, model)
    dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("round-robin"))
    async with running(dispatcher, staying):
        await leaving.start()
        await live_workers(dispatcher, 2)
        await leaving.stop()
        await eventually(lambda: _not_live(dispatcher, leaving.worker_id), what="the stopped worker dropped")
        ids = await publish_requests(broker, model, [{"value": i} for i in range(6)], unique)
        records = await wait_terminal(store, ids, timeout_s=60)
    assert {r.worker_id for r in records.values()} == {staying.worker_id}


async def test_status_endpoint_reports_idle_queues_routes_and_per_worker_load(unique) -> None:
    settings = FleetSettings(heartbeat_interval_s=0.2, ack_wait_s=2.0)
    async with connected_pair(settings) as (broker, store):
        model = f"dsp-status-{unique}"
        worker = dispatch_worker(broker, store, settings, model)
        dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("jiq-amnesia"))
        async with running(dispatcher, worker):
            await live_workers(dispatcher, 1)
            await eventually(lambda: _idle_tokens(dispatcher, 1), timeout_s=10, what="an idle announcement")
            ids = await publish_requests(broker, model, [{"value": i} for i in range(3)], unique)
            await wait_terminal(store, ids)
            await eventually(lambda: _completed(dispatcher, 3), what="results seen by the dispatcher")
            transport = httpx.ASGITransport(app=create_status_app([dispatcher]))
            async with httpx.AsyncClient(transport=transport, base_url="http://dispatcher") as client:
                status = (await client.get("/status")).json()
                metrics = (await client.get("/metrics")).text
    [one] = status
    assert one["model"] == model and one["completed"] == 3
    assert one["workers"][0]["worker_id"] == worker.worker_id and one["workers"][0]["completed"] == 3
    assert one["idle_share"] is not None and 0 < one["idle_share"] <= 1
    assert f'fleet_dispatcher_assignments_total{{dispatcher="{dispatcher.dispatcher_id}"' in metrics
    assert "fleet_dispatcher_idle_queue_length" in metrics


# -- helpers ----------------------------------------------------------------------------------------------------
async def _idle_tokens(dispatcher: Dispatcher, count: int) -> bool:
    return dispatcher.state.idle_length >= count


async def _completed(dispatcher: Dispatcher, count: int) -> bool:
    return dispatcher.completed >= count


async def _not_live(dispatcher: Dispatcher, worker_id: str) -> bool:
    return not dispatcher.state.is_live(worker_id)


async def _lag_is(broker: Broker, model: str, expected: int) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == expected


async def _freeze(worker: Worker) -> None:
    """Stop a worker's every task without any of its shutdown steps, as a hung process would look."""
    tasks = [worker._fetch_task, worker._compute_task, *worker._aux_tasks]
    if worker._announcer is not None:
        tasks += worker._announcer._tasks
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    _, still = await asyncio.wait(live, timeout=5)
    assert not still, f"worker tasks that outlived their cancellation: {[t.get_name() for t in still]}"
    worker._stopped = True  # its stop() must not say goodbye either


async def _dead_letters(broker: Broker, model: str, count: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(10):
        got += await drain_subject(broker, c.dlq_subject(model), "dlq-reader", timeout_s=2)
        if len(got) >= count:
            return got
    raise AssertionError(f"expected {count} dead letters, got {[json.loads(d.data) for d in got]}")


async def test_pathological_bodies_in_dispatch_routing_are_dead_lettered_and_good_jobs_still_run(infra, unique) -> None:
    """No body wedges the dispatcher: without a usable job id it dead-letters the message at once; a body with
    one reaches a worker, which dead-letters it with the parser's reason. The good jobs around them all run."""
    from tests.test_poison import PATHOLOGICAL, named

    broker, store, settings = infra
    model = f"dsp-{unique}"
    worker = dispatch_worker(broker, store, settings, model)
    dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("jiq-amnesia"))
    async with running(dispatcher, worker):
        await live_workers(dispatcher, 1)
        before = await publish_requests(broker, model, [{"value": i} for i in range(5)], f"{unique}-a")
        for body in PATHOLOGICAL.values():
            await broker.publish(c.request_subject(model), named(body, model))
        after = await publish_requests(broker, model, [{"value": i} for i in range(5)], f"{unique}-b")
        records = await wait_terminal(store, before + after, timeout_s=60)
        assert {r.state for r in records.values()} == {JobState.succeeded}
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-reader-{unique}", timeout_s=5)
    assert len(letters) == len(PATHOLOGICAL), [DeadLetter.model_validate_json(d.data).error.message for d in letters]
