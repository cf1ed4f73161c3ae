"""Per-stage timings of a job's run: the ``StageTimings`` its terminal record carries, and the stage histograms.

The worker stamps each job as it passes a stage (``Job.fetched_at`` when the batch collector hands its batch over,
``batch_started_at`` / ``computed_at`` around the batch's compute); ``timings_of`` turns them, with the request's
``submitted_at`` (queued), into the record's ``timings`` (the store adds ``stored`` as it writes,
``fleet.store.transitions.finished``). ``StageHistograms.observe`` puts each stored job's stages into
``fleet_job_stage_seconds{model, stage}``, with the job's trace id as the exemplar when it was traced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fleet.consumers.metrics import STAGE_SECONDS
from fleet.consumers.requests import Job
from fleet.schemas.construct import built
from fleet.schemas.jobs import JobRecord, StageTimings

_FIELDS = frozenset({"queued", "fetched", "batch_started", "computed"})
STAGES = ("queue", "batch_wait", "compute", "store", "hop")


def timings_of(job: Job) -> StageTimings | None:
    """The stage instants ``job`` passed (None: it was never fetched by a worker, e.g. a conflict record)."""
    if job.fetched_at is None:
        return None
    values = {
        "queued": job.request.submitted_at if job.request is not None else None,
        "fetched": job.fetched_at,
        "batch_started": job.batch_started_at,
        "computed": job.computed_at,
        "stored": None,
        "next_published": None,
    }
    return built(StageTimings, values, set(_FIELDS))


class StageHistograms:
    """``fleet_job_stage_seconds`` of one model, its label children looked up once."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._children = {stage: STAGE_SECONDS.labels(model, stage) for stage in STAGES}

    def observe(self, records: Iterable[JobRecord]) -> None:
        """Each stage of each record that has timings (a stage whose two ends are not both known is skipped)."""
        queue, wait, compute, store = (self._children[s] for s in STAGES[:4])
        for record in records:
            t = record.timings
            if t is None:
                continue
            exemplar = {"trace_id": record.trace_id} if record.trace_id else None
            _observe(queue, t.queued, t.fetched, exemplar)
            _observe(wait, t.fetched, t.batch_started, exemplar)
            _observe(compute, t.batch_started, t.computed, exemplar)
            _observe(store, t.computed, t.stored, exemplar)

    def on_hop(self, record: JobRecord, seconds: float) -> None:
        """A DAG step's hop (``DagRunner.on_hop``): its record written to its next steps published."""
        _observe(self._children["hop"], 0.0, seconds, {"trace_id": record.trace_id} if record.trace_id else None)


def _observe(child: Any, start: float | None, end: float | None, exemplar: dict[str, str] | None) -> None:
    if start is None or end is None:
        return
    value = end - start
    if value < 0:
        value = 0.0  # clocks of two hosts (a producer's submitted_at): a skew is no negative wait
    if exemplar is None:
        child.observe(value)
    else:
        child.observe(value, exemplar)
