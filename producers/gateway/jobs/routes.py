"""``/v1/jobs``: submit, poll (optionally long-poll) and cancel.

A submission is checked (model, input, size), counted against its model's queue bound (``backlog``: 429
``queue_full`` beyond it), written ``queued`` together with an unpublished mark that keeps the request message
(one store command), published with the job id as message id, and marked published once the broker acknowledged
it; only then is the answer ``202``. A publish that fails deletes the record and the mark; a gateway killed
before the acknowledgement leaves the mark, and a reconcile sweep (``reconcile``) publishes the job again.

Submitting an id that already has a record with the same model and input (same canonical JSON, key order aside:
``fleet.schemas.jobs.input_digest``) is idempotent: the answer is ``202`` with the existing job's current status and
nothing new is created, also when the queue is full. Another model, another input or another tenant's job is
``409 job_id_conflict``, one answer for all (``id_conflict``: the id, nothing of the job that holds it).
When that job is still ``queued`` the request is published again with the same message id; the broker's
de-duplication drops it when the first publish got through. A failed re-publish answers ``503`` but leaves the
existing record alone: it belongs to the first submission.

Result caches (``fleet.producers.gateway.cache``): for a model that opted in, the lookup comes after the checks and
before the queue bound. A hit is still a job: its record is created (with the request message, as any job) and
finished ``succeeded`` at once with the cached output, ``cache`` and ``cache_similarity`` set, through the store's
``finish``, so polling, long-polls, WebSockets and SSE see it as any computed job; the answer is ``202`` with
status ``succeeded``. A miss is submitted as usual and filled when its result arrives. ``X-Cache-Control:
bypass`` or ``"cache": false`` skips lookup and fill.

Tenants (``fleet.tenancy``): a job belongs to the tenant of the key that submitted it (``JobRecord.tenant``, also
on the wire so the worker and a reconcile republish keep it; the operator token and ``FLEET_AUTH=off`` submit as
the default tenant). A read by id (``GET``, ``?wait``, cancel) of another tenant's job answers the 404 of an
unknown id; the operator token reads every tenant's jobs. A submit whose job id belongs to another tenant's job
answers the ``409 job_id_conflict`` of any used id, word for word (nothing of that job: not its model, state,
input or tenant) and leaves it alone. Job ids are one namespace across tenants (a store key per id), so that a
used id is a conflict at all is the one thing a submitter learns; it learns the same of its own jobs.

Versions and traffic policies (``fleet.producers.gateway.policies``): once the model is known, its traffic policy
(if it has one) picks the version that answers and the arm (primary or canary), written on the record, the message
and its ``fleet-version`` header; the input is validated and the caches keyed with that version's spec. A job that
names ``name@version`` runs that version (the served one, or one a policy names), outside the split. A version
whose circuit breaker is open answers ``503 circuit_open`` with ``Retry-After`` (a canary's share falls back to the
primary instead). When the policy mirrors the job to a shadow version, a second job ``<job_id>.shadow`` is created
and published after the client's (same tenant and input, arm ``shadow``, ``shadow_of`` the client's job, priority
``low``, never cached): it is not charged to the tenant's rate or queued-job quota (the operator mirrors it, the
client did not ask for it), it is skipped when the model's queue is at its bound, and a failure to create or
publish it is logged, never the client's error. Its record is read by no submitter (``fleet.tenancy.readable``);
the operator sees the comparison (``GET /v1/models/{name}/comparisons``). A job answered from the caches is not
mirrored. Client job ids ending in ``.shadow`` are refused (``fleet.schemas.api.SubmitRequest``).

One word per step of a submit: the tenant is *charged* (its rate and queued-job quota, ``access.charge``, where
the quota store *decides*: ``fleet.store.quotas.Quotas.decide``), the job *reserves* a place under its model's
queue bound (``Backlog.reserve``, given back by ``Backlog.published``), is *created* in the store and *published*.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from fleet import constants as c
from fleet import tenancy, tracing
from fleet.encoding import no_vectors_message
from fleet.errors import InvalidInput, PayloadTooLarge, QueueFull, StoreError
from fleet.models import served_spec
from fleet.producers.gateway import access
from fleet.producers.gateway.access import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.cache import Hit, Lookup
from fleet.producers.gateway.calls import long_poll, publish_request, read_job
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import (
    ApiError,
    error_responses,
    error_type,
    limited_responses,
    validation_errors,
    validation_message,
)
from fleet.producers.gateway.limits import check_wait, read_limited_body
from fleet.producers.gateway.metrics import CACHE_REQUESTS, JOBS_SUBMITTED, ROUTED, SUBMIT_ERRORS
from fleet.producers.gateway.policies import Choice
from fleet.producers.gateway.recent_jobs import note_submitted
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import SubmitRequest, SubmitResponse
from fleet.schemas.jobs import JobError, JobRecord, JobState, input_digest
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import RequestMessage
from fleet.store import transitions

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)

SUBMIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": SubmitRequest.model_json_schema()}},
    }
}


# -- submit ---------------------------------------------------------------------------------------------------
def parse_submit(raw: bytes) -> SubmitRequest:
    """Parse and shape-check the body.

    Raises:
        ApiError: 400 ``malformed_json`` or 422 ``invalid_request`` naming each bad field, or a value JSON cannot
            carry exactly (``fleet.producers.gateway.client_json``: non-finite numbers, huge integers, lone surrogates,
            nesting past its limit).
    """
    return submit_request(parse_json(raw))


def submit_request(data: Any, what: str = "the request body", prefix: str = "body") -> SubmitRequest:
    """Shape-check a parsed submit body (``what`` names it in messages, ``prefix`` in field paths: an item of
    ``POST /v1/jobs:batch`` is ``items.3``). Raises ApiError 422 ``invalid_request`` as ``parse_submit``."""
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", f"{what} must be a JSON object, not {type(data).__name__}")
    try:
        return SubmitRequest.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc, prefix=prefix)
        raise ApiError(422, "invalid_request", validation_message(errors, "invalid request"), errors) from None


def validate_input(spec: ModelSpec, value: dict[str, Any]) -> None:
    """Raises InvalidInput naming each field path (``input.texts.0: ...``) when ``value`` does not fit the model."""
    try:
        spec.input_model.model_validate(value)
    except ValidationError as exc:
        errors = validation_errors(exc, prefix="input")
        raise InvalidInput(validation_message(errors, f"invalid input for model {spec.name!r}"), errors) from None


def check_encoding(spec: ModelSpec, encoding: str) -> None:
    """Raises InvalidInput (422) for ``encoding_format: base64`` on a model without vector outputs."""
    if encoding != "float" and not spec.vector_fields:
        error = {"loc": "body.encoding_format", "msg": "the model has no vector output", "type": "value_error"}
        raise InvalidInput(no_vectors_message(spec.name), [error])


def _digest(value: dict[str, Any]) -> str:
    try:
        return input_digest(value)
    except (RecursionError, ValueError) as exc:
        raise ApiError(422, "invalid_request", f"the input cannot be encoded as JSON: {exc}") from None


def new_job(
    body: SubmitRequest, now: float, tenant: str | None = None, choice: Choice | None = None
) -> tuple[JobRecord, bytes]:
    """The queued record and the wire message of a new job of ``tenant`` (None: the default tenant), for the version
    and arm of ``choice`` (None: the plain route)."""
    tenant = tenancy.stored(tenant)
    job_id = body.job_id or uuid.uuid4().hex
    version = choice.version if choice is not None else None
    arm = choice.arm if choice is not None else None
    expires_at = now + body.timeout_s if body.timeout_s else None
    record = JobRecord(
        job_id=job_id,
        model=body.model,
        state=JobState.queued,
        created_at=now,
        expires_at=expires_at,
        deliveries=0,
        input_digest=_digest(body.input),
        tenant=tenant,
        version=version,
        arm=arm,
    )
    message = RequestMessage(
        v=1,
        job_id=job_id,
        model=body.model,
        input=body.input,
        submitted_at=now,
        deadline=expires_at,
        priority=body.priority,
        cache=body.cache,
        encoding_format=body.encoding_format,
        tenant=tenant,
        version=version,
        arm=arm,
    )
    return record, message.model_dump_json().encode()


def shadow_job(record: JobRecord, data: bytes, shadow: ModelSpec) -> tuple[JobRecord, bytes]:
    """The queued record and message of the shadow copy of the job ``record`` / ``data`` for version ``shadow``."""
    job_id = record.job_id + c.SHADOW_JOB_SUFFIX
    fields = {"version": shadow.version, "arm": "shadow", "shadow_of": record.job_id}
    copy = record.model_copy(update={"job_id": job_id, **fields})
    message = RequestMessage.model_validate_json(data).model_copy(
        update={"job_id": job_id, "priority": "low", "cache": False, **fields}
    )
    return copy, message.model_dump_json().encode()


async def _mirror(state: GatewayState, record: JobRecord, data: bytes, shadow: ModelSpec) -> None:
    """Create and publish the shadow copy of a published job; never raises (see the module docstring)."""
    copy, message = shadow_job(record, data, shadow)
    try:
        await state.backlog.reserve(copy.model)
    except QueueFull:
        logger.info(
            "job %s: not mirrored to version %s, the queue of %s is full", record.job_id, shadow.version, copy.model
        )
        return
    published = False
    try:
        if await state.bounded(state.store.create(copy, message)):
            await _publish_new(state, copy, message, "low")
            published = True
            ROUTED.labels(copy.model, shadow.version, "shadow").inc()
    except Exception as exc:
        logger.warning(
            "job %s: its shadow copy for version %s was not published: %s", record.job_id, shadow.version, exc
        )
    finally:
        state.backlog.published(copy.model, published)


async def _forget(state: GatewayState, job_id: str) -> None:
    """Delete the record (and its unpublished mark) of a job whose publish failed, so that no record claims a job
    that is not queued."""
    try:
        await state.bounded(state.store.delete(job_id))
    except Exception:
        logger.exception("job %s was not published and its record could not be deleted", job_id)


async def _publish(state: GatewayState, record: JobRecord, data: bytes, priority: str) -> None:
    """``publish_request``, with a broker that refused the message for its own bound answered as 429 too."""
    try:
        await publish_request(
            state.broker, record.model, record.job_id, data, state.limits, priority=priority, version=record.version
        )
    except QueueFull as exc:
        raise state.backlog.refused_by_broker(record.model, exc) from exc


async def _publish_new(state: GatewayState, record: JobRecord, data: bytes, priority: str) -> None:
    try:
        await _publish(state, record, data, priority)
    except BaseException:
        # Cancelled or failed: either way the client gets no 202, so the record must go. The shield lets the
        # delete finish when the request task itself is being cancelled.
        await asyncio.shield(_forget(state, record.job_id))
        raise
    await _mark_published(state, record.job_id)


async def _mark_published(state: GatewayState, job_id: str) -> None:
    """Clear the job's unpublished mark; a store that fails here changes nothing for the client (the broker has
    the job) and a reconcile sweep clears the mark later (its republish is a duplicate the broker drops)."""
    try:
        await state.bounded(state.store.published(job_id))
    except StoreError as exc:
        logger.warning("job %s is published but still marked unpublished: %s", job_id, exc.message)


def id_conflict(job_id: str) -> ApiError:
    """The one answer to every submit under a used id that is not the same job: the same type, message and details
    whatever differs (model, input, tenant) and whatever that job's state, so it tells nothing of that job."""
    return ApiError(
        409,
        "job_id_conflict",
        f"job id {job_id!r} is already used by another job; resubmit the same model and input, or choose another id "
        "(or let Fleet choose)",
        {"job_id": job_id},
    )


