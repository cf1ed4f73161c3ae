"""Turn a raw delivery into a validated job, or into a clear reason why it cannot be one. Pure functions."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from fleet.brokers.base import Delivery
from schemas.jobs import JobError
from schemas.models import ModelSpec
from schemas.wire import JOB_ID_PATTERN, RequestMessage

_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
_validate_request_json = RequestMessage.__pydantic_validator__.validate_json


@dataclass(slots=True)
class Job:
    """One delivery with what could be made of it. ``error`` is set when the message is not a valid request;
    ``body`` then holds what could be decoded of it (for the dead letter)."""

    delivery: Delivery
    job_id: str | None
    request: RequestMessage | None = None
    input: BaseModel | None = None
    error: JobError | None = None
    body: dict[str, Any] | None = None


def describe_validation(exc: ValidationError, prefix: str = "") -> str:
    """``ValidationError`` as one line naming each failing field: ``input.texts.0: Input should be a string``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        parts.append(f"{loc or '(root)'}: {err['msg']}")
    return "; ".join(parts)


def _invalid(delivery: Delivery, job_id: str | None, message: str, body: dict[str, Any] | None = None) -> Job:
    return Job(delivery, job_id, error=JobError(type="invalid_request", message=message), body=body)


def _fallback_job_id(delivery: Delivery, body: dict[str, Any] | None) -> str | None:
    candidate = body.get("job_id") if body else None
    if not isinstance(candidate, str):
        candidate = delivery.msg_id
    return candidate if isinstance(candidate, str) and _JOB_ID_RE.match(candidate) else None


def parse_delivery(delivery: Delivery, spec: ModelSpec) -> Job:
    """Decode and validate a request for ``spec``'s model. Never raises: problems become ``Job.error``."""
    # The validators themselves, as ``model_validate_json``/``model_validate`` call them: this runs once per job.
    try:
        request: RequestMessage = _validate_request_json(delivery.data)  # the common case, in one pass
    except ValidationError:
        return _explain(delivery)
    if request.model != spec.name:
        message = f"message names model {request.model!r} but was sent to {spec.name!r}"
        return _invalid(delivery, request.job_id, message, request.model_dump(mode="json"))
    try:
        model_input = spec.input_model.__pydantic_validator__.validate_python(request.input)
    except ValidationError as exc:
        message = f"input does not match the {spec.name!r} schema: {describe_validation(exc, 'input')}"
        return _invalid(delivery, request.job_id, message, request.model_dump(mode="json"))
    return Job(delivery, request.job_id, request=request, input=model_input)


def _explain(delivery: Delivery) -> Job:
    """The message is not a valid request: find the most useful thing to say about it, and its job id if any."""
    try:
        body = json.loads(delivery.data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _invalid(delivery, _fallback_job_id(delivery, None), f"message is not valid UTF-8 JSON: {exc}")
    if not isinstance(body, dict):
        return _invalid(
            delivery, _fallback_job_id(delivery, None), "message must be a JSON object (see RequestMessage)"
        )
    try:
        RequestMessage.model_validate(body)
    except ValidationError as exc:
        message = f"message does not match the wire format: {describe_validation(exc)}"
        return _invalid(delivery, _fallback_job_id(delivery, body), message, body)
    # Valid as a Python object but not as JSON text (e.g. a float job id): report it as the wire format's problem.
    return _invalid(delivery, _fallback_job_id(delivery, body), "message does not match the wire format", body)
