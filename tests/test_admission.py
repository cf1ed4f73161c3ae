"""``running`` means computing: a job waiting in a worker's buffer is not running, and expires there."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleet import constants as c
from fleet.producers.publish import publish_all
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.wire import RequestMessage
from tests.infra import drain_subject, eventually, request_bytes, wait_terminal
from tests.test_worker import infra, make_worker, settings  # noqa: F401  (fixtures: every broker/store pair)


async def test_a_job_waiting_behind_a_batch_is_not_running_and_expires_before_it_runs(infra, settings, unique) -> None:  # noqa: F811
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    slow, late, fine = f"{unique}-slow", f"{unique}-late", f"{unique}-fine"
    subject = c.request_subject(model)
    await broker.publish(subject, request_bytes(model, slow, {"value": 1, "sleep_ms": 2000}), msg_id=slow)
    async with make_worker(infra, settings, model, max_batch=1, max_wait_ms=0) as worker:

        async def computing() -> bool:
            return bool(worker.handler.calls)

        await eventually(computing, 10, "the first batch")
        # Published only once the slow job computes: a Kafka topic has no order across its partitions.
        deadline = time.time() + 1.0
        await broker.publish(subject, request_bytes(model, late, {"value": 2}, deadline=deadline), msg_id=late)
        await broker.publish(subject, request_bytes(model, fine, {"value": 3}, deadline=time.time() + 60), msg_id=fine)
        await asyncio.sleep(0.3)  # the worker has fetched (and admitted) the next batch by now
        waiting = await store.get(late)
        assert waiting is None or waiting.state is JobState.queued, "a job in the worker's buffer is not running"
        running = await store.get(slow)
        assert running is not None and running.state is JobState.running and running.started_at is not None
        records = await wait_terminal(store, [slow, late, fine], timeout_s=30)
    assert records[slow].state is JobState.succeeded
    assert records[late].state is JobState.expired and records[late].error is not None
    assert records[late].error.type == "expired"
    assert records[fine].state is JobState.succeeded
    assert [1] in worker.handler.calls and [2] not in worker.handler.calls, "an expired job must never compute"


def reads_of(store: Any) -> list[str]:
    """Spy on ``store.get_many`` (the admission read): the job ids it was asked for, in order."""
    read: list[str] = []
    get_many = store.get_many

    async def counting(job_ids: list[str]) -> Any:
        read.extend(job_ids)
        return await get_many(job_ids)

    store.get_many = counting
    return read


def items(model: str, unique: str, count: int, start: int = 0) -> list[RequestMessage]:
    return [RequestMessage(job_id=f"{unique}-{i}", model=model, input={"value": i}) for i in range(start, count)]


async def test_jobs_published_without_a_record_start_without_a_read_and_finish_once(infra, settings, unique) -> None:  # noqa: F811
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    read = reads_of(store)
    messages = items(model, unique, 40)
    await publish_all(broker, messages)  # fleet publish's path: it makes no record and says so
    async with make_worker(infra, settings, model, max_batch=16, max_wait_ms=20) as worker:
        records = await wait_terminal(store, [m.job_id for m in messages])
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert {r.deliveries for r in records.values()} == {1}
    assert sorted(v for batch in worker.handler.calls for v in batch) == list(range(40))
    assert read == [], "a first delivery published without a record is not read before its start"


async def test_a_finished_job_published_again_without_a_record_is_not_computed_again(infra, settings, unique) -> None:  # noqa: F811
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    (message,) = items(model, unique, 1)
    await publish_all(broker, [message])
    async with make_worker(infra, settings, model, max_wait_ms=0) as worker:
        first = (await wait_terminal(store, [message.job_id]))[message.job_id]
        # The same request again, past any de-duplication (no message id), still claiming it has no record.
        headers = {c.HEADER_JOB_ID: message.job_id, c.HEADER_RECORD: c.RECORD_NONE}
        await broker.publish(c.request_subject(model), message.model_dump_json().encode(), headers=headers)
        (marker,) = items(model, unique, 2, start=1)  # behind it: once this one is done, the copy was settled
        await publish_all(broker, [marker])
        await wait_terminal(store, [marker.job_id])
        await eventually(lambda: _lag_is_zero(broker, model), 10, "the copy settled")
    again = await store.get(message.job_id)
    assert again is not None and again.finished_at == first.finished_at and again.deliveries == 1
    assert [v for batch in worker.handler.calls for v in batch].count(0) == 1, "computed once, not again"


async def test_a_job_with_a_queued_record_published_as_recordless_runs_once_from_its_record(
    infra,  # noqa: F811
    settings,  # noqa: F811
    unique,
) -> None:
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    (message,) = items(model, unique, 1)
    queued = JobRecord(job_id=message.job_id, model=model, state=JobState.queued, created_at=time.time() - 30)
    assert await store.create(queued)
    await publish_all(broker, [message])  # a producer that says "no record" although there is one
    async with make_worker(infra, settings, model, max_wait_ms=0) as worker:
        record = (await wait_terminal(store, [message.job_id]))[message.job_id]
    assert record.state is JobState.succeeded and record.deliveries == 1
    assert record.created_at == queued.created_at, "the start found the record and moved it on, not a new one"
    assert worker.handler.calls == [[0]]


async def _lag_is_zero(broker: Any, model: str) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == 0


async def test_odd_record_headers_and_garbage_bodies_claiming_no_record_change_nothing(infra, settings, unique) -> None:  # noqa: F811
    """Only the exact value ``none`` skips the read; any other value is read as usual, and a body that is no
    request is dead-lettered whatever the header claims."""
    broker, store = infra
    model = f"items-{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    odd = ["NONE", "", "none-ish", "x" * 10_000, "nöne"]  # (NATS strips the spaces around a value)
    ids = [f"{unique}-odd-{i}" for i in range(len(odd))]
    for i, (job_id, value) in enumerate(zip(ids, odd, strict=True)):
        headers = {c.HEADER_RECORD: value}
        await broker.publish(subject, request_bytes(model, job_id, {"value": i}), msg_id=job_id, headers=headers)
    garbage = [b"{", b'{"job_id": "' + unique.encode() + b'-g", "model": 7}', b"\xff\xfe", b"[" * 5000]
    for n, body in enumerate(garbage):
        await broker.publish(subject, body, msg_id=f"{unique}-g{n}", headers={c.HEADER_RECORD: c.RECORD_NONE})
    read = reads_of(store)
    async with make_worker(infra, settings, model, max_batch=16, max_wait_ms=20):
        records = await wait_terminal(store, ids)
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-{unique}", timeout_s=10)
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert sorted(read) == sorted(ids), "every odd header value was read first, as without the header"
    assert len(letters) == len(garbage), "each garbage body was dead-lettered"
