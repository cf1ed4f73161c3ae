"""The job-record state transitions, as pure functions shared by every result store.

A store reads the current record, asks these functions for the next one and writes it with its own atomic
compare-and-set; keeping the rules here means the in-memory store and Redis cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from schemas.jobs import JobError, JobRecord, JobState


def started(
    current: JobRecord | None,
    job_id: str,
    *,
    model: str,
    worker_id: str,
    deliveries: int,
    now: float,
) -> JobRecord:
    """The record after a worker picked the job up; a terminal ``current`` is returned unchanged."""
    if current is None:
        return JobRecord(
            job_id=job_id,
            model=model,
            state=JobState.running,
            created_at=now,
            started_at=now,
            worker_id=worker_id,
            deliveries=deliveries,
            expires_at=None,
        )
    if current.terminal:
        return current
    return current.model_copy(
        update={
            "state": JobState.running,
            "started_at": current.started_at if current.started_at is not None else now,
            "worker_id": worker_id,
            "deliveries": deliveries,
        }
    )


def finished(
    current: JobRecord | None,
    job_id: str,
    state: JobState,
    *,
    model: str,
    output: Any,
    error: JobError | None,
    worker_id: str | None,
    now: float,
) -> JobRecord:
    """The terminal record that replaces a non-terminal ``current`` (or stands alone when there is none)."""
    state = JobState(state)
    if not state.terminal:
        raise ValueError(f"finish() needs a terminal state, got {state.value!r}")
    if current is None:
        return JobRecord(
            job_id=job_id,
            model=model,
            state=state,
            output=output,
            error=error,
            created_at=now,
            finished_at=now,
            worker_id=worker_id,
            deliveries=0,
            expires_at=None,
        )
    return current.model_copy(
        update={
            "state": state,
            "output": output,
            "error": error,
            "finished_at": now,
            "worker_id": worker_id if worker_id is not None else current.worker_id,
        }
    )
