"""The wire format: what producers publish on ``fleet.req.<model>`` and what workers announce.

A request is one UTF-8 JSON object per message (see ``RequestMessage``). NATS producers set the
``Nats-Msg-Id`` header to the job id so that a repeated publish is de-duplicated; Kafka producers use the job id as
the message key.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from fleet.schemas.jobs import Arm, JobError

WIRE_VERSION = 1

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,159}$"
"""Job ids on the wire and in the store: a client's (``CLIENT_JOB_ID_PATTERN``) or a DAG step's, whose
``<run>.<step>.<index>.<key>`` (``fleet.dags.state.job_id``) may be longer than a client may choose."""
CLIENT_JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
"""The job ids a client may choose (``POST /v1/jobs``), except the shape reserved for DAG steps
(``fleet.schemas.dags.STEP_JOB_ID_PATTERN``)."""
TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"  # W3C trace-context, version 00
VERSION_PATTERN = r"^[a-z0-9][a-z0-9_]{0,31}$"  # a model version (fleet.schemas.manifest.VERSION_RE)
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # the tenants of API keys (fleet.store.keys.check_tenant)
TENANT_HELP = (
    "the tenant the job belongs to; absent: the default tenant. The broker does not check it: a producer allowed "
    "to publish on the subject can name any tenant (broker permissions are the boundary, see the README)"
)

EncodingFormat = Literal["float", "base64"]  # the same as fleet.encoding.EncodingFormat
ENCODING_HELP = (
    "float (the default): vector outputs (embed's embedding/embeddings) are JSON arrays of numbers; base64: each "
    "vector is one string, base64 of its little-endian float32 bytes (as the OpenAI embeddings API); a model "
    "without vector outputs refuses base64"
)

PRIORITY_NAMES = ("high", "normal", "low")  # highest first; the same as fleet.constants.PRIORITIES
PRIORITY_INT_LIMIT = 9
PRIORITY_HELP = (
    "priority must be 'high', 'normal' or 'low' (or an integer from -9 to 9: above 0 is high, 0 is normal, "
    "below 0 is low)"
)


def to_priority(value: object) -> str:
    """A priority name from a name or an integer (older producers sent ``0``-``9``, 0 being normal).

    Integers map by sign: ``1``..``9`` -> ``high``, ``0`` -> ``normal``, ``-9``..``-1`` -> ``low``. Anything else
    (another string, a bool, a float, an integer out of range) is a ``ValueError`` that says what is accepted.
    """
    if isinstance(value, str) and value in PRIORITY_NAMES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= PRIORITY_INT_LIMIT:
        return "high" if value > 0 else "low" if value < 0 else "normal"
    raise ValueError(f"{PRIORITY_HELP}; got {value!r}")


Priority = Annotated[
    Literal["high", "normal", "low"],
    BeforeValidator(to_priority),
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": list(PRIORITY_NAMES), "type": "string"},
                {"type": "integer", "minimum": -PRIORITY_INT_LIMIT, "maximum": PRIORITY_INT_LIMIT},
            ],
            "description": "high, normal or low; integers map by sign (>0 high, 0 normal, <0 low)",
        },
        mode="validation",
    ),
]


class DagContext(BaseModel):
    """Where a job stands in a DAG run: the settling worker continues the run from it (``fleet.dags.runner``)."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="the run id; the job id is '<run>.<step>.<index>'")
    dag: str = Field(description="the DAG's name")
    version: int = Field(ge=1, description="the registered version of the DAG the run follows")
    step: str = Field(description="the step's id")
    index: int = Field(0, ge=0, description="the item of a for_each step (0 otherwise)")
    runs: int | None = Field(None, ge=1, description="most runs of this job (the step's retries + 1)")
    hop_started: float | None = Field(
        None,
        description="unix seconds: the record that completed this step's inputs was stored (the hop's start; "
        "null for a run's first steps)",
    )


