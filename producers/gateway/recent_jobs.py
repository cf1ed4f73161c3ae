"""The dashboard's recent jobs: the newest job ids submitted through this gateway process, read from the store.

This is not a job history. The gateway keeps the ids of the last ``KEPT_JOBS`` jobs it accepted (a bounded ring,
in memory, lost on restart; jobs submitted through another gateway or published straight to the broker are not
in it), and ``GET /v1/operator/jobs`` reads their records in one round trip, so each line shows the job's state
now. The job history, every job the store holds, filtered and paged, is ``GET /v1/jobs``
(``fleet.producers.gateway.jobs.history``), which the dashboard shows.
"""

from __future__ import annotations

from collections import deque

from starlette.requests import Request

from fleet import tenancy
from fleet.schemas.jobs import JobRecord
from fleet.schemas.operator import RecentJob, RecentJobs
from fleet.store.base import ResultStore

KEPT_JOBS = 200
SCOPE = (
    "the newest jobs submitted through this gateway process since it started (not jobs of other gateways, "
    "nor older ones)"
)


class RecentJobIds:
    """A bounded ring of job ids, newest last; ``note`` is O(1) on the submit path."""

    def __init__(self, kept: int = KEPT_JOBS) -> None:
        self.kept = kept
        self._ids: deque[str] = deque(maxlen=kept)

    def note(self, job_id: str) -> None:
        self._ids.append(job_id)

    def newest(self, limit: int) -> list[str]:
        return list(reversed(self._ids))[:limit]


def recent_job(record: JobRecord) -> RecentJob:
    error = f"{record.error.type}: {record.error.message}" if record.error is not None else None
    return RecentJob(
        job_id=record.job_id,
        model=record.model,
        state=str(record.state),
        tenant=record.tenant,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        error=error,
    )


async def read_recent(
    ids: RecentJobIds, store: ResultStore, limit: int, viewer: str | None = tenancy.ALL_TENANTS
) -> RecentJobs:
    """The records of the newest ``limit`` ids that ``viewer`` may read (``fleet.tenancy.visible``: an operator
    key sees its tenant's jobs, as ``GET /v1/jobs/{id}`` does; the operator token every tenant's). An id whose
    record expired is left out."""
    wanted = ids.newest(ids.kept)
    jobs: list[RecentJob] = []
    for start in range(0, len(wanted), limit):
        records = await store.get_many(wanted[start : start + limit])
        jobs += [recent_job(r) for r in records if r is not None and tenancy.readable(r, viewer)]
        if len(jobs) >= limit:
            break
    return RecentJobs(jobs=jobs[:limit], kept=ids.kept, scope=SCOPE)


def note_submitted(request: Request, job_id: str) -> None:
    """Remember a job this gateway accepted (in ``GatewayState.recent_jobs``, read here without importing the state,
    which holds this module's ``RecentJobIds``)."""
    ids: RecentJobIds = request.app.state.gateway.recent_jobs
    ids.note(job_id)