def _check_same_job(existing: JobRecord, record: JobRecord) -> None:
    """Raises 409 ``job_id_conflict`` (``id_conflict``) when ``record`` reuses the id of another tenant's job, or
    of a job with another model or input.

    A record without a digest (published straight to the topic, or written by an older Fleet) cannot be compared
    and is taken as the same job when its tenant and model are the same.
    """
    if tenancy.owner(existing.tenant) != tenancy.owner(record.tenant) or existing.model != record.model:
        raise id_conflict(record.job_id)
    if existing.input_digest is not None and existing.input_digest != record.input_digest:
        raise id_conflict(record.job_id)


async def _resubmit(state: GatewayState, record: JobRecord, data: bytes, priority: str) -> SubmitResponse:
    """The job id already has a record: answer with it (see the module docstring)."""
    existing = await state.bounded(state.store.get(record.job_id))
    if existing is None:
        raise id_conflict(record.job_id)  # it ended and expired meanwhile: a retry is a fresh submit
    _check_same_job(existing, record)
    if existing.state == JobState.queued:
        await _publish(state, record, data, priority)
        await _mark_published(state, record.job_id)
    return SubmitResponse(job_id=existing.job_id, status=existing.state)


async def _reserve_place(
    state: GatewayState, body: SubmitRequest, record: JobRecord, data: bytes
) -> SubmitResponse | None:
    """Count the job against its model's bound; None when it has its place, else the answer to give.

    A queue at its bound raises ``QueueFull`` (429), except for a resubmit of a job that exists already: that
    creates nothing, so it gets its usual answer.
    """
    try:
        await state.backlog.reserve(record.model)
    except QueueFull:
        if body.job_id is None or await state.bounded(state.store.get(body.job_id)) is None:
            raise
        return await _resubmit(state, record, data, body.priority)
    return None


