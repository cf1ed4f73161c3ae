"""The composition root: build brokers, stores, workers and the gateway from settings and run them.

This is the only place in ``fleet`` that imports components (producers, consumers, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import uvicorn

from fleet.autoscaler.backends import default_backend_name, make_backend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.cli.probes import WorkerProbe, serve_probes
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers import ModelHandler, resolve_handler
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.dags.starter import DagStarter
from fleet.dispatcher.service import Dispatcher
from fleet.errors import FleetError
from fleet.models import resolve_spec, resolve_specs
from fleet.outages import OutageLog, services_of, watch_outages
from fleet.producers.gateway.access.gate import OperatorGate
from fleet.producers.gateway.app import check_auth, close_operator_streams, create_app
from fleet.readiness import WorkerTracker
from fleet.redaction import redact
from fleet.scaling import ScalingStore, make_scaling_store
from fleet.settings import FleetSettings
from fleet.startup import Deadline, retry_until
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.keys import KeyStore
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Handlers that never touch torch: their workers skip the device probe, which would import torch (~500 MB).
DEVICELESS_HANDLERS = (EchoHandler, SleepHandler)


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns SIGINT/SIGTERM and the shutdown order.

    Given ``sock`` (bound beforehand by ``fleet.cli.ports.listen_socket``, so a busy port fails before anything
    starts), it serves on that socket. ``up`` is set once the server accepts connections; a start-up that uvicorn
    gives up on (a failed lifespan start-up, which it logs) ends ``serve`` with ``started`` false instead of
    ``SystemExit``.
    """

    def __init__(self, config: uvicorn.Config, sock: socket.socket | None = None) -> None:
        super().__init__(config)
        self.sock = sock
        self.up = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets if sockets is not None or self.sock is None else [self.sock])

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            self.should_exit = True
            return
        if sockets is not None:  # uvicorn logs where it listens only when it binds the socket itself
            host, port = sockets[0].getsockname()[:2]
            log.info("listening on http://%s:%d", host, port)
        self.up.set()


def startup_deadline(settings: FleetSettings) -> Deadline:
    return Deadline.after(settings.startup_timeout_s)


@contextlib.asynccontextmanager
async def connected(
    settings: FleetSettings, deadline: Deadline | None = None
) -> AsyncIterator[tuple[Broker, ResultStore]]:
    """A connected broker and store, each retried until the start-up deadline (``fleet.startup``), watched for
    outages while in use (``fleet.outages``: one warning when one starts, one when it ends). Closing them never
    fails the process: a connection lost with its server is closed all the same."""
    deadline = deadline or startup_deadline(settings)
    broker = make_broker(settings)
    store = make_store(settings)
    try:
        await retry_until(deadline, "connect to the broker", broker.connect)
        await retry_until(deadline, "connect to the result store", store.connect)
        services = services_of(settings)
        watchers = [asyncio.create_task(watch_outages(services, OutageLog()), name="outage-watch")] if services else []
        try:
            yield broker, store
        finally:
            await cancel_and_wait(watchers)
            await close_quietly(f"the result store at {redact(settings.store_url)}", store.close)
    finally:
        await close_quietly(f"the broker at {redact(settings.broker_url)}", broker.close)


async def close_quietly(what: str, close: Callable[[], Awaitable[None]]) -> None:
    """Close a client; an error (its server went away meanwhile) is logged, naming ``what``, never raised."""
    try:
        await close()
    except Exception as exc:
        log.warning("closing the connection to %s failed (%r); it is closed all the same", what, exc)


async def ensure_models(broker: Broker, models: list[str], deadline: Deadline) -> None:
    """Create each model's subjects and group, retried until the start-up deadline: a worker or dispatcher then
    starts on a broker that answered a moment ago."""
    for model in models:
        await retry_until(
            deadline, f"create the subjects and group of {model!r}", functools.partial(broker.ensure_model, model)
        )


def stop_on_signals(stop: asyncio.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop``; returns a function that restores the defaults."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def restore() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    return restore


def build_worker(
    ref: str,
    broker: Broker,
    store: ResultStore,
    settings: FleetSettings,
    stores: Stores | None = None,
    **overrides: object,
) -> Worker:
    """A worker of ``ref`` that continues DAG runs as it settles their steps. ``stores``: the process's stores beside
    ``store`` (``fleet up`` shares its bundle with the gateway); None builds them (a worker alone in its process)."""
    stores = stores or Stores.beside(store)
    handler, device = build_handler(ref, settings)
    worker = Worker(handler, broker, store, settings=settings, device=device, stores=stores, **overrides)  # type: ignore[arg-type]
    worker.settler.on_settled.append(DagRunner(broker, store, stores.dags).on_settled)  # DAG continuation
    return worker


def build_handler(ref: str, settings: FleetSettings) -> tuple[ModelHandler[Any, Any], str]:
    """The (not yet loaded) handler and its device; raises ``UnknownModel``/``ConfigError`` for a bad reference,
    option or device, so the CLI calls it once before connecting anything."""
    handler_cls = resolve_handler(ref)
    device = "cpu" if issubclass(handler_cls, DEVICELESS_HANDLERS) else resolve_device(settings.device)
    return handler_cls(device=device, slowness=settings.slowness), device


async def start_worker(build: Callable[[], Worker], deadline: Deadline) -> Worker:
    """Build and start a worker; a start that fails on the broker or store is retried with a fresh worker (a
    failed start leaves nothing running) until the start-up deadline."""

    async def attempt() -> Worker:
        worker = build()
        await worker.start()
        return worker

    return await retry_until(deadline, "start the worker", attempt)


async def run_workers(builds: Sequence[Callable[[], Worker]], stop: asyncio.Event, deadline: Deadline) -> None:
    """Start every worker (models load concurrently), serve until ``stop``, then drain them all."""
    workers: list[Worker] = []
    try:
        started = await asyncio.gather(*(start_worker(b, deadline) for b in builds), return_exceptions=True)
        workers = [w for w in started if isinstance(w, Worker)]
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        log.info("serving %s", ", ".join(f"{w.model} ({w.worker_id})" for w in workers))
        await stop.wait()
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)


