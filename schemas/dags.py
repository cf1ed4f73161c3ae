"""The DAG DSL's shape (``DagSpec``, ``StepSpec``) and the REST bodies of the DAG routes (``/v1/dags``, ``/v1/runs``,
``fleet.producers.gateway.dags.routes``); ``fleet.dags.spec`` loads specs, ``fleet schemas export`` writes their JSON
Schemas."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""DAG names and step ids: they become Redis keys, job ids (``<run>.<step>.<index>``) and Mermaid labels."""
MAX_STEPS = 256
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,57}$"
"""Run ids: no '.', so that ``<run>.<step>.<index>.<key>`` splits back; 58 + 1 + 63 (step id) + 1 + 4 (index below
``fleet.dags.state.MAX_FAN_OUT``) + 1 + 16 (the run's key) stays within the 160 characters of
``fleet.schemas.wire.JOB_ID_PATTERN``."""
STEP_JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,57}\.[^.]+\.[0-9]+(\..*)?$"
"""The job ids reserved for the steps of DAG runs: ``<run>.<step>.<index>`` (runs started before step ids had a
key) and ``<run>.<step>.<index>.<key>``. No client may submit a job under one (``fleet.schemas.api.SubmitRequest``)."""
STEP_JOB_ID_RULE = (
    "job ids shaped '<run>.<step>.<index>' (optionally followed by '.<anything>') are reserved for the steps of "
    "DAG runs; choose another id (or let Fleet choose)"
)

OnError = Literal["fail", "continue"]


class StepSpec(BaseModel):
    """One step: a job (or, with ``for_each``, one job per item) on ``model`` with ``input``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=NAME_PATTERN, description="unique in the DAG; 1-63 of a-z 0-9 _ -")
    model: str = Field(min_length=1, description="the model's name, e.g. echo")
    input: Any = Field(default_factory=dict, description="the model's input; '${...}' values are expressions")
    after: list[str] = Field(default_factory=list, description="steps to wait for beyond those referenced")
    for_each: str | None = Field(None, description="'${...}' giving a list: one job per item (a fan-out)")
    when: str | None = Field(None, description="'${...}': the step runs only when it is truthy, else is skipped")
    timeout_s: float | None = Field(None, gt=0, description="deadline of each of the step's jobs")
    retries: int | None = Field(None, ge=0, description="runs after the first for a job that fails retriably")
    on_error: OnError = Field("fail", description="fail: a failed step fails the run; continue: its output is null")

    @property
    def fan_out(self) -> bool:
        return self.for_each is not None


class DagSpec(BaseModel):
    """A DAG: named steps, what they depend on, and the run's ``output`` (an expression or a template)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    input_schema: dict[str, Any] | None = Field(None, description="a JSON Schema the run's input must match")
    steps: list[StepSpec] = Field(min_length=1, max_length=MAX_STEPS)
    output: Any = Field(description="the run's output, evaluated once every step has settled")


RunStatus = Literal["running", "succeeded", "failed", "cancelled", "expired"]
StepStatus = Literal["pending", "running", "succeeded", "failed", "skipped", "cancelled"]


class DagRegistered(BaseModel):
    """``POST /v1/dags``: the name and version under which the spec is stored (the same spec keeps its version)."""

    name: str
    version: int


class DagSummary(BaseModel):
    name: str
    version: int = Field(description="the latest version")


class DagList(BaseModel):
    """``GET /v1/dags``."""

    dags: list[DagSummary]


class GraphNode(BaseModel):
    id: str
    model: str
    for_each: str | None = None
    when: str | None = None
    on_error: str = "fail"


class GraphEdge(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: str = Field(alias="from", serialization_alias="from")
    to: str
    kind: Literal["data", "after"] = Field(description="data: 'to' reads 'from'; after: it only waits for it")


class DagGraph(BaseModel):
    nodes: list[GraphNode] = Field(description="one per step, in topological order")
    edges: list[GraphEdge]


class DagDetail(BaseModel):
    """``GET /v1/dags/{name}``: one version of a DAG, its spec and its graph."""

    name: str
    version: int
    versions: list[int]
    spec: dict[str, Any] = Field(description="the spec as stored (the DSL's structure, as JSON)")
    graph: DagGraph
    mermaid: str = Field(description="the graph as a Mermaid flowchart")


class StartRunRequest(BaseModel):
    """``POST /v1/dags/{name}/runs``."""

    model_config = ConfigDict(extra="forbid")

    input: Any = Field(default_factory=dict, description="the run's input; checked against the DAG's input_schema")
    run_id: str | None = Field(
        None,
        pattern=RUN_ID_PATTERN,
        description="idempotency key of the tenant: starting the same id again returns that run",
    )
    version: int | None = Field(None, ge=1, description="the DAG version to run (default: the latest)")
    timeout_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="a run not finished within this many seconds ends 'expired'"
    )


class RunStarted(BaseModel):
    run_id: str
    version: int = Field(description="the DAG version the run runs")
    state: RunStatus
    created: bool = Field(description="false when run_id named a run that already existed")


class StepItems(BaseModel):
    total: int = Field(description="jobs of the step (one per item for a for_each step)")
    done: int = Field(description="of those, the ones with a result")


class StepView(BaseModel):
    state: StepStatus
    job_ids: list[str]
    items: StepItems
    started_at: float | None = None
    finished_at: float | None = None
    error: dict[str, Any] | None = None


class RunView(BaseModel):
    """``GET /v1/runs/{run_id}``."""

    run_id: str
    dag: str
    version: int
    state: RunStatus
    steps: dict[str, StepView] = Field(description="by step id, in topological order")
    output: Any = None
    error: dict[str, Any] | None = None
    created_at: float
    finished_at: float | None = None
