"""The job index (``fleet.store.jobindex``) on every store: written where records are born, read newest first from
a position, per tenant and model, trimmed by age, with ties of one batch's ``created_at`` paged without loss."""

from __future__ import annotations

import time

from fleet import constants as c
from fleet.schemas.jobs import JobRecord, JobState
from fleet.store.base import Finish, ResultStore, Start
from fleet.store.jobindex import Position, Refreshes, Scope, index_keys
from fleet.store.redis import RedisStore
from tests.contract import store_fixtures
from tests.contract.store_fixtures import StoreFactory

# The shared fixtures, bound here so pytest finds them (one test per store kind).
store_kind = store_fixtures.store_kind
store_factory = store_fixtures.store_factory
store = store_fixtures.store


def _record(job_id: str, tenant: str, model: str = "embed", at: float | None = None) -> JobRecord:
    return JobRecord(job_id=job_id, model=model, state=JobState.queued, tenant=tenant, created_at=at or time.time())


async def _all(where: ResultStore, scope: Scope, count: int = 3, **bounds: float) -> list[str]:
    """Every id of ``scope``'s index, read ``count`` at a time."""
    out: list[Position] = []
    position = None
    while True:
        page = await where.index_page(scope, bounds.get("since"), bounds.get("until"), position, count)
        out += page
        if len(page) < count:
            return [p.job_id for p in out]
        position = page[-1]


async def test_created_records_are_indexed_per_tenant_and_model(store: ResultStore, unique: str) -> None:
    a, b = f"a{unique}", f"b{unique}"
    now = time.time()
    await store.create(_record(f"{unique}-1", a, at=now - 3), b"{}")
    await store.create(_record(f"{unique}-2", a, model="rank", at=now - 2))
    await store.create(_record(f"{unique}-3", b, at=now - 1), b"{}")
    assert await _all(store, Scope(a)) == [f"{unique}-2", f"{unique}-1"]
    assert await _all(store, Scope(a, "embed")) == [f"{unique}-1"]
    assert await _all(store, Scope(b)) == [f"{unique}-3"]
    everyone = await _all(store, Scope(None), count=500, since=now - 4)
    assert [i for i in everyone if i.startswith(unique)] == [f"{unique}-3", f"{unique}-2", f"{unique}-1"]
    # a record created terminal (a cache hit) is indexed too
    done = _record(f"{unique}-4", b, at=now - 0.5).model_copy(update={"state": JobState.succeeded})
    assert await store.create(done)
    assert await _all(store, Scope(b)) == [f"{unique}-4", f"{unique}-3"]
    # A create that loses (the id is used) adds nothing, not even for another tenant.
    assert not await store.create(_record(f"{unique}-1", b, at=now))
    assert await _all(store, Scope(b)) == [f"{unique}-4", f"{unique}-3"]


async def test_since_until_bound_the_scores(store: ResultStore, unique: str) -> None:
    t = f"t{unique}"
    now = time.time()
    for i in range(5):
        await store.create(_record(f"{unique}-{i}", t, at=now - 50 + i * 10))
    window = await _all(store, Scope(t), since=now - 40, until=now - 20)
    assert window == [f"{unique}-3", f"{unique}-2", f"{unique}-1"]


async def test_worker_created_records_are_indexed_and_ties_page_without_loss(store: ResultStore, unique: str) -> None:
    """A batch of jobs published straight to the topic: ``start_many`` creates their records with one
    ``created_at``, so the index holds ties; pages of 3 still return each exactly once."""
    t = f"t{unique}"
    ids = [f"{unique}-{i:02d}" for i in range(10)]
    starts = [Start(job_id=i, model="embed", worker_id="w", deliveries=1, unread=True, tenant=t) for i in ids]
    await store.start_many(starts)
    await store.finish_many([Finish(job_id=f"{unique}-x", state=JobState.failed, model="embed", tenant=t)])
    listed = await _all(store, Scope(t), count=3)
    assert sorted(listed) == sorted([*ids, f"{unique}-x"]) and len(listed) == len(set(listed))
    assert await _all(store, Scope(t, "embed"), count=4) == listed
    # the single forms too
    await store.start(f"{unique}-s", model="embed", worker_id="w", deliveries=1)
    assert f"{unique}-s" in await _all(store, Scope(c.DEFAULT_TENANT), count=500, since=time.time() - 5)


async def test_entries_older_than_the_ttl_are_trimmed_on_write(store_factory: StoreFactory, unique: str) -> None:
    short = await store_factory(job_ttl_s=30)
    t = f"t{unique}"
    await short.create(_record(f"{unique}-old", t, at=time.time() - 31))  # its entry is past the TTL
    await short.create(_record(f"{unique}-new", t))
    assert await _all(short, Scope(t)) == [f"{unique}-new"]


async def test_forget_removes_entries(store: ResultStore, unique: str) -> None:
    t = f"t{unique}"
    await store.create(_record(f"{unique}-1", t))
    page = await store.index_page(Scope(t), None, None, None, 10)
    await store.index_forget(Scope(t), page)
    assert await store.index_page(Scope(t), None, None, None, 10) == []


async def test_redis_index_keys_live_twice_the_ttl(redis_url: str, unique: str) -> None:
    short = RedisStore(redis_url, job_ttl_s=40)
    await short.connect()
    try:
        t = f"t{unique}"
        await short.create(_record(f"{unique}-1", t), b"{}")
        for key in index_keys(_record("x", t)):
            assert 60 < await short.redis.ttl(key) <= 80, key
    finally:
        await short.close()


def test_refreshes_are_due_once_per_quarter_ttl_per_key() -> None:
    refreshes = Refreshes(ttl_s=100)
    assert refreshes.due(["a", "b"], 1000.0)
    assert not refreshes.due(["a", "b"], 1024.0)
    assert refreshes.due(["a", "c"], 1024.0)  # c is new: all of them are refreshed
    assert not refreshes.due(["a"], 1048.0)
    assert refreshes.due(["b"], 1025.0 + 1) is True  # b's last refresh was at 1000
