"""`fleet autoscaler`: scales workers on queue lag, and runs the rollout controller (``fleet.lifecycle.service``).

The flags build one ``ScalingConfig`` that applies to every model served (``--model``, repeatable, or
``FLEET_MODELS``); operators change min, max and pause per model later through ``PUT /v1/scaling/{model}``. A pool
(``FLEET_POOLS``) is scaled as one target, on the sum of its models' demand, and its models are not scaled alone.
"""

# No ``from __future__ import annotations`` here: typer evaluates the command's annotations, and the option aliases
# (Broker, Store, LogLevel) are locals of ``register``. Annotations of names imported for type checking are quoted.
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pydantic import ValidationError

    from fleet.autoscaler.backends.base import ScalerBackend
    from fleet.autoscaler.config import ScalingConfig
    from fleet.brokers.base import Broker as BrokerClient
    from fleet.scaling import ScalingStore
    from fleet.settings import FleetSettings
    from fleet.store.bundle import Stores

log = logging.getLogger(__name__)


class BackendName(StrEnum):
    process = "process"
    kubernetes = "kubernetes"
    dry_run = "dry-run"


class Mode(StrEnum):
    rate = "rate"
    keda = "keda"


def scaling_configs(
    models: list[str], flags: dict[str, Any], queue_ages: dict[str, float] | None = None
) -> "dict[str, ScalingConfig]":
    """One validated ``ScalingConfig`` per model name from the flags that were given; ``queue_ages`` (per model,
    ``FLEET_AUTOSCALE_MAX_QUEUE_AGE_S``) sets a model's ``max_queue_age_s`` over the flag's.

    Raises:
        ValueError: a bad value or two conflicting settings (the message names both), or a queue age for a model
            not scaled.
    """
    from fleet.autoscaler.config import ScalingConfig

    unknown = sorted(set(queue_ages or {}) - set(models))
    if unknown:
        raise ValueError(f"autoscale_max_queue_age_s names {', '.join(unknown)}, not among {', '.join(models)}")
    config = ScalingConfig.model_validate({k: v for k, v in flags.items() if v is not None})
    ages = queue_ages or {}
    return {m: config.with_changes(max_queue_age_s=ages[m]) if m in ages else config for m in models}


def describe_config_error(exc: "ValidationError") -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    return "invalid scaling configuration:\n" + "\n".join(lines)


def partitions_of(settings: "FleetSettings") -> int | None:
    """Kafka: the partition count Fleet creates request topics with (the broker seam cannot report it)."""
    return settings.kafka_partitions if settings.broker_scheme == "kafka" else None


@contextlib.asynccontextmanager
async def broker_and_scaling_store(
    settings: "FleetSettings",
) -> "AsyncIterator[tuple[BrokerClient, ScalingStore, Stores]]":
    """The broker, the scaling store and the stores beside the result store (the rollout controller's), connected
    with start-up retries."""
    from fleet.brokers import make_broker
    from fleet.scaling import make_scaling_store
    from fleet.startup import Deadline, retry_until
    from fleet.store import make_store
    from fleet.store.bundle import Stores

    deadline = Deadline.after(settings.startup_timeout_s)
    broker = make_broker(settings)
    scaling = make_scaling_store(settings)
    store = make_store(settings)
    try:
        await retry_until(deadline, "connect to the broker", broker.connect)
        await retry_until(deadline, "connect to the scaling store", scaling.connect)
        await retry_until(deadline, "connect to the store", store.connect)
        try:
            yield broker, scaling, Stores.beside(store)
        finally:
            await scaling.close()
            await store.close()
    finally:
        await broker.close()


async def run_autoscaler(
    settings: "FleetSettings",
    configs: "dict[str, ScalingConfig]",
    backend: "ScalerBackend",
    interval_s: float,
) -> None:
    """Run the autoscaler and the rollout controller until SIGINT/SIGTERM; then release their locks and close the
    backend (workers drain)."""
    from fleet.autoscaler.service import Autoscaler
    from fleet.cli.compose import stop_on_signals
    from fleet.lifecycle.service import RolloutService
    from fleet.pools import members

    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    try:
        async with broker_and_scaling_store(settings) as (broker, scaling, stores):
            autoscaler = Autoscaler(
                broker,
                scaling,
                backend,
                configs,
                interval_s,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                partitions=partitions_of(settings),
                pools=members(settings.pools),
            )
            rollouts = RolloutService(
                stores.rollouts, interval_s=settings.rollout_interval_s, window_s=settings.rollout_window_s
            )
            async with autoscaler, rollouts:
                await stop.wait()
    finally:
        restore()


def _backend_kwargs(name: str, namespace: str | None, template: str | None, log_dir: Path | None) -> dict[str, Any]:
    if name == "kubernetes":
        kwargs: dict[str, Any] = {"namespace": namespace or "default"}
        if template:
            kwargs["deployment_name_template"] = template
        return kwargs
    if name == "process" and log_dir is not None:
        return {"log_dir": log_dir}
    return {}


