"""``/v1/operator``: how the operator surface is protected, the live snapshot and its server-sent-event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from fleet.producers.gateway.access import OperatorGate, Principal, operator_gate, require_operator
from fleet.producers.gateway.errors import error_responses
from fleet.producers.gateway.operator.feed import OperatorFeed
from fleet.producers.gateway.recent_jobs import read_recent
from fleet.producers.gateway.state import GatewayState, gateway_state, state_of
from fleet.schemas.operator import OperatorAccess, OperatorSnapshot, RecentJobs

router = APIRouter(prefix="/v1/operator", tags=["operator"])

KEEP_ALIVE = b": keep-alive\n\n"
KEEP_ALIVE_S = 15.0
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def operator_feed(request: Request) -> OperatorFeed:
    """FastAPI dependency: this gateway's one feed (``GatewayState.operator_feed``)."""
    return state_of(request).operator_feed


@router.get("/access", summary="Whether operator calls need a token", response_model=OperatorAccess)
async def access(gate: OperatorGate = Depends(operator_gate)) -> OperatorAccess:
    """No token needed: tells the dashboard whether to show its login form, and whether the controls are off."""
    return gate.access()


@router.get(
    "/snapshot",
    summary="Everything the dashboard shows, now",
    response_model=OperatorSnapshot,
    responses=error_responses(401, 403),
)
async def snapshot(
    feed: OperatorFeed = Depends(operator_feed), _operator: Principal = Depends(require_operator)
) -> OperatorSnapshot:
    """Per model: lag, rates, latency, replicas, limits, pause and scale-to-N; the scaling decisions of the last
    15 minutes; the workers and dispatchers heard from; dead letters; recent DAG runs. ``series`` holds the whole
    15-minute ring of one-second samples."""
    return feed.snapshot()


async def feed_events(feed: OperatorFeed, keep_alive_s: float = KEEP_ALIVE_S) -> AsyncIterator[bytes]:
    """The stream of one subscriber: the full snapshot, then each sampling's delta, keep-alives while quiet."""
    seq, first = feed.full_event()
    feed.subscribers += 1
    try:
        yield first
        while not feed.stopped:
            seq, events = await feed.events_after(seq, keep_alive_s)
            if feed.stopped:
                return
            if not events:
                yield KEEP_ALIVE
            for event in events:
                yield event
    finally:
        feed.subscribers -= 1


@router.get(
    "/stream",
    summary="The live snapshot, pushed every second (server-sent events)",
    description=(
        "`text/event-stream`. First `event: snapshot` with the whole 15-minute ring in `series`; then, every "
        "second, an `event: snapshot` whose `series` holds only the samples added since the previous event (a "
        "client that fell behind gets a full snapshot again). `: keep-alive` comments every 15 s while nothing "
        "else is said. Read it with `fetch()` and a stream reader so that the token travels in the Authorization "
        "header."
    ),
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the event stream"},
        **error_responses(401, 403),
    },
)
async def stream(
    feed: OperatorFeed = Depends(operator_feed), _operator: Principal = Depends(require_operator)
) -> StreamingResponse:
    return StreamingResponse(feed_events(feed), media_type="text/event-stream", headers=STREAM_HEADERS)


@router.get(
    "/jobs",
    summary="The newest jobs submitted through this gateway",
    response_model=RecentJobs,
    responses=error_responses(401, 403, 503),
)
async def recent_jobs(
    request: Request,
    limit: int = Query(20, ge=1, le=200, description="how many, newest first"),
    state: GatewayState = Depends(gateway_state),
    operator: Principal = Depends(require_operator),
) -> RecentJobs:
    """Each job's state now, read from the store. Not a job history: only jobs this gateway process accepted since
    it started, its newest 200 at most (``scope`` says so); look any job up by id with ``GET /v1/jobs/{id}``. An
    operator API key sees its own tenant's jobs, as ``GET /v1/jobs/{id}`` shows them; the operator token every
    tenant's."""
    recent = read_recent(state.recent_jobs, state.store, limit, operator.tenant)
    return await state.bounded(recent)
