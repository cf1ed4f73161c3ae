"""REST bodies of the gateway."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet import constants as c
from fleet.schemas.dags import STEP_JOB_ID_PATTERN, STEP_JOB_ID_RULE
from fleet.schemas.jobs import Arm, CacheLevel, JobError, JobState
from fleet.schemas.wire import CLIENT_JOB_ID_PATTERN, ENCODING_HELP, EncodingFormat, Priority

_STEP_JOB_ID_RE = re.compile(STEP_JOB_ID_PATTERN)


class SubmitRequest(BaseModel):
    """``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="model name, e.g. embed, echo, sleep; 'name@version' is accepted when that version is the one "
        "served (else 404 unknown_model naming the served version)"
    )
    input: dict[str, Any] = Field(description="model input, validated against the model's input schema")
    job_id: str | None = Field(
        None,
        pattern=CLIENT_JOB_ID_PATTERN,
        description=(
            "optional idempotency key: submitting the same id twice creates one job. Ids shaped "
            "<run>.<step>.<index>[.<anything>] are reserved for DAG steps"
        ),
    )
    timeout_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="a job not started within this many seconds ends 'expired'"
    )
    priority: Priority = Field(
        "normal", description="high, normal or low (integers -9..9 map by sign: >0 high, 0 normal, <0 low)"
    )
    cache: bool = Field(
        True,
        description="false: skip the result caches (no lookup, no fill), as the header 'X-Cache-Control: bypass'",
    )
    encoding_format: EncodingFormat = Field("float", description=ENCODING_HELP)

    @field_validator("job_id")
    @classmethod
    def _not_a_step_id(cls, value: str | None) -> str | None:
        if value is not None and _STEP_JOB_ID_RE.match(value):
            raise ValueError(STEP_JOB_ID_RULE)
        if value is not None and value.endswith(c.SHADOW_JOB_SUFFIX):
            raise ValueError(
                f"job ids ending in {c.SHADOW_JOB_SUFFIX!r} are reserved for the shadow copies of traffic policies; "
                "choose another id (or let Fleet choose)"
            )
        return value


class SubmitResponse(BaseModel):
    job_id: str
    status: JobState
    cache: CacheLevel | None = Field(
        None, description="the cache level that answered (status 'succeeded' at once); absent when not cached"
    )


class InferResponse(BaseModel):
    """``POST /v1/infer``: the output of a job that succeeded within the wait."""

    job_id: str
    model: str
    output: Any = Field(description="the model's output, as in the job's record")
    worker_id: str | None = Field(None, description="the worker that computed it")
    started_at: float | None = None
    finished_at: float | None = None
    cache: CacheLevel | None = Field(None, description="the result cache level that answered; null when computed")
    cache_similarity: float | None = Field(None, description="for an L3 (semantic) hit: the cosine similarity")


class ErrorBody(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. unknown_model, invalid_input, payload_too_large")
    message: str
    details: Any = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class JobSummary(BaseModel):
    """One line of ``GET /v1/jobs``: a job's record less its output (read it with ``GET /v1/jobs/{id}``)."""

    job_id: str
    model: str
    state: JobState
    tenant: str = Field(description="the tenant that owns the job")
    version: str | None = None
    created_at: float = Field(description="unix seconds")
    started_at: float | None = None
    finished_at: float | None = None
    expires_at: float | None = None
    deliveries: int = 0
    error: JobError | None = None
    cache: CacheLevel | None = None
    arm: Arm | None = None


class JobPage(BaseModel):
    """``GET /v1/jobs``: a page of jobs, newest first."""

    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        description="pass as ?cursor= (with the same filters) for the next page; null: nothing older matches"
    )
    scanned: int = Field(description="index entries this page read (a state filter may skip many)")


class BatchItemResult(BaseModel):
    """One item of ``POST /v1/jobs:batch``, in the order of the request."""

    index: int = Field(description="the item's place in the request, from 0")
    status: int = Field(description="what POST /v1/jobs would have answered for it alone: 202, or a 4xx/5xx")
    job_id: str | None = Field(None, description="the job's id (absent when the item was refused)")
    state: JobState | None = Field(None, description="the job's state (queued, or succeeded for a cached answer)")
    cache: CacheLevel | None = None
    error: ErrorBody | None = Field(None, description="why the item was refused (absent when accepted)")


class BatchResponse(BaseModel):
    """``POST /v1/jobs:batch``: one entry per item; a refused item never fails the others."""

    items: list[BatchItemResult]
    accepted: int = Field(description="items answered 2xx")
    refused: int = Field(description="items answered 4xx or 5xx")