class RequestMessage(BaseModel):
    """One inference request on ``fleet.req.<model>``."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = Field(1, description="wire format version (WIRE_VERSION)")
    job_id: str = Field(pattern=JOB_ID_PATTERN, description="unique id chosen by the producer (uuid4 hex is fine)")
    model: str = Field(description="model name; must match the subject's model")
    input: dict[str, Any] = Field(description="model input; must match the model's input schema")
    submitted_at: float = Field(default_factory=time.time, description="unix seconds")
    deadline: float | None = Field(
        None, description="unix seconds; a job still waiting at this time ends 'expired' instead of running"
    )
    priority: Priority = Field(
        "normal",
        description="high, normal or low (integers -9..9 map by sign); published on fleet.req.<model>[.high|.low]",
    )
    dag: DagContext | None = Field(None, description="set on the jobs of a DAG run's steps")
    cache: bool = Field(
        True, description="false: the job's output must not be stored in the result caches (a bypassed request)"
    )
    encoding_format: EncodingFormat = Field("float", description=ENCODING_HELP)
    tenant: str | None = Field(None, pattern=TENANT_PATTERN, description=TENANT_HELP)
    version: str | None = Field(
        None,
        pattern=VERSION_PATTERN,
        description="the model version to answer (a traffic policy's choice); null: the worker's default version",
    )
    arm: Arm | None = Field(None, description="the side of the model's traffic policy that took the job")
    shadow_of: str | None = Field(
        None,
        pattern=JOB_ID_PATTERN,
        description="on a shadow copy: the job it mirrors (its output is stored beside, compared, never returned)",
    )
    traceparent: str | None = Field(
        None,
        max_length=55,
        pattern=TRACEPARENT_PATTERN,
        description="W3C trace context (https://www.w3.org/TR/trace-context/): the request's trace, for a raw "
        "producer that cannot set message headers; the 'traceparent' header wins when both are set",
    )
    tracestate: str | None = Field(None, max_length=512, description="W3C tracestate that goes with traceparent")


class GpuStats(BaseModel):
    """One device as NVML reports it (``fleet.consumers.gpu_stats``)."""

    index: int
    name: str
    uuid: str | None = None
    utilization_pct: float = Field(description="percent of the last sample period a kernel was running")
    memory_used_bytes: int
    memory_total_bytes: int


class Heartbeat(BaseModel):
    """Published by each worker every ``heartbeat_interval_s`` on ``fleet.ctl.heartbeat.<model>``."""

    worker_id: str
    model: str
    device: str
    pid: int
    max_batch: int = Field(description="the batch size in force (the controller's current value when adaptive)")
    max_wait_ms: float = Field(description="the batch wait in force (the controller's current value when adaptive)")
    p99_target_ms: float | None = Field(None, description="the p99 target batches are sized for; null: fixed")
    max_batch_cost: int | None = Field(None, description="the cost budget of one batch; null: bounded by count")
    state: Literal["starting", "ready", "degraded", "draining", "stopped"] = Field(
        description="starting: loading the model; ready: serving; degraded: serving, but the store cannot be reached"
    )
    routing: Literal["pull", "dispatch"] = Field("pull", description="dispatch: the worker reads its own inbox")
    in_flight: int = 0
    loaded: list[str] = Field(
        default_factory=list, description="the versions of the model loaded and warm in this worker (multi-model)"
    )
    replicas: int = Field(1, description="batches of this model the worker computes at once on one copy of weights")
    breaker: Literal["closed", "open", "half_open"] = Field(
        "closed", description="the worker's circuit breaker for this model: open takes no work"
    )
    batches: int = 0
    items: int = 0
    failures: int = 0
    mean_batch_size: float = 0.0
    latency_ewma_ms: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    throughput_per_s: float = 0.0
    gpus: list[GpuStats] = Field(
        default_factory=list, description="the worker's devices (NVML) where it has GPUs; empty without one"
    )
    model_memory_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="device memory allocated per loaded version (torch's statistics; empty on a CPU worker)",
    )
    sent_at: float = Field(default_factory=time.time)


class DeadLetter(BaseModel):
    """What lands on ``fleet.dlq.<model>``: the original request (or its raw bytes) and why it failed."""

    job_id: str | None
    model: str
    error: JobError
    deliveries: int
    worker_id: str
    failed_at: float = Field(default_factory=time.time)
    request: dict[str, Any] | None = None
    raw: str | None = Field(None, description="the message body, when it was not a valid request")


class IdleAnnouncement(BaseModel):
    """A worker with a free slot tells one dispatcher (on ``fleet.ctl.idle.<model>.<dispatcher>``) it is idle.

    The dispatcher queues the token; a token is used once. ``free_slots == 0`` retracts token ``seq``: the worker
    took work from elsewhere. A worker repeats its current token now and then (same ``seq``), so that a lost
    announcement heals; the dispatcher ignores the repeat.
    """

    model_config = ConfigDict(extra="ignore")

    worker_id: str
    model: str
    seq: int = Field(ge=0, description="the worker's token number; a newer token replaces an older one")
    free_slots: int = Field(ge=0, description="0 retracts the token")
    sent_at: float = Field(default_factory=time.time)


class DispatcherBeat(BaseModel):
    """A dispatcher's heartbeat on ``fleet.ctl.dispatcher.<model>``: workers read it to choose where to announce."""

    model_config = ConfigDict(extra="ignore")

    dispatcher_id: str
    model: str
    policy: str
    announce: Literal["none", "random", "sq"] = Field(description="how workers pick a dispatcher to announce to")
    d: int = Field(2, ge=1, description="sample size of the SQ(d) announcement rule")
    idle_length: int = Field(0, ge=0, description="valid idle tokens queued")
    live_workers: int = 0
    outstanding: int = 0
    state: Literal["ready", "stopped"] = "ready"
    route_shares: dict[str, float] = Field(
        default_factory=dict, description="share of assignments per route (idle, amnesia, fallback, policy)"
    )
    worker_outstanding: dict[str, int] = Field(default_factory=dict, description="requests held per worker id")
    sent_at: float = Field(default_factory=time.time)


class DagStartMessage(BaseModel):
    """What to publish on ``fleet.req._dagrun`` to start a run."""

    model_config = ConfigDict(extra="forbid")

    dag: str = Field(description="a registered DAG's name (of the run's tenant)")
    version: int | None = Field(None, ge=1, description="the version to run (absent: the latest)")
    input: Any = Field(default_factory=dict, description="the run's input")
    run_id: str | None = Field(None, description="idempotency key; derived from the message when absent")
    timeout_s: float | None = Field(None, gt=0, description="the run ends 'expired' if not over by then")
    tenant: str | None = Field(
        None, pattern=TENANT_PATTERN, description="the run's tenant (its steps' jobs too); absent: the default tenant"
    )


class DrainRequest(BaseModel):
    """On ``fleet.ctl.drain.<worker_id>``: an operator asks that worker to drain and stop (as on SIGTERM)."""

    model_config = ConfigDict(extra="ignore")

    worker_id: str
    requested_at: float = Field(default_factory=time.time)
