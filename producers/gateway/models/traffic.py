"""``/v1/models/{name}/traffic`` (operator): a model's traffic policy, and ``/v1/models/{name}/comparisons``: its
recent shadow comparisons.

- ``GET`` answers the model's ``RolloutDoc`` (policy, rollout config, controller and breaker state, revision), or
  ``404 no_traffic_policy`` when it has none (every job goes to its served version).
- ``PUT`` sets the policy (``TrafficUpdate``: a ``TrafficPolicy``, an optional ``RolloutConfig`` for the automatic
  controller and an optional ``BreakerConfig``). Each version it names must exist (the repository, or a manifest a
  worker serving it published: ``fleet.models.resolve_version``), else ``422 invalid_request`` naming it. The
  document is written by compare-and-set on its revision, read again and redone on a lost race (``CAS_TRIES``), so
  a person's change never overwrites the controller's step unseen; the controller's memory starts again, the
  breakers of the versions still named are kept. The change is put on the decisions timeline (action ``set``, by the
  operator) and in the audit log (``traffic.set``).
- ``DELETE`` removes it (back to plain serving; ``traffic.clear`` in the audit log); a model without one answers 204
  all the same.
- ``GET .../comparisons`` lists the recent comparisons of the model's shadow outputs with its answers, newest first
  (``ComparisonEntry``: both job ids and versions, the outputs' digests, the score).

A model's traffic is every tenant's: every route needs the operator token or an operator key of the default
tenant (as promote and rollback do, ``fleet.producers.gateway.operator``); a submitter key, or an operator key bound
to another tenant, is 403 (the comparisons name every tenant's jobs). An unknown model is ``404 unknown_model``; a
body over ``MAX_BODY_BYTES``, not JSON or not of the shape is 413, 400 or 422.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.errors import ConfigError, UnknownModel
from fleet.lifecycle.breaker import BreakerConfig
from fleet.lifecycle.controller import RolloutConfig
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.producers.gateway.access import Principal, record_action, require_fleet_operator
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import ApiError, error_responses, validation_errors, validation_message
from fleet.producers.gateway.limits import read_limited_body
from fleet.producers.gateway.policies import TrafficPolicies
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.store.rollouts import ComparisonEntry, DecisionEntry, RolloutDoc, RolloutStore

router = APIRouter(prefix="/v1/models", tags=["traffic"])

MAX_BODY_BYTES = 64 * 1024
CAS_TRIES = 5


class TrafficUpdate(BaseModel):
    """The body of ``PUT /v1/models/{name}/traffic``."""

    model_config = ConfigDict(extra="forbid")

    policy: TrafficPolicy
    rollout: RolloutConfig | None = Field(None, description="the automatic controller's thresholds; null: by hand")
    breaker: BreakerConfig | None = Field(None, description="the versions' circuit breakers; null: the defaults")


PUT_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": TrafficUpdate.model_json_schema()}}}
}


def _served(state: GatewayState, name: str) -> TrafficPolicies:
    if name not in state.specs:
        raise UnknownModel(name, list(state.specs))
    if state.traffic is None:
        raise ApiError(503, "not_ready", "this gateway routes no traffic policies (it has none loaded)")
    return state.traffic


def _no_policy(name: str, version: str) -> ApiError:
    return ApiError(
        404,
        "no_traffic_policy",
        f"model {name!r} has no traffic policy: every job goes to its served version {version!r}",
        {"model": name},
    )


async def parse_update(request: Request) -> TrafficUpdate:
    """The body, shape-checked: 413 over ``MAX_BODY_BYTES``, 400 not JSON, 422 naming each bad field."""
    data = parse_json(await read_limited_body(request, MAX_BODY_BYTES))
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return TrafficUpdate.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc, prefix="body")
        raise ApiError(422, "invalid_request", validation_message(errors, "invalid traffic policy"), errors) from None


async def _check_versions(traffic: TrafficPolicies, name: str, policy: TrafficPolicy) -> None:
    for role, version in (("primary", policy.primary), ("canary", policy.canary), ("shadow", policy.shadow)):
        if version is None:
            continue
        try:
            await traffic.spec_of(name, version)
        except ConfigError as exc:
            error = {"loc": f"body.policy.{role}", "msg": exc.message, "type": "value_error"}
            raise ApiError(422, "invalid_request", f"invalid traffic policy: {role}: {exc.message}", [error]) from None


def _updated(current: RolloutDoc | None, name: str, update: TrafficUpdate, by: str) -> RolloutDoc:
    named = {v for v in (update.policy.primary, update.policy.canary, update.policy.shadow) if v is not None}
    kept = {v: s for v, s in (current.breakers if current else {}).items() if v in named}
    return RolloutDoc(
        model=name,
        policy=update.policy,
        rollout=update.rollout,
        breaker=update.breaker or (current.breaker if current else BreakerConfig()),
        breakers=kept,
        updated_at=time.time(),
        updated_by=by,
    )


async def _write(rollouts: RolloutStore, name: str, update: TrafficUpdate, by: str) -> tuple[RolloutDoc, float | None]:
    """Write the new document by compare-and-set; (the stored document, the canary weight it replaced)."""
    for _ in range(CAS_TRIES):
        current = await rollouts.read(name)
        doc = _updated(current, name, update, by)
        revision = current.revision if current is not None else 0
        if await rollouts.write(doc, revision):
            previous = current.policy.canary_weight if current is not None else None
            return doc.model_copy(update={"revision": revision + 1}), previous
    raise ApiError(
        409,
        "traffic_conflict",
        f"the traffic policy of {name!r} changed {CAS_TRIES} times while this change was written; try again",
        {"model": name},
    )


def _describe(policy: TrafficPolicy) -> str:
    parts = [f"primary {policy.primary}"]
    if policy.canary is not None:
        parts.append(f"canary {policy.canary} at {policy.canary_weight:g}")
    if policy.shadow is not None:
        parts.append(f"shadow {policy.shadow} at {policy.shadow_share:g}")
    if policy.sticky.source != "none":
        parts.append(f"sticky by {policy.sticky.source}" + (f" {policy.sticky.name}" if policy.sticky.name else ""))
    return ", ".join(parts)


@router.get(
    "/{name}/traffic",
    summary="A model's traffic policy",
    response_model=RolloutDoc,
    responses=error_responses(401, 403, 404, 503),
    dependencies=[Depends(require_fleet_operator)],
)
async def get_traffic(name: str, state: GatewayState = Depends(gateway_state)) -> RolloutDoc:
    """The model's policy, rollout config, controller and breaker state; 404 ``no_traffic_policy`` without one."""
    _served(state, name)
    doc = await state.stores.rollouts.read(name)
    if doc is None:
        raise _no_policy(name, state.specs[name].version)
    return doc


