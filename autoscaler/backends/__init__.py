"""Scaler backends: what the autoscaler drives to change a model's replica count.

==============  ==========================================================================================
``process``     ``fleet worker`` processes on this machine (needs a real broker and store)
``inprocess``   workers inside this process, for the embedded in-memory broker (needs ``start_worker``)
``kubernetes``  the ``scale`` subresource of each model's worker Deployment (needs ``namespace``)
``dry-run``     records the decisions, changes nothing
==============  ==========================================================================================
"""

from __future__ import annotations

from typing import Any

from fleet.autoscaler.backends.base import ScalerBackend
from fleet.errors import ConfigError
from fleet.settings import FleetSettings

BACKENDS = ("process", "inprocess", "kubernetes", "dry-run")


def default_backend_name(settings: FleetSettings) -> str:
    """``process`` with a real broker and store; ``inprocess`` with the embedded in-memory ones."""
    memory = settings.broker_scheme == "memory" or settings.store_scheme == "memory"
    return "inprocess" if memory else "process"


def make_backend(name: str, settings: FleetSettings, **kwargs: Any) -> ScalerBackend:
    """Build the backend called ``name``; ``kwargs`` go to its constructor.

    Raises:
        ConfigError: an unknown name, or arguments the backend does not take or needs.
    """
    try:
        return _build(name, settings, kwargs)
    except TypeError as exc:
        raise ConfigError(f"scaler backend {name!r}: {exc}") from exc


def _build(name: str, settings: FleetSettings, kwargs: dict[str, Any]) -> ScalerBackend:
    if name == "process":
        from fleet.autoscaler.backends.process import ProcessBackend

        return ProcessBackend(settings, **kwargs)
    if name == "inprocess":
        from fleet.autoscaler.backends.inprocess import InProcessBackend

        return InProcessBackend(**kwargs)
    if name == "kubernetes":
        from fleet.autoscaler.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(**kwargs)
    if name == "dry-run":
        from fleet.autoscaler.backends.dry_run import DryRunBackend

        return DryRunBackend(**kwargs)
    raise ConfigError(f"unknown scaler backend {name!r}; known backends: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "ScalerBackend", "default_backend_name", "make_backend"]
