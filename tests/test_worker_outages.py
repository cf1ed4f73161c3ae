"""Infrastructure failures are not job failures: a worker outlives an outage of its store or its broker.

Each test runs a real worker on NATS + Redis with ``max_deliveries=1``: if a single delivery that the outage cost
were counted as a run, its job would end ``failed``. The servers are this test's own, killed with SIGKILL and
restarted on the same port from their data (Redis from its append-only file, NATS from its JetStream directory).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet import constants as c
from fleet.brokers import make_broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from fleet.store import make_store
from tests.aof_redis import Restartable, restartable
from tests.handlers_for_tests import Items
from tests.infra import TEST_SETTINGS, eventually, request_bytes, wait_terminal


def outage_settings(broker_url: str, store_url: str) -> FleetSettings:
    values = {**TEST_SETTINGS, "broker_url": broker_url, "store_url": store_url, "max_deliveries": 1}
    return FleetSettings(**values)


async def _run_through_outage(settings: FleetSettings, server: Restartable, unique: str, jobs: int) -> list[str]:
    """Publish ``jobs`` slow-ish jobs, SIGKILL ``server`` while they run, restart it after 2 s; the states seen."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"items-{unique}"
    states: list[str] = []
    try:
        await broker.ensure_model(model)
        ids = [f"{unique}-{i}" for i in range(jobs)]
        for i, job_id in enumerate(ids):
            body = request_bytes(model, job_id, {"value": i, "sleep_ms": 20})
            await broker.publish(c.request_subject(model), body, msg_id=job_id)
        worker = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=4, max_wait_ms=5)
        async with worker:

            async def running() -> bool:
                return worker.stats.items >= 8

            await eventually(running, 30, "the first batches")
            server.kill()
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                states.append(worker.state)
                await asyncio.sleep(0.05)
            server.start()
            records = await wait_terminal(store, ids, timeout_s=60)
        wrong = {k: (r.state.value, r.error and r.error.message) for k, r in records.items() if r.state != "succeeded"}
        assert not wrong, f"healthy jobs that did not succeed through the outage: {wrong}"
        assert all(r.state is JobState.succeeded for r in records.values())
        assert worker.stats.items >= jobs
    finally:
        await store.close()
        await broker.close()
    return states


@pytest.mark.timeout(180)
async def test_a_redis_restart_mid_run_fails_no_job_and_the_worker_says_it_is_degraded(nats_url, unique) -> None:
    with restartable("redis") as server:
        states = await _run_through_outage(outage_settings(nats_url, server.url), server, unique, 80)
    assert "degraded" in states, f"the worker must say it is degraded while its store is away; saw {set(states)}"


@pytest.mark.timeout(180)
async def test_a_nats_restart_mid_run_fails_no_job(redis_url, unique) -> None:
    with restartable("nats") as server:
        await _run_through_outage(outage_settings(server.url, redis_url), server, unique, 80)


@pytest.mark.timeout(300)
async def test_a_kafka_restart_mid_run_fails_no_job(redis_url, unique) -> None:
    with restartable("kafka") as server:
        await _run_through_outage(outage_settings(server.url, redis_url), server, unique, 80)
