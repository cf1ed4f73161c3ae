"""The operator surface's bodies: access, the live snapshot the dashboard draws, and the controls' bodies.

``OperatorSnapshot`` is what ``GET /v1/operator/snapshot`` answers and what each ``event: snapshot`` of
``GET /v1/operator/stream`` carries (the stream's later events hold only the new samples in ``series``).
The contract with the page is ``/work/operator-contract.md`` (kept in the repository's history of issue 11).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.schemas.jobs import JobError
from fleet.schemas.scaling import DecisionRecord, Pin
from fleet.schemas.wire import GpuStats

MAX_LETTER_IDS = 1000  # letters one redrive or purge call may name


class OperatorAccess(BaseModel):
    """``GET /v1/operator/access``: whether the page must ask for a token, and whether the controls work at all."""

    token_required: bool = Field(description="true: operator calls need 'Authorization: Bearer <token>'")
    enabled: bool = Field(description="false: the operator surface is off here (see reason)")
    reason: str | None = Field(None, description="why it is off, and what to do; null when enabled")
    auth: str = Field("off", description="FLEET_AUTH: 'keys' (an API key or the operator token) or 'off'")


class ModelPanel(BaseModel):
    """One model's numbers now."""

    model: str
    lag: int | None = Field(description="requests waiting or in flight (broker lag); null when unknown")
    arrival_rate: float | None = Field(description="requests per second arriving")
    throughput_per_s: float | None = Field(description="completions per second, all workers of the model")
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    error_rate: float | None = Field(description="failed jobs per second")
    dead_letter_rate: float | None = Field(description="dead letters recorded per second")
    dead_letters: int = Field(description="letters held now")
    current_replicas: int
    desired_replicas: int
    min_replicas: int
    max_replicas: int
    paused: bool
    pinned: Pin | None = Field(None, description="an active scale-to-N override")
    live_workers: int = Field(0, description="workers whose heartbeat is fresh")
    ready_workers: int = Field(0, description="workers heard ready (serving)")
    starting_workers: int = Field(
        0,
        description="replicas started and not serving yet: workers heard warming up, plus replicas the autoscaler "
        "started that have not sent a heartbeat yet",
    )
    unheard_replicas: int = Field(
        0, description="replicas the autoscaler runs that no heartbeat names yet (started, still loading)"
    )
    wanted_replicas: int | None = Field(
        None, description="the policy's recommendation before min, max and smoothing; null: no decision yet"
    )
    reason: str = Field("", description="why desired_replicas is what it is, in words")
    pool: list[str] | None = Field(
        None, description="a pool's panel (FLEET_POOLS): the models its workers serve, whose numbers it adds up"
    )


class Sample(BaseModel):
    """One point of a model's time series (one per second)."""

    at: float
    lag: int | None = None
    arrival_rate: float | None = None
    throughput_per_s: float | None = None
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    error_rate: float | None = None
    current_replicas: int = 0
    desired_replicas: int = 0


class WorkerView(BaseModel):
    """A worker as its latest heartbeat describes it."""

    worker_id: str
    model: str
    device: str
    state: str = Field(description="starting (warming), ready (serving), draining, degraded")
    routing: str
    in_flight: int
    mean_batch_size: float
    items: int = Field(0, description="jobs finished since the worker started")
    latency_ewma_ms: float | None = Field(description="null: no job finished yet (idle since it started)")
    latency_p99_ms: float | None = Field(description="null: no job finished yet")
    heartbeat_age_s: float
    loaded: list[str] = Field(
        default_factory=list,
        description="the model versions loaded and warm in the worker (a multi-model worker "
        "loads on demand: empty until its first job)",
    )
    replicas: int = Field(1, description="batches of the model the worker computes at once on one copy of weights")
    breaker: str = Field(
        "closed", description="the worker's circuit breaker for the model: closed, open (takes no work) or half_open"
    )
    gpus: list[GpuStats] = Field(default_factory=list, description="the worker's GPUs (NVML); empty without one")
    model_memory_bytes: dict[str, int] = Field(
        default_factory=dict, description="device bytes per loaded version (empty on a CPU worker)"
    )


class DispatcherView(BaseModel):
    """A dispatcher as its latest beat describes it. The shares are null when the beat does not carry them."""

    dispatcher_id: str
    model: str
    policy: str
    idle_queue_length: int
    idle_share: float | None = None
    amnesia_share: float | None = None
    fallback_share: float | None = None
    outstanding: dict[str, int] = Field(default_factory=dict, description="per worker id (when the beat says)")
    outstanding_total: int = 0
    heartbeat_age_s: float


class DeadLetterView(BaseModel):
    """One recorded dead letter."""

    letter_id: str
    job_id: str | None
    model: str
    error: JobError
    deliveries: int
    worker_id: str
    at: float = Field(description="unix seconds the job failed")
    redrivable: bool = Field(True, description="false: the letter holds raw bytes, not a request")


class DeadLetterGroup(BaseModel):
    count: int
    latest: list[DeadLetterView]


class RunSummary(BaseModel):
    run_id: str
    dag: str
    state: str
    started_at: float
    finished_at: float | None = None


class DecisionLine(DecisionRecord):
    """A decision as the dashboard lists it: a run of alike no-change decisions is one line."""

    repeats: int = Field(1, description="how many stored decisions this line stands for")
    since: float = Field(description="unix seconds of the first decision of the run")


class RecentJob(BaseModel):
    """A job submitted through this gateway, as the store holds it now."""

    job_id: str
    model: str
    state: str
    tenant: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = Field(None, description="the error's type and message, for a failed job")


class RecentJobs(BaseModel):
    """``GET /v1/operator/jobs``: the newest jobs submitted through this gateway process, newest first."""

    jobs: list[RecentJob]
    kept: int = Field(description="how many job ids this gateway keeps (the oldest are forgotten)")
    scope: str = Field(description="what the list covers, in words")


class OperatorSnapshot(BaseModel):
    """Everything the dashboard shows, at ``at``."""

    at: float
    models: list[ModelPanel]
    series: dict[str, list[Sample]]
    decisions: dict[str, list[DecisionLine]]
    workers: list[WorkerView]
    dispatchers: list[DispatcherView]
    dead_letters: dict[str, DeadLetterGroup]
    runs: list[RunSummary]


class ScaleRequest(BaseModel):
    """``POST /v1/scaling/{model}/scale``: hold ``replicas`` for ``ttl_s`` seconds."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(ge=0, le=10_000)
    ttl_s: float = Field(600.0, gt=0, le=7 * 86400, description="seconds until the normal policy applies again")


class DrainAccepted(BaseModel):
    worker_id: str
    state: Literal["draining"] = "draining"


class DeadLetterList(BaseModel):
    models: dict[str, DeadLetterGroup]


class LetterSelection(BaseModel):
    """Which letters a redrive or purge applies to: ``letter_ids``, or every letter of ``model`` with ``all``."""

    model_config = ConfigDict(extra="forbid")

    letter_ids: list[str] | None = Field(None, max_length=MAX_LETTER_IDS)
    model: str | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_way(self) -> LetterSelection:
        if self.letter_ids is not None and (self.model is not None or self.all):
            raise ValueError("give either letter_ids, or model with all: true, not both")
        if self.letter_ids is None and not (self.model and self.all):
            raise ValueError("give letter_ids, or model with all: true")
        return self


class RedriveResult(BaseModel):
    redriven: list[str]
    missing: list[str]
    not_redrivable: dict[str, str] = Field(default_factory=dict, description="letter id -> why not")


class PurgeResult(BaseModel):
    purged: list[str]
    missing: list[str]
