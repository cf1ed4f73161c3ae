"""Prometheus metrics of the dispatcher (``fleet_dispatcher_*``), labelled by model and dispatcher id."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

IDLE_QUEUE = Gauge("fleet_dispatcher_idle_queue_length", "Valid idle tokens queued", ["model", "dispatcher"])
LIVE_WORKERS = Gauge(
    "fleet_dispatcher_live_workers", "Workers heartbeating in dispatch routing", ["model", "dispatcher"]
)
ASSIGNMENTS = Counter(
    "fleet_dispatcher_assignments_total",
    "Requests assigned, by route: idle (an idle token), amnesia (the amnesia list), fallback (random), "
    "policy (a non-JIQ policy), warm (a busy worker with the version loaded), reassigned (the first worker died)",
    ["model", "dispatcher", "route"],
)
COLD_ASSIGNMENTS = Counter(
    "fleet_dispatcher_cold_assignments_total",
    "Requests assigned to a worker without their model version loaded (it loads it first)",
    ["model", "dispatcher"],
)
WORKER_ASSIGNMENTS = Counter(
    "fleet_dispatcher_worker_assignments_total", "Requests assigned per worker", ["model", "dispatcher", "worker"]
)
WORKER_OUTSTANDING = Gauge(
    "fleet_dispatcher_worker_outstanding",
    "Requests assigned to a worker and not yet finished",
    ["model", "dispatcher", "worker"],
)
OUTSTANDING = Gauge(
    "fleet_dispatcher_outstanding", "Requests held until their result is stored", ["model", "dispatcher"]
)
COMPLETED = Counter("fleet_dispatcher_completed_total", "Requests whose result was stored", ["model", "dispatcher"])
DEAD_LETTERED = Counter(
    "fleet_dispatcher_dead_lettered_total", "Messages with no usable job id, dead-lettered", ["model", "dispatcher"]
)
LATENCY = Histogram(
    "fleet_dispatcher_assignment_seconds",
    "From assignment to stored result",
    ["model", "dispatcher"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
