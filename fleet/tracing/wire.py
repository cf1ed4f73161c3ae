"""W3C trace context on the wire: which ``traceparent`` / ``tracestate`` a delivered request carries.

A request carries its trace in the message headers ``traceparent`` / ``tracestate`` (``fleet.constants``), or, for a
raw producer that cannot set headers, in the body fields ``RequestMessage.traceparent`` / ``.tracestate``; the
header wins. A header that is not a valid version-00 ``traceparent`` (or is all zeros) counts as absent. Pure
string work: no OpenTelemetry import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fleet.constants import HEADER_TRACEPARENT, HEADER_TRACESTATE
from fleet.schemas.wire import TRACEPARENT_PATTERN

_VALID = re.compile(TRACEPARENT_PATTERN).match
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
MAX_TRACESTATE = 512


def valid(traceparent: str | None) -> bool:
    """Whether ``traceparent`` is a W3C version-00 trace parent naming a real trace and span."""
    return (
        traceparent is not None
        and _VALID(traceparent) is not None
        and traceparent[:2] != "ff"
        and traceparent[3:35] != _ZERO_TRACE
        and traceparent[36:52] != _ZERO_SPAN
    )


def carried(headers: Mapping[str, str] | None, request: Any) -> tuple[str, str | None] | None:
    """``(traceparent, tracestate)`` a message carries: its headers', else its request's body fields (``request``
    a ``RequestMessage`` or None); None when it carries no valid one."""
    if headers:
        parent = headers.get(HEADER_TRACEPARENT)
        if valid(parent):
            assert parent is not None
            return parent, _state(headers.get(HEADER_TRACESTATE))
    if request is not None:
        parent = request.traceparent
        if valid(parent):
            return parent, _state(request.tracestate)
    return None


def trace_id(traceparent: str) -> str:
    """The 32-hex trace id of a valid ``traceparent``."""
    return traceparent[3:35]


def _state(value: str | None) -> str | None:
    return value if value and len(value) <= MAX_TRACESTATE else None
