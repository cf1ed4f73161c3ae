"""``/v1/dags`` and ``/v1/runs``: register DAG specs, show them, start runs, poll (optionally long-poll) and cancel
them. The push routes (WebSocket and server-sent events) are in ``producers.gateway.dag_events``.

``POST /v1/dags`` takes YAML (``application/yaml``, ``text/yaml``, ``text/plain``, or no content type) or JSON
(``application/json``): text that does not parse is ``400 malformed_spec`` naming the line and column, a spec that
parses but is wrong ``422 dag_invalid`` with one ``{step, path, message}`` per problem. Registering the same spec
again keeps its version; a changed spec gets the next one. A run runs the latest version at its start.

DAG specs are shared by every tenant; runs are not: a run belongs to the tenant of the key that started it (its
document's ``tenant``; its steps' jobs carry it too). Reading or cancelling another tenant's run answers the 404
of an unknown run, and starting a run with another tenant's ``run_id`` answers ``409 run_id_taken`` and leaves
that run alone. The operator token reads every tenant's runs.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from dags import graph
from dags.runner import DagRunner, view_of
from dags.spec import MAX_SPEC_BYTES, parse_text
from dags.state import RunState
from dags.validate import CompiledDag
from fleet.errors import DagInvalid, PayloadTooLarge
from fleet.store.dagstore import RunDoc
from producers.gateway import ratelimit
from producers.gateway.auth import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from producers.gateway.client_json import parse_json
from producers.gateway.errors import ApiError, error_responses, limited_responses, validation_errors, validation_message
from producers.gateway.limits import read_limited_body
from producers.gateway.routes_jobs import check_wait
from producers.gateway.state import GatewayState, gateway_state
from schemas.dags import DagDetail, DagList, DagRegistered, DagSummary, RunStarted, RunView, StartRunRequest

router = APIRouter(tags=["dags"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain")
_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/yaml": {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}},
        },
    }
}
_RUN_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": StartRunRequest.model_json_schema()}},
    }
}


def runner_of(state: GatewayState) -> DagRunner:
    runner = state.dag_runner
    if runner is None:  # a GatewayState built without the lifespan (tests of other routes)
        raise ApiError(503, "not_ready", "this gateway runs no DAG runner")
    return runner


def run_view(dag: CompiledDag, doc: RunDoc) -> dict[str, Any]:
    """``runner.view_of`` with each step's item counts: ``items: {total, done}``."""
    view = view_of(dag, doc)
    state = RunState.from_dict(doc["run"])
    for sid, step in view["steps"].items():
        items = state.steps[sid].items
        step["items"] = {"total": len(items), "done": sum(1 for item in items if item != "pending")}
    return view


async def view_doc(runner: DagRunner, doc: RunDoc) -> dict[str, Any]:
    _, dag = await runner.compiled(doc["run"]["dag"], doc["version"])
    return run_view(dag, doc)


