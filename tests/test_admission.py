"""``running`` means computing: a job waiting in a worker's buffer is not running, and expires there."""

from __future__ import annotations

import asyncio
import time

from fleet import constants as c
from schemas.jobs import JobState
from tests.infra import eventually, request_bytes, wait_terminal
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
