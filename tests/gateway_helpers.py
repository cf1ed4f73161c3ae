"""Helpers of the gateway and SDK tests: per-test model names, the real worker with a record of what it took, a
gateway served by a real uvicorn server on a free port, and a private nats-server that a test may stop.

Model names: ``tests.gateway_helpers:echo_<token>`` resolves (through the module ``__getattr__``) to the built-in
echo spec renamed ``echo-<token>``, so each test serves its own subjects and consumer groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from fleet.brokers.base import Broker, Delivery
from fleet.cli.httpserver import QuietServer
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.requests import Job
from fleet.consumers.worker import Worker
from fleet.producers.gateway import GatewayLimits, create_app
from fleet.schemas.jobs import JobRecord
from fleet.schemas.models import BUILTIN_SPECS, ModelSpec
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.tasks import wait_event
from tests import services

# Short waits so that tests cross a WebSocket wait step (ws_wait_chunk_s) and see timeouts quickly.
FAST_LIMITS = GatewayLimits(
    publish_timeout_s=1.5, store_timeout_s=1.5, ping_timeout_s=1.0, ws_wait_chunk_s=0.2, sse_keepalive_s=0.2
)


def __getattr__(name: str) -> ModelSpec:
    base, sep, token = name.partition("_")
    if sep and base in BUILTIN_SPECS:
        return dataclasses.replace(BUILTIN_SPECS[base], name=f"{base}-{token}")
    raise AttributeError(name)


def model_refs(unique: str, *bases: str) -> tuple[list[str], list[str]]:
    """(settings.models references, model names) of per-test copies of built-in models."""
    return [f"tests.gateway_helpers:{b}_{unique}" for b in bases], [f"{b}-{unique}" for b in bases]


WORKER_ID = "gateway-test-worker"
WORKER_SETTINGS = FleetSettings.model_validate({"ack_wait_s": 5, "heartbeat_interval_s": 0.5, "drain_timeout_s": 5})


@dataclass
class ObservedWorker:
    """The real ``fleet.consumers.worker.Worker`` serving the echo model under a per-test name. ``seen`` keeps each
    delivery it settled (through the settle path's ``on_settled`` hook); ``handled(n)`` waits until n deliveries
    were settled and nothing is held any more."""

    broker: Broker
    store: ResultStore
    model: str
    seen: list[Delivery] = field(default_factory=list)
    _progress: asyncio.Event = field(default_factory=asyncio.Event)
    _worker: Worker | None = None

    async def handled(self, count: int = 1, timeout_s: float = 10) -> None:
        """Wait until the worker has taken ``count`` deliveries and settled them."""
        assert self._worker is not None
        async with asyncio.timeout(timeout_s):
            while len(self.seen) < count or len(self._worker.held):
                self._progress.clear()
                await wait_event(self._progress, 0.05)

    async def _observe(self, job: Job, record: JobRecord, won: bool) -> None:
        self.seen.append(job.delivery)
        self._progress.set()

    async def __aenter__(self) -> ObservedWorker:
        handler = with_name(EchoHandler, self.model)()
        self._worker = Worker(
            handler,
            self.broker,
            self.store,
            settings=WORKER_SETTINGS,
            worker_id=WORKER_ID,
            max_wait_ms=2,
            on_settled=[self._observe],
        )
        await self._worker.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._worker is not None
        await self._worker.stop()


@contextlib.asynccontextmanager
async def asgi_gateway(
    settings: FleetSettings,
    broker: Broker | None = None,
    store: ResultStore | None = None,
    limits: GatewayLimits = FAST_LIMITS,
    stores: Stores | None = None,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan running and an httpx client talking to it in-process (no WebSockets); ``stores``:
    the stores the caller shares with it (keys it made, limits it reads), beside ``store``."""
    if stores is None and store is not None:
        stores = Stores.beside(store)  # fixed at build: a test that serves the app again (``served``) keeps them
    app = create_app(settings, broker=broker, stores=stores, limits=limits)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield app, client


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn (lifespan included) on a free port; yields the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", ws="websockets-sansio")
    server = QuietServer(config)  # leaves the test runner's signal handlers alone
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped during start-up; see the log above")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), SHUTDOWN_WAIT_S)
        except TimeoutError:
            held = _pending_stacks()  # what the gateway's shutdown is still waiting on, before cancelling it
            task.cancel()
            raise AssertionError(f"the gateway did not stop within {SHUTDOWN_WAIT_S:.0f}s; pending:\n{held}") from None


# Time a served gateway gets to stop. It stops in well under a second on its own; on a loaded 2-core CI machine a
# gateway with L3 on was seen to need more than 10 s, so a timeout here prints every pending task's await chain.
SHUTDOWN_WAIT_S = 30.0


def _pending_stacks() -> str:
    """Each pending task of the loop, with the innermost coroutines of the chain it is awaiting."""
    lines = []
    for pending in asyncio.all_tasks():
        if pending is asyncio.current_task():
            continue
        chain, coro = [], pending.get_coro()
        while coro is not None and len(chain) < 60:
            frame = (
                getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
            )
            if frame is not None:
                chain.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
            awaited = (
                getattr(coro, "cr_await", None)
                or getattr(coro, "gi_yieldfrom", None)
                or getattr(coro, "ag_await", None)
            )
            if awaited is not None and not hasattr(awaited, "cr_frame") and frame is not None:
                inner = getattr(frame.f_locals.get("self"), "gen", None)  # an @asynccontextmanager's generator
                awaited = inner if inner is not None and hasattr(inner, "ag_frame") else awaited
            coro = awaited
        shown = chain if len(chain) <= 10 else ["...", *chain[-10:]]  # the innermost awaits say what it waits on
        lines.append(f"  {pending.get_name()}: {' -> '.join(shown) or repr(pending)}")
    return "\n".join(sorted(lines))


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an ErrorResponse, checking the envelope on the way."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"type", "message", "details"}, body
    error: dict[str, Any] = body["error"]
    return error


@dataclass
class EchoSleepGateway:
    """A gateway served by uvicorn over one broker/store pair, serving per-test ``echo`` and ``sleep`` models."""

    base_url: str
    broker: Broker
    store: ResultStore
    echo: str
    sleep: str

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=15)

    def worker(self) -> ObservedWorker:
        return ObservedWorker(self.broker, self.store, self.echo)


