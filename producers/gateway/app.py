"""The gateway's FastAPI application and its lifespan.

``create_app(settings)`` is the entry point. The lifespan resolves the served models, connects the broker and the
store (or adopts the ones passed in, which it then leaves open: their owner closes them) and makes sure every
model's subjects exist before the first request.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from fleet import tracing
from fleet.brokers.base import Broker
from fleet.dags.runner import DagRunner
from fleet.errors import ConfigError
from fleet.models import resolve_served
from fleet.producers.gateway import dashboard, ops
from fleet.producers.gateway.access import (
    Authenticator,
    OperatorGate,
    RateLimitHeaders,
    build_limiter,
    is_loopback,
    log_access,
)
from fleet.producers.gateway.access import keys as access_keys
from fleet.producers.gateway.cache import ResultCache, TextModel, build_cache
from fleet.producers.gateway.dags import events as dag_events
from fleet.producers.gateway.dags import routes as dag_routes
from fleet.producers.gateway.docs import install_docs
from fleet.producers.gateway.errors import install_error_handlers
from fleet.producers.gateway.jobs import batch, history, infer, sse, ws
from fleet.producers.gateway.jobs import routes as job_routes
from fleet.producers.gateway.jobs.backlog import Backlog
from fleet.producers.gateway.jobs.reconcile import Reconciler
from fleet.producers.gateway.limits import GatewayLimits
from fleet.producers.gateway.metrics import MetricsMiddleware
from fleet.producers.gateway.models import embeddings, listing, rerank
from fleet.producers.gateway.models import traffic as traffic_routes
from fleet.producers.gateway.openapi_doc import install_openapi
from fleet.producers.gateway.operator import deadletters
from fleet.producers.gateway.operator import rollouts as rollout_routes
from fleet.producers.gateway.operator import routes as operator_routes
from fleet.producers.gateway.operator import scaling as scaling_routes
from fleet.producers.gateway.operator import workers as worker_routes
from fleet.producers.gateway.operator.beats import BeatListener, Beats
from fleet.producers.gateway.operator.deadletter_recorder import DeadLetterRecorder
from fleet.producers.gateway.operator.feed import OperatorFeed
from fleet.producers.gateway.policies import TrafficPolicies
from fleet.producers.gateway.state import GatewayState
from fleet.producers.gateway.tracing_middleware import TracingMiddleware
from fleet.producers.gateway.usage import routes as usage_routes
from fleet.readiness import WorkerTracker
from fleet.repository.layout import Repository
from fleet.scaling import ScalingStore, make_scaling_store
from fleet.schemas.models import ModelSpec
from fleet.settings import FleetSettings
from fleet.startup import Deadline, retry_until
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.cachestore import CacheStore

logger = logging.getLogger(__name__)

OPENAPI_TAGS = [
    {"name": "jobs", "description": "Submit inference jobs, poll them and cancel them."},
    {"name": "push", "description": "WebSockets and server-sent events that push job records as jobs end."},
    {
        "name": "models",
        "description": "The models this gateway accepts (OpenAI's list shape), with their kind and the JSON Schemas "
        "of their input and output.",
    },
    {
        "name": "openai",
        "description": "OpenAI-compatible embeddings and TEI- or Cohere-shaped rerank, run as ordinary jobs; their "
        "errors answer in OpenAI's shape, {error: {message, type, param, code}}.",
    },
    {"name": "ops", "description": "Liveness, readiness and Prometheus metrics."},
    {
        "name": "dags",
        "description": "DAG workflows: register specs (YAML or JSON), show their graphs, start runs, follow them "
        "step by step (long-poll, WebSocket, server-sent events) and cancel them.",
    },
    {"name": "scaling", "description": "What the autoscaler does per model; set min, max and pause."},
    {
        "name": "operator",
        "description": "The operator surface: access, the live snapshot and stream, scale-to-N, drain a worker, "
        "dead letters, the audit log. With FLEET_AUTH=keys they need an API key with the operator role (or "
        "FLEET_OPERATOR_TOKEN); with FLEET_AUTH=off, FLEET_OPERATOR_TOKEN when it is set.",
    },
    {
        "name": "keys",
        "description": "API keys (admin): create, list, revoke. With FLEET_AUTH=keys every route but /healthz, "
        "/readyz, /metrics and the docs needs 'Authorization: Bearer <API key>': 401 without a valid key, 403 "
        "when its role is too low.",
    },
]


def _build_broker(settings: FleetSettings) -> Broker:
    from fleet.brokers import make_broker  # the factory lives with the implementations

    broker: Broker = make_broker(settings)
    return broker


def _build_store(settings: FleetSettings) -> ResultStore:
    from fleet.store import make_store

    store: ResultStore = make_store(settings)
    return store


async def _open_clients(
    stack: AsyncExitStack,
    settings: FleetSettings,
    broker: Broker | None,
    store: ResultStore | None,
    deadline: Deadline,
) -> tuple[Broker, ResultStore]:
    """Adopt the given clients, or build, connect (retried until the start-up deadline) and schedule the close of
    the missing ones."""
    if broker is None:
        broker = _build_broker(settings)
        stack.push_async_callback(broker.close)
        await retry_until(deadline, "connect to the broker", broker.connect)
    if store is None:
        store = _build_store(settings)
        stack.push_async_callback(store.close)
        await retry_until(deadline, "connect to the result store", store.connect)
    return broker, store


async def _open_scaling(
    stack: AsyncExitStack, settings: FleetSettings, scaling: ScalingStore | None, deadline: Deadline
) -> ScalingStore:
    """Adopt the given scaling store, or build and connect one next to the result store (closed at shutdown)."""
    if scaling is None:
        scaling = make_scaling_store(settings)
        stack.push_async_callback(scaling.close)
        await retry_until(deadline, "connect to the scaling store", scaling.connect)
    return scaling


async def _open_tracker(
    stack: AsyncExitStack, settings: FleetSettings, broker: Broker, workers: WorkerTracker | None
) -> WorkerTracker:
    """Adopt the given heartbeat tracker, or start one on ``broker`` (stopped at shutdown)."""
    if workers is None:
        workers = await stack.enter_async_context(WorkerTracker(broker, settings.heartbeat_interval_s))
    return workers


async def _open_operator(
    stack: AsyncExitStack,
    settings: FleetSettings,
    broker: Broker,
    stores: Stores,
    scaling: ScalingStore,
    workers: WorkerTracker,
    models: list[str],
) -> tuple[Beats, OperatorFeed]:
    """The operator surface's parts: beats heard, the dead-letter recorder, and the one feed of this process."""
    beats = Beats(settings.heartbeat_interval_s)
    await stack.enter_async_context(BeatListener(broker, beats, workers))
    await stack.enter_async_context(DeadLetterRecorder(broker, stores.dead_letters, models))
    feed = await stack.enter_async_context(
        OperatorFeed(
            settings=settings,
            models=models,
            broker=broker,
            scaling=scaling,
            beats=beats,
            dead_letters=stores.dead_letters,
            dag_store=stores.dags,
            interval_s=settings.operator_interval_s,
        )
    )
    return beats, feed


