"""Each model's queue depth as the gateway sees it, the bound on it, and the drain rate behind ``Retry-After``.

The depth is the broker's lag (``fleet.lag.read_lag``: waiting plus in flight), read every ``lag_interval_s`` (the
same read keeps the ``fleet_queue_lag`` gauge fresh), plus what this gateway accepted since the read started and
what it is publishing now. A sample a few seconds old therefore never lets a burst through: 3,000 concurrent
submissions against a bound of 5 are counted one by one as they reserve their place. A stale sample can only make
the estimate too high (jobs drained since); before refusing, the gateway reads the lag again when its sample is older
than ``refresh_min_s``, once for all the submissions waiting on it.

What the gateway cannot see between reads is other producers: other gateway replicas and direct publishers. On
NATS the request stream itself refuses a publish beyond the bound (``fleet.brokers.nats``), which the gateway
answers with the same 429; on Kafka and the in-memory broker the bound is as exact as the gateway's sample.

The drain rate is what the model's workers finished per second between two reads: the earlier lag, plus what this
gateway accepted in between, minus the later lag. Other producers' jobs are missing from it, so it errs low and
``Retry-After`` errs long. It is an exponentially weighted mean over reads that had work to drain.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.brokers.base import Broker
from fleet.errors import QueueFull
from fleet.lag import QUEUE_LAG, read_lag
from fleet.producers.gateway.metrics import REJECTED
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

DRAIN_ALPHA = 0.5  # weight of a new drain-rate sample
RETRY_AFTER_UNKNOWN_S = 10  # Retry-After when the model has not been seen draining (no workers yet, say)
RETRY_AFTER_MAX_S = 60


@dataclass(slots=True)
class _Queue:
    bound: int  # 0: unbounded
    depth: int | None = None  # the broker's lag at the last read
    read_at: float | None = None  # monotonic time that read started
    accepted: deque[float] = field(default_factory=deque)  # monotonic times of publishes acked after read_at
    publishing: int = 0  # reserved, publish not yet answered
    drain_per_s: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def estimate(self) -> int:
        return (self.depth or 0) + len(self.accepted) + self.publishing


def retry_after_s(excess: int, drain_per_s: float | None) -> int:
    """Seconds until ``excess`` requests drained at ``drain_per_s`` (at least 1, at most ``RETRY_AFTER_MAX_S``)."""
    if not drain_per_s or drain_per_s <= 0:
        return RETRY_AFTER_UNKNOWN_S
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(max(excess, 1) / drain_per_s)))


class Backlog:
    """Admission against each model's bound; ``async with`` reads the lag once, then every ``interval_s``.

    Args:
        broker: a connected broker (``lag`` of each model's request subject and group).
        bounds: model name -> bound on its queued requests (0: unbounded).
        interval_s: how often every model's lag is read.
        refresh_min_s: before refusing, read the lag again if the last read is older than this.
    """

    def __init__(
        self,
        broker: Broker,
        bounds: dict[str, int],
        interval_s: float,
        *,
        refresh_min_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.interval_s = interval_s
        self.refresh_min_s = refresh_min_s
        self._clock = clock
        self._queues = {model: _Queue(bound) for model, bound in bounds.items()}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def bound(self, model: str) -> int:
        return self._queues[model].bound

    def depth(self, model: str) -> int:
        """The estimated depth: the last lag read plus what this gateway added since."""
        return self._queues[model].estimate()

    def drain_rate(self, model: str) -> float | None:
        return self._queues[model].drain_per_s

    # -- admission --------------------------------------------------------------------------------------------
    async def reserve(self, model: str) -> None:
        """Count one submission as publishing, or raise ``QueueFull`` (with ``retry_after_s``) when at the bound.

        Each reserved submission must end with ``published(model, ok)``.
        """
        queue = self._queues[model]
        if queue.bound and queue.estimate() >= queue.bound and self._stale(queue):
            await self.refresh(model)
        depth = queue.estimate()
        if queue.bound and depth >= queue.bound:  # no await between this check and the count below
            REJECTED.labels(model, "queue_full").inc()
            raise self.full(model, depth)
        queue.publishing += 1

    def published(self, model: str, ok: bool) -> None:
        """The publish of a reserved submission ended: acked by the broker (``ok``) or not."""
        queue = self._queues[model]
        queue.publishing -= 1
        if ok:
            queue.accepted.append(self._clock())

    def refused_by_broker(self, model: str, exc: QueueFull) -> QueueFull:
        """The broker refused a publish for its own bound: the queue is fuller than the sample said."""
        queue = self._queues[model]
        REJECTED.labels(model, "broker_full").inc()
        depth = max(queue.estimate(), exc.limit or 0, queue.bound)
        # Until the next read, count the queue as full (the refused publish itself is about to be released).
        queue.depth = max(queue.depth or 0, depth - len(queue.accepted))
        return self.full(model, depth, limit=exc.limit or queue.bound or None)

    def full(self, model: str, depth: int, *, limit: int | None = None) -> QueueFull:
        queue = self._queues[model]
        bound = limit if limit is not None else queue.bound
        wait_s = retry_after_s(depth - bound + 1, queue.drain_per_s)
        return QueueFull(model, bound, depth=depth, retry_after_s=wait_s)

    def _stale(self, queue: _Queue) -> bool:
        return queue.read_at is None or self._clock() - queue.read_at >= self.refresh_min_s

    # -- reads ------------------------------------------------------------------------------------------------
    async def refresh(self, model: str) -> None:
        """Read the lag of ``model`` now; submissions that wait on a read in progress share it."""
        queue = self._queues[model]
        if queue.lock.locked():
            async with queue.lock:  # someone is reading: its result is fresh enough
                return
        async with queue.lock:
            started = self._clock()
            try:
                lag = await read_lag(self.broker, model)
            except Exception as exc:
                log.warning("lag of %s not read: %s", model, exc)
                return
            QUEUE_LAG.labels(model).set(lag)
            self._sampled(queue, lag, started)

    def _sampled(self, queue: _Queue, lag: int, started: float) -> None:
        """Apply a lag read that started at ``started``: publishes acked before then are in it."""
        arrived = 0
        while queue.accepted and queue.accepted[0] <= started:
            queue.accepted.popleft()
            arrived += 1
        previous, previous_at = queue.depth, queue.read_at
        if previous is not None and previous_at is not None and started > previous_at and (previous or lag or arrived):
            rate = max(0, previous + arrived - lag) / (started - previous_at)
            old = queue.drain_per_s
            queue.drain_per_s = rate if old is None else DRAIN_ALPHA * rate + (1 - DRAIN_ALPHA) * old
        queue.depth, queue.read_at = lag, started

    async def refresh_all(self, models: Iterable[str] | None = None) -> None:
        for model in list(models or self._queues):
            await self.refresh(model)

    async def _run(self) -> None:
        while not self._stop.is_set():
            await wait_event(self._stop, self.interval_s)
            if not self._stop.is_set():
                await self.refresh_all()

    async def __aenter__(self) -> Backlog:
        await self.refresh_all()
        self._task = asyncio.create_task(self._run(), name="gateway-backlog")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task])
