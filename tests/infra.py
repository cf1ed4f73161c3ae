"""Build a connected broker + store pair of one kind for a test, and small helpers shared by worker tests."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker, Delivery
from fleet.schemas.jobs import JobRecord
from fleet.schemas.wire import Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore

# Pairs that every end-to-end test runs over.
PAIRS = ["memory", "nats+redis", "kafka+redis"]
# NATS with the store on a 3-primary Redis Cluster (``redis_cluster_url``): the worker tests run on it too.
CLUSTER_PAIR = "nats+redis_cluster"

TEST_SETTINGS: dict[str, Any] = {
    "ack_wait_s": 2.0,
    "max_deliveries": 3,
    "heartbeat_interval_s": 0.2,
    "drain_timeout_s": 5.0,
    "max_wait_ms": 5,
}


def settings_for(pair: str, urls: dict[str, str], **overrides: Any) -> FleetSettings:
    broker_kind, _, store_kind = pair.partition("+")
    values = {**TEST_SETTINGS, **overrides}
    values["broker_url"] = urls[broker_kind] if broker_kind != "memory" else "memory://"
    values["store_url"] = urls[store_kind or "memory"] if store_kind else "memory://"
    return FleetSettings(**values)


@contextlib.asynccontextmanager
async def connected_pair(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    broker = make_broker(settings)
    store = make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        yield broker, store
    finally:
        await store.close()
        await broker.close()


def request_bytes(model: str, job_id: str, payload: dict[str, Any], **extra: Any) -> bytes:
    return RequestMessage(job_id=job_id, model=model, input=payload, **extra).model_dump_json().encode()


async def publish_requests(broker: Broker, model: str, inputs: list[dict[str, Any]], prefix: str) -> list[str]:
    await broker.ensure_model(model)
    ids = [f"{prefix}-{i}" for i in range(len(inputs))]
    for job_id, payload in zip(ids, inputs, strict=True):
        await broker.publish(c.request_subject(model), request_bytes(model, job_id, payload), msg_id=job_id)
    return ids


async def wait_terminal(store: ResultStore, job_ids: list[str], timeout_s: float = 20) -> dict[str, JobRecord]:
    """Wait until every job is terminal; fail naming the stragglers."""
    records = await asyncio.gather(*(store.wait(job_id, timeout_s) for job_id in job_ids))
    out = dict(zip(job_ids, records, strict=True))
    stragglers = {k: (v.state if v else None) for k, v in out.items() if v is None or not v.terminal}
    assert not stragglers, f"jobs not terminal after {timeout_s}s: {stragglers}"
    return {k: v for k, v in out.items() if v is not None}


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s}s")


async def drain_subject(broker: Broker, subject: str, group: str, timeout_s: float = 3) -> list[Delivery]:
    """Read (and ack) everything currently on a durable subject, e.g. a dead-letter subject."""
    sub = await broker.subscribe(subject, group)
    got: list[Delivery] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await sub.fetch(100, 0.3)
            if not batch and got:
                break
            for delivery in batch:
                await delivery.ack()
            got.extend(batch)
    finally:
        await sub.close()
    return got


async def count_completions(redis_url: str, ready: asyncio.Event, counts: collections.Counter[str]) -> None:
    """Count every completion notification per job id (to prove exactly one terminal result per job)."""
    client = aioredis.from_url(redis_url)
    pubsub = client.pubsub()
    await pubsub.psubscribe(c.done_channel("*"))
    ready.set()
    try:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                counts[message["channel"].decode().rsplit(":", 1)[-1]] += 1
    finally:
        await pubsub.aclose()
        await client.aclose()


class HeartbeatTally:
    """The latest ``items`` counter of every worker of a model, from the heartbeats the test hears itself."""

    def __init__(self) -> None:
        self.items: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def following(self, broker: Broker, model: str) -> AsyncIterator[HeartbeatTally]:
        events = await broker.listen(c.heartbeat_subject(model))

        async def run() -> None:
            async for _, data in events:
                hb = Heartbeat.model_validate_json(data)
                self.items[hb.worker_id] = max(self.items.get(hb.worker_id, 0), hb.items)

        self._task = asyncio.create_task(run())
        try:
            yield self
        finally:
            self._task.cancel()
            await events.close()

    @property
    def total(self) -> int:
        return sum(self.items.values())


def until(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Call ``check`` every ``interval_s`` until it returns something true (returned), for at most ``timeout_s``:
    the blocking sibling of ``eventually``, for tests that drive a browser or a synchronous client."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:g}s (last: {last!r})")
