"""The composition of a multi-model worker process (``fleet worker --models a,b@2,c`` or ``--pool NAME``): one
``Worker`` per model name, sharing the broker, the stores and one ``ModelPool`` within the memory budget.

``plan_pool`` checks everything the flags say before anything connects (a model named twice, an unknown model, a
budget that does not parse), so that a bad flag is one line; ``run_pool_worker`` serves until SIGTERM, then drains
every worker and unloads the pool. Each reference becomes a ``ServedVersions``: ``name@v`` serves only ``v``, an
unpinned repository ``name`` serves every version its repository holds (the highest by default), a built-in or a
handler class its one version.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.brokers.base import Broker
from fleet.cli.compose import (
    DEVICELESS_HANDLERS,
    connected,
    dag_starter,
    ensure_models,
    publish_manifest,
    run_workers,
    runtimes_of,
    startup_deadline,
    stop_on_signals,
)
from fleet.cli.probes import PoolProbe, serve_probes
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers import HandlerClass, entry_handler, resolve_handler
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.pool import ModelPool, ServedVersions, budget_bytes, parse_budget
from fleet.consumers.version_outcomes import VersionOutcomes
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.errors import ConfigError, FleetError
from fleet.models import builtin_of, is_import_path
from fleet.repository.layout import Repository, split_ref
from fleet.settings import FleetSettings
from fleet.startup import Deadline, retry_until
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What a multi-model worker process serves: each model's versions and the pool's budget (None: none)."""

    served: list[ServedVersions]
    handlers: list[ModelHandler[Any, Any]]  # each model's default version, constructed, not loaded (costs, specs)
    budget_bytes: int | None
    device: str


def pool_refs(settings: FleetSettings, models: str | None, pool: str | None) -> list[str]:
    """The model references of ``--models a,b@2`` or ``--pool NAME`` (settings ``pools``).

    Raises:
        ConfigError: both or neither given, an unknown pool, an empty list.
    """
    if (models is None) == (pool is None):
        raise ConfigError("give one of --models a,b@2,c and --pool NAME")
    if pool is not None:
        if pool not in settings.pools:
            known = ", ".join(sorted(settings.pools)) or "none (set FLEET_POOLS, e.g. 'nlp=a+b@2')"
            raise ConfigError(f"--pool {pool!r} is not a pool of the settings; pools: {known}")
        return list(settings.pools[pool])
    refs = [ref.strip() for ref in (models or "").split(",") if ref.strip()]
    if not refs:
        raise ConfigError(f"--models {models!r} names no model; write --models a,b@2,c")
    return refs


def plan_pool(settings: FleetSettings, refs: list[str], budget: str | None) -> PoolPlan:
    """Resolve every reference and the budget, touching no weights.

    Raises:
        UnknownModel: a reference that resolves to nothing.
        ConfigError: a model named twice, a bad reference or version, a budget that does not parse.
    """
    repository = Repository.from_settings(settings)
    classes = [(ref, resolve_handler(ref, repository)) for ref in refs]
    deviceless = all(issubclass(cls, DEVICELESS_HANDLERS) for _, cls in classes)
    device = "cpu" if deviceless else resolve_device(settings.device)
    parsed = parse_budget(budget) if budget is not None else None
    served: list[ServedVersions] = []
    handlers: list[ModelHandler[Any, Any]] = []
    for ref, cls in classes:
        name = cls.spec.name
        if any(s.name == name for s in served):
            raise ConfigError(f"--models: model {name!r} is named twice; a worker serves each model once")
        served.append(_served(ref, cls, repository, device, settings.slowness))
        handlers.append(cls(device=device, slowness=settings.slowness))
    return PoolPlan(served, handlers, budget_bytes(parsed, device) if parsed is not None else None, device)


def _served(ref: str, cls: HandlerClass, repository: Repository, device: str, slowness: float) -> ServedVersions:
    spec = cls.spec
    if builtin_of(ref) is not None or is_import_path(ref) or "@" in ref:  # one version
        return ServedVersions(spec.name, spec.version, lambda _: cls(device=device, slowness=slowness))
    name, _ = split_ref(ref)

    def make(version: str) -> ModelHandler[Any, Any]:
        return entry_handler(repository.get(name, version))(device=device, slowness=slowness)

    return ServedVersions(name, spec.version, make, functools.partial(repository.versions, name))


