"""`fleet dispatcher`: direct assignment of requests to workers (JIQ and other policies)."""

# No ``from __future__ import annotations``: typer evaluates the command's annotations, and the option aliases
# (Broker, Store, LogLevel) are locals of ``register``.
import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:  # the settings module is imported by the command that needs it, not by `fleet --help`
    from fleet.settings import FleetSettings


def register(app: typer.Typer) -> None:
    from fleet.cli.common import Broker, LogLevel, Store, fail, run, settings_from

    @app.command()
    def dispatcher(
        model: Annotated[list[str], typer.Option("--model", "-m", help="model to dispatch (repeat for several)")],
        policy: Annotated[
            str | None,
            typer.Option(
                help="random, round-robin, power-of-d, least-outstanding, peak-ewma, jiq-random, jiq-sq, jiq-sed or "
                "jiq-amnesia (env FLEET_DISPATCH_POLICY; default jiq-amnesia)"
            ),
        ] = None,
        d: Annotated[int | None, typer.Option("--d", help="sample size d (env FLEET_DISPATCH_D)")] = None,
        host: Annotated[str, typer.Option(help="address of the /status, /metrics and /healthz server")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, max=65535, help="port of that server; 0 turns it off")] = 9000,
        dispatcher_id: Annotated[str | None, typer.Option(help="stable id (default: MODEL-d-RANDOM)")] = None,
        broker: Broker = None,
        store: Store = None,
        log_level: LogLevel = None,
    ) -> None:
        """Assign a model's requests to the inboxes of its workers (workers run with --routing dispatch).

        Run several for JIQ (each keeps its own idle queue). A request is acked on the broker only once its result
        is stored; a worker that stops heartbeating has its work reassigned, and a dispatcher that dies has its
        requests redelivered to the others. GET /status shows idle queues, routes and per-worker load.
        """
        settings = settings_from(
            broker_url=broker,
            store_url=store,
            dispatch_policy=policy,
            dispatch_d=d,
            log_level=log_level,
            models=",".join(model),
        )
        if settings.broker_scheme == "memory" or settings.store_scheme == "memory":
            raise fail(
                "a standalone dispatcher needs a real broker and store: pass --broker nats://... or kafka://... "
                "and --store redis://..."
            )
        run(run_dispatchers(settings, model, host=host, port=port, dispatcher_id=dispatcher_id), settings)


async def run_dispatchers(
    settings: "FleetSettings", models: list[str], *, host: str, port: int, dispatcher_id: str | None
) -> None:
    """One dispatcher per model on one broker and store connection, plus the status server; SIGTERM stops."""
    import uvicorn

    from fleet.cli.compose import connected, ensure_models, startup_deadline, stop_on_signals
    from fleet.cli.httpserver import QuietServer
    from fleet.cli.ports import listen_socket
    from fleet.dispatcher.http import create_status_app
    from fleet.dispatcher.service import Dispatcher

    # bound first: a port in use is one error line (naming --port) before anything connects
    sock = listen_socket(host, port, "--port (0 turns the status server off)") if port else None
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    deadline = startup_deadline(settings)
    try:
        async with connected(settings, deadline) as (broker, store):
            await ensure_models(broker, models, deadline)  # retried: a broker restarting now is not fatal
            dispatchers = [
                Dispatcher(
                    broker,
                    store,
                    model=m,
                    settings=settings,
                    dispatcher_id=f"{dispatcher_id}-{m}" if dispatcher_id and len(models) > 1 else dispatcher_id,
                )
                for m in models
            ]
            try:
                await asyncio.gather(*(d.start() for d in dispatchers))
                server: QuietServer | None = None
                if port:
                    config = uvicorn.Config(create_status_app(dispatchers), host=host, port=port, log_config=None)
                    server = QuietServer(config, sock)  # uvicorn without its own signal handlers: ours stop everything
                    serving = asyncio.create_task(server.serve())
                await stop.wait()
                if server is not None:
                    server.should_exit = True
                    await serving
            finally:
                await asyncio.gather(*(d.stop() for d in dispatchers), return_exceptions=True)
    finally:
        restore()
        if sock is not None:
            sock.close()
