"""Shutdowns stay bounded even when a library swallows a cancellation (nats-py's publish path does)."""

from __future__ import annotations

import asyncio
import time

from fleet import constants as c
from fleet.brokers.memory import MemoryBroker
from fleet.lag import LagMonitor
from fleet.tasks import cancel_and_wait


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
