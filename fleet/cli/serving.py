"""The composition root's gateway side: ``fleet up`` (gateway, autoscaler, workers, dispatchers in one process)
and ``fleet gateway``, served by uvicorn.

Split from ``fleet.cli.compose`` (the worker side, which it builds on) so that a worker's process never imports
uvicorn, FastAPI, the gateway or the autoscaler: the ``fleet`` command imports this module only for the commands
that serve the gateway.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import sys

import uvicorn

from fleet.autoscaler.backends import default_backend_name, make_backend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.brokers.base import Broker
from fleet.cli.common import describe
from fleet.cli.compose import (
    build_handler,
    build_worker,
    connected,
    dag_starter,
    ensure_models,
    first_of,
    run_workers,
    startup_deadline,
    stop_on_signals,
)
from fleet.cli.httpserver import QuietServer
from fleet.consumers.worker import Worker
from fleet.dispatcher.service import Dispatcher
from fleet.errors import ConfigError, FleetError
from fleet.lifecycle.service import RolloutService
from fleet.models import resolve_served, resolve_specs
from fleet.pools import members, scaling_targets
from fleet.producers.gateway.access.gate import OperatorGate
from fleet.producers.gateway.app import check_auth, close_operator_streams, create_app
from fleet.readiness import WorkerTracker
from fleet.repository.layout import Repository
from fleet.scaling import ScalingStore, make_scaling_store
from fleet.settings import FleetSettings
from fleet.startup import Deadline, retry_until
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.keys import KeyStore
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def _server(
    settings: FleetSettings,
    broker: Broker | None,
    stores: Stores | None,
    scaling: ScalingStore | None = None,
    *,
    workers: WorkerTracker | None = None,
    require_ready_workers: bool = False,
    sock: socket.socket | None = None,
) -> QuietServer:
    errors: list[BaseException] = []
    app = create_app(
        settings,
        broker=broker,
        stores=stores,
        scaling=scaling,
        workers=workers,
        require_ready_workers=require_ready_workers,
        on_startup_error=errors.append,
    )
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    return QuietServer(config, sock, errors)


async def serve_gateway(server: QuietServer, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    close_operator_streams(server.config.app)  # open dashboard streams would hold up uvicorn's shutdown
    server.should_exit = True
    stopper.cancel()
    await task
    if not server.started:
        where = f"{server.config.host}:{server.config.port}"
        why = describe(server.startup_errors[0]) if server.startup_errors else "see the log"
        raise FleetError(f"the gateway could not start on {where}: {why}")


def up_autoscaler(settings: FleetSettings, broker: Broker, stores: Stores, scaling: ScalingStore) -> Autoscaler:
    """The autoscaler of ``fleet up``: workers in this process on the embedded broker or store (``inprocess``),
    ``fleet worker`` processes on real infrastructure (``process``); from ``autoscale_min_replicas`` (1 by default,
    so every model is served at once) up to ``autoscale_max_replicas`` per model."""
    refs = {
        name: ref
        for ref, name in zip(
            settings.models, resolve_specs(settings.models, Repository.from_settings(settings)), strict=True
        )
    }

    async def start_worker(model: str) -> Worker:
        worker = build_worker(refs[model], broker, stores.results, settings, stores)
        await worker.start()
        return worker

    name = default_backend_name(settings)
    if settings.pools and name == "inprocess":
        # A pool worker in this process needs the multi-model worker (issue 29), which builds its own handlers.
        raise FleetError(
            "pools (FLEET_POOLS) need fleet worker processes (--models): run fleet up with a real broker and "
            "store (nats:// or kafka://, redis://), or leave FLEET_POOLS unset"
        )
    backend = (
        make_backend(name, settings, start_worker=start_worker) if name == "inprocess" else make_backend(name, settings)
    )
    config = ScalingConfig(
        min_replicas=settings.autoscale_min_replicas,
        max_replicas=settings.autoscale_max_replicas,
        scale_down_stabilization_s=settings.autoscale_stabilization_s,
        target_drain_s=settings.autoscale_target_drain_s,
    )
    ages = settings.autoscale_max_queue_age_s
    targets = scaling_targets(list(refs), settings.pools)
    unknown = sorted(set(ages) - set(targets))
    if unknown:
        raise ConfigError(
            f"autoscale_max_queue_age_s names {', '.join(unknown)}, which this fleet does not scale "
            f"(it scales {', '.join(targets)})"
        )
    return Autoscaler(
        broker,
        scaling,
        backend,
        {t: config.with_changes(max_queue_age_s=ages[t]) if t in ages else config for t in targets},
        settings.autoscale_interval_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        partitions=settings.kafka_partitions if settings.broker_scheme == "kafka" else None,
        pools=members(settings.pools),
    )


def rollout_service(settings: FleetSettings, stores: Stores) -> RolloutService:
    """The rollout controller of ``fleet up`` and ``fleet autoscaler``: steps canaries and judges breakers of every
    model with a traffic policy, every ``rollout_interval_s`` on windows of ``rollout_window_s``."""
    return RolloutService(stores.rollouts, interval_s=settings.rollout_interval_s, window_s=settings.rollout_window_s)


def up_dispatchers(settings: FleetSettings, broker: Broker, store: ResultStore) -> list[Dispatcher]:
    """One dispatcher per model in ``dispatch`` routing (``FLEET_ROUTING``): its workers read their inboxes."""
    names = list(resolve_specs(settings.models, Repository.from_settings(settings)))
    return [
        Dispatcher(broker, store, model=name, settings=settings)
        for name in names
        if settings.routing_for(name) == "dispatch"
    ]


async def run_autoscaled(autoscaler: Autoscaler, stop: asyncio.Event) -> None:
    """Run ``autoscaler`` until ``stop``; its stop drains the workers it started."""
    async with autoscaler:
        await stop.wait()


def requires_ready_workers(settings: FleetSettings) -> bool:
    """``fleet up`` is ready only once each model has a warm worker, unless models may scale to zero."""
    return not settings.autoscale or settings.autoscale_min_replicas > 0


async def announce_ready(
    settings: FleetSettings, tracker: WorkerTracker, stop: asyncio.Event, server: QuietServer
) -> None:
    """Log (and print, for the console) when the gateway listens and every model has a warm worker: the moment
    /readyz turns 200."""
    models = list(resolve_specs(settings.models, Repository.from_settings(settings)))
    if requires_ready_workers(settings) and not await tracker.wait_ready(models, stop):
        return
    if not await first_of(server.up, stop):
        return
    log.info("fleet up ready: %s each have a warm worker", ", ".join(models))
    base = f"http://{settings.host}:{settings.port}"
    announce_console(f"fleet up: ready at {base} ({', '.join(models)})")
    off = OperatorGate.from_settings(settings).disabled_reason
    announce_console(
        f"fleet up: operator dashboard off: {off}" if off else f"fleet up: operator dashboard at {base}/dashboard"
    )


def announce_console(line: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(line, highlight=False)


async def run_up(settings: FleetSettings, sock: socket.socket | None = None) -> None:
    """Gateway, autoscaler, workers and (for models in ``dispatch`` routing) dispatchers in one process, sharing
    one broker, one store and one scaling store.

    With ``autoscale`` off, one worker per model runs for the whole session instead. ``/readyz`` answers 200 (and
    "ready" is logged) once the gateway listens (on ``sock`` when given) and each model has a warm worker.
    """
    auth = check_auth(settings)  # before anything connects: a refused bind fails at once
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    deadline = startup_deadline(settings)
    try:
        async with connected(settings, deadline) as (broker, store):
            stores = Stores.beside(store)  # one bundle for the gateway, the workers and the DAG starter
            async with dag_starter(broker, stores, "fleet up", deadline):
                await _up(settings, auth, broker, stores, stop, deadline, sock)
    finally:
        restore()


async def _up(
    settings: FleetSettings,
    auth: str,
    broker: Broker,
    stores: Stores,
    stop: asyncio.Event,
    deadline: Deadline,
    sock: socket.socket | None,
) -> None:
    """``fleet up`` once its broker, stores and DAG starter are there: the scaling store, the dispatchers, the
    heartbeat tracker and the rollout controller, then the gateway with the workers or the autoscaler."""
    if auth == "keys" and stores.results.scheme == "memory":
        await bootstrap_admin_key(stores.keys)
    scaling = make_scaling_store(settings)
    await retry_until(deadline, "connect to the scaling store", scaling.connect)
    dispatchers = up_dispatchers(settings, broker, stores.results)
    try:
        await ensure_models(broker, [d.model for d in dispatchers], deadline)
        await asyncio.gather(*(d.start() for d in dispatchers))
        async with WorkerTracker(broker, settings.heartbeat_interval_s) as tracker, rollout_service(settings, stores):
            await _serve_up(settings, broker, stores, scaling, tracker, stop, deadline, sock)
    finally:
        await asyncio.gather(*(d.stop() for d in dispatchers), return_exceptions=True)
        await scaling.close()


async def bootstrap_admin_key(keys: KeyStore) -> None:
    """``fleet up`` with API keys on the embedded store: no ``fleet keys`` can reach its keys, so it makes one admin
    key and prints it once on standard error (never logged); more come from ``POST /v1/keys`` with it."""
    key, info = await keys.create("admin", "admin", None)
    print(
        f"fleet up: FLEET_AUTH=keys on the embedded store; admin key {info.key_id} (shown once): {key}", file=sys.stderr
    )


async def _serve_up(
    settings: FleetSettings,
    broker: Broker,
    stores: Stores,
    scaling: ScalingStore,
    tracker: WorkerTracker,
    stop: asyncio.Event,
    deadline: Deadline,
    sock: socket.socket | None = None,
) -> None:
    if settings.autoscale:
        task = asyncio.create_task(run_autoscaled(up_autoscaler(settings, broker, stores, scaling), stop))
    else:
        for ref in settings.models:
            build_handler(ref, settings)  # a bad model or device fails before the gateway starts
        builds = [
            functools.partial(build_worker, ref, broker, stores.results, settings, stores) for ref in settings.models
        ]
        task = asyncio.create_task(run_workers(builds, stop, deadline))
    task.add_done_callback(lambda _: stop.set())  # workers or autoscaler that fail stop the gateway
    server = _server(
        settings,
        broker,
        stores,
        scaling,
        workers=tracker,
        require_ready_workers=requires_ready_workers(settings),
        sock=sock,
    )
    announcer = asyncio.create_task(announce_ready(settings, tracker, stop, server), name="fleet-up-ready")
    try:
        await serve_gateway(server, stop)
        await task
    finally:
        await cancel_and_wait([announcer])


async def run_gateway(settings: FleetSettings, sock: socket.socket | None = None) -> None:
    """The standalone gateway. Its broker, store and scaling store are connected (with start-up retries) before
    the server starts, so an outage at start-up is retried and reported in one line, not as a lifespan traceback."""
    check_auth(settings)  # before anything connects: a refused bind fails at once
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    deadline = startup_deadline(settings)
    try:
        async with connected(settings, deadline) as (broker, store):
            repository, manifests = Repository.from_settings(settings), Stores.beside(store).manifests
            await ensure_models(broker, list(await resolve_served(settings.models, repository, manifests)), deadline)
            scaling = make_scaling_store(settings)
            await retry_until(deadline, "connect to the scaling store", scaling.connect)
            try:
                await serve_gateway(_server(settings, broker, Stores.beside(store), scaling, sock=sock), stop)
            finally:
                await scaling.close()
    finally:
        restore()
