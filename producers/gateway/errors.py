"""Every gateway error becomes ``fleet.schemas.api.ErrorResponse``: ``{"error": {"type", "message", "details"}}``,
except on the OpenAI-compatible routes, which shape the same description (``describe``) as OpenAI does
(``fleet.producers.gateway.models.openai_errors``).

Error types and status codes:

=====================  ======  ==========================================================
type                   status  when
=====================  ======  ==========================================================
malformed_json         400     the body is not JSON, or nests arrays and objects past 100 levels (details: limit;
                               ``fleet.producers.gateway.client_json``)
invalid_request        422     the body, a path or a query parameter has the wrong shape, or the body holds a value
                               JSON cannot carry exactly: NaN, Infinity, 1e400, an integer of more than 4300 digits
                               (details: limit), a lone UTF-16 surrogate
invalid_input          422     ``input`` does not match the model's input schema
dag_invalid            422     a DAG spec refused (details: ``[{step, path, message}, ...]``)
malformed_spec         400     a DAG spec that is not YAML or JSON, or not a mapping (details: as dag_invalid)
run_terminal           409     cancel of a DAG run that already ended (details: the run)
unknown_model          404     the model is not served here (details: known models), or ``name@version`` names another
                               version than the one served (details: model, version, served_version)
job_not_found          404     no record for the job id
dag_not_found          404     no DAG (or no such version of it) is registered (details: name)
run_not_found          404     no DAG run with that id (details: run_id)
not_found              404     no such route
worker_not_found       404     drain of a worker no heartbeat was heard from (details: worker_id)
unauthorized           401     no ``Authorization: Bearer <key or token>`` where one is needed (WWW-Authenticate)
invalid_key            401     FLEET_AUTH=keys: a malformed, unknown or wrong API key (WWW-Authenticate)
key_expired            401     an API key past its expiry (WWW-Authenticate)
key_revoked            401     a revoked API key (WWW-Authenticate)
forbidden              403     a wrong operator token (FLEET_AUTH=off), or a principal without the route's role
key_not_found          404     revoke of an API key id that does not exist (details: key_id)
operator_disabled      403     no ``FLEET_OPERATOR_TOKEN`` and the gateway is bound to a non-loopback address
method_not_allowed     405     the route exists with another method
job_terminal           409     cancel of a job that already ended (details: the record)
job_id_conflict        409     a job id reused for another model, another input or by another tenant: one
                               answer for all, nothing of the job that holds the id (details: job_id)
payload_too_large      413     body over ``max_body_bytes`` (details: size, limit)
queue_full             429     the model's queue holds its bound (``FLEET_MAX_QUEUED``); Retry-After from its
                               drain rate (details: model, limit, depth, retry_after_s)
rate_limited           429     the tenant is over its rate limit (``FLEET_RATE_LIMIT``); Retry-After and RateLimit-*
                               (details: tenant, rate, burst, retry_after_s)
quota_exceeded         429     the tenant holds its bound of queued jobs (``FLEET_TENANT_MAX_QUEUED``); Retry-After
                               (details: tenant, max_queued, queued, retry_after_s)
no_traffic_policy      404     ``GET /v1/models/{name}/traffic`` of a model without one (details: model)
traffic_conflict       409     a traffic policy changed ``CAS_TRIES`` times while a change was written (details: model)
circuit_open           503     the model version that must answer is refused by its circuit breaker; Retry-After
                               from its cool-down (details: model, version, breaker, retry_after_s)
broker_unavailable     503     the broker did not acknowledge the publish (Retry-After)
store_unavailable      503     the result store cannot be reached (Retry-After)
not_ready              503     ``/readyz``: a dependency does not answer (details: which)
internal_error         500     a bug; the server log has the traceback
=====================  ======  ==========================================================
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleet.errors import (
    BrokerError,
    DagInvalid,
    FleetError,
    InvalidInput,
    JobNotFound,
    PayloadTooLarge,
    QueueFull,
    RunIdTaken,
    StoreError,
    UnknownDag,
    UnknownModel,
    UnknownRun,
    UnservedVersion,
)
from fleet.schemas.api import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2


class ApiError(Exception):
    """An error answer the gateway gives that is not one of ``fleet.errors`` (conflicts, malformed JSON...)."""

    def __init__(
        self, status: int, type_: str, message: str, details: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.details = details
        self.headers = headers


def error_json(type_: str, message: str, details: Any = None) -> dict[str, Any]:
    """The ``ErrorResponse`` body as a plain dict (also the payload of WebSocket error frames)."""
    return ErrorResponse(error=ErrorBody(type=type_, message=message, details=details)).model_dump(mode="json")


def error_response(
    status: int, type_: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_json(type_, message, details), status_code=status, headers=headers)


def describe_fleet_error(exc: FleetError) -> tuple[int, str, Any]:
    """(status, type, details) of a ``fleet.errors`` exception."""
    if isinstance(exc, UnservedVersion):
        details = {"model": exc.model, "version": exc.version, "served_version": exc.served, "known": [exc.model]}
        return 404, "unknown_model", details
    if isinstance(exc, UnknownModel):
        return 404, "unknown_model", {"model": exc.model, "known": sorted(exc.known)}
    if isinstance(exc, InvalidInput):
        return 422, "invalid_input", exc.errors
    if isinstance(exc, DagInvalid):
        return 422, "dag_invalid", exc.problems
    if isinstance(exc, UnknownDag):
        return 404, "dag_not_found", {"name": exc.name}
    if isinstance(exc, UnknownRun):
        return 404, "run_not_found", {"run_id": exc.run_id}
    if isinstance(exc, RunIdTaken):
        return 409, "run_id_taken", None
    if isinstance(exc, PayloadTooLarge):
        return 413, "payload_too_large", {"size": exc.size, "limit": exc.limit}
    if isinstance(exc, JobNotFound):
        return 404, "job_not_found", {"job_id": exc.job_id}
    if isinstance(exc, QueueFull):
        return 429, "queue_full", _queue_details(exc)
    if isinstance(exc, BrokerError):
        return 503, "broker_unavailable", None
    if isinstance(exc, StoreError):
        return 503, "store_unavailable", None
    return 500, "internal_error", None


def _queue_details(exc: QueueFull) -> dict[str, Any]:
    return {"model": exc.model, "limit": exc.limit, "depth": exc.depth, "retry_after_s": exc.retry_after_s}


def retry_after(exc: FleetError, status: int) -> dict[str, str] | None:
    """The Retry-After header (integer seconds) of a 429 or 503 answer."""
    if isinstance(exc, QueueFull):
        return {"Retry-After": str(math.ceil(exc.retry_after_s or RETRY_AFTER_S))}
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


def error_type(exc: BaseException) -> str:
    """The ``type`` an exception is reported as; the label of the submit-error counter."""
    if isinstance(exc, ApiError):
        return exc.type
    if isinstance(exc, FleetError):
        return describe_fleet_error(exc)[1]
    return "internal_error"


def _header(description: str, kind: str = "integer") -> dict[str, Any]:
    return {"description": description, "schema": {"type": kind}}


RETRY_AFTER_HEADER = {"Retry-After": _header("seconds to wait before trying again")}
# The IETF draft RateLimit headers of a route that tenants' limits count (fleet.producers.gateway.access.ratelimit):
# on every answer while a rate limit applies to the caller's tenant.
RATE_LIMIT_HEADERS = {
    "RateLimit-Limit": _header("the tenant's burst: requests it may make at once"),
    "RateLimit-Remaining": _header("requests left in the burst now"),
    "RateLimit-Reset": _header("seconds until the burst is whole again"),
    "RateLimit-Policy": _header("the policy as `<burst>;w=<window seconds>`", "string"),
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: each status documented with the ``ErrorResponse`` body (and a 429's or
    503's ``Retry-After``, a 429's ``RateLimit-*`` headers)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorResponse}
        if code == 429:
            out[code]["headers"] = RETRY_AFTER_HEADER | RATE_LIMIT_HEADERS
        elif code == 503:
            out[code]["headers"] = dict(RETRY_AFTER_HEADER)
    return out


def limited_responses(success: int, *codes: int) -> dict[int | str, dict[str, Any]]:
    """``error_responses(*codes)`` for a route that tenants' rate limits count, with the ``RateLimit-*`` headers
    documented on its ``success`` answer too."""
    return {success: {"headers": dict(RATE_LIMIT_HEADERS)}, **error_responses(*codes)}


def validation_errors(exc: ValidationError | RequestValidationError, prefix: str = "") -> list[dict[str, Any]]:
    """Pydantic errors as JSON-safe dicts ``{"loc": "input.texts.0", "msg", "type"}``."""
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        out.append({"loc": path or "(root)", "msg": str(err["msg"]), "type": str(err["type"])})
    return out


def validation_message(errors: list[dict[str, Any]], what: str) -> str:
    """One line naming each bad field: ``invalid input: input.texts.0: Input should be a valid string``."""
    return f"{what}: " + "; ".join(f"{e['loc']}: {e['msg']}" for e in errors)


@dataclass(frozen=True, slots=True)
class Described:
    """What an exception answers, before it is shaped into a body: the gateway's ``ErrorResponse`` here, another
    API's error shape on the routes that speak it (``fleet.producers.gateway.models``)."""

    status: int
    type: str
    message: str
    details: Any = None
    headers: dict[str, str] | None = None


