"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, on the routes of this feature.

Every error these routes raise, FastAPI's and the dependencies' included (a missing key, a bad body, a tenant's
rate limit), is described by the gateway's core (``fleet.producers.gateway.errors.describe``) and then shaped here
instead of as Fleet's ``ErrorResponse``; the route class ``OpenAIRoute`` does it for the routes it serves. The rest
of the API keeps its own shape. Headers (``Retry-After``, ``WWW-Authenticate``, ``RateLimit-*``) are kept.

=======  =========================  =====================================================================
status   type                       when (``code``: Fleet's error type, except as named)
=======  =========================  =====================================================================
400      invalid_request_error      a bad body (Fleet's 400 and 422 alike), token-id input, a model of another
                                    kind (``model_not_supported``), ``dimensions`` a model does not take
401      invalid_request_error      no key or a bad one (``invalid_api_key``), an expired or revoked key
                                    (``key_expired``, ``key_revoked``)
403      permission_error           a key without the submitter role
404      invalid_request_error      an unknown model (``model_not_found``)
409      invalid_request_error      a conflict (a cancelled job)
413      invalid_request_error      a body over ``FLEET_MAX_BODY_BYTES`` (``payload_too_large``)
429      rate_limit_error           ``rate_limited``, ``quota_exceeded`` or ``queue_full``, with ``Retry-After``
500      server_error               the model failed on the input (``job_failed``), or a bug
503      server_error               the broker or the store does not answer, with ``Retry-After``
504      server_error               the jobs did not end within the wait (``infer_timeout``) or expired
=======  =========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from fleet.producers.gateway.errors import RATE_LIMIT_HEADERS, RETRY_AFTER_HEADER, ApiError, describe

TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "rate_limit_error"}
# Fleet's error types that OpenAI names otherwise (an expired or revoked key keeps Fleet's more telling code)
CODES = {"unknown_model": "model_not_found", "invalid_key": "invalid_api_key", "unauthorized": "invalid_api_key"}


class OpenAIErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, permission_error, rate_limit_error or server_error")
    param: str | None = Field(None, description="the request field at fault, where one is")
    code: str | None = Field(None, description="machine-readable kind, e.g. model_not_found, invalid_api_key")


class OpenAIErrorResponse(BaseModel):
    """An error in OpenAI's shape (the OpenAI-compatible and rerank routes only)."""

    error: OpenAIErrorBody


class Refused(ApiError):
    """A ``400 invalid_request_error`` of these routes, naming the request field at fault (``param``)."""

    def __init__(self, code: str, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(status, code, message)
        self.param = param


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return TYPES.get(status, "invalid_request_error")


def _param(details: Any) -> str | None:
    """The body field of the first validation error (``body.input.3`` -> ``input``; a job's ``input.texts.3`` ->
    ``input``, the request field its texts came from), if any."""
    if isinstance(details, list) and details and isinstance(details[0], dict):
        parts = str(details[0].get("loc", "")).split(".")
        parts = parts[1:] if parts[0] == "body" else parts
        return parts[0] if parts and parts[0] else None
    return None


def openai_error(request: Request, exc: BaseException) -> JSONResponse:
    """The OpenAI-shaped answer to ``exc`` raised while serving ``request``."""
    described = describe(request, exc)
    status = 400 if described.status == 422 else described.status
    param = exc.param if isinstance(exc, Refused) else _param(described.details)
    body = OpenAIErrorBody(
        message=described.message,
        type=error_type(status),
        param=param,
        code=CODES.get(described.type, described.type),
    )
    return JSONResponse({"error": body.model_dump()}, status_code=status, headers=described.headers)


def openai_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a route of this feature: each status with the ``OpenAIErrorResponse`` body."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": OpenAIErrorResponse}
        if code == 429:
            out[code]["headers"] = RETRY_AFTER_HEADER | RATE_LIMIT_HEADERS
        elif code == 503:
            out[code]["headers"] = dict(RETRY_AFTER_HEADER)
    return out


class OpenAIRoute(APIRoute):
    """A route whose every error, its dependencies' and its body's included, answers in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return openai_error(request, exc)

        return route
