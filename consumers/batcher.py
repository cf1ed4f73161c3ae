"""Micro-batch collection: wait for the first message, then let the batch fill for at most ``max_wait_ms``,
bounded by a count (``max_batch``) and, when the model declares item costs, by a cost budget (``max_cost``).

The wait to fill is skipped when it would most likely wait for nothing: the collector keeps a decaying count of
the messages it fetched (time constant ``ARRIVAL_TAU_S``), and when fewer than ``FILL_WORTH_ARRIVALS`` are expected
within ``max_wait_ms`` at that rate, a batch closes with what has come. A lone request (a DAG step, an idle
service) then pays no ``max_wait_ms``, while under load, when batching pays, batches fill as before.

A message cannot be un-fetched from NATS or Kafka, so one that was fetched but does not fit the budget is held
over (``BatchCollector.carry``) and starts the next batch, ahead of anything fetched later. The worker counts the
held-over messages among the deliveries it holds, so their ack deadlines are extended like the rest and a drain
hands them back. A single item that is over the budget on its own still runs, alone.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fleet.brokers.base import Delivery, Subscription

ARRIVAL_TAU_S = 1.0  # the arrival rate is a count of fetched messages decaying with this time constant
FILL_WORTH_ARRIVALS = 1.0  # wait for a batch to fill only when at least this many more messages are expected

CostOf = Callable[[Delivery], int]
"""The cost of one fetched message (tokens, pixels...); ``BatchCollector`` never lets a batch's sum exceed the
budget, but for a lone item over it."""


@dataclass(frozen=True, slots=True)
class BatchBounds:
    """The bounds of the next batch: ``max_batch`` items, ``max_wait_s`` after its first one, at most ``max_cost``
    (``None``: no cost bound)."""

    max_batch: int
    max_wait_s: float
    max_cost: int | None = None


class BatchCollector:
    """Collects micro-batches from one subscription; keeps what did not fit for the next batch.

    Args:
        sub: the subscription to fetch from.
        cost_of: the cost of a message; needed only for batches with a ``max_cost``.
        on_fetch: hears of every fetched message at once (the worker counts it as held from then on, so a
            message held over, or one fetched by a collection that is cancelled, is kept alive and handed back).
    """

    def __init__(
        self,
        sub: Subscription,
        cost_of: CostOf | None = None,
        on_fetch: Callable[[list[Delivery]], None] | None = None,
    ) -> None:
        self.sub = sub
        self.cost_of = cost_of
        self.on_fetch = on_fetch
        self.carry: deque[tuple[Delivery, int]] = deque()  # fetched, not yet in a batch, with its cost
        self.closed_full = False  # the last batch closed on its count or its budget (more work was there)
        self._mean_cost = 1.0
        self._arrivals = 0.0  # fetched messages, decaying with ARRIVAL_TAU_S
        self._arrivals_at = 0.0  # loop time of the last update of _arrivals

    def carried(self) -> list[Delivery]:
        """Messages fetched but held over for the next batch."""
        return [delivery for delivery, _ in self.carry]

    async def collect(self, bounds: BatchBounds, idle_timeout_s: float) -> list[Delivery]:
        """The next batch, or ``[]`` when nothing is carried and nothing arrived within ``idle_timeout_s``.

        The clock for ``max_wait_s`` starts with the first message, so an idle worker answers a lone request as
        soon as it arrives plus at most ``max_wait_s``; with ``max_wait_s == 0`` it takes only what is waiting.
        """
        batch: list[Delivery] = []
        cost = 0
        self.closed_full = False
        if not self.carry:
            self._hold(await self.sub.fetch(self._fetch_size(batch, 0, bounds), idle_timeout_s), bounds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bounds.max_wait_s
        while True:
            cost = self._take(batch, cost, bounds)
            if self.carry or len(batch) >= bounds.max_batch:  # the budget or the count is spent
                self.closed_full = bool(batch)
                return batch
            now = loop.time()
            remaining = deadline - now
            if not batch or remaining <= 0 or self.expected_arrivals(remaining, now) < FILL_WORTH_ARRIVALS:
                return batch
            fetched = await self.sub.fetch(self._fetch_size(batch, cost, bounds), remaining)
            if not fetched:
                return batch
            self._hold(fetched, bounds)

    def expected_arrivals(self, within_s: float, now: float) -> float:
        """How many messages are expected within ``within_s`` at the recent arrival rate."""
        rate = self._arrivals * math.exp((self._arrivals_at - now) / ARRIVAL_TAU_S) / ARRIVAL_TAU_S
        return rate * within_s

    def _count_arrivals(self, n: int, now: float) -> None:
        self._arrivals = self._arrivals * math.exp((self._arrivals_at - now) / ARRIVAL_TAU_S) + n
        self._arrivals_at = now

    def _hold(self, fetched: list[Delivery], bounds: BatchBounds) -> None:
        if not fetched:
            return
        self._count_arrivals(len(fetched), asyncio.get_running_loop().time())
        if self.on_fetch is not None:
            self.on_fetch(fetched)
        for delivery in fetched:
            item_cost = self.cost_of(delivery) if bounds.max_cost is not None and self.cost_of else 1
            self.carry.append((delivery, max(0, item_cost)))
            self._mean_cost += 0.2 * (max(1, item_cost) - self._mean_cost)

    def _take(self, batch: list[Delivery], cost: int, bounds: BatchBounds) -> int:
        """Move carried messages into ``batch`` while they fit; return the batch's cost."""
        while self.carry and len(batch) < bounds.max_batch:
            delivery, item_cost = self.carry[0]
            if bounds.max_cost is not None and batch and cost + item_cost > bounds.max_cost:
                break
            self.carry.popleft()
            batch.append(delivery)
            cost += item_cost
        return cost

    def _fetch_size(self, batch: list[Delivery], cost: int, bounds: BatchBounds) -> int:
        """Ask for what the count allows, and under a budget for about what the rest of it holds, so that few
        fetched messages are held over."""
        room = bounds.max_batch - len(batch)
        if bounds.max_cost is None:
            return room
        fits = math.ceil(max(0, bounds.max_cost - cost) / max(1.0, self._mean_cost))
        return max(1, min(room, fits))


async def collect_batch(sub: Subscription, max_batch: int, max_wait_s: float, idle_timeout_s: float) -> list[Delivery]:
    """Return up to ``max_batch`` deliveries, or ``[]`` when nothing arrived within ``idle_timeout_s``: one batch
    bounded by count only (a ``BatchCollector`` without costs)."""
    return await BatchCollector(sub).collect(BatchBounds(max_batch, max_wait_s), idle_timeout_s)
