"""Admission: what becomes of a fetched batch before the model sees it.

``admit`` (while the previous batch computes) parses every message on its own (``fleet.consumers.requests``: a body that
breaks a parser is one invalid message, never a failed batch), reads the batch's records in one round trip and
settles at once what must not run: invalid or poison messages, jobs that already ended (a redelivery, a cancel),
jobs whose deadline passed, jobs out of runs (``fleet.consumers.crashes``: ``max_deliveries`` runs counted against
them, or ten times that many started whatever ended them), and messages whose job id holds another model's or
tenant's record (``Settler.conflicts``: never computed, that record never touched). A redelivered job whose previous
run never ended (its worker disappeared) is judged by the size of that run's batch: a strike if it ran alone, else a
smaller batch for its next run (``fleet.consumers.crashes``; the compute loop splits the batch). The first delivery of a
job published without a record is not read: a DAG step (the runner makes none) and a request whose producer says so
(header ``fleet-record: none``: ``fleet publish``, ``publish_all``). The start's compare-and-set finds a record that
exists after all (a cancel, a duplicate, a re-publish of a finished job, another tenant's job: the store leaves that
one alone), so such a batch costs one store round trip less. ``start`` (when the batch is about to go to the device)
checks the deadlines again and moves the jobs to ``running``: a job is
``running`` only while it computes, and one that waits in the worker past its deadline ends ``expired``.

The run count lives in the job's record (``deliveries``: runs started; ``strikes``: runs counted against it;
``batch_size``: how many jobs its latest run started with), so redeliveries caused by an outage of the store or
the broker do not use up a job's runs, nor does a worker killed while it computed many jobs. A store outage is
waited out (``fleet.consumers.outage``) until the worker stops; then the messages go back to the broker.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fleet.brokers.base import Delivery
from fleet.constants import HEADER_RECORD, RECORD_NONE
from fleet.consumers.acks import poisoned
from fleet.consumers.crashes import OutOfRuns, after_vanished, out_of_runs
from fleet.consumers.requests import Job, parse_delivery
from fleet.consumers.settle import Settler, runs_allowed
from fleet.errors import StoreError
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.schemas.models import ModelSpec
from fleet.store.base import Start

log = logging.getLogger(__name__)

_RUNNING = JobState.running


def _tenant(job: Job) -> str | None:
    """The tenant the request message names (None: the default tenant, or no valid request)."""
    return job.request.tenant if job.request is not None else None


def _unrecorded(job: Job) -> bool:
    """Whether the job was published without a record: a DAG step, or a producer's ``fleet-record: none``."""
    if job.request is None:
        return False
    return job.request.dag is not None or job.delivery.headers.get(HEADER_RECORD) == RECORD_NONE


