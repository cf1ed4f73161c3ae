"""What the gateway's request handlers share, built by the lifespan in ``producers.gateway.app``.

It lives apart from ``app`` so that the route modules, which ``app`` imports, never import ``app`` back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from fleet.brokers.base import Broker
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from producers.gateway.limits import GatewayLimits
from schemas.models import ModelSpec


@dataclass(slots=True)
class GatewayState:
    """What the request handlers share: settings, the connected clients and the served models' specs."""

    settings: FleetSettings
    broker: Broker
    store: ResultStore
    specs: dict[str, ModelSpec]
    limits: GatewayLimits = field(default_factory=GatewayLimits)


def gateway_state(request: Request) -> GatewayState:
    """FastAPI dependency: the state the lifespan built (also reachable as ``app.state.gateway``)."""
    state: GatewayState = request.app.state.gateway
    return state
