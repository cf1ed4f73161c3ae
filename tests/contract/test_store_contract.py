"""The ``ResultStore`` contract (``fleet/store/base.py``), run unchanged on the in-memory store and on Redis,
followed by the Redis store's own promises: TTL on the key, one shared pub/sub connection, recovery when that
connection drops, and readable errors when Redis is down."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from fleet import constants as c
from fleet.encoding import decode_vector, encode_vector
from fleet.errors import ConfigError, StoreError
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store import make_store, transitions
from fleet.store.base import Finish, ResultStore, Start
from fleet.store.memory import MemoryStore
from fleet.store.redis import RedisStore
from tests import services
from tests.aof_redis import AofRedis, aof_redis
from tests.contract import store_fixtures
from tests.contract.store_fixtures import STORE_KINDS, StoreFactory

# The shared fixtures, bound here so pytest finds them (one test per store kind).
store_kind = store_fixtures.store_kind
store_factory = store_fixtures.store_factory
store = store_fixtures.store


def new_id() -> str:
    return f"test-{uuid.uuid4().hex}"


def queued(job_id: str, **fields: object) -> JobRecord:
    return JobRecord.model_validate({"job_id": job_id, "model": "echo", "state": "queued", **fields})


async def succeed(store: ResultStore, job_id: str, output: object = "done") -> tuple[bool, JobRecord]:
    return await store.finish(job_id, JobState.succeeded, model="echo", output=output, worker_id="w1")


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# -- create / get / delete -------------------------------------------------------------------------------------


async def test_create_is_idempotent_and_does_not_overwrite(store: ResultStore) -> None:
    job_id = new_id()
    assert await store.create(queued(job_id, output="first")) is True
    assert await store.create(queued(job_id, output="second")) is False
    record = await store.get(job_id)
    assert record is not None
    assert record.output == "first"
    assert record.state is JobState.queued


async def test_a_terminal_record_created_at_once_wakes_its_waiters_and_is_created_once(store: ResultStore) -> None:
    """A cache hit is a job that is created finished: one write, announced like a finish."""
    job_id = new_id()
    waiter = asyncio.create_task(store.wait(job_id, 5))
    await asyncio.sleep(0.1)  # the waiter is waiting for a job that does not exist yet
    answered = transitions.finished(
        queued(job_id), job_id, JobState.succeeded, model="echo", output="cached", error=None, worker_id=None, now=1.0
    )
    assert await store.create(answered) is True
    woken = await waiter
    assert woken is not None and woken.state == JobState.succeeded and woken.output == "cached"
    assert await store.create(answered) is False, "a job id is created once"
    assert (await store.get(job_id)) == woken
    assert job_id not in dict(await store.claim_unpublished(0.0, 100)), "nothing to publish: it is answered"


async def test_get_unknown_job_returns_none(store: ResultStore) -> None:
    assert await store.get(new_id()) is None


async def test_record_round_trips_exactly(store: ResultStore) -> None:
    job_id = new_id()
    output = {"empty": {}, "list": [], "x": 0.1 + 0.2, "big": 2**60, "text": "ünï"}
    original = queued(job_id, expires_at=1234567890.123456)
    await store.create(original)
    assert await store.get(job_id) == original
    _, done = await succeed(store, job_id, output)
    stored = await store.get(job_id)
    assert stored == done
    assert stored is not None and stored.output == output


async def test_base64_vectors_are_stored_as_their_bytes_and_read_back_as_the_same_text(store: ResultStore) -> None:
    one, other = encode_vector([0.25] * 384), encode_vector(np.arange(8, dtype=np.float32))
    output = {"dim": 384, "embedding": one, "embeddings": [other, one], "mixed": [other, "AAAAAA=="], "n": None}
    job_id, later = new_id(), new_id()
    waiter = asyncio.create_task(store.wait(job_id, 5))
    await asyncio.sleep(0.05)
    won, done = await succeed(store, job_id, output)
    assert won
    expected = {**output, "embedding": str(one), "embeddings": [str(other), str(one)]}
    for read in (await store.get(job_id), (await store.get_many([job_id]))[0], await waiter):
        assert read == done and read is not None and read.output == expected
        assert decode_vector(read.output["embedding"]) == [0.25] * 384
    lost, current = await store.finish(job_id, JobState.failed, model="echo", error=JobError(type="x", message="y"))
    assert not lost and current == done  # a lost race reads the packed winner back
    await store.finish_many([Finish(later, JobState.succeeded, "echo", output={"embeddings": [one] * 3})])
    stored = await store.get(later)
    assert stored is not None and stored.output == {"embeddings": [str(one)] * 3}
    if isinstance(store, RedisStore):  # the bytes themselves: 384 float32 values in 1,536 bytes, not 2,048 of text
        raw = await store.redis.get(c.job_key(later))
        assert raw[:1] == b"\x00" and 3 * 1536 < len(raw) < 3 * 2048, len(raw)


async def test_delete_removes_the_record(store: ResultStore) -> None:
    job_id = new_id()
    await store.create(queued(job_id))
    await store.delete(job_id)
    assert await store.get(job_id) is None
    await store.delete(job_id)  # deleting twice is fine
    assert await store.create(queued(job_id)) is True


async def test_record_expires_after_its_ttl(store_factory: StoreFactory) -> None:
    short = await store_factory(job_ttl_s=1)
    job_id = new_id()
    await short.create(queued(job_id))
    assert await short.get(job_id) is not None
    await asyncio.sleep(1.3)
    assert await short.get(job_id) is None
    assert await short.create(queued(job_id)) is True


# -- start ------------------------------------------------------------------------------------------------------


async def test_start_on_absent_job_creates_running_record(store: ResultStore) -> None:
    job_id = new_id()
    before = time.time()
    record = await store.start(job_id, model="echo", worker_id="w1", deliveries=1)
    assert record.state is JobState.running
    assert (record.job_id, record.model, record.worker_id, record.deliveries) == (job_id, "echo", "w1", 1)
    assert record.started_at is not None and record.started_at >= before
    assert await store.get(job_id) == record


async def test_start_moves_queued_to_running_and_keeps_first_start_time(store: ResultStore) -> None:
    job_id = new_id()
    original = queued(job_id, expires_at=99.0)
    await store.create(original)
    first = await store.start(job_id, model="echo", worker_id="w1", deliveries=1)
    assert first.state is JobState.running
    assert (first.created_at, first.expires_at) == (original.created_at, 99.0)
    second = await store.start(job_id, model="echo", worker_id="w2", deliveries=2)
    assert second.state is JobState.running
    assert (second.worker_id, second.deliveries, second.started_at) == ("w2", 2, first.started_at)
    assert await store.get(job_id) == second


async def test_start_leaves_a_terminal_job_untouched(store: ResultStore) -> None:
    job_id = new_id()
    await store.create(queued(job_id))
    _, done = await succeed(store, job_id)
    after = await store.start(job_id, model="echo", worker_id="w9", deliveries=7)
    assert after == done
    assert await store.get(job_id) == done


# -- finish -----------------------------------------------------------------------------------------------------


async def test_finish_first_of_many_concurrent_writers_wins(store: ResultStore) -> None:
    job_id = new_id()
    await store.create(queued(job_id))
    await store.start(job_id, model="echo", worker_id="w0", deliveries=1)
    results = await asyncio.gather(*(succeed(store, job_id, output=i) for i in range(50)))
    winners = [record for won, record in results if won]
    assert len(winners) == 1
    winner = winners[0]
    assert all(record == winner for _, record in results)  # losers see the winner's record
    assert await store.get(job_id) == winner
    won, current = await store.finish(
        job_id, JobState.failed, model="echo", error=JobError(type="model_error", message="late")
    )
    assert (won, current) == (False, winner)
    assert await store.get(job_id) == winner


async def test_finish_keeps_the_records_history(store: ResultStore) -> None:
    job_id = new_id()
    original = queued(job_id)
    await store.create(original)
    started = await store.start(job_id, model="echo", worker_id="w1", deliveries=3)
    won, done = await store.finish(
        job_id, JobState.failed, model="echo", error=JobError(type="model_error", message="boom")
    )
    assert won is True
    assert done.state is JobState.failed
    assert done.error == JobError(type="model_error", message="boom")
    assert (done.created_at, done.started_at, done.deliveries, done.worker_id) == (
        original.created_at,
        started.started_at,
        3,
        "w1",
    )
    assert done.finished_at is not None and done.started_at is not None and done.finished_at >= done.started_at


async def test_finish_on_absent_job_creates_terminal_record(store: ResultStore) -> None:
    job_id = new_id()
    won, record = await succeed(store, job_id, output=[1, 2])
    assert won is True
    assert (record.state, record.output, record.model) == (JobState.succeeded, [1, 2], "echo")
    assert record.finished_at is not None
    assert await store.get(job_id) == record


async def test_finish_refuses_a_non_terminal_state(store: ResultStore) -> None:
    job_id = new_id()
    with pytest.raises(ValueError, match="terminal"):
        await store.finish(job_id, JobState.running, model="echo")
    assert await store.get(job_id) is None


# -- batches ----------------------------------------------------------------------------------------------------


async def test_start_many_handles_absent_queued_and_terminal_jobs_in_order(store: ResultStore) -> None:
    absent, waiting, done = new_id(), new_id(), new_id()
    await store.create(queued(waiting))
    await succeed(store, done, output="kept")
    records = await store.start_many([Start(job_id, "echo", "w2", deliveries=2) for job_id in (absent, waiting, done)])
    assert [r.job_id for r in records] == [absent, waiting, done]
    assert [r.state for r in records] == [JobState.running, JobState.running, JobState.succeeded]
    assert records[0].deliveries == 2 and records[1].worker_id == "w2"
    assert records[2].output == "kept" and records[2].worker_id == "w1"
    assert (await store.get(waiting)) == records[1]


async def test_start_and_finish_many_write_the_version_and_keep_the_records_when_given_none(
    store: ResultStore,
) -> None:
    absent, chosen, plain = new_id(), new_id(), new_id()
    await store.create(queued(chosen, version="2", arm="canary"))  # a traffic policy's choice
    await store.create(queued(plain))
    started = await store.start_many(
        [Start(absent, "echo", "w", 1, version="3"), Start(chosen, "echo", "w", 1), Start(plain, "echo", "w", 1)]
    )
    assert [r.version for r in started] == ["3", "2", None]
    finished = await store.finish_many(
        [
            Finish(absent, JobState.succeeded, "echo", output=1),
            Finish(chosen, JobState.succeeded, "echo", output=2, version="2"),
            Finish(plain, JobState.failed, "echo", error=JobError(type="x", message="y"), version="1"),
        ]
    )
    assert [(won, r.version) for won, r in finished] == [(True, "3"), (True, "2"), (True, "1")]
    assert finished[1][1].arm == "canary"
    assert [(await store.get(job_id)).version for job_id in (absent, chosen, plain)] == ["3", "2", "1"]  # type: ignore[union-attr]
    fresh = new_id()
    won, record = (await store.finish_many([Finish(fresh, JobState.succeeded, "echo", output=0, version="7")]))[0]
    assert won and record.version == "7" and (await store.get(fresh)) == record


async def test_an_unread_start_finds_a_record_that_exists_after_all(store_factory: StoreFactory) -> None:
    """A DAG step's first delivery starts without a read: the start itself must see what is there, also when
    another process wrote it (so nothing this store remembers helps)."""
    store = await store_factory()
    absent, started_elsewhere, cancelled = new_id(), new_id(), new_id()
    await store.start(started_elsewhere, model="echo", worker_id="w1", deliveries=3)
    await store.finish(cancelled, JobState.cancelled, model="echo")
    other = await store_factory()
    if await other.get(cancelled) is not None:  # a second client of the same server (Redis): the real case
        store = other
    records = await store.start_many(
        [Start(job_id, "echo", "w2", deliveries=1, unread=True) for job_id in (absent, started_elsewhere, cancelled)]
    )
    assert [r.state for r in records] == [JobState.running, JobState.running, JobState.cancelled]
    assert records[0].deliveries == 1
    assert records[1].deliveries == 4, "the runs the record counted go on counting"
    assert (await store.get(started_elsewhere)) == records[1]
    assert (await store.get(cancelled)).state == JobState.cancelled, "a cancelled job is not started"


async def test_finish_many_lets_each_item_win_or_lose_its_own_race(store: ResultStore) -> None:
    ids = [new_id() for _ in range(20)]
    for job_id in ids[::2]:
        await succeed(store, job_id, output="earlier")
    items = [Finish(job_id, JobState.succeeded, "echo", output=i, worker_id="w2") for i, job_id in enumerate(ids)]
    outcomes = await store.finish_many(items)
    assert [won for won, _ in outcomes] == [i % 2 == 1 for i in range(20)]
    assert [r.output for _, r in outcomes] == ["earlier" if i % 2 == 0 else i for i in range(20)]
    stored = [await store.get(job_id) for job_id in ids]
    assert [r.output for r in stored if r is not None] == [r.output for _, r in outcomes]


async def test_finish_many_races_single_finishes_with_one_winner_each(store: ResultStore) -> None:
    ids = [new_id() for _ in range(30)]
    batch = [Finish(job_id, JobState.failed, "echo", error=JobError(type="x", message="batch")) for job_id in ids]
    singles = [succeed(store, job_id, output="single") for job_id in ids]
    batch_outcomes, *single_outcomes = await asyncio.gather(store.finish_many(batch), *singles)
    for (batch_won, batch_record), (single_won, single_record) in zip(batch_outcomes, single_outcomes, strict=True):
        assert batch_won != single_won, "exactly one writer wins each job"
        assert batch_record == single_record, "the loser sees the winner's record"


async def test_start_and_finish_many_leave_another_tenants_or_models_record_untouched(
    store_factory: StoreFactory,
) -> None:
    """A message naming someone else's job id (a raw publish, a guessed DAG step id) must neither start nor
    finish that job: the store hands the record back as it is, queued or running, read before or not (unread),
    from this client or another one."""
    store = await store_factory()
    queued_a, running_a, other_model = new_id(), new_id(), new_id()
    await store.create(queued(queued_a, tenant="team-a"))
    await store.start_many([Start(running_a, "echo", "wa", deliveries=1, tenant="team-a")])
    await store.create(queued(other_model))  # the default tenant's echo job
    before = {job_id: await store.get(job_id) for job_id in (queued_a, running_a, other_model)}
    other = await store_factory()  # a second client of the same server (Redis): nothing it remembers helps it
    writers = [store, other] if await other.get(queued_a) is not None else [store]
    for writer in writers:
        for unread in (False, True):
            starts = [
                Start(queued_a, "echo", "wb", deliveries=1, unread=unread, tenant="team-b"),
                Start(running_a, "echo", "wb", deliveries=1, unread=unread),  # the default tenant
                Start(other_model, "sleep", "wb", deliveries=1, unread=unread),
            ]
            assert await writer.start_many(starts) == list(before.values())
        finishes = [
            Finish(queued_a, JobState.succeeded, "echo", output="B-INJECTED", worker_id="wb", tenant="team-b"),
            Finish(running_a, JobState.failed, "echo", error=JobError(type="x", message="B"), worker_id="wb"),
            Finish(other_model, JobState.succeeded, "sleep", output="B-INJECTED", worker_id="wb"),
        ]
        assert await writer.finish_many(finishes) == [(False, record) for record in before.values()]
    assert {job_id: await store.get(job_id) for job_id in before} == before
    owner = await store.finish_many([Finish(queued_a, JobState.succeeded, "echo", output="A", tenant="team-a")])
    assert owner[0][0] is True and owner[0][1].output == "A", "the owner still finishes its job"


async def test_finish_many_wakes_the_waiters_of_every_job(store: ResultStore) -> None:
    ids = [new_id() for _ in range(10)]
    waiters = [asyncio.create_task(store.wait(job_id, 5)) for job_id in ids]
    await asyncio.sleep(0.1)
    await store.finish_many([Finish(job_id, JobState.succeeded, "echo", output=job_id) for job_id in ids])
    records = await asyncio.gather(*waiters)
    assert [r.output for r in records if r is not None] == ids


async def test_empty_batches_are_no_ops(store: ResultStore) -> None:
    assert await store.start_many([]) == []
    assert await store.finish_many([]) == []


# -- wait -------------------------------------------------------------------------------------------------------


async def test_wait_returns_at_once_for_a_finished_job(store: ResultStore) -> None:
    job_id = new_id()
    _, done = await succeed(store, job_id)
    started = time.monotonic()
    assert await store.wait(job_id, timeout_s=10) == done
    assert time.monotonic() - started < 0.5


async def test_wait_wakes_up_when_another_task_finishes_the_job(store: ResultStore) -> None:
    job_id = new_id()
    await store.create(queued(job_id))
    waiter = asyncio.create_task(store.wait(job_id, timeout_s=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    _, done = await succeed(store, job_id)
    finished = time.monotonic()
    assert await asyncio.wait_for(waiter, 2) == done
    assert time.monotonic() - finished < 0.5


async def test_wait_times_out_with_the_current_record(store: ResultStore) -> None:
    job_id = new_id()
    await store.create(queued(job_id))
    running = await store.start(job_id, model="echo", worker_id="w1", deliveries=1)
    started = time.monotonic()
    assert await store.wait(job_id, timeout_s=0.3) == running
    assert 0.25 <= time.monotonic() - started < 2


async def test_wait_times_out_with_none_for_an_unknown_job(store: ResultStore) -> None:
    started = time.monotonic()
    assert await store.wait(new_id(), timeout_s=0.3) is None
    assert 0.25 <= time.monotonic() - started < 2


async def test_wait_sees_a_job_created_and_finished_after_it_began(store: ResultStore) -> None:
    job_id = new_id()
    waiter = asyncio.create_task(store.wait(job_id, timeout_s=10))
    await asyncio.sleep(0.1)
    await store.start(job_id, model="echo", worker_id="w1", deliveries=1)
    _, done = await succeed(store, job_id)
    assert await asyncio.wait_for(waiter, 2) == done


async def test_many_concurrent_waiters_all_wake(store: ResultStore) -> None:
    job_ids = [new_id() for _ in range(200)]
    waiters = [asyncio.create_task(store.wait(job_id, timeout_s=20)) for job_id in job_ids]
    waiters += [asyncio.create_task(store.wait(job_ids[0], timeout_s=20)) for _ in range(5)]  # shared channel
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in waiters)
    await asyncio.gather(*(succeed(store, job_id, output=job_id) for job_id in job_ids))
    records = await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert [r.output if r else None for r in records] == job_ids + [job_ids[0]] * 5


async def test_cancelled_waiter_leaves_the_store_usable(store: ResultStore) -> None:
    job_id = new_id()
    waiter = asyncio.create_task(store.wait(job_id, timeout_s=10))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    second = asyncio.create_task(store.wait(job_id, timeout_s=10))
    await asyncio.sleep(0.1)
    _, done = await succeed(store, job_id)
    assert await asyncio.wait_for(second, 2) == done


# -- make_store -------------------------------------------------------------------------------------------------


def test_make_store_picks_the_implementation_by_url_scheme() -> None:
    assert isinstance(make_store(FleetSettings.model_validate({"store_url": "memory://"})), MemoryStore)
    for url in ("redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0", "redis+cluster://127.0.0.1:7000"):
        store = make_store(FleetSettings.model_validate({"store_url": url, "job_ttl_s": 77}))
        assert isinstance(store, RedisStore)
        assert store.job_ttl_s == 77
        assert store.cluster_mode == url.startswith("redis+cluster")
    with pytest.raises(ConfigError, match="scheme"):
        make_store(FleetSettings.model_construct(store_url="mongodb://x", job_ttl_s=1))


def test_store_kinds_cover_every_store_scheme() -> None:
    assert STORE_KINDS == ["memory", "redis", "redis-cluster"]


# -- Redis specifics --------------------------------------------------------------------------------------------


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    """A Redis store whose connections carry a unique client name, so CLIENT LIST can single them out."""
    name = f"fleet-test-{uuid.uuid4().hex[:8]}"
    store = RedisStore(f"{redis_url}?client_name={name}", job_ttl_s=60)
    await store.connect()
    yield store
    await store.close()


async def subscriber_connections(store: RedisStore) -> list[dict[str, str]]:
    name = store.url.rsplit("client_name=", 1)[1]
    clients = await store.redis.client_list()
    return [cl for cl in clients if cl.get("name") == name and int(cl.get("sub", 0)) > 0]


async def command_calls(store: RedisStore) -> dict[str, int]:
    stats = await store.redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_redis_batch_costs_a_few_commands_not_one_per_job(redis_store: RedisStore) -> None:
    """The worker's throughput rests on this: a micro-batch of 64 is 2 commands to start (and 1 to enter the records
    it created in the job index: these jobs had none, as jobs published straight to the topic) and 1 to finish."""
    ids = [new_id() for _ in range(64)]
    before = await command_calls(redis_store)
    await redis_store.start_many([Start(job_id, "echo", "w1", 1) for job_id in ids])
    await redis_store.finish_many([Finish(job_id, JobState.succeeded, "echo", output=1) for job_id in ids])
    after = await command_calls(redis_store)
    used = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # commandstats also counts the GET/SET/PUBLISH calls made inside the scripts; what crosses the network is:
    assert used.get("mget") == 1 and used.get("evalsha") == 3, used  # finish reuses what start wrote
    assert used.get("zadd") == 4 * 64, used  # inside the index script: four index entries per new record


async def test_redis_key_holds_the_record_json_with_ttl(redis_store: RedisStore) -> None:
    job_id = new_id()
    key = c.job_key(job_id)
    await redis_store.create(queued(job_id))
    assert 0 < await redis_store.redis.ttl(key) <= 60
    await redis_store.redis.expire(key, 5)
    await redis_store.start(job_id, model="echo", worker_id="w1", deliveries=1)
    assert 5 < await redis_store.redis.ttl(key) <= 60  # refreshed by the write
    _, done = await succeed(redis_store, job_id)
    assert 0 < await redis_store.redis.ttl(key) <= 60
    raw = await redis_store.redis.get(key)
    assert raw is not None
    assert JobRecord.model_validate_json(raw) == done


async def test_redis_finish_publishes_the_terminal_record(redis_store: RedisStore) -> None:
    job_id = new_id()
    pubsub = redis_store.redis.pubsub()
    await pubsub.subscribe(c.done_channel(job_id))
    try:
        assert (await pubsub.get_message(timeout=1))["type"] == "subscribe"
        _, done = await succeed(redis_store, job_id)
        await succeed(redis_store, job_id, output="loser")  # a lost race publishes nothing
        message = await pubsub.get_message(timeout=1)
        assert JobRecord.model_validate_json(message["data"]) == done
        assert await pubsub.get_message(timeout=0.2) is None
    finally:
        await pubsub.aclose()


async def test_redis_waiters_share_one_pubsub_connection(redis_store: RedisStore) -> None:
    job_ids = [new_id() for _ in range(200)]
    waiters = [asyncio.create_task(redis_store.wait(job_id, timeout_s=20)) for job_id in job_ids]
    await eventually(lambda: redis_store.pubsub.watched_channels == 200)
    for _ in range(100):  # confirmed subscriptions, counted by the server (a loaded machine may take a while)
        connections = await subscriber_connections(redis_store)
        if len(connections) != 1 or int(connections[0]["sub"]) == 200:
            break
        await asyncio.sleep(0.05)
    assert len(connections) == 1
    assert int(connections[0]["sub"]) == 200
    assert redis_store.pubsub.watched_channels == 200
    await asyncio.gather(*(succeed(redis_store, job_id) for job_id in job_ids))
    assert all(r is not None and r.terminal for r in await asyncio.wait_for(asyncio.gather(*waiters), 10))
    await asyncio.sleep(0.2)
    assert redis_store.pubsub.watched_channels == 0
    assert await subscriber_connections(redis_store) == []  # every channel was unsubscribed
    assert redis_store.pubsub.connects == 1


async def test_redis_waiter_survives_a_dropped_pubsub_connection(redis_store: RedisStore) -> None:
    job_id = new_id()
    waiter = asyncio.create_task(redis_store.wait(job_id, timeout_s=15))
    await asyncio.sleep(0.3)
    [connection] = await subscriber_connections(redis_store)
    await redis_store.redis.client_kill_filter(_id=connection["id"])
    _, done = await succeed(redis_store, job_id)  # published while nobody listens: only the re-check can see it
    assert await asyncio.wait_for(waiter, 5) == done
    await eventually(lambda: redis_store.pubsub.connects == 2 and redis_store.pubsub.connected)
    second_id = new_id()
    second = asyncio.create_task(redis_store.wait(second_id, timeout_s=15))
    await asyncio.sleep(0.2)
    _, second_done = await succeed(redis_store, second_id)
    assert await asyncio.wait_for(second, 2) == second_done


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_redis_connect_to_a_closed_port_fails_fast_and_says_why(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{services.free_port()}" + ("/0" if scheme == "redis" else "")
    store = RedisStore(url, job_ttl_s=60)
    started = time.monotonic()
    try:
        with pytest.raises(StoreError, match="redis-server running") as caught:
            await store.connect()
    finally:
        await store.close()
    assert time.monotonic() - started < 5
    assert url in caught.value.message
    assert caught.value.retriable is True


async def test_a_cluster_url_naming_a_plain_redis_says_so(redis_url: str) -> None:
    url = redis_url.replace("redis://", "redis+cluster://").removesuffix("/0")
    store = RedisStore(url, job_ttl_s=60)
    try:
        with pytest.raises(StoreError, match=r"[Cc]luster") as caught:
            await store.connect()
    finally:
        await store.close()
    assert url in caught.value.message


def test_redis_urls_in_messages_hide_the_password() -> None:
    store = RedisStore("redis://user:s3cret@127.0.0.1:1/0", job_ttl_s=60)
    assert store.display_url == "redis://user:***@127.0.0.1:1/0"


@pytest.fixture
def private_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of this test's own, which the test may stop."""
    binary = services.require_binary("redis-server", "redis-server")
    port = services.free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-redis-") as tmp:
        log = Path(tmp) / "server.log"
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            services.wait_port("127.0.0.1", port, proc, log, 20, "redis-server")
            yield f"redis://127.0.0.1:{port}/0", proc
        finally:
            proc.kill()
            proc.wait()


