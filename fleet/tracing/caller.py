"""The caller's trace context for a client request: the SDK sends the current OpenTelemetry span as ``traceparent``
/ ``tracestate`` headers, so the gateway's spans join the caller's trace.

Never imports OpenTelemetry: a caller with a current span has imported it already (``sys.modules``); without it
(the base client install) this is one dictionary lookup and no header.
"""

from __future__ import annotations

import sys

from fleet.constants import HEADER_TRACEPARENT, HEADER_TRACESTATE


def trace_headers() -> dict[str, str]:
    """``{"traceparent": ..., "tracestate": ...}`` of the caller's current span, or ``{}`` when none is current."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return {}
    try:
        ctx = api.get_current_span().get_span_context()
        if not ctx.is_valid:
            return {}
        headers = {HEADER_TRACEPARENT: f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:
            headers[HEADER_TRACESTATE] = state
        return headers
    except Exception:  # another opentelemetry than the API we know: send nothing rather than fail the call
        return {}
