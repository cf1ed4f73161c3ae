"""REST bodies of the gateway."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.jobs import CacheLevel, JobState
from schemas.wire import JOB_ID_PATTERN


class SubmitRequest(BaseModel):
    """``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model name, e.g. embed, echo, sleep")
    input: dict[str, Any] = Field(description="model input, validated against the model's input schema")
    job_id: str | None = Field(
        None,
        pattern=JOB_ID_PATTERN,
        description="optional idempotency key: submitting the same id twice creates one job",
    )
    timeout_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="a job not started within this many seconds ends 'expired'"
    )
    priority: int = Field(0, ge=0, le=9)
    cache: bool = Field(
        True,
        description="false: skip the result caches (no lookup, no fill), as the header 'X-Cache-Control: bypass'",
    )


class SubmitResponse(BaseModel):
    job_id: str
    status: JobState
    cache: CacheLevel | None = Field(
        None, description="the cache level that answered (status 'succeeded' at once); absent when not cached"
    )


class ErrorBody(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. unknown_model, invalid_input, payload_too_large")
    message: str
    details: Any = None


class ErrorResponse(BaseModel):
    error: ErrorBody
