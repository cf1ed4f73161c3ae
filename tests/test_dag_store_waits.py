"""The DAG store's round trips, on real Redis and on the memory store where the contract is shared: a run created in
one script (idempotent, indexed once), the latest version read without the spec, and (Redis) a run's waiter that
needs no read after each change it is woken by, but never misses one (``PubSubMux.last_message``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleet import constants as c
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.dagstore import RunDoc
from tests.infra import connected_pair, settings_for


@pytest.fixture(params=["memory", "nats+redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResultStore]:
    urls = {k: request.getfixturevalue(f"{k}_url") for k in ("nats", "redis") if k in request.param}
    async with connected_pair(settings_for(request.param, urls)) as (_, connected):
        yield connected


@pytest.fixture
async def redis_store(nats_url: str, redis_url: str) -> AsyncIterator[ResultStore]:
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    async with connected_pair(settings) as (_, connected):
        yield connected


def doc(n: int) -> RunDoc:
    return {"run": {"run_id": "r", "n": n}, "version": 1, "created_at": 1.0, "deadline": None, "finished_at": None}


def bump(to: int) -> Any:
    return lambda current: {**current, "run": {**current["run"], "n": to}}


async def test_create_run_is_idempotent_and_indexes_a_new_run_once(store: ResultStore) -> None:
    dags = Stores.beside(store).dags
    run = uuid.uuid4().hex
    created, first = await dags.create_run(run, doc(1))
    again, second = await dags.create_run(run, doc(2))
    assert created and not again and first == second == doc(1)
    assert await dags.get_run(run) == doc(1)
    recent = [run_id for run_id, _ in await dags.recent_runs(c.DEFAULT_RECENT_RUNS_KEPT)]
    assert recent.count(run) == 1


async def test_latest_version_follows_registrations(store: ResultStore) -> None:
    dags = Stores.beside(store).dags
    name = f"d-{uuid.uuid4().hex[:10]}"
    assert await dags.latest_version(name) is None
    assert await dags.register(name, {"v": 1}) == 1
    assert await dags.register(name, {"v": 2}) == 2
    assert await dags.register(name, {"v": 1}) == 1  # the same spec again keeps its version
    assert await dags.latest_version(name) == 2


async def test_a_waiter_woken_by_a_change_waits_for_the_next_without_a_read_and_never_misses_one(
    redis_store: ResultStore,
) -> None:
    dags = Stores.beside(redis_store).dags
    run = uuid.uuid4().hex
    await dags.create_run(run, doc(0))
    channel = c.dag_events_channel(run)
    mux = redis_store.pubsub  # type: ignore[attr-defined]
    keeper = await mux.watch(channel, 5)  # a second client of the run keeps its channel subscribed throughout
    reads = 0
    inner_get = dags.get_run

    async def counted_get(run_id: str) -> RunDoc | None:
        nonlocal reads
        reads += 1
        return await inner_get(run_id)

    try:
        first = asyncio.create_task(dags.wait_change(run, doc(0), 5))
        await asyncio.sleep(0.1)
        _, doc1 = await dags.update_run(run, bump(1))
        seen = await asyncio.wait_for(first, 5)
        assert seen == doc1
        dags.get_run = counted_get  # type: ignore[method-assign]
        second = asyncio.create_task(dags.wait_change(run, seen, 5))
        await asyncio.sleep(0.1)
        assert not second.done() and reads == 0  # the mux saw nothing newer than what woke it: no read
        _, doc2 = await dags.update_run(run, bump(2))
        assert await asyncio.wait_for(second, 5) == doc2 and reads == 0
        # A change published while no wait was under way is not lost: the next wait reads it at once.
        _, doc3 = await dags.update_run(run, bump(3))
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(dags.wait_change(run, doc2, 5), 2) == doc3
        assert reads == 1
    finally:
        mux.release(channel, keeper)
