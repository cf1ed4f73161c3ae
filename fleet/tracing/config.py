"""Whether this process traces, from the standard OpenTelemetry environment variables. Imports no OpenTelemetry.

Tracing is on when ``OTEL_SDK_DISABLED`` is not true and either ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``, or ``console`` for a look on stderr) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). ``OTEL_TRACES_EXPORTER=none`` turns it off whatever else is set. The other
variables (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and ``_ARG``, the exporter's
headers and timeouts) are read by the OpenTelemetry SDK itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fleet.errors import ConfigError

EXPORTERS = ("otlp", "console", "none")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def exporter(environ: Mapping[str, str] | None = None) -> str | None:
    """The exporter to use (``otlp`` or ``console``), or None when tracing is off. Raises ``ConfigError`` naming
    the variable for an exporter Fleet does not ship, or a malformed protocol."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        first = named.split(",")[0].strip()
        if first not in EXPORTERS:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={named!r}: Fleet ships the exporters {', '.join(EXPORTERS)} (OTLP over HTTP)"
            )
        return None if first == "none" else first
    if any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol and protocol.strip() != "http/protobuf":
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: Fleet exports OTLP over HTTP only ('http/protobuf')"
            )
        return "otlp"
    return None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment turns tracing on (see the module docstring)."""
    return exporter(environ) is not None
