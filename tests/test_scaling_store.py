"""The scaling store contract, run unchanged on Redis and on the in-memory store: the single-autoscaler lock,
decisions kept newest first and capped, statuses, and operator overrides."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from fleet.scaling import MemoryScalingStore, RedisScalingStore, ScalingStore, make_scaling_store
from fleet.schemas.scaling import DecisionRecord, ScalingOverrides, ScalingStatus
from fleet.settings import FleetSettings


@pytest.fixture(params=["redis", "memory"])
async def scaling(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[ScalingStore]:
    store: ScalingStore
    if request.param == "redis":
        # A lock of this test alone: tests share the session's Redis.
        store = RedisScalingStore(request.getfixturevalue("redis_url"), lock_key=f"fleet:scale:_lock-{unique}")
    else:
        store = MemoryScalingStore()
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def decision(model: str, n: int) -> DecisionRecord:
    return DecisionRecord(
        at=time.time(),
        model=model,
        current_replicas=n,
        desired_replicas=n + 1,
        replicas=n + 1,
        lag=10 * n,
        arrival_rate=1.5,
        throughput_per_replica=2.0,
        reason=f"decision {n}",
        changed=True,
    )


def status(model: str, replicas: int) -> ScalingStatus:
    return ScalingStatus(
        model=model,
        current_replicas=replicas,
        desired_replicas=replicas,
        lag=3,
        arrival_rate=0.5,
        min_replicas=1,
        max_replicas=4,
        paused=False,
        backend="dry-run",
        updated_at=time.time(),
    )


async def mine(store: ScalingStore, *models: str) -> dict[str, ScalingStatus]:
    """The statuses of this test's models (the Redis database is shared with other tests)."""
    return {s.model: s for s in await store.statuses() if s.model in models}


async def test_only_one_owner_holds_the_lock_and_only_it_renews_or_releases(scaling: ScalingStore) -> None:
    assert await scaling.acquire("a", ttl_s=5)
    assert not await scaling.acquire("b", ttl_s=5)
    assert await scaling.acquire("a", ttl_s=5), "the holder renews"
    await scaling.release("b")  # not the holder: nothing happens
    assert not await scaling.acquire("b", ttl_s=5)
    await scaling.release("a")
    assert await scaling.acquire("b", ttl_s=5)
    assert not await scaling.acquire("a", ttl_s=5)
    await scaling.release("b")


async def test_an_expired_lock_is_taken_over_and_the_old_owner_cannot_take_it_back(scaling: ScalingStore) -> None:
    assert await scaling.acquire("old", ttl_s=0.2)
    assert not await scaling.acquire("new", ttl_s=5)
    await asyncio.sleep(0.35)
    assert await scaling.acquire("new", ttl_s=5), "a lapsed lock is free"
    assert not await scaling.acquire("old", ttl_s=5), "the old owner cannot renew what it lost"
    await scaling.release("old")  # a late release must not free the successor's lock
    assert not await scaling.acquire("third", ttl_s=5)
    await scaling.release("new")


async def test_decisions_are_kept_newest_first_and_capped(scaling: ScalingStore, unique: str) -> None:
    model, other = f"m-{unique}", f"o-{unique}"
    for n in range(7):
        await scaling.record(decision(model, n), keep=5)
    await scaling.record(decision(other, 99))
    await scaling.put_status(status(model, 3))
    await scaling.put_status(status(other, 1))
    found = await mine(scaling, model, other)
    assert [d.reason for d in found[model].decisions] == [f"decision {n}" for n in (6, 5, 4, 3, 2)]
    assert found[model].decisions[0] == decision(model, 6).model_copy(update={"at": found[model].decisions[0].at})
    assert [d.reason for d in found[other].decisions] == ["decision 99"]


async def test_a_status_is_replaced_and_listed_by_model(scaling: ScalingStore, unique: str) -> None:
    first, second = f"a-{unique}", f"b-{unique}"
    await scaling.put_status(status(second, 2))
    await scaling.put_status(status(first, 1))
    await scaling.put_status(status(first, 5).model_copy(update={"decisions": [decision(first, 1)]}))
    found = await mine(scaling, first, second)
    assert list(found) == [first, second], "sorted by model"
    assert found[first].current_replicas == 5
    assert found[first].decisions == [], "decisions come from record(), not from the status"
    expected = status(second, 2).model_copy(update={"updated_at": found[second].updated_at})
    assert found[second] == expected


async def test_overrides_are_per_model_and_none_removes_one(scaling: ScalingStore, unique: str) -> None:
    model, other = f"m-{unique}", f"o-{unique}"
    assert await scaling.get_overrides(model) == ScalingOverrides()
    await scaling.set_overrides(model, ScalingOverrides(min_replicas=0, max_replicas=8, paused=True))
    await scaling.set_overrides(other, ScalingOverrides(paused=False))
    assert await scaling.get_overrides(model) == ScalingOverrides(min_replicas=0, max_replicas=8, paused=True)
    await scaling.set_overrides(model, ScalingOverrides(max_replicas=3))
    assert await scaling.get_overrides(model) == ScalingOverrides(max_replicas=3)
    assert await scaling.get_overrides(other) == ScalingOverrides(paused=False)


def test_the_scaling_store_follows_the_result_store_url(redis_url: str) -> None:
    assert isinstance(make_scaling_store(FleetSettings(store_url="memory://")), MemoryScalingStore)
    assert isinstance(make_scaling_store(FleetSettings(store_url=redis_url)), RedisScalingStore)
