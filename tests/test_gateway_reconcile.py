"""No orphaned ``queued`` record: a job whose gateway died between writing the record and publishing the request
is published by a reconcile sweep (of any gateway) once it is older than ``reconcile_after_s``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from fleet import constants as c
from fleet.producers.gateway.jobs.reconcile import Reconciler
from fleet.schemas.jobs import JobRecord, JobState, input_digest
from fleet.store.base import ResultStore
from fleet.store.redis import RedisStore
from tests import services
from tests.contract import store_fixtures
from tests.crashing_gateway import EXIT_CODE
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, asgi_gateway, model_refs, urls_for
from tests.infra import connected_pair, request_bytes, settings_for, wait_terminal
from tests.processes import ROOT, fleet_env, wait_http_ready
from tests.test_gateway import metric

store_kind = store_fixtures.store_kind
store_factory = store_fixtures.store_factory
store = store_fixtures.store

AFTER_S = 2.0  # reconcile_after_s of these tests (longer than FAST_LIMITS.publish_timeout_s)


def queued(job_id: str, model: str = "echo", expires_at: float | None = None) -> JobRecord:
    return JobRecord(job_id=job_id, model=model, state=JobState.queued, expires_at=expires_at)


def mine(claimed: list[tuple[str, bytes | None]], ids: set[str]) -> dict[str, bytes | None]:
    """The claimed entries of this test (a shared Redis may hold other tests' leftovers)."""
    return {job_id: message for job_id, message in claimed if job_id in ids}


# -- the store's unpublished marks (memory and Redis) --------------------------------------------------------
async def test_a_mark_is_claimed_once_per_interval_until_published(store: ResultStore) -> None:
    a, b, plain = (f"mark-{uuid.uuid4().hex}" for _ in range(3))
    assert await store.create(queued(a), b"message-a")
    assert await store.create(queued(b), b"message-b")
    assert await store.create(queued(plain))  # no message: nothing to reconcile
    assert not await store.create(queued(a), b"another"), "create stays write-once"
    assert mine(await store.claim_unpublished(5.0, 1000), {a, b}) == {}, "too young"
    await asyncio.sleep(0.3)
    assert mine(await store.claim_unpublished(0.2, 1000), {a, b, plain}) == {a: b"message-a", b: b"message-b"}
    assert mine(await store.claim_unpublished(0.2, 1000), {a, b}) == {}, "a claim restarts the clock"
    await store.published(a)
    await asyncio.sleep(0.3)
    assert mine(await store.claim_unpublished(0.2, 1000), {a, b}) == {b: b"message-b"}
    await store.delete(b)
    await asyncio.sleep(0.3)
    assert mine(await store.claim_unpublished(0.2, 1000), {a, b}) == {}
    assert await store.get(b) is None and (await store.get(a)) is not None


async def test_concurrent_claims_split_the_marks(store: ResultStore) -> None:
    ids = {f"split-{uuid.uuid4().hex}" for _ in range(30)}
    for job_id in ids:
        await store.create(queued(job_id), job_id.encode())
    await asyncio.sleep(0.3)
    first, second = await asyncio.gather(store.claim_unpublished(0.2, 20), store.claim_unpublished(0.2, 20))
    got_first, got_second = mine(first, ids), mine(second, ids)
    assert not set(got_first) & set(got_second)
    assert set(got_first) | set(got_second) == ids
    assert all(message == job_id.encode() for job_id, message in {**got_first, **got_second}.items())


async def test_redis_keeps_the_mark_in_a_sorted_set_and_a_lost_message_is_claimed_as_none(redis_url: str) -> None:
    redis_store = RedisStore(redis_url, job_ttl_s=60)
    await redis_store.connect()
    try:
        job_id = f"lost-{uuid.uuid4().hex}"
        await redis_store.create(queued(job_id), b"m")
        assert await redis_store.redis.zscore(c.PENDING_KEY, job_id) is not None
        assert await redis_store.redis.get(c.pending_message_key(job_id)) == b"m"
        assert 0 < await redis_store.redis.ttl(c.pending_message_key(job_id)) <= 60
        await redis_store.redis.delete(c.pending_message_key(job_id))  # as if its TTL had run out
        await asyncio.sleep(0.3)
        assert mine(await redis_store.claim_unpublished(0.2, 1000), {job_id}) == {job_id: None}
        await redis_store.published(job_id)
        assert await redis_store.redis.zscore(c.PENDING_KEY, job_id) is None
    finally:
        await redis_store.close()


# -- the sweep ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair", ["memory", "nats+redis"])
async def test_a_fresh_gateway_publishes_what_a_dead_one_left_unpublished(
    request: pytest.FixtureRequest, unique: str, pair: str
) -> None:
    """The record and its mark written as the gateway writes them, and never published (the gateway died)."""
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for(pair, urls_for(request, pair), models=refs, reconcile_after_s=AFTER_S)
    ok, late, lost = f"ok-{unique}", f"late-{unique}", f"lost-{unique}"
    async with connected_pair(settings) as (broker, jobs):
        await broker.ensure_model(echo)
        await jobs.create(queued(ok, echo), request_bytes(echo, ok, {"n": 1}))
        await jobs.create(queued(late, echo, expires_at=time.time() + 0.5), request_bytes(echo, late, {}))
        await jobs.create(queued(lost, echo), request_bytes(echo, lost, {}))
        if isinstance(jobs, RedisStore):  # Redis can lose the message (its key's TTL); the memory store cannot
            await jobs.redis.delete(c.pending_message_key(lost))
        written = time.monotonic()
        republished = metric("fleet_gateway_reconciled_total", model=echo, outcome="republished")
        async with ObservedWorker(broker, jobs, echo) as worker, asgi_gateway(settings, broker, jobs):
            records = await wait_terminal(jobs, [ok, late, lost], timeout_s=AFTER_S + 10)
            elapsed_s = time.monotonic() - written
        assert records[ok].state == JobState.succeeded and records[ok].output == {"n": 1}
        lost_runs = not isinstance(jobs, RedisStore)
        assert sorted(d.msg_id for d in worker.seen) == sorted([ok, *([lost] if lost_runs else [])])
        assert records[late].state == JobState.expired and records[late].error is not None
        assert "stopped before publishing" in records[late].error.message
        assert AFTER_S <= elapsed_s < AFTER_S + 8, elapsed_s
        now_republished = metric("fleet_gateway_reconciled_total", model=echo, outcome="republished")
        assert now_republished == republished + 1 + lost_runs
        if lost_runs:
            assert records[lost].state == JobState.succeeded
        else:
            assert records[lost].state == JobState.failed and records[lost].error is not None
            assert records[lost].error.type == "not_published" and records[lost].error.retriable
        assert mine(await jobs.claim_unpublished(0, 1000), {ok, late, lost}) == {}, "reconciled marks are cleared"


@pytest.mark.services
async def test_a_republish_of_a_job_the_broker_had_is_dropped(request: pytest.FixtureRequest, unique: str) -> None:
    """The gateway died after the publish but before clearing the mark: the sweep's publish is a duplicate."""
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for("nats+redis", urls_for(request, "nats+redis"), models=refs)
    job_id = f"dup-{unique}"
    async with connected_pair(settings) as (broker, jobs):
        await broker.ensure_model(echo)
        data = request_bytes(echo, job_id, {})
        await jobs.create(queued(job_id, echo), data)
        await broker.publish(c.request_subject(echo), data, msg_id=job_id)
        await asyncio.sleep(0.3)
        sweep = Reconciler(broker, jobs, FAST_LIMITS, after_s=0.2)
        assert await sweep.sweep() >= 1
        assert await broker.lag(c.request_subject(echo), c.consumer_name(echo)) == 1
        async with ObservedWorker(broker, jobs, echo) as worker:
            await wait_terminal(jobs, [job_id])
            await asyncio.sleep(0.5)
        assert [d.msg_id for d in worker.seen] == [job_id]


@pytest.mark.services
async def test_a_gateway_killed_between_record_and_publish(
    request: pytest.FixtureRequest, unique: str, tmp_path: Path
) -> None:
    """A real ``fleet gateway`` process dies (os._exit) after writing the record and before publishing; a fresh
    gateway's sweep gets the job run within reconcile_after_s (plus a sweep interval)."""
    refs, (echo,) = model_refs(unique, "echo")
    urls = urls_for(request, "nats+redis")
    port = services.free_port()
    env = fleet_env(FLEET_BROKER_URL=urls["nats"], FLEET_STORE_URL=urls["redis"], FLEET_MODELS=refs[0])
    env.update(FLEET_PORT=str(port), FLEET_LOG_LEVEL="WARNING")
    log = tmp_path / "gateway.log"
    job_id = f"killed-{unique}"
    with log.open("wb") as out:
        proc = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block; waiting is bounded below
            [sys.executable, "-m", "tests.crashing_gateway", "gateway"], env=env, stdout=out, stderr=out, cwd=ROOT
        )
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with pytest.raises(httpx.HTTPError):  # the connection drops: the process is gone
                await client.post("/v1/jobs", json={"model": echo, "input": {"k": "v"}, "job_id": job_id}, timeout=30)
        assert proc.wait(30) == EXIT_CODE, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    settings = settings_for("nats+redis", urls, models=refs, reconcile_after_s=AFTER_S)
    async with connected_pair(settings) as (broker, jobs):
        record = await jobs.get(job_id)
        assert record is not None and record.state == JobState.queued, "the dead gateway wrote the record"
        assert await broker.lag(c.request_subject(echo), c.consumer_name(echo)) == 0, "and published nothing"
        started = time.monotonic()
        async with ObservedWorker(broker, jobs, echo), asgi_gateway(settings, broker, jobs):
            done = (await wait_terminal(jobs, [job_id], timeout_s=AFTER_S + 10))[job_id]
        assert done.state == JobState.succeeded and done.output == {"k": "v"}
        assert time.monotonic() - started < AFTER_S + 8


async def test_a_client_resubmit_publishes_an_orphan_at_once_and_clears_its_mark(
    request: pytest.FixtureRequest, unique: str
) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for("memory", {}, models=refs)  # the sweep would only come after 30 s
    job_id = f"again-{unique}"
    async with connected_pair(settings) as (broker, jobs), asgi_gateway(settings, broker, jobs) as (_, client):
        record = queued(job_id, echo).model_copy(update={"input_digest": input_digest({"a": 1})})
        await jobs.create(record, request_bytes(echo, job_id, {"a": 1}))
        again = await client.post("/v1/jobs", json={"model": echo, "input": {"a": 1}, "job_id": job_id})
        assert again.status_code == 202 and again.json()["status"] == "queued"
        async with ObservedWorker(broker, jobs, echo):
            done = (await wait_terminal(jobs, [job_id]))[job_id]
        assert done.state == JobState.succeeded and done.output == {"a": 1}
        assert mine(await jobs.claim_unpublished(0, 1000), {job_id}) == {}
