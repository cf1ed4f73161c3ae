"""The usage store's contract on memory, Redis and a Redis Cluster: counts added per batch sum per key over the
buckets a range overlaps, a range reads only its buckets, integers stay integers and seconds keep their decimals,
and the Redis hash of an hour expires (retention)."""

from __future__ import annotations

import time
import uuid

import pytest

from fleet import constants as c
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.redis import RedisStore
from fleet.store.usage import UsageCount, UsageKey
from tests.contract.store_fixtures import store, store_factory, store_kind  # noqa: F401

HOUR = c.USAGE_BUCKET_S


async def test_counts_sum_per_key_over_the_buckets_a_range_overlaps(store: ResultStore) -> None:  # noqa: F811
    usage = Stores.beside(store).usage
    unique = uuid.uuid4().hex[:8]
    base = (int(time.time() // HOUR) - 5) * HOUR  # an hour of its own in the past, far from other tests' counts
    a, b = UsageKey(f"t-{unique}", "m", "1", "cpu"), UsageKey(f"t-{unique}", "m", "2", "cuda")
    await usage.add({a: UsageCount(2, 7, 0.125), b: UsageCount(1, 1, 1e-6)}, now=base + 10)
    await usage.add({a: UsageCount(1, 3, 0.375)}, now=base + HOUR - 1)  # the same hour, another batch
    await usage.add({a: UsageCount(4, 4, 4.0)}, now=base + HOUR + 1)  # the next hour
    mine = lambda counts: {k: v for k, v in counts.items() if k.tenant == f"t-{unique}"}  # noqa: E731
    first = mine(await usage.read(base, base + HOUR))
    assert first == {a: UsageCount(3, 10, 0.5), b: UsageCount(1, 1, pytest.approx(1e-6))}
    assert isinstance(first[a].jobs, int) and isinstance(first[a].items, int)
    both = mine(await usage.read(base + HOUR - 1, base + HOUR + 2))  # overlaps both hours
    assert both[a] == UsageCount(7, 14, 4.5)
    assert mine(await usage.read(base + 2 * HOUR, base + 3 * HOUR)) == {}
    await usage.add({}, now=base)  # nothing to add: no call, no error


async def test_an_hour_of_counts_expires_after_the_retention_in_redis(redis_url: str) -> None:
    results = RedisStore(redis_url, job_ttl_s=60)
    await results.connect()
    try:
        bucket = int(time.time() // HOUR) - 7
        await Stores.beside(results).usage.add({UsageKey("t", "m", "1", "cpu"): UsageCount(1, 1, 1.0)}, bucket * HOUR)
        ttl = await results.redis.ttl(c.usage_key(bucket))
        assert c.USAGE_TTL_S - 60 < ttl <= c.USAGE_TTL_S
    finally:
        await results.close()
