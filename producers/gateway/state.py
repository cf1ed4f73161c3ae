"""What the gateway's request handlers share, built once by the lifespan in ``fleet.producers.gateway.app``.

It lives apart from ``app`` so that the route modules, which ``app`` imports, never import ``app`` back. The parts
of the features it holds are named by type only (``TYPE_CHECKING``): the modules that define them never import this
one, so no circle runs through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.requests import HTTPConnection

from fleet.brokers.base import Broker
from fleet.producers.gateway.calls import Bounded
from fleet.producers.gateway.limits import GatewayLimits
from fleet.producers.gateway.recent_jobs import RecentJobIds
from fleet.readiness import WorkerTracker
from fleet.scaling import ScalingStore
from fleet.schemas.models import ModelSpec
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores

if TYPE_CHECKING:
    from fleet.dags.runner import DagRunner
    from fleet.producers.gateway.access.auth import Authenticator
    from fleet.producers.gateway.access.ratelimit import TenantLimiter
    from fleet.producers.gateway.cache import ResultCache
    from fleet.producers.gateway.jobs.backlog import Backlog
    from fleet.producers.gateway.operator.beats import Beats
    from fleet.producers.gateway.operator.feed import OperatorFeed
    from fleet.producers.gateway.policies import TrafficPolicies


@dataclass(slots=True, kw_only=True)
class GatewayState:
    """What the request handlers share: settings, the connected clients (the broker, the bundle of stores and the
    scaling store), the served models' specs and their queue bounds (``backlog``), who may call
    (``authenticator``) and how much (``tenant_limiter``, None without limits), the DAG runner (``dag_runner``:
    registers specs, starts and shows runs), the result caches (``cache``; None when no model uses them), the
    workers' heartbeats (``workers`` for ``/readyz``, ``beats`` for the operator), the jobs this gateway accepted
    lately (``recent_jobs``), the operator's live feed (``operator_feed``) and the models' traffic policies
    (``traffic``: which version answers a job; None routes every job plainly)."""

    settings: FleetSettings
    broker: Broker
    stores: Stores
    specs: dict[str, ModelSpec]
    backlog: Backlog
    authenticator: Authenticator
    scaling: ScalingStore
    workers: WorkerTracker
    beats: Beats
    operator_feed: OperatorFeed
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    tenant_limiter: TenantLimiter | None = None
    dag_runner: DagRunner | None = None
    cache: ResultCache | None = None
    recent_jobs: RecentJobIds = field(default_factory=RecentJobIds)
    require_ready_workers: bool = False
    traffic: TrafficPolicies | None = None

    @property
    def store(self) -> ResultStore:
        """The result store (``stores.results``)."""
        return self.stores.results

    @property
    def bounded(self) -> Bounded:
        """The result store with each call bounded by ``limits.store_timeout_s`` (``calls.store_call``)."""
        return Bounded(self.stores.results, self.limits.store_timeout_s)


def state_of(connection: HTTPConnection) -> GatewayState:
    """The state the lifespan built, for a request or a WebSocket (``app.state.gateway``)."""
    state: GatewayState = connection.app.state.gateway
    return state


async def gateway_state(request: Request) -> GatewayState:
    """FastAPI dependency: the state the lifespan built (also reachable as ``app.state.gateway``).

    Async, as every dependency of the gateway: FastAPI runs a sync one in its thread pool, a thread hop per request.
    """
    return state_of(request)
