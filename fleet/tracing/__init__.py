"""Traces of a request across Fleet's hops (OpenTelemetry), off unless the ``OTEL_*`` environment turns them on.

``config`` reads the standard variables and says whether tracing is on (no OpenTelemetry import); ``wire`` reads
and writes the W3C ``traceparent`` / ``tracestate`` of a message (headers win over the request's body fields);
``state`` holds the process's one ``Tracing`` (``start``, ``active``, ``flush``, ``shutdown``); ``otel`` (the SDK
pipeline and every span) and ``export`` (the worker's spans as OTLP/HTTP JSON from a thread of their own) are the
modules that import OpenTelemetry: ``start`` imports them when tracing is on, never otherwise. A process
with tracing off pays one ``is None`` check per batch, per submit and per DAG hop. See docs/guides/tracing.md.
"""

from fleet.tracing.config import enabled
from fleet.tracing.state import active, flush, shutdown, start, use

__all__ = ["active", "enabled", "flush", "shutdown", "start", "use"]