def register(app: typer.Typer) -> None:
    """Add ``fleet autoscaler`` to ``app``."""
    from fleet.cli.common import Broker, LogLevel, Store, fail, run, settings_from

    @app.command()
    def autoscaler(
        backend: Annotated[
            BackendName,
            typer.Option(
                help="process: fleet worker processes on this machine; kubernetes: the scale of each model's "
                "Deployment; dry-run: decide and record only",
            ),
        ] = BackendName.process,
        model: Annotated[
            list[str] | None,
            typer.Option("--model", "-m", help="model to scale (repeat for several; default: env FLEET_MODELS)"),
        ] = None,
        min_replicas: Annotated[
            int | None, typer.Option(help="fewest workers per model; 0 allows scale to zero (default 1)")
        ] = None,
        max_replicas: Annotated[int | None, typer.Option(help="most workers per model (default 4)")] = None,
        mode: Annotated[
            Mode | None,
            typer.Option(
                help="rate: (arrival + lag / target-drain-s) / throughput per worker (default); "
                "keda: lag / lag-per-replica",
            ),
        ] = None,
        target_drain_s: Annotated[float | None, typer.Option(help="rate mode: drain the backlog within this")] = None,
        lag_per_replica: Annotated[int | None, typer.Option(help="keda mode: backlog one worker handles")] = None,
        activation_lag: Annotated[int | None, typer.Option(help="scale from zero only above this lag")] = None,
        scale_up_step: Annotated[int | None, typer.Option(help="add at most this many workers per interval")] = None,
        scale_up_interval_s: Annotated[float | None, typer.Option(help="window of --scale-up-step")] = None,
        scale_down_stabilization_s: Annotated[
            float | None, typer.Option(help="scale in only after the load stayed low this long")
        ] = None,
        stale_after_s: Annotated[
            float | None, typer.Option(help="hold the replicas on signals older than this")
        ] = None,
        predictive_horizon_s: Annotated[
            float | None, typer.Option(help="rate mode: add workers for the arrival trend this far ahead")
        ] = None,
        default_throughput: Annotated[
            float | None, typer.Option(help="rate mode: jobs/s per worker assumed until heartbeats tell")
        ] = None,
        max_queue_age_s: Annotated[
            float | None,
            typer.Option(
                help="add workers when the oldest request waited longer than this (per model: env "
                "FLEET_AUTOSCALE_MAX_QUEUE_AGE_S)"
            ),
        ] = None,
        interval_s: Annotated[float | None, typer.Option(help="seconds between decisions (default 2)")] = None,
        metrics_port: Annotated[
            int | None, typer.Option(min=1, max=65535, help="serve Prometheus metrics on this port (/metrics)")
        ] = None,
        namespace: Annotated[str | None, typer.Option(help="kubernetes: namespace of the worker Deployments")] = None,
        deployment_template: Annotated[
            str | None, typer.Option(help="kubernetes: Deployment name of a model, e.g. 'fleet-worker-{model}'")
        ] = None,
        worker_log_dir: Annotated[Path | None, typer.Option(help="process: write each worker's output here")] = None,
        broker: Broker = None,
        store: Store = None,
        log_level: LogLevel = None,
    ) -> None:
        """Scale each model's workers on its queue lag, arrival rate and per-worker throughput.

        Only one autoscaler acts at a time (a lock in Redis); others wait on standby. Scale-in is graceful: a
        stopped worker finishes its batch and hands the rest back. Needs a real broker and Redis.

        The same process runs the rollout controller (one per Redis, its own lock): it steps each model's canary
        up or rolls it back, and opens and closes each version's breaker (FLEET_ROLLOUT_INTERVAL_S,
        FLEET_ROLLOUT_WINDOW_S).
        """
        settings = settings_from(
            broker_url=broker,
            store_url=store,
            models=",".join(model) if model else None,
            autoscale_interval_s=interval_s,
            log_level=log_level,
        )
        if settings.broker_scheme == "memory" or settings.store_scheme == "memory":
            raise fail(
                "the autoscaler needs a real broker and store: pass --broker nats://... or kafka://... and "
                "--store redis://... ('fleet up' runs an embedded autoscaler)"
            )
        flags = {
            "min_replicas": settings.autoscale_min_replicas if min_replicas is None else min_replicas,
            "max_replicas": settings.autoscale_max_replicas if max_replicas is None else max_replicas,
            "mode": mode.value if mode is not None else None,
            "target_drain_s": settings.autoscale_target_drain_s if target_drain_s is None else target_drain_s,
            "lag_per_replica": lag_per_replica,
            "activation_lag": activation_lag,
            "scale_up_step": scale_up_step,
            "scale_up_interval_s": scale_up_interval_s,
            "scale_down_stabilization_s": scale_down_stabilization_s,
            "stale_after_s": stale_after_s,
            "predictive_horizon_s": predictive_horizon_s,
            "default_throughput_per_replica": default_throughput,
            "max_queue_age_s": max_queue_age_s,
        }
        configs, scaler = _build(
            settings,
            flags,
            backend.value,
            _backend_kwargs(backend.value, namespace, deployment_template, worker_log_dir),
        )
        if metrics_port is not None:
            from prometheus_client import start_http_server

            try:
                start_http_server(metrics_port)
            except OSError as exc:
                raise fail(
                    f"cannot serve metrics on 0.0.0.0:{metrics_port}: {exc.strerror or exc}; another process may be "
                    "serving there: stop it, or pick another --metrics-port",
                    1,
                ) from None
        run(run_autoscaler(settings, configs, scaler, settings.autoscale_interval_s), settings)

    def _build(
        settings: "FleetSettings", flags: dict[str, Any], backend: str, kwargs: dict[str, Any]
    ) -> "tuple[dict[str, ScalingConfig], ScalerBackend]":
        from pydantic import ValidationError

        from fleet.autoscaler.backends import make_backend
        from fleet.errors import FleetError
        from fleet.models import resolve_specs
        from fleet.pools import scaling_targets

        try:
            names = list(resolve_specs(settings.models))
            targets = list(scaling_targets(names, settings.pools))
            configs = scaling_configs(targets, flags, settings.autoscale_max_queue_age_s)
            return configs, make_backend(backend, settings, **kwargs)
        except ValidationError as exc:
            raise fail(describe_config_error(exc)) from None
        except ValueError as exc:
            raise fail(str(exc)) from None
        except FleetError as exc:
            raise fail(exc.message) from None