def describe(request: Request, exc: BaseException) -> Described:
    """The answer to ``exc`` raised while serving ``request``: every kind the gateway raises, FastAPI's own
    included, and any other exception as a logged ``500 internal_error``."""
    if isinstance(exc, ApiError):
        return Described(exc.status, exc.type, exc.message, exc.details, exc.headers)
    if isinstance(exc, FleetError):
        status, type_, details = describe_fleet_error(exc)
        if status >= 500:
            logger.warning("%s %s answered %d %s: %s", request.method, request.url.path, status, type_, exc.message)
        return Described(status, type_, exc.message, details, retry_after(exc, status))
    if isinstance(exc, RequestValidationError):
        errors = validation_errors(exc)
        broken = next((e for e in errors if e["type"] == "json_invalid"), None)
        if broken is not None:  # a body that is not JSON is malformed on every route, not a field error
            return Described(400, "malformed_json", f"the request body is not valid JSON: {broken['msg']}")
        return Described(422, "invalid_request", validation_message(errors, "invalid request"), errors)
    if isinstance(exc, StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        type_ = kinds.get(exc.status_code, f"http_{exc.status_code}")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return Described(exc.status_code, type_, message, None, dict(exc.headers or {}))
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return Described(500, "internal_error", f"internal error ({type(exc).__name__}); see the gateway log")


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    d = describe(request, exc)
    return error_response(d.status, d.type, d.message, d.details, d.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error, FastAPI's own included, to an ``ErrorResponse``."""
    for kind in (ApiError, FleetError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _on_error)