# -- specs ----------------------------------------------------------------------------------------------------
def parse_spec_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The spec mapping of a ``POST /v1/dags`` body.

    Raises:
        PayloadTooLarge: over ``dags.spec.MAX_SPEC_BYTES``.
        ApiError: 415 for another content type, 400 ``malformed_spec`` for text that does not parse.
    """
    if len(raw) > MAX_SPEC_BYTES:
        raise PayloadTooLarge(len(raw), MAX_SPEC_BYTES, what="DAG spec")
    kind = content_type.split(";")[0].strip().lower()
    if kind not in ("", "application/json", *YAML_TYPES):
        message = f"send the spec as application/yaml or application/json, not {kind}"
        raise ApiError(415, "unsupported_media_type", message)
    try:
        return _json_spec(raw) if kind == "application/json" else parse_text(raw)
    except DagInvalid as exc:
        raise ApiError(400, "malformed_spec", exc.message, exc.problems) from None


def _json_spec(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f"line {exc.lineno}, column {exc.colno}: " if isinstance(exc, json.JSONDecodeError) else ""
        raise DagInvalid([{"step": None, "path": "", "message": f"{where}invalid JSON: {exc}"}]) from None
    except RecursionError:
        raise DagInvalid([{"step": None, "path": "", "message": "the JSON nests too deeply to be read"}]) from None
    if not isinstance(data, dict):
        message = f"the spec must be a mapping with name, steps and output, not {type(data).__name__}"
        raise DagInvalid([{"step": None, "path": "", "message": message}])
    return data


@router.post(
    "/v1/dags",
    status_code=201,
    response_model=DagRegistered,
    summary="Register a DAG",
    description=(
        "The body is the spec as YAML (`application/yaml`, `text/yaml`, `text/plain`) or JSON (`application/json`). "
        "It is validated (references, cycles, models, expressions, static inputs) and stored as a new version; "
        "the same spec again keeps its version. `400 malformed_spec` names the line and column of text that does not "
        "parse; `422 dag_invalid` lists each problem as `{step, path, message}`."
    ),
    responses=error_responses(400, 413, 415, 422, 503),
    openapi_extra=_SPEC_BODY,
)
async def register_dag(request: Request, state: GatewayState = Depends(gateway_state)) -> DagRegistered:
    runner = runner_of(state)
    raw = await read_limited_body(request, min(state.settings.max_body_bytes, MAX_SPEC_BYTES))
    spec = parse_spec_body(raw, request.headers.get("content-type", ""))
    name, version, _ = await runner.register(spec)
    return DagRegistered(name=name, version=version)


@router.get("/v1/dags", response_model=DagList, summary="List DAGs", responses=error_responses(503))
async def list_dags(state: GatewayState = Depends(gateway_state)) -> DagList:
    """Every registered DAG with its latest version."""
    dags = runner_of(state).dags
    summaries = []
    for name in await dags.names():
        versions = await dags.versions(name)
        if versions:
            summaries.append(DagSummary(name=name, version=max(versions)))
    return DagList(dags=summaries)


@router.get(
    "/v1/dags/{name}",
    response_model=DagDetail,
    response_model_by_alias=True,
    summary="Show a DAG",
    description="One version (the latest by default) of a DAG: its spec, its graph as nodes and edges, and Mermaid.",
    responses=error_responses(404, 503),
)
async def show_dag(
    name: str,
    version: int | None = Query(None, ge=1, description="the version to show (default: the latest)"),
    state: GatewayState = Depends(gateway_state),
) -> dict[str, Any]:
    runner = runner_of(state)
    chosen, dag = await runner.compiled(name, version)
    found = await runner.dags.spec(name, chosen)
    spec = found[1] if found is not None else dag.spec.model_dump(mode="json")
    return {
        "name": name,
        "version": chosen,
        "versions": await runner.dags.versions(name),
        "spec": spec,
        "graph": {"nodes": graph.nodes(dag), "edges": graph.edges(dag)},
        "mermaid": graph.mermaid(dag),
    }


# -- runs -----------------------------------------------------------------------------------------------------
def parse_start(raw: bytes) -> StartRunRequest:
    """Raises ApiError: 400 ``malformed_json`` or 422 ``invalid_request`` naming each bad field (or a value JSON
    cannot carry exactly: ``producers.gateway.client_json``)."""
    data = parse_json(raw) if raw.strip() else {}
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return StartRunRequest.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc, prefix="body")
        raise ApiError(422, "invalid_request", validation_message(errors, "invalid request"), errors) from None


@router.post(
    "/v1/dags/{name}/runs",
    status_code=202,
    response_model=RunStarted,
    summary="Start a DAG run",
    description=(
        "Starts a run of the DAG's latest version with `input` (checked against its `input_schema`: `422 "
        "invalid_input`) and publishes its first steps' jobs. Idempotent on `run_id`: starting an existing run "
        "again answers `202` with that run (`created: false`) and creates nothing."
    ),
    responses=limited_responses(202, 400, 404, 409, 413, 422, 429, 503),
    openapi_extra=_RUN_BODY,
    dependencies=[Depends(ratelimit.limit_rate)],  # the tenant's rate limit (producers.gateway.ratelimit)
)
async def start_run(
    name: str,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> RunStarted:
    runner = runner_of(state)
    body = parse_start(await read_limited_body(request, state.settings.max_body_bytes))
    created, doc = await runner.start(name, body.input, body.run_id, body.timeout_s, principal.tenant)
    view = await view_doc(runner, doc)
    return RunStarted(run_id=view["run_id"], state=view["state"], created=created)


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunView,
    summary="Get a DAG run",
    description=(
        "The run: its state, each step's state, job ids, item counts and times, and its output once it succeeded. "
        "With `wait`, holds the request until the run is over or `wait` seconds pass."
    ),
    responses=error_responses(404, 422, 503),
)
async def get_run(
    run_id: str,
    wait: float | None = Query(None, description="long-poll: seconds to wait for the run to end (0 < wait ≤ max)"),
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> dict[str, Any]:
    runner = runner_of(state)
    if wait is not None:
        check_wait(wait, state.settings.max_long_poll_s)
        return await view_doc(runner, await runner.wait(run_id, wait, principal.tenant))
    return await view_doc(runner, await runner.get(run_id, principal.tenant))


@router.post(
    "/v1/runs/{run_id}/cancel",
    response_model=RunView,
    summary="Cancel a DAG run",
    description=(
        "Ends a running run as `cancelled`: its pending steps never start and its outstanding jobs are cancelled. "
        "`409 run_terminal` when the run already ended."
    ),
    responses=error_responses(404, 409, 503),
)
async def cancel_run(
    run_id: str, state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> dict[str, Any]:
    runner = runner_of(state)
    doc = await runner.get(run_id, principal.tenant)
    if doc.get("finished_at") is None:
        doc = await runner.cancel(run_id)
        view = await view_doc(runner, doc)
        if view["state"] == "cancelled":
            return view
    view = await view_doc(runner, doc)
    raise ApiError(
        409,
        "run_terminal",
        f"DAG run {run_id!r} already ended '{view['state']}'; only running runs can be cancelled",
        view,
    )