@dataclass(frozen=True, slots=True)
class CacheParts:
    """What ``create_app`` may be handed for the result caches (tests inject them)."""

    store: CacheStore | None = None
    load_text_model: Callable[[str], TextModel] | None = None  # an L3 embedder by its name (``cache_embedder``)


async def _open_cache(
    stack: AsyncExitStack, settings: FleetSettings, specs: dict[str, ModelSpec], stores: Stores, parts: CacheParts
) -> ResultCache | None:
    """The result caches, when a model opted in: started now (L3 replays its logs), stopped at shutdown."""
    cache = build_cache(settings, specs, parts.store or stores.cache, parts.load_text_model)
    if cache is not None:
        await cache.start()
        stack.push_async_callback(cache.stop)
    return cache


@dataclass(frozen=True, slots=True)
class _Given:
    """What ``create_app`` was handed: clients to adopt (None: built, connected and closed by the lifespan)."""

    broker: Broker | None
    stores: Stores | None
    store: ResultStore | None
    scaling: ScalingStore | None
    workers: WorkerTracker | None
    cache_parts: CacheParts
    require_ready_workers: bool
    on_startup_error: Callable[[BaseException], None] | None


async def _open_state(
    stack: AsyncExitStack,
    settings: FleetSettings,
    limits: GatewayLimits,
    gate: OperatorGate,
    auth_mode: str,
    given: _Given,
) -> GatewayState:
    """Connect, resolve and start what the gateway serves with; ``stack`` closes it all at shutdown."""
    deadline = Deadline.after(settings.startup_timeout_s)
    results = given.stores.results if given.stores is not None else given.store
    b, s = await _open_clients(stack, settings, given.broker, results, deadline)
    stores = given.stores or Stores.beside(s)
    # the repository's models, or the manifests their workers published when this gateway has no folder
    specs = await resolve_served(settings.models, Repository.from_settings(settings), stores.manifests)
    scaling = await _open_scaling(stack, settings, given.scaling, deadline)
    for name in specs:
        await retry_until(deadline, f"create the subjects of {name!r}", functools.partial(b.ensure_model, name))
    workers = await _open_tracker(stack, settings, b, given.workers)
    bounds = {name: settings.max_queued_for(name) for name in specs}
    backlog = await stack.enter_async_context(Backlog(b, bounds, settings.lag_interval_s))
    await stack.enter_async_context(Reconciler(b, s, limits, settings.reconcile_after_s))
    cache = await _open_cache(stack, settings, specs, stores, given.cache_parts)
    traffic = TrafficPolicies(stores.rollouts, stores.manifests, Repository.from_settings(settings), specs)
    await stack.enter_async_context(traffic)
    beats, feed = await _open_operator(stack, settings, b, stores, scaling, workers, list(specs))
    return GatewayState(
        settings=settings,
        broker=b,
        stores=stores,
        specs=specs,
        backlog=backlog,
        authenticator=Authenticator(auth_mode, gate, stores.keys),
        scaling=scaling,
        workers=workers,
        beats=beats,
        operator_feed=feed,
        limits=limits,
        tenant_limiter=build_limiter(settings.limit_policy(), stores.quotas, s, settings.job_ttl_s),
        dag_runner=DagRunner(b, s, stores.dags, specs),
        cache=cache,
        require_ready_workers=given.require_ready_workers,
        traffic=traffic,
    )


