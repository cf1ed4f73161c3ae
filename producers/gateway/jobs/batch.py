"""``POST /v1/jobs:batch``: many submits in one request, one answer per item, in order.

The body is a JSON array of ``POST /v1/jobs`` bodies, or JSON Lines (``Content-Type: application/x-ndjson`` or
``application/jsonl``: one body per non-empty line). Each item goes through exactly what ``POST /v1/jobs`` does
(``routes.submit_body``: the model and input checks, caches, the tenant's rate and quota, the model's queue bound,
idempotency by ``job_id``), so an item answers what it would have answered alone: ``status`` 202 with its
``job_id`` and ``state``, or its 4xx/5xx with the error body. A refused item never fails the others; the request
itself answers ``200`` with ``{"items": [...], "accepted", "refused"}``.

Bounds: at most ``JOB_BATCH_MAX_ITEMS`` items (``413 batch_too_large`` beyond) and ``GatewayLimits.batch_max_bytes``
of body (``413 payload_too_large``); each item's message is held to ``FLEET_MAX_MESSAGE_BYTES`` as a single
submit's. A body that is not a JSON array (or a JSON Lines body with no item) is ``400``/``422`` for the request;
a JSON Lines line that does not parse is that item's ``400 malformed_json``.

Items run ``GatewayLimits.batch_concurrency`` at a time: their store calls and broker publishes overlap, so a batch
costs a few round trips per ``batch_concurrency`` items instead of one request each. Each item has a request of
its own (the caller's headers and app, a fresh per-request state), so that the quota place one item takes is given
back by that item's own outcome (``access.settled``). A job id given twice in one batch is one job: the second
item answers as a resubmit (202, the same job) or ``409`` if its input differs. The request's headers apply to
every item (``X-Cache-Control: bypass``); the ``RateLimit-*`` headers of single submits are not sent (each refused
item's error carries its ``retry_after_s``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from fleet import constants as c
from fleet.producers.gateway.access import AUTH_RESPONSES, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import ApiError, describe, error_responses, error_type
from fleet.producers.gateway.jobs.routes import submit_body, submit_request
from fleet.producers.gateway.limits import read_limited_body
from fleet.producers.gateway.metrics import SUBMIT_ERRORS
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import BatchItemResult, BatchResponse, ErrorBody, SubmitRequest

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)

JSONL_TYPES = frozenset({"application/x-ndjson", "application/jsonl", "application/json-lines"})
JSON_TYPES = frozenset({"application/json", ""})


def _too_many(count: int) -> ApiError:
    return ApiError(
        413,
        "batch_too_large",
        f"the batch holds {count} items, at most {c.JOB_BATCH_MAX_ITEMS} are accepted; split it",
        {"items": count, "limit": c.JOB_BATCH_MAX_ITEMS},
    )


def parse_items(raw: bytes, content_type: str) -> list[Any | ApiError]:
    """The items of a batch body: parsed values, or for a JSON Lines line that does not parse, its error.

    Raises:
        ApiError: 415 for another content type, 400/422 for a body that is not a JSON array, 422 for no items,
            413 ``batch_too_large`` for too many.
    """
    kind = content_type.split(";", 1)[0].strip().lower()
    items: list[Any | ApiError]
    if kind in JSONL_TYPES:
        lines = [line for line in raw.split(b"\n") if line.strip()]
        if len(lines) > c.JOB_BATCH_MAX_ITEMS:
            raise _too_many(len(lines))
        items = []
        for n, line in enumerate(lines):
            try:
                items.append(parse_json(line, what=f"item {n}"))
            except ApiError as exc:
                items.append(exc)
    elif kind in JSON_TYPES:
        data = parse_json(raw)
        if not isinstance(data, list):
            raise ApiError(422, "invalid_request", f"the batch must be a JSON array of jobs, not {type(data).__name__}")
        if len(data) > c.JOB_BATCH_MAX_ITEMS:
            raise _too_many(len(data))
        items = list(data)
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"a batch is application/json (an array) or JSON Lines (application/x-ndjson), not {kind[:64]!r}",
        )
    if not items:
        raise ApiError(422, "invalid_request", "the batch holds no items")
    return items


def _own_request(request: Request) -> Request:
    """A request for one item: the caller's scope (headers, app) with a state of its own."""
    scope = dict(request.scope)
    scope["state"] = {}
    return Request(scope, request.receive)


