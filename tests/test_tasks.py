"""Shutdowns stay bounded even when a library swallows a cancellation (nats-py's publish path does), and the
waits of Fleet's own loops never swallow one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from fleet import constants as c
from fleet.brokers.memory import MemoryBroker
from fleet.lag import LagMonitor
from fleet.producers.gateway.cache.l3 import L3Options, SemanticLevel
from fleet.schemas.jobs import JobState
from fleet.store.cachestore import MemoryCacheStore, VectorEntry
from fleet.store.memory import MemoryStore
from fleet.tasks import cancel_and_wait, wait_event


class SwallowingBroker(MemoryBroker):
    """The embedded broker, with a lag read that ignores a cancellation the way nats-py's flush does."""

    async def lag(self, subject: str, group: str) -> int:
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass
        return await super().lag(subject, group)


async def test_cancel_and_wait_gives_up_on_a_task_that_ignores_its_cancellation() -> None:
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    started = time.monotonic()
    await cancel_and_wait([task], timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 2
    assert not task.done()
    stop.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert task.done()


async def test_lag_monitor_stops_even_when_the_broker_swallows_the_cancellation() -> None:
    broker = SwallowingBroker(ack_wait_s=5, dedup_window_s=60, max_message_bytes=1 << 20)
    await broker.connect()
    await broker.ensure_model("swallow")
    await broker.publish(c.request_subject("swallow"), b"{}")
    async with LagMonitor(broker, ["swallow"], interval_s=0.01) as monitor:
        await asyncio.sleep(0.1)  # the monitor is inside a lag read now
        started = time.monotonic()
    assert time.monotonic() - started < 1.0
    assert monitor.last == {"swallow": 1}
    assert monitor._task is not None and monitor._task.done()
    await broker.close()


async def _cancel_as_it_resolves(waiting: asyncio.Task[object], resolve: Callable[[], Awaitable[None]]) -> None:
    """Resolve what ``waiting`` waits on and cancel it in the same loop iteration (``resolve`` must not suspend):
    the race that ``asyncio.wait_for`` loses on Python 3.11 (it returns the result and the cancellation is gone)."""
    await asyncio.sleep(0)  # the task is waiting now
    await resolve()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_loop_on_wait_event_ends_on_a_cancellation_that_meets_its_wake_up() -> None:
    poke, rounds = asyncio.Event(), []

    async def loop() -> None:  # the shape of the idle announcer's and the dispatcher's loops
        while True:
            await wait_event(poke, 10)
            poke.clear()
            rounds.append(1)

    async def wake() -> None:
        poke.set()

    await _cancel_as_it_resolves(asyncio.create_task(loop()), wake)
    assert rounds == []


async def test_a_result_wait_keeps_a_cancellation_that_meets_the_result() -> None:
    """The dispatcher's result waiter loops on ``store.wait``: a cancel lost there would leave it running."""
    store = MemoryStore(job_ttl_s=60)

    async def finish() -> None:
        await store.finish("j1", JobState.succeeded, model="echo", output={})

    await _cancel_as_it_resolves(asyncio.create_task(store.wait("j1", 10)), finish)


async def test_wait_event_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True


class SwallowingCacheStore(MemoryCacheStore):
    """The embedded cache store, with a log read that ignores a cancellation (as ``SwallowingBroker``'s lag)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    async def read_vectors(self, log: str, after: str, limit: int) -> list[tuple[str, VectorEntry]]:
        self.reads += 1
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass
        return await super().read_vectors(log, after, limit)


async def test_the_l3_sync_loop_stops_even_when_its_log_read_swallows_the_cancellation() -> None:
    """A gateway with L3 on once waited 30 s to stop: its sync task was back asleep after its cancellation."""
    store = SwallowingCacheStore()
    options = L3Options(dim=4, max_entries=100, nprobe=1, sync_interval_s=0.01, ttl_s=60, timeout_s=1.0)
    level = SemanticLevel(store, options)
    level.serve("embed", "1")
    await level.start()
    while store.reads < 3:  # noqa: ASYNC110 - polled: the loop is in its reads now
        await asyncio.sleep(0.01)
    started = time.monotonic()
    async with asyncio.timeout(5):  # a stop that trusts its one cancellation waits here for ever
        await level.stop()
    assert time.monotonic() - started < 1.0
    assert level._sync is not None and level._sync.done()
    reads = store.reads
    await asyncio.sleep(0.1)
    assert store.reads == reads, "the loop must not read again after stop()"
