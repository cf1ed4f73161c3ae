"""Bounded queues: beyond a model's ``FLEET_MAX_QUEUED`` the gateway answers 429 ``queue_full`` with Retry-After,
and on NATS the request stream itself refuses direct publishes beyond the bound."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import nats.js.errors
import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.errors import QueueFull
from fleet.producers.gateway.jobs.backlog import RETRY_AFTER_UNKNOWN_S, Backlog, retry_after_s
from fleet.producers.sdk import error_from_response
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from tests.gateway_helpers import WORKER_SETTINGS, asgi_gateway, error_of, model_refs, private_server
from tests.infra import connected_pair, eventually, request_bytes, settings_for
from tests.test_gateway import metric

BOUND = 5


def rejected(model: str, reason: str = "queue_full") -> float:
    return metric("fleet_gateway_rejected_total", model=model, reason=reason)


# -- the pure parts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("excess", "drain", "expected"),
    [(1, None, RETRY_AFTER_UNKNOWN_S), (1, 0.0, RETRY_AFTER_UNKNOWN_S), (1, 100.0, 1), (30, 2.0, 15), (10**6, 1.0, 60)],
)
def test_retry_after_is_the_time_to_drain_the_excess_within_bounds(
    excess: int, drain: float | None, expected: int
) -> None:
    assert retry_after_s(excess, drain) == expected


class FakeLag:
    """A broker whose lag the test sets; only ``lag`` is called by the backlog."""

    def __init__(self) -> None:
        self.value = 0
        self.reads = 0

    async def lag(self, subject: str, group: str) -> int:
        await asyncio.sleep(0)
        if subject != c.request_subject("m"):  # the high and low levels: empty
            return 0
        self.reads += 1
        return self.value


def backlog_of(lag: FakeLag, clock: list[float], bound: int = BOUND) -> Backlog:
    broker: Any = lag
    b: Broker = broker
    return Backlog(b, {"m": bound}, interval_s=3600, refresh_min_s=1.0, clock=lambda: clock[0])


async def test_admissions_count_on_top_of_a_stale_sample() -> None:
    lag, clock = FakeLag(), [100.0]
    backlog = backlog_of(lag, clock)
    await backlog.refresh("m")
    for _ in range(BOUND):  # the sample says 0 however many are admitted: each admission counts
        await backlog.reserve("m")
        backlog.published("m", ok=True)
    with pytest.raises(QueueFull) as full:
        await backlog.reserve("m")
    assert (full.value.limit, full.value.depth) == (BOUND, BOUND)
    assert lag.reads == 1, "a sample younger than refresh_min_s is trusted"
    clock[0] += 2.0  # the workers drained 3 of them meanwhile; a refusal reads the lag again first
    lag.value = 2
    await backlog.reserve("m")
    assert lag.reads == 2 and backlog.depth("m") == 3
    backlog.published("m", ok=False)  # a failed publish frees its slot
    assert backlog.depth("m") == 2


async def test_the_drain_rate_comes_from_successive_samples_and_own_accepts() -> None:
    lag, clock = FakeLag(), [0.0]
    backlog = backlog_of(lag, clock, bound=1000)
    lag.value = 100
    await backlog.refresh("m")
    assert backlog.drain_rate("m") is None
    for _ in range(20):  # 20 accepted between the reads; 100 + 20 - 40 = 80 finished in 10 s
        await backlog.reserve("m")
        backlog.published("m", ok=True)
    clock[0] = 10.0
    lag.value = 40
    await backlog.refresh("m")
    assert backlog.drain_rate("m") == pytest.approx(8.0)
    assert backlog.depth("m") == 40
    assert backlog.full("m", 1010).retry_after_s == 2  # 11 over the bound at 8/s


async def test_concurrent_refusals_share_one_read() -> None:
    lag, clock = FakeLag(), [0.0]
    backlog = backlog_of(lag, clock, bound=1)
    lag.value = 1
    await backlog.refresh("m")
    clock[0] = 5.0
    results = await asyncio.gather(*(backlog.reserve("m") for _ in range(50)), return_exceptions=True)
    assert all(isinstance(r, QueueFull) for r in results)
    assert lag.reads == 2


# -- through the gateway --------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def gateway(settings: FleetSettings) -> AsyncIterator[tuple[Broker, Any, httpx.AsyncClient]]:
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
        yield broker, store, client


async def burst(client: httpx.AsyncClient, model: str, count: int, prefix: str) -> list[httpx.Response]:
    async def one(i: int) -> httpx.Response:
        return await client.post("/v1/jobs", json={"model": model, "input": {}, "job_id": f"{prefix}-{i}"})

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def check_burst(store: Any, client: httpx.AsyncClient, model: str, prefix: str) -> list[httpx.Response]:
    before = rejected(model)
    responses = await burst(client, model, 20, prefix)
    accepted = [r for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 429]
    assert len(accepted) == BOUND and len(refused) == 20 - BOUND, [r.status_code for r in responses]
    for response in refused:
        error = error_of(response)
        assert error["type"] == "queue_full" and repr(model) in error["message"]
        assert error["details"]["model"] == model and error["details"]["limit"] == BOUND
        assert response.headers["retry-after"].isdigit() and 1 <= int(response.headers["retry-after"]) <= 60
    assert rejected(model) == before + len(refused)
    for i, response in enumerate(responses):  # a refused job leaves no record
        record = await store.get(f"{prefix}-{i}")
        assert (record is not None) == (response.status_code == 202)
    return responses


async def test_memory_bound_refuses_beyond_it_and_a_resubmit_still_answers(
    request: pytest.FixtureRequest, unique: str
) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = settings_for("memory", {}, models=refs, max_queued_per_model={sleep: BOUND})
    async with gateway(settings) as (_, store, client):
        responses = await check_burst(store, client, sleep, f"mem-{unique}")
        first = next(i for i, r in enumerate(responses) if r.status_code == 202)
        again = await client.post("/v1/jobs", json={"model": sleep, "input": {}, "job_id": f"mem-{unique}-{first}"})
        assert again.status_code == 202 and again.json()["status"] == "queued", "a resubmit creates nothing"


async def test_unbounded_model_accepts_a_burst(unique: str) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = settings_for("memory", {}, models=refs, max_queued=0)
    async with gateway(settings) as (_, _store, client):
        assert {r.status_code for r in await burst(client, sleep, 30, f"free-{unique}")} == {202}


@pytest.mark.services
async def test_nats_bound_in_the_gateway_and_in_the_stream(request: pytest.FixtureRequest, unique: str) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    redis_url = request.getfixturevalue("redis_url")
    with private_server("nats") as (nats_url, _):  # the stream-wide per-subject limit must not reach other tests
        urls = {"nats": nats_url, "redis": redis_url}
        settings = settings_for("nats+redis", urls, models=refs, max_queued=BOUND, lag_interval_s=3600)
        async with gateway(settings) as (broker, store, client):
            await check_burst(store, client, sleep, f"nats-{unique}")
            subject = c.request_subject(sleep)
            with pytest.raises(QueueFull) as full:  # Fleet's own publisher, straight to the subject
                await broker.publish(subject, request_bytes(sleep, "direct", {}), msg_id=f"direct-{unique}")
            assert full.value.model == sleep and full.value.limit == BOUND
            nc = await nats.connect(nats_url)  # and a raw JetStream client
            try:
                with pytest.raises(nats.js.errors.APIError) as raw:
                    await nc.jetstream().publish(subject, request_bytes(sleep, "raw", {}))
                assert raw.value.err_code == 10077, raw.value
                dup = await nc.jetstream().publish(subject, b"{}", headers={c.HEADER_MSG_ID: f"nats-{unique}-0"})
                assert dup.duplicate, "a duplicate of a stored message is still acknowledged as one"
            finally:
                await nc.close()


@pytest.mark.services
async def test_nats_refusal_beyond_the_gateway_sample_is_429_broker_full(
    request: pytest.FixtureRequest, unique: str
) -> None:
    """Direct publishers filled the subject after the gateway's last lag read: the broker refuses, the gateway
    answers the same 429 and leaves no record."""
    refs, (sleep,) = model_refs(unique, "sleep")
    redis_url = request.getfixturevalue("redis_url")
    with private_server("nats") as (nats_url, _):
        urls = {"nats": nats_url, "redis": redis_url}
        settings = settings_for("nats+redis", urls, models=refs, max_queued=BOUND, lag_interval_s=3600)
        async with gateway(settings) as (broker, store, client):
            for i in range(BOUND):
                await broker.publish(c.request_subject(sleep), request_bytes(sleep, f"d{i}", {}), msg_id=f"d{i}")
            before = rejected(sleep, "broker_full")
            job_id = f"late-{unique}"
            response = await client.post("/v1/jobs", json={"model": sleep, "input": {}, "job_id": job_id})
            assert response.status_code == 429, response.text
            assert error_of(response)["type"] == "queue_full" and response.headers["retry-after"].isdigit()
            assert rejected(sleep, "broker_full") == before + 1
            assert await store.get(job_id) is None
            refused = await client.post("/v1/jobs", json={"model": sleep, "input": {}})  # now from its own count
            assert refused.status_code == 429 and rejected(sleep, "broker_full") == before + 1


async def test_the_queue_takes_jobs_again_once_workers_drain_it(request: pytest.FixtureRequest, unique: str) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = settings_for("memory", {}, models=refs, max_queued_per_model={sleep: BOUND}, lag_interval_s=0.2)
    async with gateway(settings) as (broker, store, client):
        first = await burst(client, sleep, BOUND, f"a-{unique}")
        assert {r.status_code for r in first} == {202}
        assert (await client.post("/v1/jobs", json={"model": sleep, "input": {}})).status_code == 429
        worker = Worker(with_name(SleepHandler, sleep)(), broker, store, settings=WORKER_SETTINGS, worker_id="w")
        await worker.start()
        try:
            for r in first:
                record = await store.wait(r.json()["job_id"], 10)
                assert record is not None and record.state == JobState.succeeded

            async def admitted() -> bool:
                return (await client.post("/v1/jobs", json={"model": sleep, "input": {}})).status_code == 202

            await eventually(admitted, timeout_s=10, what="a submission admitted after the drain")
        finally:
            await worker.stop()


@pytest.mark.services
async def test_connecting_brings_an_existing_request_stream_to_the_bound(unique: str) -> None:
    with private_server("nats") as (nats_url, _):
        for bound, expected in [(0, (-1, "old", False)), (3, (3, "new", True)), (0, (-1, "old", False))]:
            settings = FleetSettings.model_validate({"broker_url": nats_url, "max_queued": bound})
            async with connected_pair(settings):
                nc = await nats.connect(nats_url)
                try:
                    config = (await nc.jetstream().stream_info(c.REQ_STREAM)).config
                finally:
                    await nc.close()
            discard = str(getattr(config.discard, "value", config.discard))
            assert (config.max_msgs_per_subject, discard, config.discard_new_per_subject) == expected


def test_the_broker_bound_is_the_largest_and_none_when_any_model_is_unbounded() -> None:
    assert FleetSettings(max_queued=10, max_queued_per_model={"a": 50, "b": 5}).broker_max_queued == 50
    assert FleetSettings(max_queued=10, max_queued_per_model={"a": 0}).broker_max_queued == 0
    assert FleetSettings(max_queued=0).broker_max_queued == 0
    settings = FleetSettings.model_validate({"max_queued_per_model": "sleep=50, embed=1000"})
    assert (settings.max_queued_for("sleep"), settings.max_queued_for("echo")) == (50, c.DEFAULT_MAX_QUEUED)
    with pytest.raises(ValueError, match="MODEL=COUNT"):
        FleetSettings.model_validate({"max_queued_per_model": "sleep"})


async def test_a_large_concurrent_burst_gets_exactly_the_bound(unique: str) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = settings_for("memory", {}, models=refs, max_queued_per_model={sleep: 50}, lag_interval_s=3600)
    async with gateway(settings) as (_, _store, client):
        codes = [r.status_code for r in await burst(client, sleep, 600, f"big-{unique}")]
    assert (codes.count(202), codes.count(429)) == (50, 550)


async def test_the_sdk_raises_queue_full_with_the_retry_hint(unique: str) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = settings_for("memory", {}, models=refs, max_queued_per_model={sleep: 1}, lag_interval_s=3600)
    async with gateway(settings) as (_, _store, client):
        assert (await client.post("/v1/jobs", json={"model": sleep, "input": {}})).status_code == 202
        refused = await client.post("/v1/jobs", json={"model": sleep, "input": {}})
    exc = error_from_response(refused.status_code, refused.json())
    assert isinstance(exc, QueueFull) and exc.retriable
    assert (exc.model, exc.limit, exc.depth) == (sleep, 1, 1)
    assert exc.retry_after_s == float(refused.headers["retry-after"])
