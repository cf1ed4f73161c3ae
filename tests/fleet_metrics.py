"""The Prometheus series Fleet exports, read from the collectors its metric modules register (shared by the tests
that check the Grafana dashboard's queries and the alert rules' expressions against them)."""

from __future__ import annotations

import importlib

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

METRIC_MODULES = [
    "fleet.lag",
    "fleet.readiness",
    "fleet.outages",
    "fleet.consumers.metrics",
    "fleet.producers.gateway.metrics",
    "fleet.dispatcher.metrics",
    "fleet.autoscaler.service",
    "fleet.lifecycle.service",
    "fleet.tracing.export",
]
SUFFIXES = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_sum", "_count")}


def fleet_collectors() -> dict[str, tuple[type, set[str]]]:
    """Exposed series name -> (collector type, label names), for every fleet_* collector."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    out: dict[str, tuple[type, set[str]]] = {}
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        kind = next((k for k in SUFFIXES if isinstance(collector, k)), None)
        if not name.startswith("fleet_") or kind is None:
            continue
        labels = set(collector._labelnames) | ({"le"} if kind is Histogram else set())  # type: ignore[attr-defined]
        for suffix in SUFFIXES[kind]:
            out[name + suffix] = (kind, labels)
    return out
