"""``/v1/deadletters``: the dead letters the recorder stored, per model; redrive or purge them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from fleet.errors import UnknownModel
from fleet.producers.gateway.access import Principal, record_action, require_operator
from fleet.producers.gateway.errors import error_responses
from fleet.producers.gateway.operator import redrive as actions
from fleet.producers.gateway.operator.feed import dead_letter_view
from fleet.producers.gateway.state import GatewayState, gateway_state, state_of
from fleet.schemas.operator import DeadLetterGroup, DeadLetterList, LetterSelection, PurgeResult, RedriveResult
from fleet.store.deadletters import DeadLetterStore

router = APIRouter(prefix="/v1/deadletters", tags=["operator"])


async def dead_letter_store(request: Request) -> DeadLetterStore:
    """FastAPI dependency: the store the recorder writes (``GatewayState.stores.dead_letters``)."""
    return state_of(request).stores.dead_letters


def _check_model(state: GatewayState, model: str | None) -> None:
    if model is not None and model not in state.specs:
        raise UnknownModel(model, list(state.specs))


@router.get(
    "",
    summary="Dead letters per model",
    response_model=DeadLetterList,
    responses=error_responses(401, 403, 404, 422, 503),
)
async def list_dead_letters(
    model: str | None = Query(None, description="only this model"),
    limit: int = Query(10, ge=1, le=1000, description="latest letters shown per model"),
    state: GatewayState = Depends(gateway_state),
    letters: DeadLetterStore = Depends(dead_letter_store),
    _operator: Principal = Depends(require_operator),
) -> DeadLetterList:
    """How many letters each model holds and the latest ``limit`` of them, newest first, with their errors."""
    _check_model(state, model)
    counts = await letters.counts()
    models = [model] if model is not None else sorted(counts)
    out = {}
    for name in models:
        latest = await letters.latest(name, limit) if counts.get(name) else []
        out[name] = DeadLetterGroup(count=counts.get(name, 0), latest=[dead_letter_view(s) for s in latest])
    return DeadLetterList(models=out)


@router.post(
    "/redrive",
    summary="Run dead-lettered jobs again",
    response_model=RedriveResult,
    responses=error_responses(400, 401, 403, 404, 422, 503),
)
async def redrive(
    selection: LetterSelection,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    letters: DeadLetterStore = Depends(dead_letter_store),
    operator: Principal = Depends(require_operator),
) -> RedriveResult:
    """Each letter's job becomes a fresh queued attempt and its request goes back on the model's request subject;
    the letter is removed. The job runs again and ends once. Letters holding raw bytes, DAG steps and models not
    served here are answered in ``not_redrivable`` with the reason and stay; unknown ids in ``missing``."""
    _check_model(state, selection.model)
    result = await actions.redrive(state, letters, selection)
    await record_action(request, operator, "deadletters.redrive", selection.model, _outcome(selection, result))
    return result


@router.post(
    "/purge",
    summary="Delete dead letters",
    response_model=PurgeResult,
    responses=error_responses(400, 401, 403, 404, 422, 503),
)
async def purge(
    selection: LetterSelection,
    request: Request,
    state: GatewayState = Depends(gateway_state),
    letters: DeadLetterStore = Depends(dead_letter_store),
    operator: Principal = Depends(require_operator),
) -> PurgeResult:
    """Remove the letters (their jobs keep their failed records); unknown ids are answered in ``missing``."""
    _check_model(state, selection.model)
    result = await actions.purge(letters, selection)
    await record_action(request, operator, "deadletters.purge", selection.model, _outcome(selection, result))
    return result


def _outcome(selection: LetterSelection, result: RedriveResult | PurgeResult) -> dict[str, Any]:
    """What an audit entry keeps of a redrive or purge: the selection and the result."""
    return {"selection": selection.model_dump(mode="json"), "result": result.model_dump(mode="json")}
