"""``/v1/dags`` and ``/v1/runs``: register DAG specs, show them, start runs, poll (optionally long-poll) and cancel
them. The push routes (WebSocket and server-sent events) are in ``fleet.producers.gateway.dags.events``.

``POST /v1/dags`` takes YAML (``application/yaml``, ``text/yaml``, ``text/plain``, or no content type) or JSON
(``application/json``): text that does not parse is ``400 malformed_spec`` naming the line and column, a spec that
parses but is wrong ``422 dag_invalid`` with one ``{step, path, message}`` per problem. The limits of
``fleet.dags.limits``
hold before anything parses deeper: text nested over 64 levels or holding an integer of over 4,300 digits is a 400
naming the limit, a value JSON cannot carry (NaN, an infinity, a lone surrogate) and an expression over its length or
nesting a 422. A run start's body is read by the gateway's one JSON parser (``fleet.producers.gateway.client_json``),
as every request body is. Parsing,
validation and every evaluation run in a thread, so the event loop keeps serving. Registering the same spec
again keeps its version; a changed spec gets the next one. A run runs the latest version at its start, or the
``version`` its start names; the run's answers name the version it runs.

Each tenant has its own DAGs and run ids (a namespace per tenant, ``fleet.dags.state.scoped``): the key's tenant
registers, lists, shows and runs only its own DAGs, and another tenant's DAG of the same name is one that does not
exist (its own ``POST /v1/dags`` of that name makes its own version 1). A run belongs to the tenant of the key that
started it (its document's ``tenant``; its steps' jobs carry it too); reading or cancelling another tenant's run
answers the 404 of an unknown run, and another tenant's ``run_id`` is free: starting it starts a run of the
caller's own. The operator token lists every tenant's DAGs and reads every tenant's runs by the store's id,
``<tenant>:<run_id>`` (the bare id for the default tenant).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from fleet.dags import graph, limits
from fleet.dags.limits import LimitExceeded
from fleet.dags.runner import DagRunner, store_id, view_of
from fleet.dags.spec import MAX_SPEC_BYTES, parse_text
from fleet.dags.state import RunState, scoped
from fleet.dags.validate import CompiledDag
from fleet.errors import DagInvalid, PayloadTooLarge
from fleet.producers.gateway import access
from fleet.producers.gateway.access import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.calls import patiently
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import (
    ApiError,
    error_responses,
    limited_responses,
    validation_errors,
    validation_message,
)
from fleet.producers.gateway.limits import check_wait, read_limited_body
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.dags import DagDetail, DagList, DagRegistered, DagSummary, RunStarted, RunView, StartRunRequest
from fleet.store.dagstore import RunDoc

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
    """The view of ``doc``, rendered in a thread (a succeeded run evaluates its ``output``)."""
    dag = await runner.compiled_of(doc)
    return await asyncio.to_thread(_bounded_view, dag, doc)


def _bounded_view(dag: CompiledDag, doc: RunDoc) -> dict[str, Any]:
    with limits.value_budget():
        return run_view(dag, doc)


# -- specs ----------------------------------------------------------------------------------------------------
def parse_spec_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The spec mapping of a ``POST /v1/dags`` body.

    Raises:
        PayloadTooLarge: over ``fleet.dags.spec.MAX_SPEC_BYTES``.
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
        data = limits.loads_json(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f"line {exc.lineno}, column {exc.colno}: " if isinstance(exc, json.JSONDecodeError) else ""
        raise DagInvalid([{"step": None, "path": "", "message": f"{where}invalid JSON: {exc}"}]) from None
    except LimitExceeded as exc:
        raise DagInvalid([{"step": None, "path": "", "message": exc.message}]) from None
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
async def register_dag(
    request: Request, state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> DagRegistered:
    runner = runner_of(state)
    raw = await read_limited_body(request, min(state.settings.max_body_bytes, MAX_SPEC_BYTES))
    spec = await asyncio.to_thread(parse_spec_body, raw, request.headers.get("content-type", ""))  # 256 KB of YAML
    name, version, _ = await runner.register(spec, principal.tenant)
    return DagRegistered(name=name, version=version)


def own_name(stored: str, viewer: str | None) -> str | None:
    """The name ``viewer`` knows a DAG the store names ``stored`` by (None: another tenant's DAG); the operator
    token (``viewer`` None) sees every name as stored, ``<tenant>:<name>``."""
    if viewer is None:
        return stored
    name = stored.rpartition(":")[2]
    return name if scoped(name, viewer) == stored else None


@router.get("/v1/dags", response_model=DagList, summary="List DAGs", responses=error_responses(503))
async def list_dags(
    state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> DagList:
    """Every DAG of the key's tenant with its latest version."""
    dags = runner_of(state).dags
    summaries = []
    for stored in await dags.names():
        name = own_name(stored, principal.tenant)
        versions = await dags.versions(stored) if name is not None else []
        if name is not None and versions:
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
    principal: Principal = Depends(require_submitter),
) -> dict[str, Any]:
    runner = runner_of(state)
    chosen, dag = await runner.compiled(name, version, principal.tenant)
    ref = scoped(name, principal.tenant)
    found = await runner.dags.spec(ref, chosen)
    spec = found[1] if found is not None else dag.spec.model_dump(mode="json")
    return {
        "name": name,
        "version": chosen,
        "versions": await runner.dags.versions(ref),
        "spec": spec,
        "graph": {"nodes": graph.nodes(dag), "edges": graph.edges(dag)},
        "mermaid": graph.mermaid(dag),
    }


