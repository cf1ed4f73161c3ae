"""Crashes and blame: which runs count against a job's ``max_deliveries``. Pure functions, table-tested.

A worker that disappears (SIGKILL, OOM, preemption, scale-in) leaves the jobs it was computing ``running`` in
the store, and the broker delivers their messages again. That is evidence against a job only when the job was the
one thing the worker was doing. So every start of a run writes, in the same compare-and-set that moves the job to
``running`` (no extra round trip), how many jobs the run started with (``JobRecord.batch_size``) and the job's
*strikes* so far (``JobRecord.strikes``), and admission judges a redelivered job whose record is still ``running``
(its previous run never ended) by ``after_vanished``:

=================  =========================================  ========================================
``batch_size``     what the vanished run says                 the next run
=================  =========================================  ========================================
1                  the job ran alone: a **strike**             alone (at most 1 job)
n > 1              one of n: any of them, or none, killed it  at most ``n // 2`` jobs (bisection)
0                  its worker was draining (told to stop)     any batch
None               a record written before this rule          any batch
=================  =========================================  ========================================

Bisection: a job that really kills its worker is alone after at most log2(max_batch) crashes of ever smaller
batches, and collects a strike per crash from then on; its neighbours are separated from it on the way and finish.
A healthy job whose worker is killed by the infrastructure needs ``max_deliveries`` kills *while it computes alone*
to fail. A run that ends in a retriable model error is a strike too (the job failed on its own): the settler
marks such a run as a run alone (``batch_size`` 1) before handing its message back, on that error path only.

A worker told to stop (SIGTERM, an operator's drain, a scale-in) writes batch size 0 over the run it is computing
(one best-effort store call of at most ``worker.DRAIN_MARK_TIMEOUT_S``), so a grace period that runs out before the
run ends is not held against its jobs. A delivery that was fetched but never started (taken ahead of the batch
computing, handed back by a drain, held by a worker that died before its start) never moves its record: it counts
nothing here, only in the broker's count below. A record is also left ``running`` by a live worker whose ack wait
lapsed (its keep-alives could not reach the broker): that run is judged as a vanished one.

A record that is not ``running`` adds nothing: ``queued`` (no run began: a store or broker outage, a nak) or
terminal (settled elsewhere). A job is dead-lettered (``max_deliveries``) by ``out_of_runs`` when

* its strikes reach its runs allowed (``max_deliveries``, or a DAG step's ``retries + 1``): the poison cap; or
* it has started ``RAW_RUNS_FACTOR`` times that many runs, whatever ended them: the last resort, so a job never
  loops forever in a storm that never lets it compute alone.

The broker's own delivery count still backs both for a message that stops its worker before it can even start
(``acks.poisoned``, ``POISON_FACTOR`` deliveries per run). Neither broker ends a message before Fleet decides:
Fleet's NATS groups deliver without limit (``max_deliver`` -1, also set on a group found with a limit), and Kafka
has no delivery limit. Nothing here changes the order of effects in ``fleet.consumers.settle``: a dead letter is a
stored
``failed`` record first, then the letter, then the ack.

Cost: nothing more per job on the normal path than two fields in the start's compare-and-set (about 15 bytes of
record) and a comparison at admission; a batch is split (one more start round trip per extra run) only when it
holds jobs redelivered from a vanished run of many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from fleet.consumers.requests import Job
from fleet.store.base import Start

RAW_RUNS_FACTOR = 10  # runs started, whatever ended them, per run allowed: the last-resort bound
DRAINING = 0  # the batch size a draining worker writes for the runs it is computing: not evidence


@dataclass(frozen=True, slots=True)
class Blame:
    strikes: int  # the job's strikes, this vanished run included
    bound: int | None  # the most jobs its next run may start with (None: any)


def after_vanished(strikes: int, batch_size: int | None) -> Blame:
    """What a run that started with ``batch_size`` jobs and never ended says about a job with ``strikes``."""
    if batch_size is None or batch_size == DRAINING:
        return Blame(strikes, None)
    if batch_size == 1:
        return Blame(strikes + 1, 1)
    return Blame(strikes, max(1, batch_size // 2))


class OutOfRuns(StrEnum):
    strikes = "strikes"  # its runs allowed counted against it: it kills its worker (or keeps failing)
    runs = "runs"  # the last resort: too many runs started, whatever ended them


def out_of_runs(strikes: int, attempt: int, runs_allowed: int) -> OutOfRuns | None:
    """Whether a job with ``strikes`` may not start run number ``attempt`` (None: it may)."""
    if strikes >= runs_allowed:
        return OutOfRuns.strikes
    if attempt > RAW_RUNS_FACTOR * runs_allowed:
        return OutOfRuns.runs
    return None


def plan(bounds: Sequence[int | None]) -> list[list[int]]:
    """Split a batch into runs (lists of indexes, in order) so that each job runs with at most its bound of jobs.

    The tightest bounds are served first, each run filled with the next tightest; unbounded jobs fill the last run.
    One run of everything when nothing is bounded (the normal path)."""
    order = sorted(range(len(bounds)), key=lambda i: (bounds[i] is None, bounds[i] or 0, i))
    runs: list[list[int]] = []
    room = 0
    for i in order:
        if room == 0:
            runs.append([])
            bound = bounds[i]
            room = len(bounds) if bound is None else bound
        runs[-1].append(i)
        room -= 1
    return [sorted(run) for run in runs]


def split(jobs: list[Job]) -> list[list[Job]]:
    """``plan`` for jobs: the batch itself when no job in it is bounded."""
    if all(job.bound is None for job in jobs):
        return [jobs]
    return [[jobs[i] for i in run] for run in plan([job.bound for job in jobs])]


def start_of(job: Job, model: str, worker_id: str, batch_size: int) -> Start:
    """The ``start_many`` item that marks a run already started (its record exists: not ``unread``) with another
    ``batch_size``; its runs and strikes stay as they are. A terminal record is left alone, as by any start."""
    tenant = job.request.tenant if job.request is not None else None
    return Start(job.job_id or "", model, worker_id, job.attempt, False, tenant, batch_size, job.strikes, job.version)
