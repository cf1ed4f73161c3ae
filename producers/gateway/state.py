"""What the gateway's request handlers share, built by the lifespan in ``fleet.producers.gateway.app``.

It lives apart from ``app`` so that the route modules, which ``app`` imports, never import ``app`` back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from fleet.brokers.base import Broker
from fleet.producers.gateway.calls import Bounded
from fleet.producers.gateway.limits import GatewayLimits
from fleet.schemas.models import ModelSpec
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore

if TYPE_CHECKING:
    from fleet.dags.runner import DagRunner
    from fleet.producers.gateway.cache import ResultCache
    from fleet.producers.gateway.jobs.backlog import Backlog


@dataclass(slots=True)
class GatewayState:
    """What the request handlers share: settings, the connected clients, the served models' specs and their
    queue bounds (``backlog``), the DAG runner (``dag_runner``: registers specs, starts and shows runs) and the
    result caches (``cache``; None when no model uses them)."""

    settings: FleetSettings
    broker: Broker
    store: ResultStore
    specs: dict[str, ModelSpec]
    backlog: Backlog
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    dag_runner: DagRunner | None = None
    cache: ResultCache | None = None

    @property
    def bounded(self) -> Bounded:
        """The result store with each call bounded by ``limits.store_timeout_s`` (``calls.store_call``)."""
        return Bounded(self.store, self.limits.store_timeout_s)


async def gateway_state(request: Request) -> GatewayState:
    """FastAPI dependency: the state the lifespan built (also reachable as ``app.state.gateway``).

    Async, as every dependency of the gateway: FastAPI runs a sync one in its thread pool, a thread hop per request.
    """
    state: GatewayState = request.app.state.gateway
    return state
