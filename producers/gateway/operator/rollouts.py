"""``/v1/models/{name}/rollout``, ``/promote``, ``/rollback`` and ``/v1/rollouts``: each model's versions as the
rollout controller sees them, and a person's promote or rollback of a canary.

The view is the model's ``RolloutDoc`` (policy, controller state, breakers) with each version's traffic share and
its window (``rollout_window_s``: requests, error rate, p99, shadow agreement), its breaker and the latest entries
of the timeline. A promote or rollback is carried out **at once** (``fleet.lifecycle.service.manual``, through
``controller.override``): the document is written by compare-and-set on its revision (read again and redone when
the controller or a person wrote first), the timeline names who asked, and the audit log records it.

A model's traffic is the whole fleet's, every tenant's: the operator token, or an operator key of the default
tenant, may move it; an operator key bound to another tenant is refused (403), as a submitter key is.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field

from fleet import constants as c
from fleet.errors import UnknownModel
from fleet.lifecycle.breaker import BreakerState, retry_after_s
from fleet.lifecycle.service import manual
from fleet.producers.gateway.access import Principal, record_action, require_fleet_operator
from fleet.producers.gateway.errors import ApiError, error_responses
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.store.rollouts import DecisionEntry, RolloutDoc, RolloutStore, WindowStats

router = APIRouter(prefix="/v1", tags=["rollouts"])

DEFAULT_DECISIONS = 20
CAS_ATTEMPTS = 5
ModelName = Annotated[str, Path(pattern=c.MODEL_NAME_RE.pattern, description="the model's name")]
Role = Literal["primary", "canary", "shadow"]


class BreakerView(BaseModel):
    status: Literal["closed", "open", "half_open"]
    reason: str
    opened_at: float | None = Field(None, description="unix seconds the breaker last opened")
    retry_after_s: float = Field(description="seconds until it lets a request through again (0: it would now)")


class VersionView(BaseModel):
    version: str
    role: Role
    share: float = Field(description="the share of requests it answers (the shadow: the share mirrored to it)")
    requests: int
    failures: int
    error_rate: float
    p99_ms: float | None
    agreement: float | None = Field(description="mean agreement of its shadow outputs with the primary's")
    agreement_samples: int
    breaker: BreakerView


class RolloutView(BaseModel):
    """A model's traffic policy, controller and breakers, with each version's window and the latest decisions."""

    model: str
    doc: RolloutDoc
    window_s: float
    versions: list[VersionView]
    decisions: list[DecisionEntry] = Field(description="newest first")


def _rollouts(state: GatewayState) -> RolloutStore:
    return state.stores.rollouts


async def _doc(state: GatewayState, model: str) -> RolloutDoc:
    doc = await _rollouts(state).read(model)
    if doc is not None:
        return doc
    if model not in state.specs:
        raise UnknownModel(model, list(state.specs))
    raise ApiError(
        404,
        "no_traffic_policy",
        f"model {model!r} has no traffic policy: set one with PUT /v1/models/{model}/traffic",
        {"model": model},
    )


def _roles(doc: RolloutDoc) -> list[tuple[str, Role, float]]:
    policy = doc.policy
    rows: list[tuple[str, Role, float]] = [(policy.primary, "primary", 1.0 - policy.canary_weight)]
    if policy.canary is not None:
        rows.append((policy.canary, "canary", policy.canary_weight))
    if policy.shadow is not None:
        rows.append((policy.shadow, "shadow", policy.shadow_share))
    return rows


def _breaker(doc: RolloutDoc, version: str, now: float) -> BreakerView:
    state = doc.breakers.get(version, BreakerState())
    wait = retry_after_s(state, doc.breaker, now)
    return BreakerView(status=state.status, reason=state.reason, opened_at=state.opened_at_s, retry_after_s=wait)


def _version(doc: RolloutDoc, version: str, role: Role, share: float, stats: WindowStats, now: float) -> VersionView:
    return VersionView(
        version=version,
        role=role,
        share=share,
        requests=stats.requests,
        failures=stats.failures,
        error_rate=stats.error_rate,
        p99_ms=stats.p99_ms,
        agreement=stats.agreement,
        agreement_samples=stats.agreement_samples,
        breaker=_breaker(doc, version, now),
    )


async def view_of(state: GatewayState, doc: RolloutDoc, decisions: int) -> RolloutView:
    """The document with each version's window, breaker and the ``decisions`` latest timeline entries."""
    rollouts, now, window_s = _rollouts(state), time.time(), state.settings.rollout_window_s
    roles = _roles(doc)
    stats = await rollouts.window(doc.model, [v for v, _, _ in roles], window_s, now)
    versions = [_version(doc, v, role, share, stats[v], now) for v, role, share in roles]
    entries = await rollouts.decisions(doc.model, decisions)
    return RolloutView(model=doc.model, doc=doc, window_s=window_s, versions=versions, decisions=entries)