class Admission:
    """Admits one model's batches for one worker, settling through ``settler``."""

    def __init__(self, spec: ModelSpec, settler: Settler) -> None:
        self.spec = spec
        self.settler = settler
        self.max_deliveries = settler.max_deliveries

    async def admit(
        self, batch: list[Delivery], parsed: list[Job | None] | None = None, fetched_at: float | None = None
    ) -> list[Job]:
        """The jobs of ``batch`` that may run; everything else in it is settled. Never raises (but cancellation).

        ``parsed`` holds, per delivery, the job it was already parsed into (to weigh its cost), or ``None``;
        ``fetched_at`` (unix seconds) is when the batch was handed over (``Job.fetched_at``).
        """
        given = parsed or [None] * len(batch)
        jobs = [job or parse_delivery(delivery, self.spec) for delivery, job in zip(batch, given, strict=True)]
        candidates: list[Job] = []
        rejected: list[tuple[Job, JobError]] = []
        for job in jobs:
            job.fetched_at = fetched_at
            if job.error is not None:
                rejected.append((job, job.error))
            elif poisoned(job.delivery.delivery_count, self.max_deliveries):
                rejected.append((job, self._poison_error(job)))
            else:
                candidates.append(job)
        runnable = await self._check_records(candidates, rejected)
        return runnable

    async def start(self, jobs: list[Job]) -> list[Job]:
        """Just before the batch computes: expire what is past its deadline, move the rest to ``running``."""
        now = time.time()
        late = [job for job in jobs if job.deadline is not None and now > job.deadline]
        if late:
            jobs = [job for job in jobs if job.deadline is None or now <= job.deadline]
            await self.settler.expire(late)
        if not jobs:
            return []
        settler = self.settler
        model, worker_id, size = settler.model, settler.worker_id, len(jobs)
        items = [  # crashes.start_of, inlined: this runs once per job
            Start(
                job.job_id or "",
                model,
                worker_id,
                job.attempt,
                job.unread,
                _tenant(job),
                size,
                job.strikes,
                job.version,
            )
            for job in jobs
        ]
        try:
            records = await settler.outage.call(
                lambda: settler.store.start_many(items), f"start {len(items)} jobs", stop=settler.stop
            )
        except StoreError:
            await asyncio.gather(*(settler.release(job.delivery) for job in jobs))
            return []
        runnable = []
        ended = []
        foreign = []
        for job, record in zip(jobs, records, strict=True):
            if settler.foreign(job, record):  # another job's record, left as it was by the store
                foreign.append(job)
            elif record.terminal:  # cancelled since admission
                ended.append((job, record, False))
            else:
                runnable.append(job)
        if ended:
            await settler.stored(ended)
        if foreign:
            await settler.conflicts(foreign)
        return runnable

    async def _check_records(self, jobs: list[Job], rejected: list[tuple[Job, JobError]]) -> list[Job]:
        settler = self.settler
        for job in jobs:  # a first delivery published without a record: its start's compare-and-set checks that
            job.unread = job.delivery.delivery_count == 1 and _unrecorded(job)
        unread = [job for job in jobs if job.unread]
        jobs = [job for job in jobs if not job.unread]
        records: list[JobRecord | None] = []
        if jobs:
            ids = [job.job_id or "" for job in jobs]
            try:
                records = await settler.outage.call(
                    lambda: settler.store.get_many(ids), f"read {len(ids)} jobs", stop=settler.stop
                )
            except StoreError:  # stopping with the store away: hand the runnable ones back, settle the rest
                await asyncio.gather(*(settler.release(job.delivery) for job in jobs))
                jobs = []
        runnable: list[Job] = []
        ended: list[tuple[Job, JobRecord, bool]] = []
        late: list[Job] = []
        foreign: list[Job] = []
        now = time.time()
        for job, record in [*zip(jobs, records, strict=True), *((job, None) for job in unread)]:
            if record is not None and settler.foreign(job, record):
                foreign.append(job)
                continue
            if record is not None and record.terminal:
                ended.append((job, record, False))
                continue
            if record is not None:
                job.attempt = record.deliveries + 1
                job.deadline = job.deadline or record.expires_at
                if record.state is _RUNNING:  # its last run never ended: its worker disappeared
                    blame = after_vanished(record.strikes or 0, record.batch_size)
                    job.strikes, job.bound = blame.strikes, blame.bound
                elif record.strikes:
                    job.strikes = record.strikes
            out = out_of_runs(job.strikes, job.attempt, runs_allowed(job, self.max_deliveries))
            if out is not None:
                rejected.append((job, self._exhausted_error(job, out)))
            elif job.deadline is not None and now > job.deadline:
                late.append(job)
            else:
                runnable.append(job)
        settling = []  # most batches have nothing to settle here: no tasks for empty lists
        if rejected:
            settling.append(settler.reject(rejected))
        if ended:
            settling.append(settler.stored(ended))
        if late:
            settling.append(settler.expire(late))
        if foreign:
            settling.append(settler.conflicts(foreign))
        if settling:
            await asyncio.gather(*settling)
        return runnable

    def _exhausted_error(self, job: Job, out: OutOfRuns) -> JobError:
        runs, allowed = job.attempt - 1, runs_allowed(job, self.max_deliveries)
        if out is OutOfRuns.strikes:
            message = (
                f"started {runs} times without completing; {job.strikes} of those runs count against it (max "
                f"{allowed}): its worker disappeared while it computed alone, or it failed retriably. It probably "
                "crashes or stops the worker that runs it"
            )
        else:
            message = (
                f"started {runs} times without completing, the most any job may start ({allowed} runs allowed, "
                "x10), whatever ended them: its workers kept disappearing"
            )
        return JobError(type="max_deliveries", message=message)

    def _poison_error(self, job: Job) -> JobError:
        count = job.delivery.delivery_count
        return JobError(
            type="poison_message",
            message=f"delivered {count} times without ever starting (more than {self.max_deliveries} runs allow); "
            "it probably stops every worker that reads it",
        )
