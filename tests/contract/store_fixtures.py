"""Fixtures that run a test once per ``ResultStore`` implementation. Import them into a test module:

from tests.contract.store_fixtures import store, store_factory, store_kind  # noqa: F401
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from fleet.store.base import ResultStore
from fleet.store.memory import MemoryStore
from fleet.store.redis import RedisStore

STORE_KINDS = ["memory", "redis", "redis-cluster"]  # redis-cluster: 3 primaries (tests/services.py)

StoreFactory = Callable[..., Awaitable[ResultStore]]


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store_factory(store_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """``await store_factory(job_ttl_s=60)``: a connected store of this test's kind, closed after the test."""
    fixture = {"redis": "redis_url", "redis-cluster": "redis_cluster_url"}.get(store_kind)
    redis_url = str(request.getfixturevalue(fixture)) if fixture else ""
    made: list[ResultStore] = []

    async def make(job_ttl_s: int = 60) -> ResultStore:
        store: ResultStore
        if fixture:
            store = RedisStore(redis_url, job_ttl_s=job_ttl_s)
        else:
            store = MemoryStore(job_ttl_s=job_ttl_s)
        await store.connect()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
async def store(store_factory: StoreFactory) -> ResultStore:
    """A connected store of each kind with a 60 s record TTL."""
    return await store_factory()
