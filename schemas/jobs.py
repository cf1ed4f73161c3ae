"""The job record kept in the result store, one per job id."""

from __future__ import annotations

import hashlib
import json
import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


CacheLevel = Literal["l1", "l2", "l3"]  # the result-cache level that answered a job
Arm = Literal["primary", "canary", "shadow"]  # the side of a traffic policy (fleet.lifecycle.traffic) a job went to

TERMINAL_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.expired})


class JobError(BaseModel):
    """Why a job did not succeed."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="machine-readable kind, e.g. invalid_input, model_error, poison_message")
    message: str = Field(description="what went wrong and, where possible, what to do")
    retriable: bool = False


class StageTimings(BaseModel):
    """Where a job's time went: unix seconds at each stage its latest run passed (null: not reached, or not
    measured, e.g. a cache hit). In order: queued <= fetched <= batch_started <= computed <= stored, and for a
    DAG step hop_started <= queued (the hop into the step)."""

    model_config = ConfigDict(extra="forbid")

    queued: float | None = Field(None, description="the request was published (its submitted_at)")
    fetched: float | None = Field(None, description="a worker fetched the message (this run's delivery)")
    batch_started: float | None = Field(None, description="its batch started computing")
    computed: float | None = Field(None, description="its batch finished computing")
    stored: float | None = Field(None, description="its terminal record was written")
    hop_started: float | None = Field(
        None,
        description="a DAG step: the record that completed its inputs (the step before it; the last dependency "
        "of a fan-in) was stored; the hop into this step runs from here to queued (its publish)",
    )


class JobRecord(BaseModel):
    """State and result of one job. A terminal state (succeeded, failed, cancelled, expired) never changes."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    model: str
    state: JobState
    output: Any = None
    error: JobError | None = None
    created_at: float = Field(default_factory=time.time, description="unix seconds")
    started_at: float | None = None
    finished_at: float | None = None
    deliveries: int = Field(0, description="how many times a worker started running the job")
    batch_size: int | None = Field(
        None,
        description="how many jobs the latest run started with (0: its worker was draining); a run whose worker "
        "disappeared counts against the job only if the job ran alone",
    )
    strikes: int | None = Field(
        None,
        description="runs counted against max_deliveries as of the latest start: its worker disappeared while it "
        "ran alone, or it failed retriably (null: none)",
    )
    worker_id: str | None = None
    expires_at: float | None = Field(None, description="unix seconds after which a queued job is expired")
    input_digest: str | None = Field(
        None,
        description="sha256 (hex) of the input's canonical JSON, set by the gateway at submit: a resubmit of the "
        "job id with another input is refused; null for jobs published straight to the topic",
    )
    cache: CacheLevel | None = Field(
        None, description="the result cache level that answered the job (null: a worker computed it)"
    )
    cache_similarity: float | None = Field(
        None, description="for an L3 (semantic) hit: the cosine similarity of the earlier request that answered"
    )
    tenant: str | None = Field(
        None,
        description="the tenant the job belongs to (the submitting API key's, or the request message's); null: "
        "the default tenant. Another tenant reading the job gets 404, as for an unknown id",
    )
    version: str | None = Field(
        None, description="the model version that answered (or, while queued, the one the traffic policy chose)"
    )
    arm: Arm | None = Field(
        None, description="which side of the model's traffic policy took the job: primary, canary or shadow"
    )
    shadow_of: str | None = Field(
        None, description="on a shadow job: the job whose request it mirrors; its output is never returned"
    )
    timings: StageTimings | None = Field(None, description="where the job's time went (its latest run)")
    device_seconds: float | None = Field(
        None,
        description="compute time charged to the job: its batch's compute seconds shared by its items' costs "
        "(null: not computed, e.g. a cache hit)",
    )
    trace_id: str | None = Field(
        None, description="the W3C trace id (32 hex) of the job's trace, when the request carried one"
    )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


def input_digest(value: object) -> str:
    """sha256 (hex) of ``value``'s canonical JSON: keys sorted, no spaces, non-ASCII escaped.

    Two inputs that differ only in key order or whitespace have the same digest. Raises ``ValueError`` (or
    ``RecursionError`` for nesting deeper than the interpreter allows) when ``value`` is not JSON data.
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()
