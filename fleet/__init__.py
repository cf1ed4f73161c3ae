"""Fleet: an event-driven ML inference fleet.

One namespace: ``fleet`` is the kernel (settings, constants, errors, the broker and result-store seams and their
implementations, telemetry and the ``fleet`` CLI), and the components install beside it as ``fleet.schemas``,
``fleet.producers``, ``fleet.consumers``, ``fleet.dispatcher``, ``fleet.autoscaler`` and ``fleet.dags`` (the
repository keeps them as top-level folders; ``pyproject.toml`` maps them). Components depend on the kernel and on
``fleet.schemas``; only ``fleet.cli`` (the composition root) imports components.

The names a user needs come from here, imported on first use so that ``import fleet`` stays light::

    from fleet import FleetClient, FleetSyncClient, ModelHandler, ModelSpec
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "FleetClient": "fleet.producers.sdk",
    "FleetSyncClient": "fleet.producers.sdk_sync",
    "ModelHandler": "fleet.consumers.handlers.base",
    "ModelSpec": "fleet.schemas.models",
}
__all__ = ["FleetClient", "FleetSyncClient", "ModelHandler", "ModelSpec", "__version__"]

if TYPE_CHECKING:
    from fleet.consumers.handlers.base import ModelHandler
    from fleet.producers.sdk import FleetClient
    from fleet.producers.sdk_sync import FleetSyncClient
    from fleet.schemas.models import ModelSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fleet' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
