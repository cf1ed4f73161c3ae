"""Turn a raw delivery into a validated job, or into a clear reason why it cannot be one. Pure functions."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from fleet.brokers.base import Delivery
from fleet.encoding import no_vectors_message
from fleet.schemas.jobs import JobError
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import JOB_ID_PATTERN, RequestMessage

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
    attempt: int = 1  # this run's number: one more than the runs the job's record counts (set at admission)
    deadline: float | None = None  # unix seconds: the request's deadline, else its record's expiry
    unread: bool = False  # admission did not read its record (a DAG step's first delivery: it has none yet)
    strikes: int = 0  # runs counted against it so far (``fleet.consumers.crashes``), this one not included
    bound: int | None = None  # the most jobs this run may start with (``fleet.consumers.crashes``; None: any)
    version: str | None = None  # the model version it runs with (set by the worker just before its start)
    # where its time went, unix seconds (fleet.schemas.jobs.StageTimings): set by the worker as it passes them
    fetched_at: float | None = None
    batch_started_at: float | None = None
    computed_at: float | None = None
    device_seconds: float | None = None  # its share of its batch's compute time (by cost), set after compute
    cost: int | None = None  # the handler's cost(input), weighed when fetched (None: not weighed)
    trace: Any = None  # the job's trace context while it is in the worker (fleet.tracing: what its message carried,
    # then its process span's context; None: not traced)


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
    """Decode and validate a request for ``spec``'s model. Never raises: problems become ``Job.error``.

    Whatever a body does to a parser (nesting past any recursion limit, numbers past any range, invalid UTF-8,
    lone surrogates, a validator that raises something unexpected), the result is a ``Job`` with an error: one bad
    message must never stop the batch it came in, nor the subject.
    """
    try:
        return _parse(delivery, spec)
    except Exception as exc:  # a parser bug or a pathological body: the message is poison, the worker goes on
        message = f"message could not be parsed ({type(exc).__name__}: {str(exc)[:200]})"
        return _invalid(delivery, _safe_job_id(delivery), message)


def _parse(delivery: Delivery, spec: ModelSpec) -> Job:
    # The validators themselves, as ``model_validate_json``/``model_validate`` call them: this runs once per job.
    try:
        request: RequestMessage = _validate_request_json(delivery.data)  # the common case, in one pass
    except ValidationError as exc:
        return _explain(delivery, exc)
    if request.model != spec.name:
        message = f"message names model {request.model!r} but was sent to {spec.name!r}"
        return _invalid(delivery, request.job_id, message, request.model_dump(mode="json"))
    if request.encoding_format != "float" and not spec.vector_fields:
        return _invalid(delivery, request.job_id, no_vectors_message(spec.name), request.model_dump(mode="json"))
    try:
        model_input = spec.input_model.__pydantic_validator__.validate_python(request.input)
    except ValidationError as exc:
        message = f"input does not match the {spec.name!r} schema: {describe_validation(exc, 'input')}"
        return _invalid(delivery, request.job_id, message, request.model_dump(mode="json"))
    return Job(delivery, request.job_id, request=request, input=model_input, deadline=request.deadline)


def _safe_job_id(delivery: Delivery) -> str | None:
    try:
        return _fallback_job_id(delivery, None)
    except Exception:
        return None


def _json_problem(exc: ValidationError) -> str | None:
    """The parser's own words when the body is not JSON it can read (``recursion limit exceeded at line 1...``)."""
    for err in exc.errors(include_url=False, include_input=False):
        if err["type"] == "json_invalid":
            return str(err.get("ctx", {}).get("error") or err["msg"])
    return None


def _explain(delivery: Delivery, exc: ValidationError) -> Job:
    """The message is not a valid request: find the most useful thing to say about it, and its job id if any."""
    problem = _json_problem(exc)
    if problem is not None:  # not JSON the wire format accepts: no second parser gets to try (and to recurse)
        return _invalid(delivery, _fallback_job_id(delivery, None), f"message is not valid UTF-8 JSON: {problem}")
    try:
        body = json.loads(delivery.data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc2:
        return _invalid(delivery, _fallback_job_id(delivery, None), f"message is not valid UTF-8 JSON: {exc2}")
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
