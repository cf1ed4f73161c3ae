"""Per-stage timings of a job's run: the ``StageTimings`` its terminal record carries, and the stage histograms.

The worker stamps each job as it passes a stage (``Job.fetched_at`` when the batch collector hands its batch over,
``batch_started_at`` / ``computed_at`` around the batch's compute); ``timings_of`` turns them, with the request's
``submitted_at`` (queued) and, for a DAG step, its ``DagContext.hop_started`` (the runner sets it as it publishes
the step), into the record's ``timings`` (the store adds ``stored`` as it writes,
``fleet.store.transitions.finished``). ``StageHistograms.observe`` puts each stored job's stages into
``fleet_job_stage_seconds{model, stage}`` (``hop``: hop_started to queued, the hop into a DAG step), with the job's
trace id as the exemplar when it was traced.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from prometheus_client.samples import Exemplar

from fleet.consumers.metrics import STAGE_SECONDS
from fleet.consumers.requests import Job
from fleet.schemas.construct import built
from fleet.schemas.jobs import JobRecord, StageTimings

_FIELDS = frozenset({"queued", "fetched", "batch_started", "computed", "hop_started"})
STAGES = ("queue", "batch_wait", "compute", "store", "hop")
_HOP = STAGES.index("hop")


def timings_of(job: Job) -> StageTimings | None:
    """The stage instants ``job`` passed (None: it was never fetched by a worker, e.g. a conflict record)."""
    if job.fetched_at is None:
        return None
    request = job.request
    dag = request.dag if request is not None else None
    values = {
        "queued": request.submitted_at if request is not None else None,
        "fetched": job.fetched_at,
        "batch_started": job.batch_started_at,
        "computed": job.computed_at,
        "stored": None,
        "hop_started": dag.hop_started if dag is not None else None,
    }
    return built(StageTimings, values, set(_FIELDS))


class StageHistograms:
    """``fleet_job_stage_seconds`` of one model, its label children looked up once.

    A settled batch is observed at once: each stage's values are counted into their buckets and each bucket, and
    the sum, is incremented once per batch (what ``Histogram.observe`` per value would leave, at a fraction of its
    cost: it takes a lock and scans the buckets per value). A client without the histogram internals this relies on
    gets ``observe`` per value."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._children = {stage: STAGE_SECONDS.labels(model, stage) for stage in STAGES}
        self._bulk = all(hasattr(child, a) for child in self._children.values() for a in _INTERNALS)

    def observe(self, records: Iterable[JobRecord]) -> None:
        """Each stage of each record that has timings (a stage whose two ends are not both known is skipped). The
        jobs of a batch share their batch's instants: those stages are worked out once per run of equal instants."""
        values: tuple[list[float], ...] = ([], [], [], [], [])  # per stage, in STAGES' order
        exemplars: tuple[list[tuple[int, str]], ...] = ([], [], [], [], [])  # (index in values, trace id)
        queue, later, hops = values[0], values[1:_HOP], values[_HOP]
        shared: tuple[float | None, ...] = ()
        durations: list[tuple[int, float]] = []  # (stage, seconds) of the shared instants
        for record in records:
            t = record.timings
            if t is None:
                continue
            d = t.__dict__
            queued, fetched = d["queued"], d["fetched"]
            instants = (fetched, d["batch_started"], d["computed"], d["stored"])
            if instants != shared:
                shared = instants
                durations = [
                    (stage, end - start)
                    for stage, (start, end) in enumerate(pairwise(instants))
                    if start is not None and end is not None
                ]
            trace_id = record.trace_id
            if queued is not None and fetched is not None:
                if trace_id:
                    exemplars[0].append((len(queue), trace_id))
                queue.append(fetched - queued)
            hop_started = d["hop_started"]
            if hop_started is not None and queued is not None:
                if trace_id:
                    exemplars[_HOP].append((len(hops), trace_id))
                hops.append(queued - hop_started)
            for stage, seconds in durations:
                if trace_id:
                    exemplars[stage + 1].append((len(later[stage]), trace_id))
                later[stage].append(seconds)
        for stage, amounts in enumerate(values):
            if amounts:
                self._add(self._children[STAGES[stage]], amounts, exemplars[stage])

    def _add(self, child: Any, amounts: list[float], exemplars: list[tuple[int, str]]) -> None:
        """Observe ``amounts`` (a negative one, clocks of two hosts apart, as 0); ``exemplars``: (index, trace id)
        of the traced ones, whose bucket then names that trace (the latest traced value of a bucket wins)."""
        amounts = [amount if amount > 0 else 0.0 for amount in amounts]
        if not self._bulk:
            traced = dict(exemplars)
            for i, amount in enumerate(amounts):
                trace_id = traced.get(i)
                child.observe(amount, {"trace_id": trace_id} if trace_id else None)
            return
        bounds = child._upper_bounds
        counts: dict[int, int] = {}
        for amount in amounts:
            i = bisect_left(bounds, amount)
            counts[i] = counts.get(i, 0) + 1
        child._sum.inc(sum(amounts))
        buckets = child._buckets
        for i, count in counts.items():
            buckets[i].inc(count)
        now = time.time()
        for index, trace_id in exemplars:
            amount = amounts[index]
            buckets[bisect_left(bounds, amount)].set_exemplar(Exemplar({"trace_id": trace_id}, amount, now))


_INTERNALS = ("_upper_bounds", "_buckets", "_sum")
