"""``POST /v1/infer``: submit a job and answer with its output in the same request.

The body, its validation and every refusal are those of ``POST /v1/jobs`` (the same ``submit``): the job is an
ordinary job with an id and a record, so a client that loses the answer can still poll it. The request then waits
(``?wait=S``, default ``DEFAULT_INFER_WAIT_S``) for the job to end:

- ``200`` with the output when it succeeded;
- ``504 infer_timeout`` with the job id (and ``Location`` of its record) when the wait ends first: the job goes on;
- ``504 job_expired`` when it was not started within its ``timeout_s``;
- ``422 invalid_input`` when a worker refused the input, ``500 job_failed`` when the model failed on it (after its
  retries), ``409 job_cancelled`` when it was cancelled; each error's details carry the job's record.

A store outage during the wait is waited out until the wait ends (as a long-poll does), then answered ``503`` with
the job id in its details.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request

from fleet import constants as c
from fleet.errors import StoreError
from fleet.producers.gateway.access import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.calls import long_poll
from fleet.producers.gateway.errors import ApiError, limited_responses
from fleet.producers.gateway.jobs.routes import SUBMIT_BODY, submit
from fleet.producers.gateway.limits import check_wait
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import InferResponse
from fleet.schemas.jobs import JobRecord, JobState

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)


def _unfinished(record: JobRecord, wait_s: float) -> ApiError:
    return ApiError(
        504,
        "infer_timeout",
        f"job {record.job_id!r} is still {record.state} after {wait_s:g}s; it goes on: "
        f"GET /v1/jobs/{record.job_id}?wait=S for its result",
        {"job_id": record.job_id, "state": record.state.value},
        headers={"Location": f"/v1/jobs/{record.job_id}"},
    )


def _ended_without_output(record: JobRecord) -> ApiError:
    details = {"job_id": record.job_id, "record": record.model_dump(mode="json")}
    why = f"{record.error.type}: {record.error.message}" if record.error else "no reason recorded"
    if record.state == JobState.cancelled:
        return ApiError(409, "job_cancelled", f"job {record.job_id!r} was cancelled: {why}", details)
    if record.state == JobState.expired:
        return ApiError(504, "job_expired", f"job {record.job_id!r} expired before it ran: {why}", details)
    if record.error is not None and record.error.type == "invalid_input":
        return ApiError(422, "invalid_input", f"job {record.job_id!r}: {record.error.message}", details)
    return ApiError(500, "job_failed", f"job {record.job_id!r} failed: {why}", details)


def answer(record: JobRecord, wait_s: float) -> InferResponse:
    """The ``200`` body for a succeeded record; raises the error answer for any other state."""
    if not record.terminal:
        raise _unfinished(record, wait_s)
    if record.state != JobState.succeeded:
        raise _ended_without_output(record)
    return InferResponse(
        job_id=record.job_id,
        model=record.model,
        output=record.output,
        worker_id=record.worker_id,
        started_at=record.started_at,
        finished_at=record.finished_at,
        cache=record.cache,
        cache_similarity=record.cache_similarity,
    )


@router.post(
    "/infer",
    response_model=InferResponse,
    summary="Run a job and wait for its output",
    description=(
        "Same body, validation and refusals as `POST /v1/jobs`; then waits up to `wait` seconds for the job. "
        "Answers `200` with the output, or `504 infer_timeout` with the job id when the wait ends first (the job "
        "goes on: poll `GET /v1/jobs/{id}`). A job that ends otherwise answers `422 invalid_input`, "
        "`500 job_failed`, `409 job_cancelled` or `504 job_expired`, with its record in `details`."
    ),
    responses=limited_responses(200, 400, 404, 409, 413, 422, 429, 500, 503, 504),
    openapi_extra=SUBMIT_BODY,
)
async def infer(
    request: Request,
    wait: float | None = Query(
        None, description=f"seconds to wait for the output (0 < wait ≤ max; default {c.DEFAULT_INFER_WAIT_S:g})"
    ),
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> InferResponse:
    wait_s = default_wait_s(state) if wait is None else wait
    check_wait(wait_s, state.settings.max_long_poll_s)
    deadline = asyncio.get_running_loop().time() + wait_s
    submitted = await submit(request, state, principal)
    return answer(await wait_for_end(state, principal, submitted.job_id, deadline), wait_s)


def default_wait_s(state: GatewayState) -> float:
    """How long a request that runs a job waits for it when it names no wait: ``DEFAULT_INFER_WAIT_S``, at most
    ``FLEET_MAX_LONG_POLL_S``."""
    return min(c.DEFAULT_INFER_WAIT_S, state.settings.max_long_poll_s)


async def wait_for_end(state: GatewayState, principal: Principal, job_id: str, deadline: float) -> JobRecord:
    """The record of ``principal``'s job ``job_id`` once it ended, or as it is at ``deadline`` (event-loop time).

    Raises:
        ApiError: ``503 store_unavailable`` (with the job id) when the store could not be read until the deadline.
    """
    remaining_s = deadline - asyncio.get_running_loop().time()
    try:
        return await long_poll(
            state.store, job_id, max(remaining_s, 0.001), state.limits.store_timeout_s, principal.tenant
        )
    except StoreError as exc:
        raise ApiError(
            503,
            "store_unavailable",
            f"job {job_id!r} was submitted, but its result cannot be read now: {exc.message}; "
            f"poll GET /v1/jobs/{job_id}",
            {"job_id": job_id},
            headers={"Retry-After": "1"},
        ) from exc
