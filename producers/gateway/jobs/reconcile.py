"""The reconcile sweep: no job stays ``queued`` for a request that no broker has.

The gateway writes the record ``queued`` together with an *unpublished* mark that keeps the request message (one
store command, ``ResultStore.create(record, message)``), publishes, and clears the mark once the broker
acknowledged (``published``: one more command). A publish that fails deletes both. A gateway killed between the
write and the acknowledgement leaves the mark behind, and every gateway sweeps for marks older than
``reconcile_after_s``: ``claim_unpublished`` hands each one to one sweep at a time. For each claimed job:

* no record, or a record no longer ``queued``: the broker had the message (a worker started it) or the job is
  gone; the mark is cleared.
* ``queued`` past its deadline: finished ``expired``, saying the gateway stopped before publishing it.
* ``queued`` with its message: published again with the job id as message id, so the broker drops it if it had
  the first publish after all; then the mark is cleared. A publish that fails leaves the mark: the job is claimed
  again ``reconcile_after_s`` later.
* ``queued`` whose message is lost (its key expired): finished ``failed``, retriable, saying so.

``reconcile_after_s`` must be longer than the publish timeout, so that a sweep never races a publish still in
progress; a job that is republished anyway is at worst delivered twice, which workers tolerate (a job already
terminal is acked without running again).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter

from fleet.brokers.base import Broker
from fleet.errors import FleetError
from fleet.producers.gateway.calls import Bounded, message_priority, publish_request
from fleet.producers.gateway.limits import GatewayLimits
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.store.base import ResultStore
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

RECONCILED = Counter(
    "fleet_gateway_reconciled_total",
    "Jobs a reconcile sweep found unpublished, by model and outcome (republished, expired, lost, settled).",
    ["model", "outcome"],
)
CLAIM_BATCH = 100


class Reconciler:
    """Sweeps for unpublished jobs every ``interval_s`` (default: a third of ``after_s``); ``async with`` runs it."""

    def __init__(
        self,
        broker: Broker,
        store: ResultStore,
        limits: GatewayLimits,
        after_s: float,
        interval_s: float | None = None,
    ) -> None:
        self.broker = broker
        self.store = store
        self.limits = limits
        self.bounded = Bounded(store, limits.store_timeout_s)
        self.after_s = after_s
        self.interval_s = interval_s if interval_s is not None else max(after_s / 3, 0.2)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def sweep(self) -> int:
        """One sweep; returns how many unpublished jobs it handled."""
        claimed = await self.bounded(self.store.claim_unpublished(self.after_s, CLAIM_BATCH))
        for job_id, message in claimed:
            try:
                await self._reconcile(job_id, message)
            except FleetError as exc:  # the store or the broker is down: claimed again after after_s
                log.warning("unpublished job %s not reconciled yet: %s", job_id, exc.message)
        return len(claimed)

    async def _reconcile(self, job_id: str, message: bytes | None) -> None:
        record = await self.bounded(self.store.get(job_id))
        if record is None or record.state != JobState.queued:
            outcome, model = "settled", record.model if record else "unknown"
        elif record.expires_at is not None and record.expires_at <= time.time():
            outcome, model = "expired", record.model
            await self._end(record, JobState.expired, "expired", "the job's deadline passed before it was published")
        elif message is None:
            outcome, model = "lost", record.model
            await self._end(record, JobState.failed, "not_published", "its request message was lost; submit it again")
        else:
            outcome, model = "republished", record.model
            priority = message_priority(message)
            await publish_request(
                self.broker, record.model, job_id, message, self.limits, priority=priority, version=record.version
            )
            log.info("job %s was never confirmed published (its gateway stopped); published it again", job_id)
        await self.bounded(self.store.published(job_id))
        RECONCILED.labels(model, outcome).inc()

    async def _end(self, record: JobRecord, state: JobState, type_: str, why: str) -> None:
        message = f"the gateway that accepted this job stopped before publishing it, and {why}"
        error = JobError(type=type_, message=message, retriable=state == JobState.failed)
        finish = self.store.finish(record.job_id, state, model=record.model, error=error)
        await self.bounded(finish)

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.sweep()
            except FleetError as exc:
                log.warning("reconcile sweep failed (%s); trying again in %gs", exc.message, self.interval_s)
            except Exception:
                log.exception("reconcile sweep failed; trying again in %gs", self.interval_s)
            await wait_event(self._stop, self.interval_s)

    async def __aenter__(self) -> Reconciler:
        self._task = asyncio.create_task(self._run(), name="gateway-reconcile")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task])
