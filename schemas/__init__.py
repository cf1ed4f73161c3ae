"""Pydantic models for everything Fleet exchanges: the wire format, job records, REST bodies, model I/O.

These models are the contract between producers in any language and the fleet; ``fleet schemas export DIR``
writes them as JSON Schema.
"""

from fleet.schemas.api import ErrorBody, ErrorResponse, SubmitRequest, SubmitResponse
from fleet.schemas.jobs import TERMINAL_STATES, JobError, JobRecord, JobState
from fleet.schemas.wire import WIRE_VERSION, DeadLetter, Heartbeat, RequestMessage

__all__ = [
    "TERMINAL_STATES",
    "WIRE_VERSION",
    "DeadLetter",
    "ErrorBody",
    "ErrorResponse",
    "Heartbeat",
    "JobError",
    "JobRecord",
    "JobState",
    "RequestMessage",
    "SubmitRequest",
    "SubmitResponse",
]
