"""A worker's usage counts on their way to the usage store: settled batches add to them, one write sends them.

The settler adds each settled batch's counts (``fleet.consumers.usage.usage_of``) here without waiting for
anything; the worker's flusher writes what has gathered every ``interval_s`` (1 s) in one call (one Redis pipeline,
``fleet.store.usage``), and ``stop`` writes the rest after the last batch settled. So the usage store costs at most
one round trip per settled batch and, under load, one per second whatever the batch rate: the settle path, which
holds the acks and the next batch's slot, never waits on it.

A write that fails or takes longer than ``write_timeout_s`` loses the counts it carried (logged, counted in
``fleet_usage_write_failures_total``), never a job: usage is an account, not a result. A write cancelled midway (the
worker stopping) puts its counts back for the final write. A crash loses at most the last interval's counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from fleet.consumers import metrics
from fleet.errors import StoreError
from fleet.store.usage import UsageCount, UsageKey, UsageStore
from fleet.tasks import wait_event

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
WRITE_TIMEOUT_S = 2.0


class UsageBuffer:
    """Counts not written yet, for one worker (``model`` and ``worker_id`` name it in logs and metrics)."""

    def __init__(
        self,
        store: UsageStore,
        model: str,
        worker_id: str,
        *,
        interval_s: float = FLUSH_INTERVAL_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.model = model
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.write_timeout_s = write_timeout_s
        self._pending: dict[UsageKey, UsageCount] = {}

    def add(self, counts: Mapping[UsageKey, UsageCount]) -> None:
        for key, count in counts.items():
            held = self._pending.get(key)
            if held is None:
                self._pending[key] = UsageCount(count.jobs, count.items, count.device_seconds)
            else:
                held.add(count)

    async def flush(self) -> None:
        """Write what has gathered, in one call. Never raises (but cancellation, which keeps the counts)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.store.add(pending)
        except asyncio.CancelledError:
            self.add(pending)
            raise
        except (StoreError, TimeoutError) as exc:
            metrics.USAGE_WRITE_FAILURES.labels(self.model).inc()
            jobs = sum(count.jobs for count in pending.values())
            log.warning("worker %s: usage of %d jobs not counted (%s)", self.worker_id, jobs, exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``interval_s`` until ``stop`` is set (the final flush is the worker's, after the last batch)."""
        while not await wait_event(stop, self.interval_s):
            await self.flush()
