"""Prometheus metrics of the gateway.

The metrics are module-level objects on prometheus_client's default ``REGISTRY``, created once at import. Why the
default registry: ``fleet up`` runs gateway and workers in one process and serves one ``/metrics``; the worker
registers its metrics there too, so ``/metrics`` shows everything. Several apps in one process (tests) share
these series, so tests compare values before and after rather than absolute numbers.
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

JOBS_SUBMITTED = Counter(
    "fleet_gateway_jobs_submitted_total", "Jobs accepted by POST /v1/jobs (202), by model.", ["model"]
)
SUBMIT_ERRORS = Counter(
    "fleet_gateway_submit_errors_total", "POST /v1/jobs answered with an error, by error type.", ["type"]
)
ROUTED = Counter(
    "fleet_gateway_routed_total",
    "Jobs accepted for a model version by its traffic policy, by model, version and arm (primary, canary, shadow: "
    "a mirrored copy; explicit: the job named its version).",
    ["model", "version", "arm"],
)
BREAKER_TURNED = Counter(
    "fleet_gateway_breaker_turned_total",
    "Requests a version's circuit breaker turned, by model, version and outcome: fallback (a canary's request sent "
    "to the primary), refused (503 circuit_open) or probe (let through half-open).",
    ["model", "version", "outcome"],
)
REJECTED = Counter(
    "fleet_gateway_rejected_total",
    "Submissions refused with 429 queue_full, by model and reason: queue_full (the gateway's bound) or "
    "broker_full (the broker refused the publish for its own per-subject limit).",
    ["model", "reason"],
)
HTTP_REQUESTS = Counter(
    "fleet_gateway_http_requests_total",
    "HTTP requests, by method, route template and status.",
    ["method", "route", "status"],
)
HTTP_LATENCY = Histogram(
    "fleet_gateway_http_request_duration_seconds",
    "HTTP request latency in seconds, by method and route template (long-polls included).",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHE_REQUESTS = Counter(
    "fleet_cache_requests_total",
    "Result-cache lookups, by model, level (l1, l2, l3) and result: hit, miss, error (the level could not answer: "
    "counted as a miss) or bypass (the request skipped the caches; level 'all').",
    ["model", "level", "result"],
)
CACHE_LOOKUP_SECONDS = Histogram(
    "fleet_cache_lookup_seconds",
    "Time of one result-cache level's lookup in seconds (L3 includes embedding the text), by model and level.",
    ["model", "level"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
CACHE_FILLS = Counter(
    "fleet_cache_fills_total",
    "Outputs of missed jobs stored in the caches, by model and result: stored, skipped (not succeeded, or too "
    "many fills pending) or error (a level could not be written).",
    ["model", "result"],
)
CACHE_L3_READY = Gauge(
    "fleet_cache_l3_ready", "1 once this gateway's L3 embedding model is loaded (until then L3 lookups miss)."
)
CACHE_L3_ENTRIES = Gauge("fleet_cache_l3_entries", "Entries in this gateway's L3 index, by model.", ["model"])
WEBSOCKETS_OPEN = Gauge("fleet_gateway_websockets_open", "WebSocket connections open now.")
SSE_STREAMS_OPEN = Gauge("fleet_gateway_sse_streams_open", "Server-sent event streams open now.")

__all__ = [
    "CACHE_FILLS",
    "CACHE_L3_ENTRIES",
    "CACHE_L3_READY",
    "CACHE_LOOKUP_SECONDS",
    "CACHE_REQUESTS",
    "HTTP_LATENCY",
    "HTTP_REQUESTS",
    "JOBS_SUBMITTED",
    "REGISTRY",
    "REJECTED",
    "SSE_STREAMS_OPEN",
    "SUBMIT_ERRORS",
    "WEBSOCKETS_OPEN",
    "MetricsMiddleware",
]


def route_label(scope: Scope) -> str:
    """The matched route's path template (``/v1/jobs/{job_id}``); ``unmatched`` keeps 404 scans out of labels."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    """Pure ASGI middleware timing each HTTP request (WebSockets are counted by their handlers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = route_label(scope)
            method = str(scope.get("method", ""))
            HTTP_LATENCY.labels(method, route).observe(time.perf_counter() - started)
            HTTP_REQUESTS.labels(method, route, str(status)).inc()