@router.get(
    "/rollouts",
    summary="Every model's versions, traffic shares, breakers and decisions",
    response_model=list[RolloutView],
    responses=error_responses(401, 403, 503),
    dependencies=[Depends(require_fleet_operator)],
)
async def list_rollouts(
    decisions: int = Query(DEFAULT_DECISIONS, ge=0, le=200, description="latest decisions per model"),
    state: GatewayState = Depends(gateway_state),
) -> list[RolloutView]:
    """One view per model with a traffic policy, by name."""
    out = []
    for model in await _rollouts(state).models():
        doc = await _rollouts(state).read(model)
        if doc is not None:
            out.append(await view_of(state, doc, decisions))
    return out


@router.get(
    "/models/{name}/rollout",
    summary="A model's versions, traffic shares, breakers and decisions",
    response_model=RolloutView,
    responses=error_responses(401, 403, 404, 503),
    dependencies=[Depends(require_fleet_operator)],
)
async def get_rollout(
    name: ModelName,
    decisions: int = Query(DEFAULT_DECISIONS, ge=0, le=200, description="latest decisions, newest first"),
    state: GatewayState = Depends(gateway_state),
) -> RolloutView:
    """The traffic policy, the controller's state, each version's share, window (requests, error rate, p99,
    agreement) and breaker, and the latest decisions. 404: an unknown model, or one without a traffic policy."""
    return await view_of(state, await _doc(state, name), decisions)


async def _carry_out(
    request: Request, state: GatewayState, principal: Principal, name: str, action: Literal["promote", "roll_back"]
) -> RolloutView:
    rollouts = _rollouts(state)
    words = "promote" if action == "promote" else "roll back"
    for _ in range(CAS_ATTEMPTS):
        doc = await _doc(state, name)
        if doc.policy.canary is None:
            raise ApiError(
                409,
                "no_canary",
                f"model {name!r} has no canary to {words} (primary {doc.policy.primary!r})",
                {"model": name, "primary": doc.policy.primary},
            )
        new, entry = manual(doc, action, principal.subject, time.time())
        if await rollouts.write(new, doc.revision):
            await rollouts.add_decision(entry)
            details = {"version": doc.policy.canary, "from_weight": doc.policy.canary_weight, "reason": entry.reason}
            await record_action(
                request, principal, f"rollout.{'promote' if action == 'promote' else 'rollback'}", name, details
            )
            stored = await rollouts.read(name)
            return await view_of(state, stored or new, DEFAULT_DECISIONS)
    raise ApiError(409, "conflict", f"the traffic policy of {name!r} kept changing; try again", {"model": name})


@router.post(
    "/models/{name}/promote",
    summary="Promote a model's canary now",
    response_model=RolloutView,
    tags=["operator"],
    responses=error_responses(401, 403, 404, 409, 503),
)
async def promote(
    request: Request,
    name: ModelName,
    state: GatewayState = Depends(gateway_state),
    operator: Principal = Depends(require_fleet_operator),
) -> RolloutView:
    """The canary becomes the primary at once, whatever its measurements say (also after the controller rolled it
    back); the timeline and the audit log name who asked. 409 when the model has no canary."""
    return await _carry_out(request, state, operator, name, "promote")


@router.post(
    "/models/{name}/rollback",
    summary="Roll a model's canary back now",
    response_model=RolloutView,
    tags=["operator"],
    responses=error_responses(401, 403, 404, 409, 503),
)
async def rollback(
    request: Request,
    name: ModelName,
    state: GatewayState = Depends(gateway_state),
    operator: Principal = Depends(require_fleet_operator),
) -> RolloutView:
    """The canary's weight goes to 0 at once (it stays named, for the dashboard) and the controller leaves it
    there; the timeline and the audit log name who asked. 409 when the model has no canary."""
    return await _carry_out(request, state, operator, name, "roll_back")
