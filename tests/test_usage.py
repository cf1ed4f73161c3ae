"""Device-seconds and usage end to end: a real worker on memory and on NATS + Redis (and Redis Cluster) computes
weighed batches; each record's ``device_seconds`` is its cost's share of its batch, the records sum to the batches'
measured compute time (``fleet_worker_batch_seconds``), and the usage counts and ``fleet_device_seconds_total``
hold the same sums per tenant. A usage store that cannot be reached costs the batch's usage, never a job.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel, ConfigDict

from fleet import constants as c
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.models import ModelSpec
from fleet.settings import FleetSettings
from fleet.store.bundle import Stores
from fleet.store.redis import RedisStore
from fleet.store.usage import RedisUsageStore
from tests.gateway_helpers import urls_for
from tests.infra import CLUSTER_PAIR, connected_pair, eventually, request_bytes, settings_for, wait_terminal


class WeighedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: int


class WeighedOut(BaseModel):
    batch: int


class Weighed(ModelHandler[WeighedIn, WeighedOut]):
    """Costs ``weight``; a batch computes for 2 ms per unit of its weight; outputs the batch's number."""

    spec = ModelSpec("weighed", WeighedIn, WeighedOut, max_batch=6, max_wait_ms=30)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._batches = 0
        self._lock = threading.Lock()

    def cost(self, item: WeighedIn) -> int:
        return item.weight

    def predict(self, batch: list[WeighedIn]) -> list[WeighedOut | Exception]:
        with self._lock:
            self._batches += 1
            number = self._batches
        time.sleep(0.002 * sum(item.weight for item in batch))
        return [WeighedOut(batch=number) for _ in batch]


def batch_seconds(model: str) -> float:
    return REGISTRY.get_sample_value("fleet_worker_batch_seconds_sum", {"model": model}) or 0.0


def metric_device_seconds(model: str, version: str, tenant: str) -> float:
    labels = {"model": model, "version": version, "tenant": tenant}
    return REGISTRY.get_sample_value("fleet_device_seconds_total", labels) or 0.0


async def publish_weighed(broker: Any, model: str, unique: str, count: int) -> dict[str, tuple[int, str]]:
    """``count`` jobs of weights 1..5, alternately of two tenants: job id -> (weight, tenant)."""
    await broker.ensure_model(model)
    jobs = {f"{unique}-{i}": (1 + i % 5, f"t{i % 2}-{unique}") for i in range(count)}
    for job_id, (weight, tenant) in jobs.items():
        body = request_bytes(model, job_id, {"weight": weight}, tenant=tenant)
        await broker.publish(c.request_subject(model), body, msg_id=job_id)
    return jobs


def check_shares(records: dict[str, JobRecord], jobs: dict[str, tuple[int, str]]) -> None:
    """Within a batch, device-seconds per unit of cost are the same for every job."""
    per_batch: dict[int, list[float]] = defaultdict(list)
    for job_id, record in records.items():
        assert record.device_seconds is not None and record.device_seconds > 0, record
        per_batch[record.output["batch"]].append(record.device_seconds / jobs[job_id][0])
    assert len(per_batch) >= 2, "the jobs must come in several batches"
    for ratios in per_batch.values():
        assert max(ratios) == pytest.approx(min(ratios), rel=1e-9), ratios


@pytest.mark.parametrize("pair", ["memory", "nats+redis", CLUSTER_PAIR])
async def test_device_seconds_add_up_to_the_batches_time_in_records_usage_and_metrics(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    settings = settings_for(pair, urls_for(request, pair))
    model = f"weighed-{unique}"
    async with connected_pair(settings) as (broker, store):
        jobs = await publish_weighed(broker, model, unique, 30)
        handler = with_name(Weighed, model)()
        version = handler.spec.version
        started = time.time()
        async with Worker(handler, broker, store, settings=settings):
            records = await wait_terminal(store, list(jobs))
        assert {r.state for r in records.values()} == {JobState.succeeded}
        check_shares(records, jobs)
        measured = batch_seconds(model)
        assert measured > 0.002 * sum(w for w, _ in jobs.values())  # the sleeps: the histogram saw the compute
        total = sum(r.device_seconds or 0.0 for r in records.values())
        assert total == pytest.approx(measured, rel=1e-9)

        usage = await Stores.beside(store).usage.read(started - 1, time.time() + 1)
        mine = {key: count for key, count in usage.items() if key.model == model}
        assert {key.tenant for key in mine} == {f"t0-{unique}", f"t1-{unique}"}
        assert {(key.version, key.device) for key in mine} == {(version, "cpu")}
        for key, count in mine.items():
            own = [job_id for job_id, (_, tenant) in jobs.items() if tenant == key.tenant]
            assert count.jobs == len(own)
            assert count.items == sum(jobs[j][0] for j in own)
            assert count.device_seconds == pytest.approx(sum(records[j].device_seconds or 0 for j in own), rel=1e-9)
            assert metric_device_seconds(model, version, key.tenant) == pytest.approx(count.device_seconds, rel=1e-9)
        assert sum(count.device_seconds for count in mine.values()) == pytest.approx(measured, rel=1e-9)


async def test_a_usage_store_that_cannot_be_reached_costs_the_usage_not_the_jobs(unique: str) -> None:
    settings = FleetSettings(broker_url="memory://", store_url="memory://")
    model = f"weighed-{unique}"
    away = RedisStore("redis://127.0.0.1:1/0", job_ttl_s=60, connect_timeout_s=0.2, socket_timeout_s=0.2)
    failures = {"model": model}
    async with connected_pair(settings) as (broker, store):
        stores = dataclasses.replace(Stores.beside(store), usage=RedisUsageStore(away))
        jobs = await publish_weighed(broker, model, unique, 6)
        async with Worker(with_name(Weighed, model)(), broker, store, settings=settings, stores=stores):
            records = await wait_terminal(store, list(jobs))

            async def counted() -> bool:
                return (REGISTRY.get_sample_value("fleet_usage_write_failures_total", failures) or 0) >= 1

            await eventually(counted, what="the failed usage write counted")
        assert {r.state for r in records.values()} == {JobState.succeeded}
        assert all(r.device_seconds and r.device_seconds > 0 for r in records.values())
        assert await Stores.beside(store).usage.read(0, time.time() + 1) == {}  # the bundle's own store: untouched
    await away.close()
