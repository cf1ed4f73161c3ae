"""``/v1/workers``: drain one worker (the graceful stop a SIGTERM starts), by its id from the heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request

from fleet import constants as c
from fleet.producers.gateway.access import Principal, record_action, require_operator
from fleet.producers.gateway.errors import ApiError, error_responses
from fleet.producers.gateway.operator.beats import Beats
from fleet.producers.gateway.state import GatewayState, gateway_state, state_of
from fleet.schemas.operator import DrainAccepted
from fleet.schemas.wire import DrainRequest

router = APIRouter(prefix="/v1/workers", tags=["operator"])

WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_:-]{0,199}$"  # one subject token: no dots, spaces or wildcards


async def beats_heard(request: Request) -> Beats:
    return state_of(request).beats


@router.post(
    "/{worker_id}/drain",
    status_code=202,
    summary="Drain one worker",
    response_model=DrainAccepted,
    responses=error_responses(401, 403, 404, 422, 503),
)
async def drain_worker(
    request: Request,
    worker_id: str = Path(pattern=WORKER_ID_PATTERN, description="as the worker's heartbeats name it"),
    state: GatewayState = Depends(gateway_state),
    beats: Beats = Depends(beats_heard),
    operator: Principal = Depends(require_operator),
) -> DrainAccepted:
    """The worker stops fetching, finishes and settles the jobs it holds, says ``stopped`` and exits (``fleet
    worker``), as on SIGTERM. 202 once the request is sent; the worker's heartbeats show ``draining``. 404 for a
    worker whose heartbeat this gateway has not heard recently."""
    if not beats.knows_worker(worker_id):
        raise ApiError(
            404, "worker_not_found", f"no heartbeat heard from worker {worker_id!r}", {"worker_id": worker_id}
        )
    await state.broker.emit(c.drain_subject(worker_id), DrainRequest(worker_id=worker_id).model_dump_json().encode())
    await record_action(request, operator, "worker.drain", worker_id, {})
    return DrainAccepted(worker_id=worker_id)