def _lifespan(
    settings: FleetSettings, limits: GatewayLimits, gate: OperatorGate, auth_mode: str, given: _Given
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_access(gate)
        async with AsyncExitStack() as stack:
            stack.callback(tracing.flush)  # last: the spans of the requests served go out before the process ends
            try:
                state = await _open_state(stack, settings, limits, gate, auth_mode, given)
            except Exception as exc:  # uvicorn logs it and gives up; the command that runs the app says why
                if given.on_startup_error is not None:
                    given.on_startup_error(exc)
                raise
            app.state.gateway = state
            logger.info(
                "gateway ready: models %s, broker %s, store %s",
                ", ".join(state.specs),
                state.broker.scheme,
                state.stores.results.scheme,
            )
            yield
            logger.info("gateway stopping")

    return lifespan


def check_auth(settings: FleetSettings) -> str:
    """The auth mode of a gateway with ``settings``: ``settings.auth``, or ``off`` on a loopback host.

    Raises:
        ConfigError: the gateway would listen on a non-loopback address with FLEET_AUTH unset.
    """
    if settings.auth is not None:
        if settings.auth == "off" and not is_loopback(settings.host):
            logger.warning("FLEET_AUTH=off on %s: anyone who reaches this port can submit and read jobs", settings.host)
        return settings.auth
    if is_loopback(settings.host):
        return "off"
    raise ConfigError(
        f"the gateway would listen on {settings.host}, which is not a loopback address, without authentication: "
        "set FLEET_AUTH=keys (and create keys with 'fleet keys create'), or FLEET_AUTH=off to serve without keys"
    )


def close_operator_streams(app: object) -> None:
    """End the open operator streams of ``app`` (a gateway app), so that a server shutting down is not held up by
    them (call it before telling uvicorn to exit; a no-op before start-up or for another app)."""
    state = getattr(getattr(app, "state", None), "gateway", None)
    if isinstance(state, GatewayState):
        feed = state.operator_feed
        feed.close_streams()


def create_app(
    settings: FleetSettings,
    *,
    broker: Broker | None = None,
    store: ResultStore | None = None,
    stores: Stores | None = None,
    limits: GatewayLimits | None = None,
    scaling: ScalingStore | None = None,
    workers: WorkerTracker | None = None,
    require_ready_workers: bool = False,
    cache_parts: CacheParts | None = None,
    on_startup_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """Build the gateway application.

    Args:
        settings: models to serve, broker and store URLs, body and long-poll limits.
        broker: a connected broker to use (``fleet up`` shares its embedded one); the app does not close it.
            When None, the lifespan builds one from ``settings.broker_url``, connects it and closes it at shutdown.
        store: the same for the result store.
        stores: the result store and the stores beside it (``fleet.store.bundle.Stores``: keys, audit log, limits,
            DAG store, dead letters, cache entries), when the process shares them with other parts (``fleet up``'s
            workers, a test that writes keys); its result store is adopted as ``store`` is. When None, the
            lifespan builds them beside the result store.
        limits: timeouts and WebSocket limits; the defaults suit production.
        scaling: the autoscaler's state (``fleet up`` shares its embedded one); when None, one is built next to
            the result store (``fleet.scaling.make_scaling_store``), connected and closed at shutdown.
        workers: the heartbeat tracker behind ``/readyz``'s per-model ``ready_workers`` (``fleet up`` shares
            its own); when None, the lifespan starts one on the broker.
        require_ready_workers: ``/readyz`` answers 503 until every served model has a ready worker (``fleet
            up``); by default it is 200 whenever the broker and store answer, since submissions queue.
        cache_parts: the result caches' store (default: beside the result store) and the loader of the L3
            embedders by name (default: ``cache.embedder.load_embedder`` on ``settings.device``).
        on_startup_error: called with the exception that stops the lifespan's start-up, before uvicorn logs it and
            gives up (``fleet gateway`` and ``fleet up`` print it as their one error line).

    Raises:
        ConfigError: the gateway is bound to a non-loopback address with ``settings.auth`` unset (``check_auth``),
            or ``settings.reconcile_after_s`` is not longer than ``limits.publish_timeout_s`` (a sweep would
            republish jobs whose first publish is still in progress).
    Raises (at start-up, from the lifespan):
        UnknownModel / ConfigError: a model in ``settings.models`` does not resolve, or ``settings.cache`` names a
            model that is not served, asks l3 of a model without ``cache_text``, or of one whose ``cache_embedder``
            the gateway cannot load.
        StartupTimeout: a client the app builds itself could not connect within ``settings.startup_timeout_s``.
    """
    limits = limits or GatewayLimits()
    auth_mode = check_auth(settings)
    if settings.reconcile_after_s <= limits.publish_timeout_s:
        raise ConfigError(
            f"reconcile_after_s ({settings.reconcile_after_s:g}s) must be longer than the publish timeout "
            f"({limits.publish_timeout_s:g}s)"
        )
    if stores is not None and store is not None and store is not stores.results:
        raise ConfigError("create_app: store and stores.results must be the same store (give one of them)")
    given = _Given(
        broker, stores, store, scaling, workers, cache_parts or CacheParts(), require_ready_workers, on_startup_error
    )
    app = FastAPI(
        title="Fleet gateway",
        version="1",
        summary="Submit ML inference jobs to the fleet and receive their results.",
        openapi_tags=OPENAPI_TAGS,
        lifespan=_lifespan(settings, limits, OperatorGate.from_settings(settings), auth_mode, given),
        docs_url=None,  # served from installed assets instead of a CDN: fleet.producers.gateway.docs
        redoc_url=None,
    )
    install_docs(app)
    app.include_router(dashboard.router)  # the page and its assets, next to /docs (neither is in the schema)
    app.mount(dashboard.ASSETS_PATH, dashboard.static_files(), name="dashboard-assets")
    install_error_handlers(app)
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(MetricsMiddleware)
    app.include_router(history.router)
    app.include_router(batch.router)
    traced = tracing.start("fleet-gateway")  # None unless the OTEL_* environment asks (fleet.tracing)
    if traced is not None:  # outermost: the SERVER span covers the whole request
        app.add_middleware(TracingMiddleware, tracing=traced)
    app.include_router(job_routes.router)
    app.include_router(infer.router)
    app.include_router(ws.router)
    app.include_router(sse.router)
    app.include_router(ops.router)
    app.include_router(listing.router)
    app.include_router(embeddings.router)
    app.include_router(rerank.router)
    app.include_router(traffic_routes.router)
    app.include_router(scaling_routes.router)
    app.include_router(rollout_routes.router)
    app.include_router(dag_routes.router)
    app.include_router(dag_events.router)
    app.include_router(operator_routes.router)
    app.include_router(deadletters.router)
    app.include_router(worker_routes.router)
    app.include_router(access_keys.router)
    app.include_router(usage_routes.router)
    install_openapi(app, settings.max_long_poll_s)
    return app