# -- result caches --------------------------------------------------------------------------------------------
def cache_bypassed(request: Request) -> bool:
    """True for ``X-Cache-Control: bypass``. Raises 422 ``invalid_request`` for any other value of the header."""
    value = request.headers.get(c.HEADER_CACHE_CONTROL)
    if value is None:
        return False
    if value.strip().lower() == "bypass":
        return True
    raise ApiError(
        422,
        "invalid_request",
        f"invalid request: header.{c.HEADER_CACHE_CONTROL}: the only value is 'bypass', got {value[:64]!r}",
        [{"loc": f"header.{c.HEADER_CACHE_CONTROL}", "msg": "must be 'bypass'", "type": "value_error"}],
    )


async def _cache_lookup(state: GatewayState, spec: ModelSpec, body: SubmitRequest, tenant: str | None) -> Lookup | None:
    """The lookup of a model that uses the caches, unless the request bypasses them (None then)."""
    if state.cache is None or not state.cache.uses(spec.name):
        return None
    if not body.cache:
        CACHE_REQUESTS.labels(spec.name, "all", "bypass").inc()
        return None
    return await state.cache.lookup(spec, body.input, body.encoding_format, tenancy.owner(tenant))


async def _answer_from_cache(
    state: GatewayState, record: JobRecord, data: bytes, hit: Hit, priority: str
) -> SubmitResponse:
    """Create the job ``succeeded`` with the cached output, in one store call.

    The record is written terminal at once (if the job id is new) and announced to the job's waiters like a
    finish, so there is no moment at which a gateway that dies leaves a job half made. A job id that exists
    already is a resubmit and gets its usual answer.
    """
    record.cache, record.cache_similarity = hit.level, hit.similarity
    answered = transitions.finished(
        record,
        record.job_id,
        JobState.succeeded,
        model=record.model,
        output=hit.output,
        error=None,
        worker_id=None,
        now=time.time(),
    )
    if not await state.bounded(state.store.create(answered)):
        return await _resubmit(state, record, data, priority)
    JOBS_SUBMITTED.labels(record.model).inc()
    return SubmitResponse(job_id=record.job_id, status=answered.state, cache=answered.cache)