def _refused(index: int, request: Request, exc: BaseException) -> BatchItemResult:
    described = describe(request, exc)
    body = ErrorBody(type=described.type, message=described.message, details=described.details)
    return BatchItemResult(index=index, status=described.status, error=body)


async def _one(
    index: int, item: Any, request: Request, state: GatewayState, principal: Principal, slots: asyncio.Semaphore
) -> BatchItemResult:
    try:
        if isinstance(item, ApiError):
            raise item
        body: SubmitRequest = submit_request(item, what=f"item {index}", prefix=f"items.{index}")
    except ApiError as exc:
        SUBMIT_ERRORS.labels(error_type(exc)).inc()
        return _refused(index, request, exc)
    async with slots:
        own = _own_request(request)
        try:
            answer = await submit_body(own, state, principal, body)
        except Exception as exc:  # each item answers its own error; the batch goes on
            return _refused(index, own, exc)
    return BatchItemResult(index=index, status=202, job_id=answer.job_id, state=answer.status, cache=answer.cache)


_JOB_SCHEMA = SubmitRequest.model_json_schema()
_JSONL_EXAMPLE = (
    '{"model": "embed", "input": {"texts": ["first"]}}\n{"model": "embed", "input": {"texts": ["second"]}}\n'
)
BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"type": "array", "items": _JOB_SCHEMA},
                "example": [
                    {"model": "embed", "input": {"texts": ["first"]}, "job_id": "order-1"},
                    {"model": "embed", "input": {"texts": ["second"]}},
                ],
            },
            "application/x-ndjson": {
                "schema": {"type": "string"},
                "example": _JSONL_EXAMPLE,
            },
        },
    }
}
EXAMPLE_ANSWER = {
    "items": [
        {"index": 0, "status": 202, "job_id": "order-1", "state": "queued"},
        {
            "index": 1,
            "status": 404,
            "error": {"type": "unknown_model", "message": "unknown model 'embedd'; served models: embed"},
        },
    ],
    "accepted": 1,
    "refused": 1,
}


@router.post(
    "/jobs:batch",
    response_model=BatchResponse,
    response_model_exclude_none=True,
    summary="Submit many jobs",
    description=(
        "A JSON array of `POST /v1/jobs` bodies, or JSON Lines (`application/x-ndjson`). Each item is submitted as "
        "`POST /v1/jobs` would submit it (checks, caches, the tenant's rate and quota, the queue bound, idempotency "
        "by `job_id`) and answers in `items`, in order: `status` 202 with `job_id` and `state`, or the 4xx/5xx and "
        "`error` it would have had alone. A refused item never fails the others. At most "
        f"{c.JOB_BATCH_MAX_ITEMS} items (`413 batch_too_large`)."
    ),
    responses={
        **error_responses(400, 413, 415, 422),
        200: {"content": {"application/json": {"example": EXAMPLE_ANSWER}}},
    },
    openapi_extra=BATCH_BODY,
)
async def submit_batch(
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> BatchResponse:
    raw = await read_limited_body(request, state.limits.batch_max_bytes)
    items = parse_items(raw, request.headers.get("content-type", ""))
    slots = asyncio.Semaphore(state.limits.batch_concurrency)
    results = await asyncio.gather(*(_one(i, it, request, state, principal, slots) for i, it in enumerate(items)))
    accepted = sum(1 for r in results if r.status < 300)
    return BatchResponse(items=list(results), accepted=accepted, refused=len(results) - accepted)
