"""The worker over every broker/store pair: batching, isolation of bad items, dead letters, redelivery, drain."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.schemas.wire import DeadLetter, Heartbeat
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items
from tests.infra import (
    CLUSTER_PAIR,
    PAIRS,
    connected_pair,
    drain_subject,
    eventually,
    publish_requests,
    request_bytes,
    settings_for,
    wait_terminal,
)


def urls_for(request: pytest.FixtureRequest, pair: str) -> dict[str, str]:
    urls = {}
    for kind in pair.split("+"):
        if kind != "memory":
            urls[kind] = request.getfixturevalue(f"{kind}_url")
    return urls


@pytest.fixture(params=[*PAIRS, CLUSTER_PAIR])
def settings(request: pytest.FixtureRequest) -> FleetSettings:
    return settings_for(request.param, urls_for(request, request.param))


@pytest.fixture
async def infra(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as pair:
        yield pair


def make_worker(infra: tuple[Broker, ResultStore], settings: FleetSettings, name: str, **kw: Any) -> Worker:
    broker, store = infra
    handler = with_name(Items, name)()
    return Worker(handler, broker, store, settings=settings, **kw)


async def test_batches_are_computed_and_stored(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    ids = await publish_requests(broker, model, [{"value": i} for i in range(40)], unique)
    async with make_worker(infra, settings, model, max_batch=16, max_wait_ms=50) as worker:
        records = await wait_terminal(store, ids)
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(40)]
    assert all(r.worker_id == worker.worker_id and r.deliveries == 1 for r in records.values())
    assert max(r.output["batch_size"] for r in records.values()) > 1, "requests waiting together must share a batch"
    assert all(len(call) <= 16 for call in worker.handler.calls)


async def test_a_raising_item_is_isolated_and_dead_lettered(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    inputs = [{"value": i, "boom": i == 5} for i in range(12)]
    await broker.ensure_model(model)
    ids = await publish_requests(broker, model, inputs, unique)
    async with make_worker(infra, settings, model, max_batch=12, max_wait_ms=100) as worker:
        records = await wait_terminal(store, ids, timeout_s=30)
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-reader-{unique}")
    bad = records[ids[5]]
    assert bad.state is JobState.failed
    assert bad.error is not None and "boom" in bad.error.message
    assert bad.deliveries == settings.max_deliveries
    good = [records[j] for j in ids if j != ids[5]]
    assert all(r.state is JobState.succeeded for r in good)
    assert all(r.deliveries == 1 for r in good), "good items must not be retried because of a neighbour"
    assert [json.loads(d.data)["job_id"] for d in letters] == [ids[5]]
    letter = DeadLetter.model_validate_json(letters[0].data)
    assert letter.deliveries == settings.max_deliveries and letter.request and letter.request["input"]["boom"]
    assert worker.handler.predicted.count(5) >= settings.max_deliveries


async def test_an_item_returned_as_exception_fails_alone(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    ids = await publish_requests(broker, model, [{"value": i, "bad": i == 1} for i in range(4)], unique)
    async with make_worker(infra, settings, model, max_batch=4, max_wait_ms=100):
        records = await wait_terminal(store, ids, timeout_s=30)
    assert records[ids[1]].state is JobState.failed
    assert "item 1 is bad" in records[ids[1]].error.message
    assert [records[j].state for j in (ids[0], ids[2], ids[3])] == [JobState.succeeded] * 3


async def test_poison_messages_are_dead_lettered_and_the_worker_keeps_serving(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    await broker.publish(subject, b"\xff not json", msg_id=f"{unique}-raw")
    await broker.publish(subject, json.dumps({"job_id": f"{unique}-schema", "model": model}).encode())
    await broker.publish(subject, request_bytes(model, f"{unique}-input", {"value": "many"}))
    await broker.publish(subject, request_bytes("other", f"{unique}-wrong-model", {"value": 1}))
    ids = await publish_requests(broker, model, [{"value": 7}], unique)
    async with make_worker(infra, settings, model):
        ok = await wait_terminal(store, ids)
        bad = await wait_terminal(store, [f"{unique}-schema", f"{unique}-input", f"{unique}-wrong-model"])
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-reader-{unique}")
    assert ok[ids[0]].output["value"] == 14
    assert "input: Field required" in bad[f"{unique}-schema"].error.message
    assert "input.value" in bad[f"{unique}-input"].error.message
    assert "'other'" in bad[f"{unique}-wrong-model"].error.message
    assert all(r.state is JobState.failed and r.error.type == "invalid_request" for r in bad.values())
    dead = [DeadLetter.model_validate_json(d.data) for d in letters]
    assert len(dead) == 4
    raw = [d for d in dead if d.raw is not None]
    assert len(raw) == 1 and "not valid UTF-8 JSON" in raw[0].error.message


async def test_a_terminal_job_is_acked_without_recomputing(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    job_id = f"{unique}-done"
    await store.finish(job_id, JobState.succeeded, model=model, output={"value": 99, "batch_size": 1})
    await broker.publish(c.request_subject(model), request_bytes(model, job_id, {"value": 1}))
    ids = await publish_requests(broker, model, [{"value": 3}], unique)
    async with make_worker(infra, settings, model) as worker:
        await wait_terminal(store, ids)
        await eventually(lambda: _lag_is(broker, model, 0), what="all messages acked")
    assert 1 not in worker.handler.predicted
    record = await store.get(job_id)
    assert record is not None and record.output["value"] == 99


async def _lag_is(broker: Broker, model: str, expected: int) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == expected


async def test_expired_and_cancelled_jobs_do_not_run(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    expired, cancelled = f"{unique}-late", f"{unique}-cancel"
    await broker.publish(c.request_subject(model), request_bytes(model, expired, {"value": 1}, deadline=1.0))
    await store.create(JobRecord(job_id=cancelled, model=model, state=JobState.queued))
    await store.finish(cancelled, JobState.cancelled, model=model)
    await broker.publish(c.request_subject(model), request_bytes(model, cancelled, {"value": 2}))
    async with make_worker(infra, settings, model) as worker:
        records = await wait_terminal(store, [expired, cancelled])
        await eventually(lambda: _lag_is(broker, model, 0), what="all messages acked")
    assert records[expired].state is JobState.expired
    assert records[cancelled].state is JobState.cancelled
    assert worker.handler.predicted == []


async def test_drain_finishes_in_flight_work_and_hands_back_the_rest(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 150} for i in range(8)], unique)
    worker = make_worker(infra, settings, model, max_batch=2, max_wait_ms=0)
    await worker.start()
    await eventually(lambda: _started(worker), what="first batch running")
    await worker.stop(drain_timeout_s=5)
    done = [r for r in [await store.get(j) for j in ids] if r is not None and r.terminal]
    assert 1 <= len(done) < len(ids), "the in-flight batch finishes, the rest is left for redelivery"
    assert all(r.state is JobState.succeeded for r in done)
    async with make_worker(infra, settings, model, max_batch=8) as second:
        records = await wait_terminal(store, ids, timeout_s=30)
    assert all(r.state is JobState.succeeded for r in records.values())
    assert set(worker.handler.predicted).isdisjoint(second.handler.predicted) or settings.broker_scheme == "memory"
    assert sorted(worker.handler.predicted + second.handler.predicted) == list(range(8))


async def _started(worker: Worker) -> bool:
    return bool(worker.handler.calls)


async def test_heartbeats_report_the_worker(infra, settings, unique) -> None:
    broker, store = infra
    model = f"items-{unique}"
    events = await broker.listen(f"{c.HEARTBEAT_PREFIX}.*")
    seen: list[Heartbeat] = []

    async def collect() -> None:
        async for _subject, data in events:
            seen.append(Heartbeat.model_validate_json(data))

    task = asyncio.create_task(collect())
    try:
        ids = await publish_requests(broker, model, [{"value": 1}, {"value": 2}], unique)
        async with make_worker(infra, settings, model) as worker:
            await wait_terminal(store, ids)
            await eventually(lambda: _has_items(seen, worker.worker_id), what="a heartbeat with counts")
        await eventually(lambda: _has_stopped(seen, worker.worker_id), what="the last heartbeat: stopped")
    finally:
        task.cancel()
        await events.close()
    mine = [h for h in seen if h.worker_id == worker.worker_id]
    assert mine[-1].state == "stopped"
    assert max(h.items for h in mine) == 2 and mine[-1].max_batch == worker.max_batch and mine[-1].model == model


async def _has_items(seen: list[Heartbeat], worker_id: str) -> bool:
    return any(h.worker_id == worker_id and h.items == 2 for h in seen)


async def _has_stopped(seen: list[Heartbeat], worker_id: str) -> bool:
    return any(h.worker_id == worker_id and h.state == "stopped" for h in seen)


async def test_a_redelivered_failed_job_sends_its_dead_letter_once(infra, settings, unique) -> None:
    """A worker died between storing 'failed' and publishing the dead letter: the redelivery completes it."""
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    job_id = f"{unique}-failed"
    error = JobError(type="model_error", message="boom, earlier")
    await store.finish(job_id, JobState.failed, model=model, error=error)
    for _ in range(2):  # the same message twice: two redeliveries, one dead letter
        await broker.publish(c.request_subject(model), request_bytes(model, job_id, {"value": 1}))
    async with make_worker(infra, settings, model) as worker:
        await eventually(lambda: _lag_is(broker, model, 0), what="the message settled")
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-reader-{unique}")
    assert worker.handler.predicted == [], "a terminal job is never recomputed"
    assert [DeadLetter.model_validate_json(d.data).error.message for d in letters] == ["boom, earlier"]
    record = await store.get(job_id)
    assert record is not None and record.state is JobState.failed
