"""Server-sent events for one job: ``GET /v1/jobs/{job_id}/events``.

For clients that cannot or will not hold a WebSocket: ``curl -N``, the browser's ``EventSource``, proxies that
only speak HTTP. The answer is ``text/event-stream``; each event's data is one line of JSON::

    event: job        the current record, first, when the job has not ended yet; again when its state changes
    : keep-alive      a comment every ``GatewayLimits.sse_keepalive_s`` while nothing else is said
    event: result     the terminal record; the stream then ends
    event: error      {"error": {...}}: the record vanished (its TTL ran out) or is corrupt; the stream ends

A job that ended before the request gets ``event: result`` at once. An unknown job is a plain ``404`` before any
event, with the usual error body. A store outage is no error, neither while the stream is open nor when it is
opened (like a WebSocket's or a long-poll's, the README's outage section): a stream whose job cannot be read when
it is requested opens at once (``200``), sends keep-alives while the store is away, and goes on as above once the
job's record can be read; if the job turns out unknown it ends with ``event: error`` (``job_not_found``), since
its status was sent. Another tenant's job is the ``404`` (or that event) of an unknown job (the operator token
streams every tenant's jobs). ``EventSource`` reconnects when a stream ends, so a browser client should
``close()`` it on ``result``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from fleet import tenancy
from fleet.errors import JobNotFound, StoreError
from fleet.producers.gateway.access import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.calls import read_job
from fleet.producers.gateway.errors import error_json
from fleet.producers.gateway.metrics import SSE_STREAMS_OPEN
from fleet.producers.gateway.push import KEEP_ALIVE, OUTAGE_PAUSE_S, STREAM_HEADERS, sse_event
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import ErrorResponse
from fleet.schemas.jobs import JobRecord

logger = logging.getLogger(__name__)

router = APIRouter(tags=["push"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)


def error_event(type_: str, message: str, details: object = None) -> bytes:
    return sse_event("error", json.dumps(error_json(type_, message, details)))


async def job_events(state: GatewayState, record: JobRecord) -> AsyncIterator[bytes]:
    """The events of one job from ``record`` (already read) until it ends; never raises into the server."""
    store, limits, job_id = state.store, state.limits, record.job_id
    SSE_STREAMS_OPEN.inc()
    try:
        if not record.terminal:
            yield sse_event("job", record.model_dump_json())
        while not record.terminal:
            wait_s = limits.sse_keepalive_s
            try:
                latest = await state.bounded(store.wait(job_id, wait_s), waits_s=wait_s)
            except StoreError as exc:
                if not exc.retriable:
                    raise
                # The store is down: keep the stream (and the client) waiting until it is back.
                logger.debug("event stream for job %s waits for the store: %s", job_id, exc.message)
                yield KEEP_ALIVE
                await asyncio.sleep(OUTAGE_PAUSE_S)
                continue
            if latest is None:
                yield error_event("job_not_found", JobNotFound(job_id).message, {"job_id": job_id})
                return
            if latest.terminal:
                record = latest
            elif latest.state != record.state:
                record = latest
                yield sse_event("job", record.model_dump_json())
            else:
                yield KEEP_ALIVE
        yield sse_event("result", record.model_dump_json())
    except StoreError as exc:
        yield error_event("store_unavailable", exc.message)
    except Exception as exc:  # a bug or a corrupt record: tell the client, keep the gateway serving
        logger.exception("event stream for job %s failed", job_id)
        yield error_event("internal_error", f"{type(exc).__name__}: {exc}")
    finally:
        SSE_STREAMS_OPEN.dec()


async def events_after_outage(state: GatewayState, job_id: str, viewer: str | None) -> AsyncIterator[bytes]:
    """The events of a job whose record could not be read when the stream was requested: keep-alives until it
    can be, then ``job_events``; an unknown job (or one ``viewer`` may not see) ends with ``event: error``."""
    store = state.store
    while True:
        try:
            record = await state.bounded(store.get(job_id))
            break
        except StoreError as exc:
            if not exc.retriable:  # a corrupt record: waiting does not mend it
                yield error_event("store_unavailable", exc.message)
                return
            yield KEEP_ALIVE
            await asyncio.sleep(OUTAGE_PAUSE_S)
    if record is None or not tenancy.readable(record, viewer):
        yield error_event("job_not_found", JobNotFound(job_id).message, {"job_id": job_id})
        return
    async for event in job_events(state, record):
        yield event


@router.get(
    "/v1/jobs/{job_id}/events",
    summary="Stream a job's progress and result (server-sent events)",
    description=(
        "`text/event-stream`: `event: job` with the current record while the job has not ended (again when its "
        "state changes), `: keep-alive` comments while nothing happens, then `event: result` with the terminal "
        "record, after which the stream ends. A job that already ended gets `event: result` at once. "
        "A store outage only delays the result (keep-alives go on), also one under way when the stream is "
        "requested: the stream then opens at once, and an unknown job ends it with `event: error`. "
        "`event: error` (with the usual error body) ends the stream if the record expires or is corrupt."
    ),
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the event stream"},
        404: {"model": ErrorResponse},
        503: {"model": ErrorResponse},
    },
)
async def stream_job_events(
    job_id: str, state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> StreamingResponse:
    try:
        record = await read_job(state.store, job_id, state.limits.store_timeout_s, principal.tenant)
    except StoreError as exc:
        if not exc.retriable:
            raise
        events = events_after_outage(state, job_id, principal.tenant)  # waits the outage out, as every waiter does
        return StreamingResponse(events, media_type="text/event-stream", headers=STREAM_HEADERS)
    return StreamingResponse(job_events(state, record), media_type="text/event-stream", headers=STREAM_HEADERS)
