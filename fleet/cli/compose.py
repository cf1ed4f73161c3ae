"""The composition root: build brokers, stores, workers and the gateway from settings and run them.

This is the only place in ``fleet`` that imports components (producers, consumers, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator

import uvicorn

from autoscaler.backends import default_backend_name, make_backend
from autoscaler.config import ScalingConfig
from autoscaler.service import Autoscaler
from consumers.device import resolve_device
from consumers.handlers import resolve_handler
from consumers.worker import Worker
from dags.runner import DagRunner
from dags.starter import DagStarter
from dispatcher.service import Dispatcher
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.models import resolve_specs
from fleet.scaling import ScalingStore, make_scaling_store
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.dagstore import make_dag_store
from producers.gateway.app import create_app

log = logging.getLogger(__name__)


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns SIGINT/SIGTERM and the shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def connected(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    broker = make_broker(settings)
    store = make_store(settings)
    await broker.connect()
    try:
        await store.connect()
        try:
            yield broker, store
        finally:
            await store.close()
    finally:
        await broker.close()


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
    **overrides: object,
) -> Worker:
    device = resolve_device(settings.device)
    handler_cls = resolve_handler(ref)
    handler = handler_cls(device=device, slowness=settings.slowness)
    worker = Worker(handler, broker, store, settings=settings, device=device, **overrides)  # type: ignore[arg-type]
    worker.settler.on_settled.append(DagRunner(broker, store, make_dag_store(store)).on_settled)  # DAG continuation
    return worker


async def run_workers(workers: list[Worker], stop: asyncio.Event) -> None:
    """Start every worker (models load concurrently), serve until ``stop``, then drain them all."""
    try:
        await asyncio.gather(*(w.start() for w in workers))
        log.info("serving %s", ", ".join(f"{w.model} ({w.worker_id})" for w in workers))
        await stop.wait()
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)


@contextlib.asynccontextmanager
async def dag_starter(broker: Broker, store: ResultStore, owner: str) -> AsyncIterator[DagStarter]:
    """This process's consumer of ``fleet.req._dagrun``: runs started by publishing, without the gateway."""
    starter = DagStarter(DagRunner(broker, store, make_dag_store(store)), owner)
    await starter.start()
    try:
        yield starter
    finally:
        await starter.stop()


def _server(
    settings: FleetSettings, broker: Broker | None, store: ResultStore | None, scaling: ScalingStore | None = None
) -> QuietServer:
    app = create_app(settings, broker=broker, store=store, scaling=scaling)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    return QuietServer(config)


async def serve_gateway(server: QuietServer, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    server.should_exit = True
    stopper.cancel()
    await task
    if not server.started:
        raise SystemExit(f"the gateway could not start on {server.config.host}:{server.config.port}")


def up_autoscaler(settings: FleetSettings, broker: Broker, store: ResultStore, scaling: ScalingStore) -> Autoscaler:
    """The autoscaler of ``fleet up``: workers in this process on the embedded broker or store (``inprocess``),
    ``fleet worker`` processes on real infrastructure (``process``); from ``autoscale_min_replicas`` (1 by default,
    so every model is served at once) up to ``autoscale_max_replicas`` per model."""
    refs = {name: ref for ref, name in zip(settings.models, resolve_specs(settings.models), strict=True)}

    async def start_worker(model: str) -> Worker:
        worker = build_worker(refs[model], broker, store, settings)
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


async def run_up(settings: FleetSettings) -> None:
    """Gateway, autoscaler, workers and (for models in ``dispatch`` routing) dispatchers in one process, sharing
    one broker, one store and one scaling store.

    With ``autoscale`` off, one worker per model runs for the whole session instead.
    """
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings) as (broker, store), dag_starter(broker, store, "fleet up"):
            scaling = make_scaling_store(settings)
            await scaling.connect()
            dispatchers = up_dispatchers(settings, broker, store)
            try:
                await asyncio.gather(*(d.start() for d in dispatchers))
                if settings.autoscale:
                    task = asyncio.create_task(run_autoscaled(up_autoscaler(settings, broker, store, scaling), stop))
                else:
                    workers = [build_worker(ref, broker, store, settings) for ref in settings.models]
                    task = asyncio.create_task(run_workers(workers, stop))
                task.add_done_callback(lambda _: stop.set())  # workers or autoscaler that fail stop the gateway
                await serve_gateway(_server(settings, broker, store, scaling), stop)
                await task
            finally:
                await asyncio.gather(*(d.stop() for d in dispatchers), return_exceptions=True)
                await scaling.close()
    finally:
        restore()


async def run_worker(settings: FleetSettings, ref: str, **overrides: object) -> None:
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings) as (broker, store), dag_starter(broker, store, f"fleet worker {ref}"):
            await run_workers([build_worker(ref, broker, store, settings, **overrides)], stop)
    finally:
        restore()


async def run_gateway(settings: FleetSettings) -> None:
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        await serve_gateway(_server(settings, None, None), stop)
    finally:
        restore()