def build_pool_worker(
    served: ServedVersions,
    handler: ModelHandler[Any, Any],
    pool: ModelPool,
    broker: Broker,
    store: ResultStore,
    settings: FleetSettings,
    stores: Stores | None = None,
    **overrides: Any,
) -> Worker:
    """A worker of ``served`` through ``pool`` that continues DAG runs as it settles their steps and counts each
    version's outcomes and shadow comparisons (``fleet.consumers.version_outcomes``; ``handler``: the default
    version's, not loaded: it weighs input costs)."""
    stores = stores or Stores.beside(store)
    worker = Worker(handler, broker, store, settings=settings, stores=stores, pool=pool, versions=served, **overrides)
    runner = DagRunner(broker, store, stores.dags)
    worker.settler.on_settled.append(runner.on_settled)
    outcomes = VersionOutcomes(store, stores.rollouts, runtimes_of(Repository.from_settings(settings)))
    worker.settler.on_settled.append(outcomes.on_settled)
    return worker


async def publish_other_versions(stores: Stores, plan: PoolPlan, repository: Repository, deadline: Deadline) -> None:
    """Publish the manifest of each version an unpinned repository model serves beside its default (before the
    default's, which must be the one published last: ``ManifestStore.read`` gives the latest), so that a gateway
    without the repository folder knows every version a traffic policy may name. A version whose manifest is
    refused is logged and skipped: its jobs fail on their own when they ask for it."""
    for served in plan.served:
        if served.listed is None:
            continue
        for version in served.listed():
            if version == served.default:
                continue
            try:
                entry = repository.get(served.name, version)
            except FleetError as exc:
                log.warning("model %s version %s is not published: %s", served.name, version, exc.message)
                continue
            publish = functools.partial(stores.manifests.publish, entry.name, entry.version, entry.manifest)
            await retry_until(deadline, f"publish the manifest of {entry.ref}", publish)


async def run_pool_worker(
    settings: FleetSettings,
    plan: PoolPlan,
    *,
    metrics_port: int | None = None,
    worker_id: str | None = None,
    **overrides: object,
) -> None:
    """The models of ``plan`` in one process, each its own ``Worker`` on a shared broker, store and ``ModelPool``
    (``worker_id``: a stable prefix, each worker's id is ``<worker_id>-<model>``)."""
    deadline = startup_deadline(settings)
    names = [served.name for served in plan.served]
    probe = PoolProbe(names)
    server = serve_probes(probe, metrics_port) if metrics_port is not None else None
    stop = asyncio.Event()
    restore = stop_on_signals(stop)
    pool = ModelPool(plan.budget_bytes, retry_after_s=settings.model_retry_after_s)
    try:
        async with connected(settings, deadline) as (broker, store):
            stores = Stores.beside(store)
            await publish_other_versions(stores, plan, Repository.from_settings(settings), deadline)
            for handler in plan.handlers:
                await publish_manifest(stores, handler, deadline)
            async with dag_starter(broker, stores, f"fleet worker --models {','.join(names)}", deadline):
                await ensure_models(broker, names, deadline)

                def builder(served: ServedVersions, handler: ModelHandler[Any, Any]) -> Callable[[], Worker]:
                    def build() -> Worker:
                        worker = build_pool_worker(
                            served,
                            handler,
                            pool,
                            broker,
                            store,
                            settings,
                            stores,
                            device=plan.device,
                            on_drain=stop.set,
                            worker_id=f"{worker_id}-{served.name}" if worker_id else None,
                            **overrides,
                        )
                        return probe.probes[served.name].track(worker)  # type: ignore[no-any-return]

                    return build

                try:
                    await run_workers(
                        [builder(s, h) for s, h in zip(plan.served, plan.handlers, strict=True)], stop, deadline
                    )
                finally:
                    await pool.close()
    finally:
        restore()
        if server is not None:
            server.shutdown()


__all__ = ["PoolPlan", "build_pool_worker", "plan_pool", "pool_refs", "run_pool_worker"]
