"""Settling: the one place where an outcome becomes a store write and then an ack, a nak or a dead letter.

Every message a worker takes leaves through here, whatever became of it: a result or a model error of a batch
(``results``), a message that must not run (``reject``: invalid, poison, out of runs), one whose deadline passed
(``expire``) and one whose job had already ended elsewhere (``stored``). The order is always the same:

1. the outcome is written to the store (first terminal write wins; a store outage is waited out, see
   ``fleet.consumers.outage``: it is not the job's failure);
2. the ``on_settled`` hooks run with the stored terminal record (DAG continuation, cache fill, tests); a hook that
   raises hands the message back, and because the record is terminal its redelivery only runs the hooks again;
3. ``acks.for_stored`` says ack or dead letter (a ``failed`` job (re)sends its letter, de-duplicated by id);
4. with tenants' quotas on (``fleet.store.quotas``), the batch's jobs give their queued places back, in one
   pipelined call, never raising: a release that fails only delays the places until a sweep or their holds end;
5. the computed jobs whose records this write made terminal add their device-seconds (written into each record in
   step 1, ``fleet.consumers.usage``) to ``fleet_device_seconds_total`` and to the worker's usage buffer
   (``fleet.consumers.usage_buffer``), which writes them to the usage store in one call per second at most: nothing
   here waits on the usage store, and a usage write that fails loses usage, never a job.

A message whose job id holds another model's or another tenant's record (``fleet.store.transitions.foreign``,
checked by the store inside its compare-and-set of start and finish) is a conflict (``conflicts``): it is never
computed, nothing is written into that record and nothing of it is handed on; the hooks hear of the message's own
job as ``failed`` (a record made here, not stored: a DAG run does not wait for a step that cannot run) and the
message is dead-lettered with the error ``job_id_conflict``, so that the subject moves on.

Only a retriable model error skips the terminal write: ``acks.decide`` says retry (while the job's strikes allow,
``fleet.consumers.crashes``), its run is marked as one that counts against it (``batch_size`` 1, one ``start_many`` for
the batch's retries, on that error path only; a store outage there only leaves it uncounted) and the message is
handed back with a delay. Because the ack comes last, a crash anywhere before it means a redelivery, which finds
the record terminal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fleet.brokers.base import Broker, Delivery, ack_all
from fleet.consumers import metrics
from fleet.consumers.acks import Action, decide, for_stored
from fleet.consumers.crashes import start_of
from fleet.consumers.outage import StoreOutage
from fleet.consumers.requests import Job
from fleet.consumers.stages import StageHistograms, timings_of
from fleet.consumers.stats import WorkerStats
from fleet.consumers.usage import usage_of
from fleet.consumers.usage_buffer import UsageBuffer
from fleet.deadletter import dead_letter_bytes, publish_dead_letter
from fleet.errors import BrokerError, StoreError
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.store import transitions
from fleet.store.base import Finish, ResultStore
from fleet.store.quotas import Quotas, release_quietly, tenant_of_record

log = logging.getLogger(__name__)

OnSettled = Callable[[Job, JobRecord, bool], Awaitable[None]]
"""A hook: ``(job, terminal record, won)``, awaited before the message is settled; ``won`` when this worker's write
made the record terminal. It must be idempotent: a redelivery of a terminal job calls it again."""

HOOK_RETRY_DELAY_S = 1.0


def tenant_of(job: Job) -> str | None:
    """The tenant a message names: its request's, or for a message that is no valid request the ``tenant`` of
    what could be decoded of it (None: the default tenant)."""
    if job.request is not None:
        return job.request.tenant
    tenant = job.body.get("tenant") if job.body else None
    return tenant if isinstance(tenant, str) else None


def runs_allowed(job: Job, max_deliveries: int) -> int:
    """The most runs of a job: its DAG step's ``retries + 1`` when it has them, else ``max_deliveries``."""
    dag = job.request.dag if job.request is not None else None
    return dag.runs if dag is not None and dag.runs is not None else max_deliveries


