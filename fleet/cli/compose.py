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

from consumers.device import resolve_device
from consumers.handlers import resolve_handler
from consumers.worker import Worker
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from producers.gateway.app import create_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
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
    return Worker(handler, broker, store, settings=settings, device=device, **overrides)  # type: ignore[arg-type]


async def run_workers(workers: list[Worker], stop: asyncio.Event) -> None:
    """Start every worker (models load concurrently), serve until ``stop``, then drain them all."""
    try:
        await asyncio.gather(*(w.start() for w in workers))
        log.info("serving %s", ", ".join(f"{w.model} ({w.worker_id})" for w in workers))
        await stop.wait()
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)


def _server(settings: FleetSettings, broker: Broker | None, store: ResultStore | None) -> _Server:
    app = create_app(settings, broker=broker, store=store)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    return _Server(config)


async def serve_gateway(server: _Server, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    server.should_exit = True
    stopper.cancel()
    await task
    if not server.started:
        raise SystemExit(f"the gateway could not start on {server.config.host}:{server.config.port}")


async def run_up(settings: FleetSettings) -> None:
    """Gateway and one worker per model in one process, sharing one broker and one store."""
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings) as (broker, store):
            workers = [build_worker(ref, broker, store, settings) for ref in settings.models]
            server = _server(settings, broker, store)
            worker_task = asyncio.create_task(run_workers(workers, stop))
            await serve_gateway(server, stop)
            await worker_task
    finally:
        restore()


async def run_worker(settings: FleetSettings, ref: str, **overrides: object) -> None:
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with connected(settings) as (broker, store):
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
