"""The process's one ``Tracing`` (or None): started from the environment, flushed at stop.

``start`` reads the ``OTEL_*`` environment (``fleet.tracing.config``) once: with tracing off it imports nothing and
``active()`` stays None, so the hot paths test one global; with it on it builds the SDK pipeline
(``fleet.tracing.otel``). Workers, the gateway and ``fleet up`` call ``start`` as they start and ``flush`` as they
stop; ``shutdown`` ends the pipeline (and lets the next ``start`` read the environment again: tests use it).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fleet.tracing.config import exporter

if TYPE_CHECKING:
    from fleet.tracing.otel import Tracing

_active: Tracing | None = None
_started = False
_lock = threading.Lock()


def active() -> Tracing | None:
    """The process's tracing, or None when off (or not started)."""
    return _active


def start(service: str) -> Tracing | None:
    """Start tracing as the environment says (once per process; later calls return the first outcome).
    ``service`` is the service name when ``OTEL_SERVICE_NAME`` sets none. Raises ``ConfigError`` for an
    exporter Fleet does not ship."""
    global _active, _started
    with _lock:
        if _started:
            return _active
        kind = exporter()
        if kind is not None:
            from fleet.tracing.otel import Tracing

            _active = Tracing.from_environment(service, kind)
        _started = True
        return _active


def use(given: Tracing | None) -> Tracing | None:
    """Make ``given`` (built elsewhere, e.g. on an in-memory exporter) the process's tracing, instead of the
    environment's; the one it replaces is returned, not shut down. Tests and benchmarks use it."""
    global _active, _started
    with _lock:
        previous, _active, _started = _active, given, True
        return previous


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far (a stopping worker or gateway); nothing when tracing is off."""
    if _active is not None:
        _active.flush(timeout_s)


def shutdown() -> None:
    """Flush and end the pipeline; the next ``start`` reads the environment again."""
    global _active, _started
    with _lock:
        if _active is not None:
            _active.shutdown()
        _active = None
        _started = False
