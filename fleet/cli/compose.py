"""The composition root: build brokers, stores and workers from settings and run them (``fleet worker``).

This module and ``fleet.cli.serving`` (the gateway side: ``fleet up``, ``fleet gateway``) are the only places in
``fleet`` that import components (producers, consumers, ...). Imports follow use: a worker's process imports
neither the gateway, FastAPI, uvicorn, the autoscaler nor FAISS, and torch only when its handler loads a model
(``tests/test_startup_imports.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.cli.probes import WorkerProbe, serve_probes
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers import ModelHandler, resolve_handler
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.replicas import check_replicas
from fleet.consumers.version_outcomes import VersionOutcomes
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.dags.starter import DagStarter
from fleet.errors import FleetError
from fleet.models import resolve_spec
from fleet.outages import OutageLog, services_of, watch_outages
from fleet.redaction import redact
from fleet.repository.entry import RepositoryEntry
from fleet.repository.layout import Repository
from fleet.schemas.models import BUILTIN_SPECS
from fleet.settings import FleetSettings
from fleet.startup import Deadline, retry_until
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Handlers that never touch torch: their workers skip the device probe, which would import torch (~500 MB).
DEVICELESS_HANDLERS = (EchoHandler, SleepHandler)


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
    runner = DagRunner(broker, store, stores.dags)
    worker.settler.on_settled.append(runner.on_settled)  # DAG continuation
    outcomes = VersionOutcomes(store, stores.rollouts, runtimes_of(Repository.from_settings(settings)))
    worker.settler.on_settled.append(outcomes.on_settled)  # per-version counts and shadow comparisons
    return worker


def runtimes_of(repository: Repository) -> Callable[[str, str | None], str | None]:
    """The runtime whose measure compares a model version's outputs (``fleet.lifecycle.compare``): its repository
    entry's, ``embeddings`` for the built-in ``embed``, else None (exact equality). Read once per version."""

    @functools.lru_cache(maxsize=256)
    def runtime_of(model: str, version: str | None) -> str | None:
        if model in BUILTIN_SPECS:
            return "embeddings" if model == "embed" else None
        try:
            return repository.get(model, version).manifest.runtime
        except FleetError:  # not a repository model (a handler class): exact equality
            return None

    return runtime_of


def build_handler(ref: str, settings: FleetSettings) -> tuple[ModelHandler[Any, Any], str]:
    """The (not yet loaded) handler and its device; raises ``UnknownModel``/``ConfigError`` for a bad reference,
    option or device, so the CLI calls it once before connecting anything."""
    handler_cls = resolve_handler(ref, Repository.from_settings(settings))
    device = "cpu" if issubclass(handler_cls, DEVICELESS_HANDLERS) else resolve_device(settings.device)
    return handler_cls(device=device, slowness=settings.slowness), device


async def publish_manifest(stores: Stores, handler: ModelHandler[Any, Any], deadline: Deadline) -> None:
    """Publish the manifest of the repository entry ``handler`` serves (none for other handlers), so that a gateway
    without the repository folder validates its inputs (``fleet.store.manifests``)."""
    entry = getattr(handler, "entry", None)
    if isinstance(entry, RepositoryEntry):
        publish = functools.partial(stores.manifests.publish, entry.name, entry.version, entry.manifest)
        await retry_until(deadline, f"publish the manifest of {entry.ref}", publish)


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


async def first_of(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for ``wanted`` or ``stop``; True when ``wanted`` is set."""
    waits = [asyncio.create_task(wanted.wait()), asyncio.create_task(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waits)
    return wanted.is_set()


async def run_worker(
    settings: FleetSettings, ref: str, *, metrics_port: int | None = None, **overrides: object
) -> None:
    """One worker on its own broker and store connections; with ``metrics_port``, ``/metrics``, ``/healthz`` and
    ``/readyz`` on that port from the start (``/readyz`` 503 until the model is warm)."""
    deadline = startup_deadline(settings)
    handler, _ = build_handler(ref, settings)  # a bad model, option or device fails before anything connects
    check_replicas(handler, settings.replicas)  # ... and replicas of a handler that cannot run them
    probe = WorkerProbe(resolve_spec(ref, Repository.from_settings(settings)).name)
    server = serve_probes(probe, metrics_port) if metrics_port is not None else None  # /healthz from the start
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings, deadline) as (broker, store):
            stores = Stores.beside(store)  # one bundle for the worker and the DAG starter
            await publish_manifest(stores, handler, deadline)
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
