"""A DAG run's progress pushed step by step: ``WS /v1/runs/{run_id}/ws`` and SSE ``GET /v1/runs/{run_id}/events``.

Both send the same events, each one JSON object (a WebSocket text frame; the ``data`` of an SSE event named after
its ``type``)::

    {"type": "run", "run": <view>}                          first: the run as it is when the client connects
    {"type": "step", "step": <id>, "state": <state>, "run": <view>}
                                                            each time a step's state changes (several changes
                                                            seen at once come in the DAG's topological order)
    {"type": "result", "run": <view>}                       last, once the run is over; then the socket closes
                                                            (1000) or the stream ends
    {"type": "error", "error": {...}}                       the run vanished (its TTL ran out) or a bug; the end

``<view>`` is the body of ``GET /v1/runs/{run_id}``. A run that is already over (also one that ended at its start)
gets ``run`` then ``result`` at once. An unknown run is a plain ``404`` (SSE) or an error frame and close code 4404
(WebSocket). The stream wakes on each change the DAG store publishes (``fleet:dagevents:<run>``); SSE sends a
``: keep-alive`` comment every ``GatewayLimits.sse_keepalive_s`` while nothing changes. A store outage only delays
events, also one under way when the stream is requested: the socket or the stream opens and waits (SSE with
keep-alives) until the run can be read; an unknown run then ends an SSE stream with an ``error`` event (its ``200``
was sent). Another tenant's run is an unknown run on both (``fleet.tenancy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse

from fleet.dags.runner import DagRunner, UnknownRun, store_id
from fleet.errors import StoreError
from fleet.producers.gateway.access import (
    AUTH_RESPONSES,
    SUBMITTER_DEPS,
    Principal,
    require_submitter,
    websocket_principal,
    ws_subprotocol,
)
from fleet.producers.gateway.calls import patiently
from fleet.producers.gateway.dags.routes import runner_of, view_doc
from fleet.producers.gateway.errors import error_json
from fleet.producers.gateway.metrics import SSE_STREAMS_OPEN, WEBSOCKETS_OPEN
from fleet.producers.gateway.push import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_NOT_FOUND,
    KEEP_ALIVE,
    OUTAGE_PAUSE_S,
    STREAM_HEADERS,
    first_of,
    sse_event,
)
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import ErrorResponse
from fleet.store.dagstore import RunDoc

logger = logging.getLogger(__name__)

router = APIRouter(tags=["dags"])

Event = dict[str, Any]


def step_changes(before: dict[str, Any], after: dict[str, Any]) -> list[Event]:
    """One ``step`` event per step whose state differs between two views (in the views' step order)."""
    return [
        {"type": "step", "step": sid, "state": step["state"], "run": after}
        for sid, step in after["steps"].items()
        if before["steps"].get(sid, {}).get("state") != step["state"]
    ]


async def run_events(runner: DagRunner, doc: RunDoc, wait_s: float) -> AsyncIterator[Event | None]:
    """The events of one run from ``doc`` (already read) to its end; None when ``wait_s`` passed with no change
    (an SSE keep-alive). Raises ``UnknownRun`` when the run vanishes and non-retriable ``StoreError``."""
    view = await view_doc(runner, doc)
    yield {"type": "run", "run": view}
    while doc.get("finished_at") is None:
        try:
            sid = store_id(doc)
            changed = await runner.dags.wait_change(sid, doc, _until_deadline(doc, wait_s))
            latest = await runner.get(sid) if changed is not None else None
        except StoreError as exc:
            if not exc.retriable:
                raise
            logger.debug("events of DAG run %s wait for the store: %s", doc["run"]["run_id"], exc.message)
            yield None
            await asyncio.sleep(OUTAGE_PAUSE_S)
            continue
        if latest is None:
            raise UnknownRun(doc["run"]["run_id"])
        if latest == doc:
            yield None
            continue
        doc, before = latest, view
        view = await view_doc(runner, doc)
        for event in step_changes(before, view):
            yield event
    yield {"type": "result", "run": view}


def _until_deadline(doc: RunDoc, wait_s: float) -> float:
    """``wait_s``, or less when the run's deadline comes first (``runner.get`` then ends it ``expired``)."""
    deadline = doc.get("deadline")
    return wait_s if not deadline else max(0.05, min(wait_s, deadline - time.time() + 0.05))


def _error_event(exc: Exception, run_id: str) -> Event:
    if isinstance(exc, UnknownRun):
        return {"type": "error", **error_json("run_not_found", exc.message, {"run_id": run_id})}
    if isinstance(exc, StoreError):
        return {"type": "error", **error_json("store_unavailable", exc.message)}
    logger.error("events of DAG run %s failed", run_id, exc_info=exc)
    return {"type": "error", **error_json("internal_error", f"{type(exc).__name__}: {exc}")}


async def sse_stream(runner: DagRunner, doc: RunDoc, keepalive_s: float) -> AsyncIterator[bytes]:
    run_id = doc["run"]["run_id"]
    SSE_STREAMS_OPEN.inc()
    try:
        async for event in run_events(runner, doc, keepalive_s):
            yield KEEP_ALIVE if event is None else sse_event(event["type"], json.dumps(event))
    except Exception as exc:  # never into the server: tell the client, keep the gateway serving
        yield sse_event("error", json.dumps(_error_event(exc, run_id)))
    finally:
        SSE_STREAMS_OPEN.dec()


async def sse_after_outage(
    runner: DagRunner, run_id: str, viewer: str | None, keepalive_s: float
) -> AsyncIterator[bytes]:
    """The stream of a run that could not be read when it was requested: keep-alives until it can be, then
    ``sse_stream``; an unknown run (or one ``viewer`` may not see) ends it with an ``error`` event."""
    while True:
        try:
            doc = await runner.get(run_id, viewer)
            break
        except StoreError as exc:
            if not exc.retriable:
                yield sse_event("error", json.dumps(_error_event(exc, run_id)))
                return
            yield KEEP_ALIVE
            await asyncio.sleep(OUTAGE_PAUSE_S)
        except UnknownRun as exc:
            yield sse_event("error", json.dumps(_error_event(exc, run_id)))
            return
    async for event in sse_stream(runner, doc, keepalive_s):
        yield event


@router.get(
    "/v1/runs/{run_id}/events",
    summary="Stream a DAG run step by step (server-sent events)",
    description=(
        "`text/event-stream`: `event: run` with the run first, `event: step` (`{type, step, state, run}`) each "
        "time a step's state changes, `: keep-alive` comments while nothing happens, and `event: result` with the "
        "finished run, after which the stream ends. `event: error` ends it if the run's record expires. A store "
        "outage only delays events, also one under way when the stream is requested (it opens and waits)."
    ),
    response_class=StreamingResponse,
    dependencies=SUBMITTER_DEPS,
    responses={
        **AUTH_RESPONSES,
        200: {"content": {"text/event-stream": {}}, "description": "the event stream"},
        404: {"model": ErrorResponse},
        503: {"model": ErrorResponse},
    },
)
async def stream_run_events(
    run_id: str, state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> StreamingResponse:
    runner = runner_of(state)
    try:
        doc = await runner.get(run_id, principal.tenant)
    except StoreError as exc:
        if not exc.retriable:
            raise
        waiting = sse_after_outage(runner, run_id, principal.tenant, state.limits.sse_keepalive_s)
        return StreamingResponse(waiting, media_type="text/event-stream", headers=STREAM_HEADERS)
    stream = sse_stream(runner, doc, state.limits.sse_keepalive_s)
    return StreamingResponse(stream, media_type="text/event-stream", headers=STREAM_HEADERS)


async def _send_all(websocket: WebSocket, runner: DagRunner, run_id: str, wait_s: float, viewer: str | None) -> int:
    """Send the run's events (``UnknownRun`` for another tenant's run than ``viewer``'s); the close code."""
    try:
        doc = await patiently(lambda: runner.get(run_id, viewer), run_id)  # a socket waits a store outage out
        async for event in run_events(runner, doc, wait_s):
            if event is not None:
                await websocket.send_text(json.dumps(event))
        return CLOSE_NORMAL
    except WebSocketDisconnect:
        raise
    except Exception as exc:
        await websocket.send_text(json.dumps(_error_event(exc, run_id)))
        return CLOSE_NOT_FOUND if isinstance(exc, UnknownRun) else CLOSE_INTERNAL_ERROR


@router.websocket("/v1/runs/{run_id}/ws", name="run_ws")
async def run_ws(websocket: WebSocket, run_id: str) -> None:
    """Push a run's events (see the module docstring), then close with 1000; unknown run: close code 4404."""
    state: GatewayState = websocket.app.state.gateway
    principal = await websocket_principal(websocket)
    if principal is None:
        return
    await websocket.accept(subprotocol=ws_subprotocol(websocket))
    WEBSOCKETS_OPEN.inc()
    try:
        runner = runner_of(state)
        wait_s = state.limits.ws_wait_chunk_s
        main = asyncio.create_task(_send_all(websocket, runner, run_id, wait_s, principal.tenant))
        if await first_of(main, websocket):
            with contextlib.suppress(RuntimeError):
                await websocket.close(main.result())
    except WebSocketDisconnect:
        logger.debug("websocket for DAG run %s closed by the client", run_id)
    finally:
        WEBSOCKETS_OPEN.dec()