@contextlib.asynccontextmanager
async def dag_starter(broker: Broker, stores: Stores, owner: str, deadline: Deadline) -> AsyncIterator[DagStarter]:
    """This process's consumer of ``fleet.req._dagrun``: runs started by publishing, without the gateway."""
    starter = DagStarter(DagRunner(broker, stores.results, stores.dags), owner)
    await retry_until(deadline, "subscribe to DAG starts", starter.start)
    try:
        yield starter
    finally:
        await starter.stop()


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
    app = create_app(
        settings,
        broker=broker,
        stores=stores,
        scaling=scaling,
        workers=workers,
        require_ready_workers=require_ready_workers,
    )
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    return QuietServer(config, sock)


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
        raise FleetError(f"the gateway could not start on {server.config.host}:{server.config.port} (see the log)")


def up_autoscaler(settings: FleetSettings, broker: Broker, stores: Stores, scaling: ScalingStore) -> Autoscaler:
    """The autoscaler of ``fleet up``: workers in this process on the embedded broker or store (``inprocess``),
    ``fleet worker`` processes on real infrastructure (``process``); from ``autoscale_min_replicas`` (1 by default,
    so every model is served at once) up to ``autoscale_max_replicas`` per model."""
    refs = {name: ref for ref, name in zip(settings.models, resolve_specs(settings.models), strict=True)}

    async def start_worker(model: str) -> Worker:
        worker = build_worker(refs[model], broker, stores.results, settings, stores)
        await worker.start()
        return worker

    name = default_backend_name(settings)
    backend = (
        make_backend(name, settings, start_worker=start_worker) if name == "inprocess" else make_backend(name, settings)
    )
    config = ScalingConfig(
        min_replicas=settings.autoscale_min_replicas,
        max_replicas=settings.autoscale_max_replicas,
        scale_down_stabilization_s=settings.autoscale_stabilization_s,
        target_drain_s=settings.autoscale_target_drain_s,
    )
    return Autoscaler(
        broker,
        scaling,
        backend,
        dict.fromkeys(refs, config),
        settings.autoscale_interval_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        partitions=settings.kafka_partitions if settings.broker_scheme == "kafka" else None,
    )


def up_dispatchers(settings: FleetSettings, broker: Broker, store: ResultStore) -> list[Dispatcher]:
    """One dispatcher per model in ``dispatch`` routing (``FLEET_ROUTING``): its workers read their inboxes."""
    names = list(resolve_specs(settings.models))
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
    models = list(resolve_specs(settings.models))
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


async def first_of(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for ``wanted`` or ``stop``; True when ``wanted`` is set."""
    waits = [asyncio.create_task(wanted.wait()), asyncio.create_task(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waits)
    return wanted.is_set()


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
    heartbeat tracker, then the gateway with the workers or the autoscaler."""
    if auth == "keys" and stores.results.scheme == "memory":
        await bootstrap_admin_key(stores.keys)
    scaling = make_scaling_store(settings)
    await retry_until(deadline, "connect to the scaling store", scaling.connect)
    dispatchers = up_dispatchers(settings, broker, stores.results)
    try:
        await ensure_models(broker, [d.model for d in dispatchers], deadline)
        await asyncio.gather(*(d.start() for d in dispatchers))
        async with WorkerTracker(broker, settings.heartbeat_interval_s) as tracker:
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


async def run_worker(
    settings: FleetSettings, ref: str, *, metrics_port: int | None = None, **overrides: object
) -> None:
    """One worker on its own broker and store connections; with ``metrics_port``, ``/metrics``, ``/healthz`` and
    ``/readyz`` on that port from the start (``/readyz`` 503 until the model is warm)."""
    deadline = startup_deadline(settings)
    build_handler(ref, settings)  # a bad model, option or device fails before anything connects
    probe = WorkerProbe(resolve_spec(ref).name)
    server = serve_probes(probe, metrics_port) if metrics_port is not None else None  # /healthz from the start
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings, deadline) as (broker, store):
            stores = Stores.beside(store)  # one bundle for the worker and the DAG starter
            async with dag_starter(broker, stores, f"fleet worker {ref}", deadline):
                await ensure_models(broker, [probe.model], deadline)

                def build() -> Worker:
                    # An operator's drain request does what SIGTERM does: the same stop event, so the process exits.
                    worker = build_worker(ref, broker, store, settings, stores, on_drain=stop.set, **overrides)
                    return probe.track(worker)  # type: ignore[no-any-return]

                await run_workers([build], stop, deadline)
    finally:
        restore()
        if server is not None:
            server.shutdown()


async def run_gateway(settings: FleetSettings, sock: socket.socket | None = None) -> None:
    """The standalone gateway. Its broker, store and scaling store are connected (with start-up retries) before
    the server starts, so an outage at start-up is retried and reported in one line, not as a lifespan traceback."""
    check_auth(settings)  # before anything connects: a refused bind fails at once
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    deadline = startup_deadline(settings)
    try:
        async with connected(settings, deadline) as (broker, store):
            await ensure_models(broker, list(resolve_specs(settings.models)), deadline)
            scaling = make_scaling_store(settings)
            await retry_until(deadline, "connect to the scaling store", scaling.connect)
            try:
                await serve_gateway(_server(settings, broker, Stores.beside(store), scaling, sock=sock), stop)
            finally:
                await scaling.close()
    finally:
        restore()