# -- runs -----------------------------------------------------------------------------------------------------
def parse_start(raw: bytes) -> StartRunRequest:
    """Raises ApiError: 400 ``malformed_json`` or 422 ``invalid_request`` naming each bad field (or a value JSON
    cannot carry exactly: ``fleet.producers.gateway.client_json``)."""
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
        "Starts a run of the DAG's latest version (or of `version`) with `input` (checked against its "
        "`input_schema`: `422 invalid_input`) and publishes its first steps' jobs. Idempotent on `run_id` within "
        "the key's tenant: starting an existing run again answers `202` with that run (`created: false`) and "
        "creates nothing; another tenant's run ids are not the caller's. A run that is over at its start (an "
        "empty `for_each`, every step skipped, a fan-out over the bound) is answered over, with its end state."
    ),
    responses=limited_responses(202, 400, 404, 409, 413, 422, 429, 503),
    openapi_extra=_RUN_BODY,
    dependencies=[Depends(access.limit_rate)],  # the tenant's rate limit (fleet.producers.gateway.access.ratelimit)
)
async def start_run(
    name: str,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> RunStarted:
    runner = runner_of(state)
    body = parse_start(await read_limited_body(request, state.settings.max_body_bytes))
    created, doc = await runner.start(name, body.input, body.run_id, body.timeout_s, principal.tenant, body.version)
    view = await view_doc(runner, doc)
    return RunStarted(run_id=view["run_id"], version=view["version"], state=view["state"], created=created)


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunView,
    summary="Get a DAG run",
    description=(
        "The run: its state, each step's state, job ids, item counts and times, and its output once it succeeded. "
        "With `wait`, holds the request until the run is over or `wait` seconds pass; a store outage inside "
        "`wait` is waited out (503 only if the run cannot be read when `wait` ends)."
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
        return await view_doc(runner, await wait_run(runner, run_id, wait, principal.tenant))
    return await view_doc(runner, await runner.get(run_id, principal.tenant))


async def wait_run(runner: DagRunner, run_id: str, wait_s: float, viewer: str | None) -> RunDoc:
    """``runner.wait`` that waits a store outage out until its own deadline, as a job's long-poll does
    (``calls.long_poll``); the last ``StoreError`` (a 503) only when the deadline passes with the run unreadable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    return await patiently(lambda: runner.wait(run_id, max(0.0, deadline - loop.time()), viewer), run_id, deadline)


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
        doc = await runner.cancel(store_id(doc))
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