async def test_redis_outage_fails_calls_but_not_a_waiter_until_its_deadline(
    private_redis: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = private_redis
    store = RedisStore(url, job_ttl_s=60)
    await store.connect()
    try:
        job_id = new_id()
        waiter = asyncio.create_task(store.wait(job_id, timeout_s=3))
        await asyncio.sleep(0.2)
        proc.kill()
        await asyncio.to_thread(proc.wait)
        started = time.monotonic()
        with pytest.raises(StoreError, match="redis-server running"):
            await store.get(job_id)
        with pytest.raises(StoreError, match="redis-server running"):
            await succeed(store, job_id)
        await asyncio.sleep(1.5)
        assert not waiter.done(), "an outage shorter than the waiter's deadline is not an error for it"
        with pytest.raises(StoreError, match="redis-server running"):
            await asyncio.wait_for(waiter, 10)  # its read at the deadline fails: now it says so
        assert time.monotonic() - started < 10
    finally:
        await store.close()


@pytest.fixture
def aof_server() -> Iterator[AofRedis]:
    with aof_redis() as server:
        yield server


async def test_redis_wait_survives_a_server_restart_and_gets_the_record_written_meanwhile(
    aof_server: AofRedis,
) -> None:
    store = RedisStore(aof_server.url, job_ttl_s=60)
    writer = RedisStore(aof_server.url, job_ttl_s=60)  # another process's store: its notices reach nobody here
    await store.connect()
    await writer.connect()
    try:
        job_id = new_id()
        await store.create(queued(job_id))
        waiter = asyncio.create_task(store.wait(job_id, timeout_s=30))
        await eventually(lambda: store.pubsub.watched_channels == 1)
        aof_server.kill()
        await eventually(lambda: not store.pubsub.connected)
        await asyncio.sleep(2)
        assert not waiter.done(), "the waiter keeps waiting through the outage"
        await asyncio.to_thread(aof_server.start)
        # Written at once, before (or while) the waiter's subscription comes back: only a re-read can see it.
        subscribed_before = store.pubsub.connected
        _, done = await succeed(writer, job_id, output="after the restart")
        assert await asyncio.wait_for(waiter, 10) == done, f"subscription up before the write: {subscribed_before}"
        # the record may reach the waiter through its periodic re-read before the subscription is back (with
        # redis-py 8 the reconnect can take longer under load); the subscription still comes back, once
        await eventually(lambda: store.pubsub.connects == 2)
    finally:
        await writer.close()
        await store.close()


async def test_redis_wait_gets_a_terminal_record_whose_notice_was_lost(redis_url: str) -> None:
    store = RedisStore(redis_url, job_ttl_s=60, recheck_interval_s=0.3)
    await store.connect()
    try:
        job_id = new_id()
        await store.create(queued(job_id))
        waiter = asyncio.create_task(store.wait(job_id, timeout_s=20))
        await eventually(lambda: store.pubsub.watched_channels == 1)
        done = queued(job_id).model_copy(update={"state": JobState.succeeded, "output": "no notice"})
        await store.redis.set(c.job_key(job_id), done.model_dump_json())  # the record, without its PUBLISH
        started = time.monotonic()
        assert await asyncio.wait_for(waiter, 5) == done
        assert time.monotonic() - started < 2, "the periodic re-read delivered it"
    finally:
        await store.close()


async def test_redis_rechecks_every_waiter_in_a_few_batched_reads(redis_url: str) -> None:
    store = RedisStore(redis_url, job_ttl_s=60, recheck_interval_s=3600)  # this test runs the passes itself
    await store.connect()
    ids = [new_id() for _ in range(1200)]
    gets_before = (await command_calls(store)).get("get", 0)
    waiters = [asyncio.create_task(store.wait(job_id, timeout_s=30)) for job_id in ids]
    try:
        for _ in range(400):  # each waiter reads twice (before and after subscribing), then only waits
            if (await command_calls(store)).get("get", 0) - gets_before >= 2 * len(ids):
                break
            await asyncio.sleep(0.05)
        assert store.pubsub.watched_channels == len(ids)
        ended = ids[::3]
        done = {job_id: queued(job_id).model_copy(update={"state": JobState.failed}) for job_id in ended}
        await store.redis.mset({c.job_key(job_id): r.model_dump_json() for job_id, r in done.items()})
        before = await command_calls(store)
        assert await store._recheck.recheck() == len(ended)
        after = await command_calls(store)
        assert after["mget"] - before.get("mget", 0) == 3  # 1200 watched jobs, 500 keys per MGET
        finished = [await asyncio.wait_for(waiters[i], 5) for i in range(0, len(ids), 3)]
        assert finished == [done[job_id] for job_id in ended]
        assert not any(waiters[i].done() for i in range(1, len(ids), 3))
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await store.close()
