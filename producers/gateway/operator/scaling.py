"""``/v1/scaling``: what the autoscaler is doing per model, and the operator's min, max, pause and scale-to-N.

The autoscaler stores each model's status and decisions in the scaling store; this router reads them and writes
overrides the autoscaler applies at its next tick. ``GET`` shows the overrides at once (on top of the last status),
so a ``PUT`` is reflected immediately. A served model the autoscaler has not reported on yet shows zero replicas,
unknown lag and rates, and the fleet's default limits (``autoscale_min_replicas``, ``autoscale_max_replicas``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request

from fleet.errors import UnknownModel
from fleet.pools import pool_of, scaling_targets
from fleet.producers.gateway.access import Principal, record_action, require_operator
from fleet.producers.gateway.errors import ApiError, error_responses
from fleet.producers.gateway.operator.status import configured, unreported, view
from fleet.producers.gateway.state import GatewayState, gateway_state, state_of
from fleet.scaling import ScalingStore
from fleet.schemas.operator import ScaleRequest
from fleet.schemas.scaling import ScalingOverrides, ScalingStatus, ScalingUpdate, check_limits

router = APIRouter(prefix="/v1/scaling", tags=["scaling"])

DEFAULT_DECISIONS = 20


async def scaling_store(request: Request) -> ScalingStore:
    """FastAPI dependency: the scaling store the lifespan opened (``GatewayState.scaling``)."""
    return state_of(request).scaling


def targets(state: GatewayState) -> dict[str, tuple[str, ...]]:
    """What is scaled: every pool (``FLEET_POOLS``) and every served model in no pool."""
    return scaling_targets(list(state.specs), state.settings.pools)


def check_target(model: str, state: GatewayState) -> None:
    """404 for a name that is not scaled; 422 for a model of a pool, naming the pool to scale instead."""
    known = targets(state)
    if model in known:
        return
    pool = pool_of(state.settings.pools, model)
    if pool is not None and model in state.specs:
        raise ApiError(
            422,
            "invalid_request",
            f"model {model!r} is scaled with its pool {pool!r} (its workers serve the pool's models): "
            f"use /v1/scaling/{pool}",
        )
    raise UnknownModel(model, list(known))


async def _status_of(model: str, state: GatewayState, scaling: ScalingStore) -> ScalingStatus:
    stored = {s.model: s for s in await scaling.statuses()}
    return stored.get(model) or unreported(model, state.settings)


@router.get(
    "",
    summary="Scaling state of every model",
    response_model=list[ScalingStatus],
    responses=error_responses(401, 403, 503),
    dependencies=[Depends(require_operator)],
)
async def list_scaling(
    decisions: int = Query(DEFAULT_DECISIONS, ge=0, le=1000, description="recent decisions per model, newest first"),
    state: GatewayState = Depends(gateway_state),
    scaling: ScalingStore = Depends(scaling_store),
) -> list[ScalingStatus]:
    """Per served model (a pool's models: one entry, the pool's): replicas running and desired, lag, arrival rate,
    min, max, paused and recent decisions."""
    stored = {s.model: s for s in await scaling.statuses()}
    out = []
    for model in targets(state):
        status = stored.get(model) or unreported(model, state.settings)
        out.append(view(status, await scaling.get_overrides(model), decisions))
    return out


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def _check_update(model: str, configured: ScalingOverrides, overrides: ScalingOverrides) -> None:
    """422 naming both limits when the overrides would put min above max (with the configured values filled in)."""
    min_replicas = _first(overrides.min_replicas, configured.min_replicas)
    max_replicas = _first(overrides.max_replicas, configured.max_replicas)
    try:
        check_limits(min_replicas, max_replicas)
    except ValueError as exc:
        details = [
            {"loc": "body.min_replicas", "msg": str(exc), "type": "value_error"},
            {"loc": "body.max_replicas", "msg": str(exc), "type": "value_error"},
        ]
        raise ApiError(422, "invalid_request", f"invalid scaling limits for model {model!r}: {exc}", details) from None


@router.put(
    "/{model}",
    summary="Set a model's min, max or pause",
    response_model=ScalingStatus,
    responses=error_responses(401, 403, 404, 422, 503),
)
async def update_scaling(
    model: str,
    update: ScalingUpdate,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    scaling: ScalingStore = Depends(scaling_store),
    operator: Principal = Depends(require_operator),
) -> ScalingStatus:
    """Override ``min_replicas``, ``max_replicas`` or ``paused`` of one model; the autoscaler applies it at its next
    tick. Fields left out keep their value; an explicit ``null`` removes the override. ``min_replicas`` may not end
    up above ``max_replicas`` (422 naming both)."""
    check_target(model, state)
    status = await _status_of(model, state, scaling)
    overrides = update.apply(await scaling.get_overrides(model))
    _check_update(model, configured(status), overrides)
    await scaling.set_overrides(model, overrides)
    await record_action(request, operator, "scaling.update", model, update.model_dump(mode="json", exclude_unset=True))
    return view(status, overrides, DEFAULT_DECISIONS)


@router.post(
    "/{model}/scale",
    summary="Scale a model to N now, for a while",
    response_model=ScalingStatus,
    tags=["operator"],
    responses=error_responses(401, 403, 404, 422, 503),
)
async def scale_to(
    model: str,
    body: ScaleRequest,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    scaling: ScalingStore = Depends(scaling_store),
    operator: Principal = Depends(require_operator),
) -> ScalingStatus:
    """The autoscaler runs ``replicas`` workers of the model from its next tick until ``ttl_s`` seconds from now,
    whatever the signals, min, max and pause say (capped only at the partition count on Kafka), and records a
    decision saying so; then its policy applies again. A new call replaces the override."""
    check_target(model, state)
    status = await _status_of(model, state, scaling)
    overrides = (await scaling.get_overrides(model)).model_copy(
        update={"pinned_replicas": body.replicas, "pinned_until": time.time() + body.ttl_s}
    )
    await scaling.set_overrides(model, overrides)
    await record_action(request, operator, "scaling.scale", model, body.model_dump(mode="json"))
    return view(status, overrides, DEFAULT_DECISIONS)


@router.delete(
    "/{model}/scale",
    summary="End a scale-to-N override",
    response_model=ScalingStatus,
    tags=["operator"],
    responses=error_responses(401, 403, 404, 503),
)
async def end_scale_to(
    model: str,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    scaling: ScalingStore = Depends(scaling_store),
    operator: Principal = Depends(require_operator),
) -> ScalingStatus:
    """The autoscaler's policy applies again from its next tick (a model without the override answers the same)."""
    check_target(model, state)
    status = await _status_of(model, state, scaling)
    overrides = (await scaling.get_overrides(model)).model_copy(update={"pinned_replicas": None, "pinned_until": None})
    await scaling.set_overrides(model, overrides)
    await record_action(request, operator, "scaling.end_scale", model, {})
    return view(status, overrides, DEFAULT_DECISIONS)