@contextlib.asynccontextmanager
async def echo_sleep_gateway(request: Any, pair: str, unique: str) -> AsyncIterator[EchoSleepGateway]:
    """``EchoSleepGateway`` on ``pair`` (``tests.infra.PAIRS``), with a 4 KB body limit and ``FAST_LIMITS``."""
    from tests.infra import connected_pair, settings_for

    refs, (echo, sleep) = model_refs(unique, "echo", "sleep")
    settings = settings_for(pair, urls_for(request, pair), models=refs, max_body_bytes=4096)
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with served(app) as base_url:
            yield EchoSleepGateway(base_url, broker, store, echo, sleep)


def urls_for(request: Any, pair: str) -> dict[str, str]:
    """The session service URLs a broker/store pair needs (starting only those)."""
    return {kind: request.getfixturevalue(f"{kind}_url") for kind in pair.split("+") if kind != "memory"}


def _server_argv(kind: str, binary: str, port: int, tmp: str) -> tuple[list[str], str]:
    if kind == "nats":
        return [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp], f"nats://127.0.0.1:{port}"
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
    return argv, f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def private_server(kind: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A nats-server or redis-server of this test alone (never the shared one), so that the test may stop it."""
    name = "nats-server" if kind == "nats" else "redis-server"
    binary = services.require_binary(name, name)
    port = services.free_port()
    with tempfile.TemporaryDirectory(prefix=f"fleet-{kind}-private-") as tmp:
        argv, url = _server_argv(kind, binary, port, tmp)
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            services.wait_port("127.0.0.1", port, proc, log, 20, name)
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(10)
