"""The cache store on memory and on real Redis (the same contract), the L1 TTL, and a Redis outage: a lookup that
cannot read L2 is a miss counted as an error, never an exception; an L3 index that cannot read its log keeps
answering from what it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from fleet.producers.gateway.cache.results import ResultCache, build_cache
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.models import ECHO
from fleet.settings import FleetSettings
from fleet.store.cachestore import CacheStore, MemoryCacheStore, RedisCacheStore, VectorEntry
from fleet.store.redis import RedisStore
from tests.cache_helpers import cache_count
from tests.gateway_helpers import private_server


@pytest.fixture(params=["memory", "redis"])
async def cache_store(request: pytest.FixtureRequest) -> AsyncIterator[CacheStore]:
    if request.param == "memory":
        yield MemoryCacheStore()
        return
    store = RedisStore(request.getfixturevalue("redis_url"), job_ttl_s=60)
    await store.connect()
    try:
        yield RedisCacheStore(store.redis, store.display_url)
    finally:
        await store.close()


async def test_entries_are_read_back_and_expire(cache_store: CacheStore, unique: str) -> None:
    await cache_store.put(f"fleet:cache:t:{unique}:a", b'{"output": 1}', 1)
    assert await cache_store.get(f"fleet:cache:t:{unique}:a") == b'{"output": 1}'
    assert await cache_store.get(f"fleet:cache:t:{unique}:none") is None
    await asyncio.sleep(1.2)
    assert await cache_store.get(f"fleet:cache:t:{unique}:a") is None


async def test_the_vector_log_is_read_from_a_position(cache_store: CacheStore, unique: str) -> None:
    log = f"fleet:cachevec:t:{unique}"
    for i in range(5):
        await cache_store.append_vector(log, VectorEntry(f"k{i}", f"text {i}", bytes([i]) * 8), 100, 60)
    first = await cache_store.read_vectors(log, "0", 3)
    assert [e.key for _, e in first] == ["k0", "k1", "k2"] and first[1][1].vector == bytes([1]) * 8
    rest = await cache_store.read_vectors(log, first[-1][0], 10)
    assert [e.key for _, e in rest] == ["k3", "k4"]
    assert await cache_store.read_vectors(log, rest[-1][0], 10) == []


def echo_cache(store: CacheStore, **settings: object) -> ResultCache:
    cache = build_cache(FleetSettings(cache="echo=l1+l2", **settings), {"echo": ECHO}, store)  # type: ignore[arg-type]
    assert cache is not None
    return cache


def succeeded(output: object) -> JobRecord:
    return JobRecord(job_id="j", model="echo", state=JobState.succeeded, output=output)


async def test_l1_entries_expire_after_their_ttl_and_only_successes_fill() -> None:
    cache = echo_cache(MemoryCacheStore(), cache_l1_ttl_s=0.3)
    found = await cache.lookup(ECHO, {"a": 1})
    assert found.hit is None
    await cache.fill(found, JobRecord(job_id="j", model="echo", state=JobState.failed))
    assert (await cache.lookup(ECHO, {"a": 1})).hit is None
    await cache.fill(found, succeeded({"a": 1}))
    hit = (await cache.lookup(ECHO, {"a": 1})).hit
    assert hit is not None and (hit.level, hit.output) == ("l1", {"a": 1})
    await asyncio.sleep(0.4)
    hit = (await cache.lookup(ECHO, {"a": 1})).hit
    assert hit is not None and hit.level == "l2"


@pytest.mark.services
async def test_a_redis_outage_is_a_miss_counted_as_an_error() -> None:
    with private_server("redis") as (url, proc):
        store = RedisStore(url, job_ttl_s=60, socket_timeout_s=0.5, connect_timeout_s=0.5)
        await store.connect()
        try:
            cache = echo_cache(RedisCacheStore(store.redis, store.display_url), cache_timeout_ms=300)
            found = await cache.lookup(ECHO, {"outage": True})
            await cache.fill(found, succeeded({"outage": True}))
            cache.l1.clear()
            assert (await cache.lookup(ECHO, {"outage": True})).hit is not None
            proc.terminate()
            proc.wait(10)
            cache.l1.clear()
            errors = cache_count("echo", "l2", "error")
            started = time.perf_counter()
            found = await cache.lookup(ECHO, {"outage": True})
            assert found.hit is None and cache_count("echo", "l2", "error") == errors + 1
            assert time.perf_counter() - started < 2
            await cache.fill(found, succeeded({"outage": True}))  # L2 write fails: no exception either
            assert (await cache.lookup(ECHO, {"outage": True})).hit is not None  # L1 still answers
        finally:
            await store.close()


async def test_an_l3_index_keeps_answering_while_its_log_cannot_be_read() -> None:
    from fleet.producers.gateway.cache.l3 import L3Options, SemanticLevel

    class Broken(MemoryCacheStore):
        async def read_vectors(self, log: str, after: str, limit: int) -> list[tuple[str, VectorEntry]]:
            raise TimeoutError("down")

    vector = np.ones(384, dtype=np.float32) / np.sqrt(384)
    level = SemanticLevel(Broken(), L3Options(384, 1000, 8, 0.05, 60, 0.1))
    level.serve("m", "1")
    await level.remember("m", "1", VectorEntry("k", "some text", vector.tobytes()), vector)
    await level.sync_once()  # fails, logged, no exception
    match = await level.match("m", "1", vector, "some text", 0.9)
    assert match is not None and match.key == "k"