async def _route(request: Request, state: GatewayState, principal: Principal, body: SubmitRequest) -> Choice:
    """The version that answers the job (and its shadow): by the model's traffic policy, if it has one."""
    if state.traffic is None:
        return Choice(served_spec(state.specs, body.model))
    name, sep, version = body.model.partition("@")
    spec = served_spec(state.specs, name)
    if not sep and state.traffic.doc(name) is None:
        return Choice(spec)  # the hot path of a model without a policy: one dict lookup
    return await state.traffic.choose(spec, version if sep else None, principal.tenant, body.input, request.headers)


async def _submit(request: Request, state: GatewayState, principal: Principal, body: SubmitRequest) -> SubmitResponse:
    settings = state.settings
    if cache_bypassed(request):
        body.cache = False
    choice = await _route(request, state, principal, body)
    spec = choice.spec
    body.model = spec.name  # name@version routes to the model's subjects and records under its plain name
    validate_input(spec, body.input)
    check_encoding(spec, body.encoding_format)
    record, data = new_job(body, time.time(), principal.tenant, choice)
    if (traced := tracing.active()) is not None:
        record.trace_id = traced.current_trace_id()
    if len(data) > settings.max_message_bytes:
        raise PayloadTooLarge(len(data), settings.max_message_bytes, what="request message")
    # The tenant's rate and queued-job quota (429 when refused): before a cache lookup, since a hit counts against
    # the rate; otherwise together with the create, in one round trip (a submit the model's bound refuses is free).
    limited = access.limiter_of(request) is not None
    cached = state.cache is not None and state.cache.uses(spec.name) and body.cache
    if limited and cached:
        await access.charge(request, record)
    found = await _cache_lookup(state, spec, body, record.tenant)
    if found is not None and found.hit is not None:
        answered = await _answer_from_cache(state, record, data, found.hit, body.priority)
        note_submitted(request, answered.job_id)
        return answered
    answer = await _reserve_place(state, body, record, data)
    if answer is not None:
        return answer
    published = False
    try:
        if limited and not cached:
            created = await access.charge_and_create(request, record, data, state.bounded)
        else:
            created = await state.bounded(state.store.create(record, data))
        if not created:
            return await _resubmit(state, record, data, body.priority)
        await _publish_new(state, record, data, body.priority)
        published = True
    finally:
        state.backlog.published(record.model, published)
    JOBS_SUBMITTED.labels(record.model).inc()
    if record.version is not None:
        ROUTED.labels(record.model, record.version, record.arm or "explicit").inc()
    note_submitted(request, record.job_id)
    if found is not None and state.cache is not None:
        state.cache.fill_later(found, record.job_id, state.store)
    if choice.shadow is not None:
        await _mirror(state, record, data, choice.shadow)
    return SubmitResponse(job_id=record.job_id, status=JobState.queued)