class Held:
    """The deliveries a worker holds (fetched, not yet settled), keyed by identity; ``on_release`` hears of each
    one let go (the idle announcer counts free slots)."""

    def __init__(self) -> None:
        self._items: dict[int, Delivery] = {}
        self.on_release: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def add(self, deliveries: Iterable[Delivery]) -> None:
        for delivery in deliveries:
            self._items[id(delivery)] = delivery

    def values(self) -> list[Delivery]:
        return list(self._items.values())

    def forget(self, delivery: Delivery) -> None:
        if self._items.pop(id(delivery), None) is not None and self.on_release is not None:
            self.on_release()


class Settler:
    """Settles one model's messages for one worker. ``stop`` is the worker's stop event: once it is set, the
    store writes of messages that have not run yet give up and hand their messages back."""

    def __init__(
        self,
        *,
        model: str,
        worker_id: str,
        broker: Broker,
        store: ResultStore,
        max_deliveries: int,
        held: Held,
        outage: StoreOutage,
        stats: WorkerStats,
        stop: asyncio.Event,
        quotas: Quotas | None = None,
        usage: UsageBuffer | None = None,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.worker_id = worker_id
        self.broker = broker
        self.store = store
        self.max_deliveries = max_deliveries
        self.held = held
        self.outage = outage
        self.stats = stats
        self.stop = stop
        self.quotas = quotas  # tenants' queued-job quotas: each settled batch gives its places back in one call
        self.usage = usage  # each settled batch adds its computed jobs' device-seconds (written by the worker)
        self.device = device  # the worker's torch device: its kind prices the usage (``cuda:0`` -> ``cuda``)
        self.on_settled: list[OnSettled] = []
        self._counters: dict[str, Any] = {}
        self._latency = metrics.JOB_LATENCY.labels(model)
        self._device_seconds: dict[tuple[str, str, str], Any] = {}  # the metric's children, by labels
        self.stages = StageHistograms(model)
        self.tracing: Any = None  # the process's fleet.tracing Tracing when tracing is on (the worker sets it)

    # -- outcomes -------------------------------------------------------------------------------------------
    async def results(self, jobs: list[Job], results: list[Any]) -> None:
        """A computed batch: outputs (JSON-ready) or ``JobError`` per job. Stored in one call, then settled."""
        final: list[tuple[Job, Finish]] = []
        retries = []
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, JobError):
                decision = decide(result, job.strikes + 1, runs_allowed(job, self.max_deliveries))
                if decision.action is Action.retry:
                    retries.append((job, result, decision.delay_s))
                    continue
                final.append((job, self._finish(job, JobState.failed, error=result)))
            else:
                final.append((job, self._finish(job, JobState.succeeded, output=result)))
        if retries:
            await self._count_against([job for job, _, _ in retries])
            await asyncio.gather(*(self._retry(job, error, delay_s) for job, error, delay_s in retries))
        # Computed work is never handed back for want of a store: only a drain deadline (a cancel) ends the wait.
        await self._store_and_settle(final, patient=True)

    async def reject(self, rejected: list[tuple[Job, JobError]]) -> None:
        """Messages that must not run: stored ``failed`` (when they have a job id), then dead-lettered."""
        letters = [self._dead_letter(job, error) for job, error in rejected if job.job_id is None]
        with_id = [(job, self._finish(job, JobState.failed, error=error)) for job, error in rejected if job.job_id]
        await asyncio.gather(*letters, self._store_and_settle(with_id, patient=False))

    async def expire(self, jobs: list[Job]) -> None:
        error = JobError(type="expired", message="the job's deadline passed before a worker could start it")
        await self._store_and_settle([(job, self._finish(job, JobState.expired, error=error)) for job in jobs], False)

    def foreign(self, job: Job, record: JobRecord) -> bool:
        """Whether ``record`` (read or handed back by the store under the job's id) belongs to another job."""
        return transitions.foreign(record, self.model, tenant_of(job))

    async def conflicts(self, jobs: list[Job]) -> None:
        """Messages whose job id holds another model's or tenant's record: settled without touching or reading it
        (see the module docstring)."""
        now = time.time()
        settled = [(job, self._conflict_record(job, now), False) for job in jobs]
        if self.on_settled:
            passed = await asyncio.gather(*(self._run_hooks(job, record, won) for job, record, won in settled))
            settled = [item for item, ok in zip(settled, passed, strict=True) if ok]
        await asyncio.gather(*(self._dead_letter(job, record.error or _NO_ERROR) for job, record, _ in settled))

    def _conflict_record(self, job: Job, now: float) -> JobRecord:
        error = JobError(
            type="job_id_conflict",
            message=f"job id {job.job_id!r} belongs to another job (another model or tenant); this message was "
            "not computed and that job was left alone: publish it again with an id of its own",
        )
        job_id, worker_id = job.job_id or "", self.worker_id
        return transitions.finished(
            None,
            job_id,
            JobState.failed,
            model=self.model,
            output=None,
            error=error,
            worker_id=worker_id,
            now=now,
            tenant=tenant_of(job),
        )

    async def stored(self, settled: list[tuple[Job, JobRecord, bool]]) -> None:
        """Settle messages whose jobs have a terminal record (maybe written elsewhere): hooks, then ack or letter.
        The acks of a batch go in one call (``ack_all``: one write on NATS; an ack does not wait for the broker),
        dead letters concurrently."""
        letters = []
        acks: list[Job] = []
        counts: dict[str, int] = {}
        if self.on_settled:  # concurrently: a hook may gather the batch's jobs (one DAG update per run, not per job)
            passed = await asyncio.gather(*(self._run_hooks(job, record, won) for job, record, won in settled))
            settled = [item for item, ok in zip(settled, passed, strict=True) if ok]
        for job, record, won in settled:
            if won and record.finished_at is not None:  # the job's own end, once: not a redelivery's
                self._latency.observe(max(0.0, record.finished_at - record.created_at))
            if for_stored(record.state) is Action.dead_letter:
                letters.append(self._dead_letter(job, record.error or _NO_ERROR))
                continue
            acks.append(job)
            outcome = record.state.value if won else "duplicate"
            counts[outcome] = counts.get(outcome, 0) + 1
        if acks:
            await self.ack(acks)
        for outcome, amount in counts.items():
            self.count(outcome, amount)
        if letters:
            await asyncio.gather(*letters)
        if self.quotas is not None and settled:  # after the acks: a Redis hiccup here never touches the jobs
            ended = [(tenant_of_record(record), job.job_id) for job, record, _ in settled if job.job_id]
            await release_quietly(self.quotas, ended)
        await self._count_usage(settled)

    async def _count_usage(self, settled: list[tuple[Job, JobRecord, bool]]) -> None:
        """Step 5 of the module docstring: the metric and the usage buffer; nothing waits, nothing raises."""
        counts = usage_of(settled, self.device)
        if not counts:
            return
        for key, count in counts.items():
            labels = (key.model, key.version, key.tenant)
            child = self._device_seconds.get(labels)
            if child is None:
                child = self._device_seconds[labels] = metrics.DEVICE_SECONDS.labels(*labels)
            child.inc(count.device_seconds)
        if self.usage is not None:
            self.usage.add(counts)

    async def release(self, delivery: Delivery, delay_s: float = 0.0) -> None:
        """Hand a message back to the broker, unsettled; it is delivered again (a lost nak: after the ack wait)."""
        self.held.forget(delivery)
        try:
            await delivery.nak(delay_s)
        except Exception as exc:
            log.warning(
                "worker %s: nak not confirmed (%s); the message returns after the ack wait", self.worker_id, exc
            )

    async def ack(self, jobs: list[Job]) -> None:
        """Settle messages whose results are stored. A lost ack only means a redelivery, acked as a duplicate."""
        forget = self.held.forget
        for job in jobs:
            forget(job.delivery)
        try:
            await ack_all([job.delivery for job in jobs])
        except BrokerError as exc:
            log.warning(
                "jobs %s...: %d acks not all confirmed (%s); a redelivery will be acked as a duplicate",
                jobs[0].job_id,
                len(jobs),
                exc,
            )

    def count(self, outcome: str, amount: int = 1) -> None:
        counter = self._counters.get(outcome)
        if counter is None:
            counter = self._counters[outcome] = metrics.ITEMS.labels(self.model, outcome)
        counter.inc(amount)

    # -- steps ----------------------------------------------------------------------------------------------
    def _finish(self, job: Job, state: JobState, *, output: Any = None, error: JobError | None = None) -> Finish:
        assert job.job_id is not None
        tenant = tenant_of(job)
        worker_id = self.worker_id
        trace_id = None
        if self.tracing is not None:
            trace_id = self.tracing.trace_id_of(job)
        return Finish(
            job.job_id,
            state,
            self.model,
            output=output,
            error=error,
            worker_id=worker_id,
            tenant=tenant,
            version=job.version,
            device_seconds=job.device_seconds,
            timings=timings_of(job),
            trace_id=trace_id,
        )

    async def _store_and_settle(self, items: list[tuple[Job, Finish]], patient: bool) -> None:
        if not items:
            return
        finishes = [finish for _, finish in items]
        try:
            stored = await self.outage.call(
                lambda: self.store.finish_many(finishes),
                f"store {len(finishes)} results",
                stop=None if patient else self.stop,
            )
        except StoreError as exc:  # only when stopping: the messages go back, nothing was decided
            log.warning(
                "worker %s: stopping with the store away (%s); handing %d back", self.worker_id, exc, len(items)
            )
            await asyncio.gather(*(self.release(job.delivery) for job, _ in items))
            return
        settled = [(job, record, won) for (job, _), (won, record) in zip(items, stored, strict=True)]
        self.stages.observe(record for _, record, won in settled if won)
        if self.tracing is not None:  # before the hooks: a DAG hop is a child of its job's process span
            self._trace([(job, record) for job, record, won in settled if won])
        foreign = [job for job, record, won in settled if not won and self.foreign(job, record)]
        if foreign:  # rare: the store handed back another job's record and wrote nothing
            settled = [(job, record, won) for job, record, won in settled if won or not self.foreign(job, record)]
            await self.conflicts(foreign)
        await self.stored(settled)

    def _trace(self, items: list[tuple[Job, JobRecord]]) -> None:
        try:
            self.tracing.settled(self.broker.scheme, self.model, items)
        except Exception:  # a tracing defect never holds up a settle
            log.exception("worker %s: the spans of %d jobs were not recorded", self.worker_id, len(items))

    async def _run_hooks(self, job: Job, record: JobRecord, won: bool) -> bool:
        try:
            for hook in self.on_settled:
                await hook(job, record, won)
        except Exception:
            log.exception("job %s: a settle hook failed; handing the message back to run it again", job.job_id)
            await self.release(job.delivery, HOOK_RETRY_DELAY_S)
            return False
        return True

    async def _count_against(self, jobs: list[Job]) -> None:
        """Mark runs that failed retriably as runs alone, so that their redeliveries count them as strikes."""
        items = [start_of(job, self.model, self.worker_id, 1) for job in jobs if job.job_id]
        if not items:
            return
        try:
            await self.outage.call(lambda: self.store.start_many(items), f"count {len(items)} retries", stop=self.stop)
        except StoreError as exc:  # stopping with the store away: the runs go uncounted, the retries happen anyway
            log.warning("worker %s: %d retries not counted (%s)", self.worker_id, len(items), exc)

    async def _retry(self, job: Job, error: JobError, delay_s: float) -> None:
        log.info("job %s failed (%s), run %d; retrying in %.1fs", job.job_id, error.message, job.attempt, delay_s)
        self.stats.failures += 1
        self.count("retried")
        await self.release(job.delivery, delay_s)

    async def _dead_letter(self, job: Job, error: JobError) -> None:
        """Publish to the dead-letter subject, then terminate the message; its failure is already stored."""
        self.stats.failures += 1
        request = job.body if job.request is None else _request_json(job)
        letter = dead_letter_bytes(
            job_id=job.job_id,
            model=self.model,
            error=error,
            deliveries=job.delivery.delivery_count,
            sender=self.worker_id,
            request=request,
            data=job.delivery.data,
        )
        log.warning("job %s dead-lettered: %s", job.job_id, error.message)
        try:
            await publish_dead_letter(self.broker, self.model, job.job_id, error, letter, job.delivery.msg_id)
            self.held.forget(job.delivery)
            await job.delivery.term()
        except BrokerError as exc:
            log.warning("job %s: dead letter not published (%s); handing the message back", job.job_id, exc)
            await self.release(job.delivery, HOOK_RETRY_DELAY_S)
            return
        self.count("dead_lettered")


def _request_json(job: Job) -> dict[str, Any] | None:
    try:
        return job.request.model_dump(mode="json") if job.request is not None else None
    except Exception:  # the letter then carries the raw body
        return None


_NO_ERROR = JobError(type="failed", message="the job failed (its record has no error)")
