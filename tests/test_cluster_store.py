"""The result store on a real 3-primary Redis Cluster: batches shard over every primary, notices stay on the shard
of their record (sharded pub/sub), and competing workers over NATS end every job exactly once (the contract suite
and tests/test_worker.py run on the cluster as well, through ``redis-cluster`` / ``nats+redis_cluster``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from fleet import constants as c
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobState
from fleet.store.base import Finish, Start
from fleet.store.cluster import done_channel_cluster, seed_nodes
from fleet.store.redis import RedisStore
from tests.handlers_for_tests import Items
from tests.infra import CLUSTER_PAIR, connected_pair, eventually, publish_requests, settings_for, wait_terminal


@pytest.fixture
async def nodes(redis_cluster_url: str) -> AsyncIterator[list[aioredis.Redis]]:
    """A plain client per primary of the session's cluster."""
    seeds, _, _ = seed_nodes(redis_cluster_url)
    clients = [aioredis.Redis(host=node.host, port=node.port) for node in seeds]
    yield clients
    for client in clients:
        await client.aclose()


async def count_notices(
    store: RedisStore, job_ids: list[str], ready: asyncio.Event, counts: collections.Counter[str]
) -> None:
    """Every completion notice of ``job_ids``, subscribed (``SSUBSCRIBE``) on the node that serves each channel's
    slot, on connections of its own."""
    channels = {done_channel_cluster(job_id): job_id for job_id in job_ids}
    by_node: dict[str, list[str]] = {}
    for channel in channels:
        node = store.redis.get_node_from_key(channel)
        by_node.setdefault(f"{node.host}:{node.port}", []).append(channel)
    clients, pubsubs = [], []
    for address, names in by_node.items():
        host, port = address.rsplit(":", 1)
        client = aioredis.Redis(host=host, port=int(port))
        pubsub = client.pubsub()
        for name in names:
            await pubsub.ssubscribe(name)
        clients.append(client)
        pubsubs.append(pubsub)

    async def listen(pubsub: Any) -> None:
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message and message["type"] == "smessage":
                counts[channels[message["channel"].decode()]] += 1

    readers = [asyncio.create_task(listen(pubsub)) for pubsub in pubsubs]
    await asyncio.sleep(0.2)  # the subscriptions confirmed (their replies are read by the listeners)
    ready.set()
    try:
        await asyncio.gather(*readers)
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for pubsub, client in zip(pubsubs, clients, strict=True):
            await pubsub.aclose()
            await client.aclose()


async def test_a_batch_is_written_on_every_primary_and_announced_on_each_record_s_shard(
    redis_cluster_url: str, nodes: list[aioredis.Redis], unique: str
) -> None:
    store = RedisStore(redis_cluster_url, job_ttl_s=60)
    await store.connect()
    counts: collections.Counter[str] = collections.Counter()
    ready = asyncio.Event()
    ids = [f"{unique}-{i}" for i in range(96)]
    listener = asyncio.create_task(count_notices(store, ids, ready, counts))
    try:
        await ready.wait()
        await store.start_many([Start(job_id, "echo", "w", 1, unread=True) for job_id in ids])
        done = await store.finish_many(
            [Finish(job_id, JobState.succeeded, "echo", output=i) for i, job_id in enumerate(ids)]
        )
        assert all(won for won, _ in done)
        again = await store.finish_many([Finish(job_id, JobState.failed, "echo") for job_id in ids])
        assert not any(won for won, _ in again), "a terminal record never changes"
        holders = [len([k async for k in node.scan_iter(match=c.job_key(f"{unique}-*"), count=1000)]) for node in nodes]
        assert sum(holders) == len(ids) and all(held > 0 for held in holders), holders
        await eventually(lambda: _all_counted(counts, ids), what="a notice per job on its shard")
        assert set(counts.values()) == {1}
        assert [r.output if r else None for r in await store.get_many(ids)] == list(range(len(ids)))
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await store.close()


async def _all_counted(counts: collections.Counter[str], ids: list[str]) -> bool:
    return all(counts[job_id] for job_id in ids)


async def test_competing_workers_over_nats_end_each_job_exactly_once_on_the_cluster(
    request: pytest.FixtureRequest, nodes: list[aioredis.Redis], unique: str
) -> None:
    urls = {"nats": request.getfixturevalue("nats_url"), "redis_cluster": request.getfixturevalue("redis_cluster_url")}
    settings = settings_for(CLUSTER_PAIR, urls)
    model = f"items-{unique}"
    counts: collections.Counter[str] = collections.Counter()
    ready = asyncio.Event()
    async with connected_pair(settings) as (broker, store):
        assert isinstance(store, RedisStore)
        listener = asyncio.create_task(count_notices(store, [f"{unique}-{i}" for i in range(120)], ready, counts))
        await ready.wait()
        ids = await publish_requests(broker, model, [{"value": i} for i in range(120)], unique)
        workers = [Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=16) for _ in range(2)]
        async with workers[0], workers[1]:
            records = await wait_terminal(store, ids, timeout_s=60)
            await eventually(lambda: _acked(broker, model), timeout_s=20, what="every request acked")
        await eventually(lambda: _all_counted(counts, ids), what="a notice per job")
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(120)]
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert {r.worker_id for r in records.values()} <= {w.worker_id for w in workers}
    assert {counts[j] for j in ids} == {1}, "exactly one terminal result announced per job"


async def _acked(broker: object, model: str) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == 0  # type: ignore[attr-defined]