@router.post(
    "",
    status_code=202,
    response_model=SubmitResponse,
    response_model_exclude_none=True,  # `cache` only on a cached answer: the plain answer stays {job_id, status}
    summary="Submit a job",
    description=(
        "Validates the model and its input, records the job as `queued` and publishes it to the model's subject. "
        "Answers `202` only after the broker acknowledged the publish. Reusing a `job_id` with the same model and "
        "input is idempotent; another model or input, or another tenant's job, is `409 job_id_conflict` (one answer "
        "for all: the id, nothing of the job that holds it). A model whose queue holds its "
        "bound (`FLEET_MAX_QUEUED`) answers `429 queue_full` with a `Retry-After` from its drain rate. For a model "
        "with result caches (`FLEET_CACHE`), a cached answer is a job that is `succeeded` at once (`status` "
        '`succeeded`, `cache` the level); `X-Cache-Control: bypass` or `"cache": false` skips the caches.'
    ),
    responses=limited_responses(202, 400, 404, 409, 413, 422, 429, 503),
    openapi_extra=SUBMIT_BODY,
)
async def submit_job(
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> SubmitResponse:
    return await submit(request, state, principal)


async def submit(request: Request, state: GatewayState, principal: Principal) -> SubmitResponse:
    """Submit the job in ``request``'s body for ``principal``'s tenant (``POST /v1/jobs`` and ``POST /v1/infer``),
    counting refusals."""
    try:
        body = parse_submit(await read_limited_body(request, state.settings.max_body_bytes))
    except Exception as exc:
        SUBMIT_ERRORS.labels(error_type(exc)).inc()
        raise
    return await submit_body(request, state, principal, body)


async def submit_body(
    request: Request, state: GatewayState, principal: Principal, body: SubmitRequest
) -> SubmitResponse:
    """Submit the job ``body`` for ``principal``'s tenant as ``POST /v1/jobs`` does once it has read and parsed its
    body: the same checks, caches, limits, queue bound and refusals (counted). ``request`` carries the caller's
    headers (``X-Cache-Control``) and the state the tenant's limits leave for the answer's headers; a route that
    builds its jobs from another body shape (``fleet.producers.gateway.models``) submits them through here.

    Raises:
        FleetError / ApiError: the refusals of ``POST /v1/jobs`` (404 unknown model, 413, 422 invalid input, 429,
            503), answered by the gateway's error handlers.
    """
    try:
        return await access.settled(request, _submit(request, state, principal, body))
    except Exception as exc:
        SUBMIT_ERRORS.labels(error_type(exc)).inc()
        raise


# -- poll and cancel ------------------------------------------------------------------------------------------
@router.get(
    "/{job_id}",
    response_model=JobRecord,
    summary="Get a job",
    description=(
        "The job's record. With `wait`, holds the request until the job ends or `wait` seconds pass. Another "
        "tenant's job answers `404 job_not_found`, as an unknown id does."
    ),
    responses=error_responses(404, 422, 503),
)
async def get_job(
    job_id: str,
    wait: float | None = Query(None, description="long-poll: seconds to wait for a terminal state (0 < wait ≤ max)"),
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> JobRecord:
    if wait is not None:
        check_wait(wait, state.settings.max_long_poll_s)
    store, timeout_s = state.store, state.limits.store_timeout_s
    if wait is not None:
        return await long_poll(store, job_id, wait, timeout_s, principal.tenant)
    return await read_job(store, job_id, timeout_s, principal.tenant)


def _already_ended(record: JobRecord) -> ApiError:
    return ApiError(
        409,
        "job_terminal",
        f"job {record.job_id!r} already ended '{record.state}'; only queued or running jobs can be cancelled",
        record.model_dump(mode="json"),
    )


@router.post(
    "/{job_id}/cancel",
    response_model=JobRecord,
    summary="Cancel a job",
    description="Ends a queued or running job as `cancelled`; a worker skips it or discards its result.",
    responses=error_responses(404, 409, 503),
)
async def cancel_job(
    job_id: str, state: GatewayState = Depends(gateway_state), principal: Principal = Depends(require_submitter)
) -> JobRecord:
    store, timeout_s = state.store, state.limits.store_timeout_s
    record = await read_job(store, job_id, timeout_s, principal.tenant)
    if record.terminal:
        raise _already_ended(record)
    error = JobError(type="cancelled", message=f"cancelled by a client (POST /v1/jobs/{job_id}/cancel)")
    call = store.finish(job_id, JobState.cancelled, model=record.model, error=error)
    won, current = await state.bounded(call)
    if not won:
        raise _already_ended(current)
    return current
