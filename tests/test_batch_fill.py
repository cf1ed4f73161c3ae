"""When a micro-batch waits to fill: only when the recent arrival rate says more messages will come within
``max_wait_ms`` (``fleet.consumers.batcher``). A lone request pays no wait; under load batches fill as before."""

from __future__ import annotations

import asyncio
import time

from fleet.brokers.base import Delivery
from fleet.consumers.batcher import ARRIVAL_TAU_S, FILL_WORTH_ARRIVALS, BatchBounds, BatchCollector
from tests.test_adaptive_batching import FakeDelivery


class Trickle:
    """Messages that become available at given loop times (seconds after ``start``)."""

    partitioned = False

    def __init__(self, offsets: list[float]) -> None:
        self.start = asyncio.get_running_loop().time()
        self.due = [(self.start + offset, FakeDelivery(1)) for offset in offsets]

    def add(self, offsets: list[float]) -> None:
        """More messages, due ``offsets`` seconds from now."""
        now = asyncio.get_running_loop().time()
        self.due += [(now + offset, FakeDelivery(1)) for offset in offsets]

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ready = [d for at, d in self.due if at <= loop.time()][:max_messages]
            if ready:
                self.due = [(at, d) for at, d in self.due if d not in ready]
                return list(ready)
            upcoming = min((at for at, _ in self.due), default=deadline)
            if loop.time() >= deadline:
                return []
            await asyncio.sleep(max(0.0, min(upcoming, deadline) - loop.time()))

    async def close(self) -> None: ...


async def test_a_lone_request_does_not_wait_for_a_batch_that_will_not_come() -> None:
    sub = Trickle([0.0, 0.6])  # the second comes after the batch's wait: waiting would only add latency
    collector = BatchCollector(sub)
    began = time.perf_counter()
    batch = await collector.collect(BatchBounds(max_batch=32, max_wait_s=0.5), idle_timeout_s=1.0)
    assert len(batch) == 1
    assert time.perf_counter() - began < 0.25, "closed at once, not after max_wait"


async def test_under_load_a_batch_waits_and_fills() -> None:
    # 400 messages over 0.2 s make a rate of about 400/s: 0.05 s of waiting brings about 20 more
    burst = [i * 0.0005 for i in range(400)]
    sub = Trickle(burst)
    collector = BatchCollector(sub)
    seen = 0
    while seen < len(burst):
        seen += len(await collector.collect(BatchBounds(max_batch=64, max_wait_s=0.0), idle_timeout_s=1.0))
    assert seen == len(burst)
    # Then ten more, over the next 20 ms (timed from the end of the burst's drain, however long that took): the
    # batch that takes the first one waits for the others, since the rate says they are coming.
    later = [0.01 + i * 0.001 for i in range(10)]
    sub.add(later)
    batch = await collector.collect(BatchBounds(max_batch=64, max_wait_s=0.05), idle_timeout_s=1.0)
    assert len(batch) == len(later), "the batch waited for the messages that kept coming"


def test_the_rate_decays_when_messages_stop() -> None:
    collector = BatchCollector(Trickle.__new__(Trickle))
    collector._count_arrivals(100, now=10.0)  # 100 messages just now: about 100/s over the time constant
    assert collector.expected_arrivals(0.02, now=10.0) == 100 / ARRIVAL_TAU_S * 0.02
    assert collector.expected_arrivals(0.02, now=10.0) >= FILL_WORTH_ARRIVALS, "worth waiting for"
    assert collector.expected_arrivals(0.02, now=10.0 + 3 * ARRIVAL_TAU_S) < FILL_WORTH_ARRIVALS, "quiet again"
    collector._count_arrivals(1, now=20.0)
    assert collector.expected_arrivals(0.002, now=20.0) < FILL_WORTH_ARRIVALS