@router.put(
    "/{name}/traffic",
    summary="Set a model's traffic policy",
    response_model=RolloutDoc,
    responses=error_responses(400, 401, 403, 404, 409, 413, 422, 503),
    openapi_extra=PUT_BODY,
)
async def put_traffic(
    name: str,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    operator: Principal = Depends(require_fleet_operator),
) -> RolloutDoc:
    """Split the model's jobs between versions (canary weight, sticky key), mirror a share to a shadow version,
    and optionally let the controller move the weight. Every version named must exist (422 naming it)."""
    update = await parse_update(request)  # a malformed body is 400 on every route, whatever the path names
    traffic = _served(state, name)
    await _check_versions(traffic, name, update.policy)
    rollouts = state.stores.rollouts
    doc, previous = await _write(rollouts, name, update, operator.subject)
    await traffic.put(doc)
    why = f"set by {operator.subject}: {_describe(update.policy)}"
    entry = DecisionEntry(
        at=time.time(),
        model=name,
        action="set",
        weight=update.policy.canary_weight,
        previous_weight=previous,
        version=update.policy.canary,
        reason=why,
        by=operator.subject,
    )
    await rollouts.add_decision(entry)
    await record_action(request, operator, "traffic.set", name, update.model_dump(mode="json", exclude_none=True))
    return doc


@router.delete(
    "/{name}/traffic",
    summary="Remove a model's traffic policy",
    status_code=204,
    responses=error_responses(401, 403, 404, 503),
)
async def delete_traffic(
    name: str,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    operator: Principal = Depends(require_fleet_operator),
) -> Response:
    """Back to plain serving: every job goes to the model's served version. 204 also when there was none."""
    traffic = _served(state, name)
    rollouts = state.stores.rollouts
    existed = await rollouts.read(name) is not None
    await rollouts.delete(name)
    traffic.drop(name)
    if existed:
        reason = f"cleared by {operator.subject}: plain serving"
        entry = DecisionEntry(at=time.time(), model=name, action="clear", reason=reason, by=operator.subject)
        await rollouts.add_decision(entry)
        await record_action(request, operator, "traffic.clear", name, {})
    return Response(status_code=204)


@router.get(
    "/{name}/comparisons",
    summary="A model's recent shadow comparisons",
    response_model=list[ComparisonEntry],
    responses=error_responses(401, 403, 404, 503),
    dependencies=[Depends(require_fleet_operator)],
)
async def list_comparisons(
    name: str,
    limit: int = Query(50, ge=1, le=200, description="how many, newest first"),
    state: GatewayState = Depends(gateway_state),
) -> list[ComparisonEntry]:
    """Each comparison of a shadow version's output with the answer the client got: both job ids and versions, the
    outputs' sha256 digests and the agreement score (``fleet.lifecycle.compare``)."""
    _served(state, name)
    return await state.stores.rollouts.comparisons(name, limit)
