"""Prometheus metrics of workers, on the default registry (served by the gateway's /metrics under `fleet up`,
or by `fleet worker --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from fleet import constants as c

ITEMS = Counter("fleet_worker_items_total", "Items settled by workers, by outcome", ["model", "outcome"])
BATCH_SIZE = Histogram(
    "fleet_worker_batch_size",
    "Items per micro-batch",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
BATCH_SECONDS = Histogram(
    "fleet_worker_batch_seconds",
    "Model compute time per micro-batch",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOB_LATENCY = Histogram(
    "fleet_job_latency_seconds",
    "From a job's creation to its terminal write, by model: jobs this worker ended (the latency SLO's histogram)",
    ["model"],
    buckets=c.JOB_LATENCY_BUCKETS_S,
)
DEVICE_SECONDS = Counter(
    "fleet_device_seconds_total",
    "Device time of computed jobs whose results a worker stored, shared by cost (fleet.consumers.usage). The "
    "tenant label is bounded by the tenants of API keys (and whatever tenants raw producers name on the wire)",
    ["model", "version", "tenant"],
)
USAGE_WRITE_FAILURES = Counter(
    "fleet_usage_write_failures_total",
    "Usage writes (each carrying the usage of one or more settled batches) the usage store did not take",
    ["model"],
)
IN_FLIGHT = Gauge("fleet_worker_in_flight", "Messages held by workers (fetched, not yet settled)", ["model"])
BREAKER_STATE = Gauge(
    "fleet_worker_breaker_state", "A worker's circuit breaker: 0 closed, 1 half-open, 2 open", ["model", "worker"]
)
BREAKER_TRANSITIONS = Counter(
    "fleet_worker_breaker_transitions_total",
    "Circuit breaker transitions of workers, by the state entered",
    ["model", "to"],
)
REPLICAS_BUSY = Gauge("fleet_worker_replicas_busy", "Replicas of a worker computing a batch now", ["model", "worker"])

# The model pool of a multi-model worker (fleet.consumers.pool), by model and version.
MODEL_LOADS = Counter("fleet_worker_model_loads_total", "Model versions loaded and warmed up", ["model", "version"])
MODEL_UNLOADS = Counter(
    "fleet_worker_model_unloads_total",
    "Model versions unloaded (evicted for the budget, or at stop)",
    ["model", "version"],
)
MODEL_LOAD_FAILURES = Counter(
    "fleet_worker_model_load_failures_total",
    "Model version loads that failed or were refused (larger than the budget)",
    ["model", "version"],
)
MODEL_LOAD_SECONDS = Histogram(
    "fleet_worker_model_load_seconds",
    "Time to load and warm up a model version",
    ["model", "version"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
MODEL_LOADED_BYTES = Gauge(
    "fleet_worker_model_loaded_bytes",
    "Budgeted bytes of a loaded model version (0 when unloaded)",
    ["model", "version"],
)

# The SLO targets of fleet.settings, per model, for the shipped alert rules (deploy/prometheus/fleet-alerts.yaml):
# the latency objective carries its threshold as ``le``, the bucket of fleet_job_latency_seconds the rules read.
SLO_LATENCY_OBJECTIVE = Gauge(
    "fleet_slo_latency_objective",
    "Share of a model's jobs that must finish within the threshold le (seconds, a bucket of "
    "fleet_job_latency_seconds); from FLEET_SLO_LATENCY_TARGET and FLEET_SLO_LATENCY_S",
    ["model", "le"],
)
SLO_ERROR_OBJECTIVE = Gauge(
    "fleet_slo_error_objective",
    "Share of a model's terminal jobs that must not fail; from FLEET_SLO_ERROR_TARGET",
    ["model"],
)

# Devices and model memory (fleet.consumers.gpu_stats), refreshed on the heartbeat; absent on a machine without GPUs.
GPU_UTILIZATION = Gauge(
    "fleet_gpu_utilization_ratio", "Share of the last NVML sample period a kernel ran on the device", ["gpu", "uuid"]
)
GPU_MEMORY_USED = Gauge("fleet_gpu_memory_used_bytes", "Device memory in use (NVML), all processes", ["gpu", "uuid"])
GPU_MEMORY_TOTAL = Gauge("fleet_gpu_memory_total_bytes", "Device memory in all (NVML)", ["gpu", "uuid"])
MODEL_MEMORY = Gauge(
    "fleet_model_memory_bytes",
    "Device memory held by a loaded model version (its parameters and buffers on the GPU); absent on CPU",
    ["model", "version"],
)


def export_objectives(model: str, latency_s: float, latency_target: float, error_target: float) -> None:
    """Publish a model's SLO targets; ``latency_s`` is labelled as the histogram labels its bucket."""
    SLO_LATENCY_OBJECTIVE.labels(model, floatToGoString(latency_s)).set(latency_target)
    SLO_ERROR_OBJECTIVE.labels(model).set(error_target)


# Where jobs' time went (fleet.consumers.stages): one observation per job and stage, with the job's trace id as
# the exemplar when it was traced (shown by the OpenMetrics exposition: Accept: application/openmetrics-text).
STAGE_SECONDS = Histogram(
    "fleet_job_stage_seconds",
    "Seconds a job spent in a stage: queue (published to fetched), batch_wait (fetched to its batch's start), "
    "compute, store (computed to its record written) and hop (into a DAG step: the record that completed its "
    "inputs written to the step published)",
    ["model", "stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
