"""The worker: its lifecycle, drain and loops. It pulls micro-batches, runs the model off the event loop, and
leaves admission (``fleet.consumers.admission``) and settling (``fleet.consumers.settle``) to their own modules.

Pipeline (one worker, one model, one device)::

    fetch loop (fetch) --(admission task: parse, get_many; queue, depth 1)--> compute loop
        (start_many: running) --(settle tasks)--> finish_many -> hooks -> ack | dead letter

The fetch loop fills the next batch and starts its admission in a task (invalid, duplicate and expired messages
are settled there) while the model computes the current one in a thread; the compute loop moves a batch to
running and runs it once its admission is done, and results of batch N are written while batch N+1 computes.
Admitting in a task lets the fetch of batch N+2 overlap the admission of batch N+1 when the model is fast, and
changes nothing when it is slow: at most one batch is taken ahead of the one computing (on Kafka, where a
partition's messages can only go to this worker anyway, one more is fetched while that one waits in the queue).
Heartbeats and ack-deadline extensions run in their own tasks, so a long batch neither looks dead nor gets
redelivered.

With ``replicas`` N > 1 (``fleet.consumers.replicas``) the compute loop takes a batch whenever one of N replica
slots is free and computes it in a task of its own: N batches compute at once in N model threads on one copy of
the weights, still at most one batch taken ahead of them, and their results settle as each ends (N + 1 settle
slots). With a circuit breaker (``fleet.consumers.breaker``) each run's outcome is recorded; while it is open the
worker takes no work and hands back, unstarted or unblamed, what it holds.

An admitted batch computes as one run, unless it holds jobs redelivered from a worker that disappeared while they
computed in a batch of many: ``fleet.consumers.crashes`` then splits it into smaller runs (bisection), each started and
computed in turn. A worker told to stop marks the run it is computing as a draining worker's (best effort, one
store call), so that if it is killed before the run ends, the run does not count against its jobs.

Versions: a worker of one handler serves its spec's version (loaded at start). A worker given the process's
``ModelPool`` (``fleet.consumers.pool``; ``fleet worker --models``) loads nothing at start: each run is grouped by the
version its requests name, and each group is started and computed on that version's handler, which the pool loads
on demand and keeps from eviction while the group computes. Either way the version is stamped on each job before
its start, so the running and the terminal record name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel

from fleet import constants as c
from fleet import tracing
from fleet.brokers.base import Broker, Delivery, Subscription
from fleet.brokers.prioritized import subscribe_inbox, subscribe_priorities
from fleet.consumers import gpu_stats, metrics
from fleet.consumers.admission import Admission
from fleet.consumers.batch_control import BatchLimits, ControlState, ControlWindow, control, initial_state
from fleet.consumers.batcher import BatchBounds, BatchCollector
from fleet.consumers.breaker import WorkerBreaker, outcome_of
from fleet.consumers.crashes import DRAINING, split, start_of
from fleet.consumers.drain import DrainListener
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.idle import IdleAnnouncer
from fleet.consumers.outage import StoreOutage
from fleet.consumers.pool.pool import ModelPool
from fleet.consumers.pool.versions import ServedVersions, by_version
from fleet.consumers.replicas import check_replicas, model_executor
from fleet.consumers.requests import Job, parse_delivery
from fleet.consumers.settle import Held, OnSettled, Settler
from fleet.consumers.stats import WorkerStats
from fleet.consumers.usage import share_device_seconds, weigh
from fleet.consumers.usage_buffer import UsageBuffer
from fleet.encoding import DEFAULT_ENCODING
from fleet.errors import BrokerError, ConfigError, FleetError, InvalidInput, ModelUnavailable
from fleet.finite import non_finite_at
from fleet.keepalive import keep_alive
from fleet.schemas.jobs import JobError
from fleet.schemas.wire import GpuStats, Heartbeat
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores, has_bundle
from fleet.store.usage import UsageStore
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

IDLE_FETCH_TIMEOUT_S = 1.0
SETTLE_CONCURRENCY = 2  # batches whose results may be written while the next batch computes (+1 per replica more)
YOUNG_GC_THRESHOLD = 10_000  # at least this many new container objects between two young garbage collections
YOUNG_GC_OBJECTS_PER_ITEM = 50  # ... and room for this many per item of a batch (a job in flight holds ~30)
DRAIN_MARK_TIMEOUT_S = 1.0  # for marking the run in flight as a draining worker's; a drain never waits longer


def new_worker_id(model: str) -> str:
    host = socket.gethostname().replace(".", "_")  # the id becomes a subject token and a group name
    return f"{model}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def count_prior_deliveries(batch: list[Delivery]) -> None:
    """An inbox message carries how often its request was handed out before (by the broker to dispatchers, and by
    dispatchers to workers that died): add it, so that the poison cap (``acks.poisoned``) sees every delivery."""
    for delivery in batch:
        prior = delivery.headers.get(c.HEADER_DELIVERIES, "")
        if prior.isdigit():
            delivery.delivery_count += int(prior)


class YoungGcTuning:
    """Raises the process's young-generation GC threshold while workers run, so that batches in flight fit in it.

    A job in flight holds ~30 container objects (delivery, request, input, records, output), created a batch at a
    time and freed a batch at a time. With CPython's default threshold (700) nearly every batch starts a young
    collection while the whole batch is alive, so every batch gets promoted, and the promotions soon force full
    collections that walk the entire heap (the model's objects, queued requests). Measured on the echo pipeline
    (20,000 jobs of 64-item batches): ~500 young and 3-4 full collections of ~55 ms each, about 15 % of the
    run; with room for a few batches, ~10 young collections and rarely a full one.

    The threshold is process-wide: it is raised (never lowered) when the first worker starts and put back when the
    last one stops, unless someone changed it meanwhile; a threshold of 0 (automatic collection off) is left alone.
    """

    def __init__(self) -> None:
        self._workers = 0
        self._restore: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None  # (ours, the one before)

    def acquire(self, max_batch: int) -> None:
        self._workers += 1
        young, middle, old = gc.get_threshold()
        wanted = max(YOUNG_GC_THRESHOLD, YOUNG_GC_OBJECTS_PER_ITEM * max_batch)
        if 0 < young < wanted:
            gc.set_threshold(wanted, middle, old)
            before = self._restore[1] if self._restore else (young, middle, old)  # the threshold before any worker
            self._restore = ((wanted, middle, old), before)
            log.debug("young GC threshold raised from %d to %d", young, wanted)

    def release(self) -> None:
        self._workers -= 1
        if self._workers == 0 and self._restore is not None:
            ours, before = self._restore
            self._restore = None
            if gc.get_threshold() == ours:
                gc.set_threshold(*before)


YOUNG_GC = YoungGcTuning()


def _pick(explicit: Any, settings: FleetSettings, field: str, preferred: Any) -> Any:
    """Explicit argument, else a setting the user set, else the model's preference."""
    if explicit is not None:
        return explicit
    return getattr(settings, field) if field in settings.model_fields_set else preferred


class Worker:
    """Serves one model from ``broker`` into ``store``. Use ``async with Worker(...)`` or start()/stop().

    Args:
        handler: a constructed (not yet loaded) model handler; ``start`` loads and warms it up.
        broker, store: connected seam implementations (the worker does not close them).
        settings: batch limits, ack wait, max deliveries, heartbeat interval, drain timeout.
        max_batch, max_wait_ms: override the settings and the model's preferences. With a p99 target (the
            model's ``p99_target_ms`` or ``settings.p99_target_ms``) they are ceilings, and ``worker.max_batch``
            and ``worker.max_wait_ms`` are the controller's current values (``fleet.consumers.batch_control``).
        routing: override ``settings.routing`` for this model: ``pull`` competes on the request subject,
            ``dispatch`` reads this worker's inbox and announces free slots to the dispatchers.
        on_settled: hooks awaited with ``(job, terminal record, won)`` after a job's record is terminal and before
            its message is acked (see ``fleet.consumers.settle``); more can be appended to
            ``worker.settler.on_settled``.
        on_drain: called when an operator asks this worker to drain (``fleet.consumers.drain``); ``fleet worker`` passes
            what SIGTERM does. Without it the worker runs its own ``stop``.
        stores: the process's stores beside ``store`` (``fleet.store.bundle.Stores``); the worker releases its
            tenants' queued-job places in ``stores.quotas`` when limits bound them, and counts its jobs' device
            time in ``stores.usage`` (``worker.usage``, a ``fleet.consumers.usage_buffer.UsageBuffer``, flushed
            every second and at stop). ``fleet up`` passes the bundle it shares with the gateway; None builds one.
        pool: the process's ``ModelPool`` (``fleet.consumers.pool``), shared with its other workers: the worker
            then loads nothing at start, and each batch's versions are loaded on demand through the pool (``handler``
            is only asked for input costs). None: ``handler`` is loaded at start and serves its one version.
        versions: with a pool, the versions this worker serves (``ServedVersions``; default: ``handler``'s one).
        replicas: batches computed at once, on the one loaded copy of the model (``fleet.consumers.replicas``); default
            ``settings.replicas``. Raises ``ConfigError`` when the handler cannot run that many.

    A batch's jobs run with the version each request names (``RequestMessage.version``; none: the default, the
    handler's spec version); a job for a version the worker does not serve fails (``unserved_version``), one whose
    version cannot be loaded fails with the pool's ``model_unavailable``; both are not retried. Every record the
    worker starts or finishes names the version.

    ``state`` is ``starting`` until the model is loaded and warmed up (with a pool: until subscribed; models load
    on their first work), then ``ready`` (``degraded`` while the store cannot be reached), ``draining`` and
    ``stopped``; heartbeats carry it, and ``loaded``, the versions loaded and warm.
    """

    def __init__(
        self,
        handler: ModelHandler,
        broker: Broker,
        store: ResultStore,
        *,
        settings: FleetSettings,
        worker_id: str | None = None,
        max_batch: int | None = None,
        max_wait_ms: float | None = None,
        device: str = "cpu",
        routing: Literal["pull", "dispatch"] | None = None,
        on_settled: list[OnSettled] | None = None,
        on_drain: Callable[[], object] | None = None,
        stores: Stores | None = None,
        pool: ModelPool | None = None,
        versions: ServedVersions | None = None,
        replicas: int | None = None,
    ) -> None:
        self.replicas = replicas or settings.replicas
        try:
            check_replicas(handler, self.replicas)
        except ConfigError as exc:
            if replicas is not None:
                raise
            # FLEET_REPLICAS covers every model of a process (fleet up): one that cannot run replicas runs one
            log.info("worker of %s: one replica, not %d: %s", handler.spec.name, self.replicas, exc.message)
            self.replicas = 1
        self.handler = handler
        self.spec = handler.spec
        self.model = self.spec.name
        self.version = self.spec.version  # of a job that names none
        self.pool = pool
        self.versions = versions or ServedVersions(self.model, self.version, lambda _: type(handler)(device=device))
        self.broker = broker
        self.store = store
        self.settings = settings
        self.worker_id = worker_id or new_worker_id(self.model)
        self.device = device
        self.batch_ceiling: int = _pick(max_batch, settings, "max_batch", self.spec.max_batch)
        self.wait_ceiling_ms: float = _pick(max_wait_ms, settings, "max_wait_ms", self.spec.max_wait_ms)
        self.max_batch = self.batch_ceiling  # in force now; the controller, if any, moves them within the limits
        self.max_wait_ms = self.wait_ceiling_ms
        self.max_batch_cost = settings.max_batch_cost_for(self.model, self.spec.max_batch_cost)
        self.batch_limits: BatchLimits | None = None
        target = settings.p99_target_for(self.model, self.spec.p99_target_ms)
        if target is not None:
            min_batch = min(self.spec.min_batch, self.batch_ceiling)
            self.batch_limits = BatchLimits(target, self.batch_ceiling, self.wait_ceiling_ms, min_batch=min_batch)
        self._control: ControlState | None = initial_state(self.batch_limits) if self.batch_limits else None
        if self._control is not None:
            self.max_batch, self.max_wait_ms = self._control.knobs.max_batch, self._control.knobs.max_wait_ms
        self._window = ControlWindow()
        self._parsed: dict[int, Job] = {}  # deliveries parsed to weigh their cost, by id, until admitted
        self.max_deliveries = settings.max_deliveries
        self.routing = routing or settings.routing_for(self.model)
        self.stats = WorkerStats()
        self._state = "starting"
        self.held = Held()
        self._stopping = asyncio.Event()
        self.outage = StoreOutage(f"worker {self.worker_id}")
        usage = _usage_store(stores, store)
        self.usage = UsageBuffer(usage, self.model, self.worker_id) if usage is not None else None
        self.settler = Settler(
            model=self.model,
            worker_id=self.worker_id,
            broker=broker,
            store=store,
            max_deliveries=self.max_deliveries,
            held=self.held,
            outage=self.outage,
            stats=self.stats,
            stop=self._stopping,
            quotas=(stores or Stores.beside(store)).quotas if settings.limit_policy().bounds_queued else None,
            usage=self.usage,
            device=device,
        )
        self.settler.on_settled.extend(on_settled or [])
        self.admission = Admission(self.spec, self.settler)
        self._queue: asyncio.Queue[asyncio.Task[list[Job]] | None] = asyncio.Queue(maxsize=1)  # None: wake up
        self._admissions: set[asyncio.Task[list[Job]]] = set()
        self._settling: set[asyncio.Task[None]] = set()
        self._settle_slots = asyncio.Semaphore(SETTLE_CONCURRENCY + self.replicas - 1)
        self._replica_slots = asyncio.Semaphore(self.replicas)
        self._runs: set[asyncio.Task[None]] = set()  # replicas computing an admitted batch
        self._probes: set[asyncio.Task[list[Job]]] = set()  # admissions of half-open probes (the breaker's)
        self.breaker = WorkerBreaker(settings.worker_breaker, model=self.model, worker_id=self.worker_id)
        self._sub: Subscription | None = None
        self._fetch_task: asyncio.Task[None] | None = None
        self._compute_task: asyncio.Task[None] | None = None
        self._computing: dict[int, list[Job]] = {}  # the runs on the device now, by id of their job list
        self._aux_tasks: list[asyncio.Task[None]] = []
        self._beats: set[asyncio.Task[None]] = set()  # heartbeats sent when the pool loads or unloads a model
        self._stopped = False
        self._taken = asyncio.Event()
        self._aux_stop = asyncio.Event()  # heartbeats and keep-alives run through the drain, then stop
        self._drain = DrainListener(broker, self.worker_id, on_drain or self._drain_self)
        self._drain_task: asyncio.Task[None] | None = None
        self._in_flight = metrics.IN_FLIGHT.labels(self.model)
        self._batch_size = metrics.BATCH_SIZE.labels(self.model)
        self._batch_seconds = metrics.BATCH_SECONDS.labels(self.model)
        self._announcer: IdleAnnouncer | None = None
        self.devices = gpu_stats.SAMPLER  # the process's NVML reader: empty without a GPU
        self._model_memory = gpu_stats.ModelMemory()
        self._device_gauges = gpu_stats.DeviceGauges(self.model)
        self._gpus: list[GpuStats] = []
        self._memory: dict[str, int] = {}
        # Threads of its own for the model's batches, one per replica: they never wait behind the loop's default
        # executor (load, warm-up and close use that one).
        self._model_thread = model_executor(handler, self.replicas, f"{self.worker_id}-model")
        self._gc_tuned = False

    @property
    def state(self) -> str:
        """starting, ready, degraded (ready, but the store cannot be reached), draining or stopped."""
        if self._state == "ready" and self.outage.degraded:
            return "degraded"
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Check the broker, load and warm up the model, then start taking work. On failure nothing is left running."""
        try:
            self.settler.tracing = tracing.start("fleet-worker")  # None unless the OTEL_* environment asks
            await self.broker.ensure_model(self.model)  # a broker misconfiguration surfaces before a slow load
            self._aux_tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"{self.worker_id}-heartbeat"))
            if self.usage is not None:
                flusher = self.usage.run(self._aux_stop)
                self._aux_tasks.append(asyncio.create_task(flusher, name=f"{self.worker_id}-usage"))
            t0 = time.perf_counter()
            if self.pool is None:
                await asyncio.to_thread(self.handler.load)
                await asyncio.to_thread(self.handler.warmup)
            else:  # models load on their first work; loads and unloads are heard of at once
                self.pool.on_change.append(self._on_pool_change)
            log.info("worker %s: %s ready in %.1fs", self.worker_id, self.model, time.perf_counter() - t0)
            YOUNG_GC.acquire(self.batch_ceiling)
            self._gc_tuned = True
            self._sub = await self._subscribe()
        except BaseException:
            self._release_gc()
            self._aux_stop.set()
            await cancel_and_wait(self._aux_tasks)
            self._aux_tasks.clear()
            self._stopped = True
            raise
        self.state = "ready"
        s = self.settings
        metrics.export_objectives(self.model, s.slo_latency_s, s.slo_latency_target, s.slo_error_target)
        self.sample_devices()
        await self._drain.start()
        await self._send_heartbeat()  # readiness (the gateway's /readyz, fleet up) hears of it now, not a beat later
        self._fetch_task = asyncio.create_task(self._fetch_loop(), name=f"{self.worker_id}-fetch")
        self._compute_task = asyncio.create_task(self._compute_loop(), name=f"{self.worker_id}-compute")
        keepalive = keep_alive(self.held.values, self.settings.ack_wait_s, self._aux_stop, f"worker {self.worker_id}")
        self._aux_tasks.append(asyncio.create_task(keepalive, name=f"{self.worker_id}-keepalive"))

    async def _subscribe(self) -> Subscription:
        """Pull routing: compete with the model's other workers, on every priority level (higher levels first:
        ``fleet.brokers.prioritized``). Dispatch routing: read our own inbox, and announce free slots to the
        dispatchers that fill it (they take higher levels first)."""
        if self.routing == "pull":
            return await subscribe_priorities(self.broker, self.model, self.settings.priority_weights)
        sub = await subscribe_inbox(self.broker, self.worker_id, self.settings.priority_weights)
        self._announcer = IdleAnnouncer(
            self.broker,
            model=self.model,
            worker_id=self.worker_id,
            free_slots=self._free_slots,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
        )
        self.held.on_release = self._announcer.poke
        await self._announcer.start()
        return sub

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain: stop pulling, finish in-flight work within the deadline, hand the rest back. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.state = "draining"
        self._stopping.set()
        await self._drain.stop()
        deadline_s = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await self._mark_draining()
        await self._stop_fetching()
        if self._announcer is not None:
            await self._announcer.stop()
        await self._release_queued()
        await self._finish_in_flight(deadline_s)
        await self._release_held()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.close()
        self.state = "stopped"
        await self._send_heartbeat()
        if self.pool is not None:  # the pool's models are the process's: its owner closes it
            with contextlib.suppress(ValueError):
                self.pool.on_change.remove(self._on_pool_change)
        else:
            try:
                await asyncio.to_thread(self.handler.close)  # not behind a batch still running past the deadline
            except Exception:
                log.exception("worker %s: model close failed", self.worker_id)
        self._model_thread.shutdown(wait=False)
        self._aux_stop.set()
        await cancel_and_wait(self._aux_tasks)
        if self.usage is not None:  # after the last settle: what the flusher has not written yet
            await self.usage.flush()
        self._release_gc()
        self.breaker.close()
        with contextlib.suppress(KeyError):
            metrics.REPLICAS_BUSY.remove(self.model, self.worker_id)
        self._device_gauges.clear()
        if self.settler.tracing is not None:
            await asyncio.to_thread(self.settler.tracing.flush)
        log.info("worker %s stopped after %d items", self.worker_id, self.stats.items)

    async def _mark_draining(self) -> None:
        """Mark the run computing as a draining worker's (``fleet.consumers.crashes``): killed before it ends (a grace
        period that runs out), it does not count against its jobs. Best effort: a run left unmarked only counts
        as any run does."""
        computing = [job for run in self._computing.values() for job in run]
        items = [start_of(job, self.model, self.worker_id, DRAINING) for job in computing if job.job_id]
        if not items:
            return
        try:
            async with asyncio.timeout(DRAIN_MARK_TIMEOUT_S):
                await self.store.start_many(items)
        except Exception as exc:
            log.info("worker %s: the run in flight is not marked as draining (%s)", self.worker_id, exc)

    def _drain_self(self) -> None:
        self._drain_task = asyncio.create_task(self.stop(), name=f"{self.worker_id}-drain-stop")

    def _release_gc(self) -> None:
        if self._gc_tuned:
            self._gc_tuned = False
            YOUNG_GC.release()

    async def _stop_fetching(self) -> None:
        if self._fetch_task is None:
            return
        # A fetch in progress returns within IDLE_FETCH_TIMEOUT_S; let it, so fetched messages are not orphaned.
        await asyncio.wait([self._fetch_task], timeout=IDLE_FETCH_TIMEOUT_S + 1)
        await cancel_and_wait([self._fetch_task], timeout_s=2.0)

    async def _release_queued(self) -> None:
        if self._admissions:  # quick (store round trips); what they leave runnable is handed back below
            await asyncio.wait(self._admissions)
        while not self._queue.empty():
            admission = self._queue.get_nowait()
            for job in [] if admission is None or admission.cancelled() else admission.result():
                await self.settler.release(job.delivery)
        self._queue.put_nowait(None)  # wakes the compute loop so it sees the stop

    async def _finish_in_flight(self, deadline_s: float) -> None:
        """Wait for the batches computing and the results being written; they may add settle tasks."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while pending := [
            t for t in (self._compute_task, *self._runs, *self._settling) if t is not None and not t.done()
        ]:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("worker %s: drain deadline of %.1fs passed; handing work back", self.worker_id, deadline_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return
            await asyncio.wait(pending, timeout=remaining)

    async def _release_held(self) -> None:
        for delivery in self.held.values():
            await self.settler.release(delivery)

    # -- loops ----------------------------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        assert self._sub is not None
        collector = BatchCollector(self._sub, self._cost_of, on_fetch=self.held.add)
        while not self._stopping.is_set():
            limit = self.breaker.fetch_limit()  # None: closed; 0: open; else the size of a half-open probe
            if limit == 0:
                await self._breaker_pause(collector)
                continue
            max_batch = self.max_batch if limit is None else min(limit, self.max_batch)
            bounds = BatchBounds(max_batch, self.max_wait_ms / 1000, self.max_batch_cost)
            try:
                batch = await collector.collect(bounds, IDLE_FETCH_TIMEOUT_S)
            except BrokerError as exc:
                log.warning("worker %s: fetch failed (%s); retrying in 1s", self.worker_id, exc)
                await asyncio.sleep(1.0)
                continue
            if not batch:  # every fetched message, held over ones included, is in self.held already
                continue
            fetched_at = time.time()
            self._window.fetched(collector.closed_full)
            if self._announcer is not None:
                self._announcer.on_assigned(batch)
                count_prior_deliveries(batch)
            self._in_flight.set(len(self.held))
            # Parsing and moving jobs to running overlap the previous batch's compute, and the next fetch.
            admission = asyncio.create_task(self._admit_batch(batch, fetched_at), name=f"{self.worker_id}-admit")
            self._admissions.add(admission)
            admission.add_done_callback(self._admissions.discard)
            if limit is not None and self.breaker.take_probe():
                self._probes.add(admission)
            # Hand over, then wait until the compute loop takes the batch: at most one batch is taken ahead of
            # the one computing, so a worker never hoards work its peers could be doing. On Kafka no peer could
            # (a partition belongs to one member of the group), so there the next fetch, whose delivery-count
            # commit is a round trip, overlaps the wait instead: one more batch ahead, bounded by the queue.
            self._taken.clear()
            await self._queue.put(admission)
            if not self._sub.partitioned:
                await self._taken.wait()

    def _cost_of(self, delivery: Delivery) -> int:
        """The handler's cost of a fetched message; the parsed job is kept for its admission (parsed once)."""
        job = parse_delivery(delivery, self.spec)
        self._parsed[id(delivery)] = job
        if job.input is None:
            return 1  # not a valid request: admission settles it without computing
        try:
            job.cost = int(self.handler.cost(job.input))
        except Exception:
            log.exception("worker %s: the model's cost() raised; counting the item as 1", self.worker_id)
            return 1
        return job.cost

    async def _admit_batch(self, batch: list[Delivery], fetched_at: float | None = None) -> list[Job]:
        """Admit a fetched batch (handed over at ``fetched_at``): the jobs that may compute. Never raises (but
        cancellation)."""
        parsed = [self._parsed.pop(id(d), None) for d in batch] if self._parsed else None
        try:
            return await self.admission.admit(batch, parsed, fetched_at)
        except Exception:  # a defect, not a message: admission settles every message problem itself
            log.exception("worker %s: could not admit a batch; handing it back", self.worker_id)
            await asyncio.gather(*(self.settler.release(d, 1.0) for d in batch))
            return []

    async def _breaker_pause(self, collector: BatchCollector) -> None:
        """While the breaker is open: hand back what was fetched ahead, wait for the cool-down (or a stop)."""
        for delivery in collector.carried():
            await self.settler.release(delivery)
        collector.carry.clear()
        await wait_event(self._stopping, min(max(self.breaker.wait_s(), 0.05), IDLE_FETCH_TIMEOUT_S))

    def _free_slots(self) -> int:
        """What the idle announcer may offer the dispatchers: nothing while stopping or while the breaker is open,
        one item for a half-open probe."""
        limit = self.breaker.fetch_limit()
        if self._stopping.is_set() or limit == 0:
            return 0
        free = self.max_batch - len(self.held)
        return free if limit is None else min(limit, free)

    async def _compute_loop(self) -> None:
        """Take a batch whenever a replica is free, and compute it in a task of its own (``_compute``)."""
        while True:
            await self._replica_slots.acquire()
            admission = await self._queue.get()
            self._taken.set()
            if admission is None:
                self._replica_slots.release()
                if self._stopping.is_set():
                    return
                continue
            run = asyncio.create_task(self._compute(admission), name=f"{self.worker_id}-replica")
            self._runs.add(run)
            run.add_done_callback(self._ran)

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._runs.discard(task)
        self._replica_slots.release()
        metrics.REPLICAS_BUSY.labels(self.model, self.worker_id).set(len(self._runs))
        if not task.cancelled() and task.exception() is not None:
            log.error("worker %s: a replica's batch failed", self.worker_id, exc_info=task.exception())

    async def _compute(self, admission: asyncio.Task[list[Job]]) -> None:
        """One replica: an admitted batch's runs, in turn. While the breaker is open a batch that is not its probe
        is handed back unstarted (nothing counts against its jobs)."""
        metrics.REPLICAS_BUSY.labels(self.model, self.worker_id).set(len(self._runs))
        probe = admission in self._probes
        self._probes.discard(admission)
        try:
            admitted = await admission
            for run, jobs in enumerate(split(admitted) if admitted else ()):  # one, unless crashes.split bounds some
                # a drain finishes the run computing, not the ones after it; an open breaker starts none
                if (run and self._stopping.is_set()) or not (probe or self.breaker.closed):
                    await asyncio.gather(*(self.settler.release(job.delivery) for job in jobs))
                    continue
                try:
                    if self.pool is None:
                        await self._start_and_run(jobs)
                    else:
                        await self._run_versions(jobs)
                except Exception:
                    log.exception("worker %s: batch failed unexpectedly; handing it back", self.worker_id)
                    await asyncio.gather(*(self.settler.release(job.delivery, 1.0) for job in jobs))
        finally:
            if probe:  # a probe that ran moved the breaker on; one whose jobs ended elsewhere frees its place
                self.breaker.cancel_probe()

    async def _start_and_run(self, jobs: list[Job]) -> None:
        """One version, the handler's: stamp it on the jobs (a job naming another fails), start them and run."""
        version = self.version
        unserved: list[Job] | None = None
        for job in jobs:  # no allocation on the normal path: a job names no version, or this one
            asked = job.request.version if job.request is not None else None
            if asked is None or asked == version:
                job.version = version
            elif unserved is None:
                unserved = [job]
            else:
                unserved.append(job)
        if unserved is not None:
            jobs = [job for job in jobs if job.version is not None]
            await self._unserved(unserved)
        jobs = await self.admission.start(jobs)
        if jobs:
            await self._run_batch(jobs)

    async def _run_versions(self, jobs: list[Job]) -> None:
        """With a pool: each version's jobs of the batch run on that version's handler, loaded on demand."""
        pool = self.pool
        assert pool is not None
        for i, (version, group) in enumerate(by_version(jobs, self.version).items()):
            if i and self._stopping.is_set():  # a drain finishes the group computing; no load starts for the rest
                await asyncio.gather(*(self.settler.release(job.delivery) for job in group))
                continue
            if not self.versions.serves(version):
                await self._unserved(group, version)
                continue
            for job in group:
                job.version = version
            try:
                async with pool.use((self.model, version), partial(self.versions.make, version)) as handler:
                    group = await self.admission.start(group)
                    if group:
                        await self._run_batch(group, handler)
            except ModelUnavailable as exc:  # raised by the pool before anything started: the jobs fail at once
                error = JobError(type="model_unavailable", message=exc.message, retriable=False)
                await self.settler.reject([(job, error) for job in group])

    async def _unserved(self, jobs: list[Job], version: str | None = None) -> None:
        rejected = []
        for job in jobs:
            asked = version or (job.request.version if job.request is not None else None) or self.version
            rejected.append((job, self.versions.unserved(asked)))
        await self.settler.reject(rejected)

    def _on_pool_change(self) -> None:
        if self._state == "ready":
            task = asyncio.create_task(self._send_heartbeat(), name=f"{self.worker_id}-loaded")
            self._beats.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._beats.discard)

    def loaded(self) -> list[str]:
        """The versions of this worker's model loaded and warm."""
        if self.pool is not None:
            return self.pool.loaded(self.model)
        return [self.version] if self._state in ("ready", "draining") else []

    def loaded_handlers(self) -> dict[str, ModelHandler[Any, Any]]:
        """The handlers of this worker's model loaded and warm, by version."""
        if self.pool is not None:
            return self.pool.handlers(self.model)
        return {self.version: self.handler} if self._state in ("ready", "draining") else {}

    def sample_devices(self) -> None:
        """Read the GPUs and the loaded versions' device memory into the next heartbeats and the gauges (on the
        heartbeat interval: never per batch)."""
        self._gpus = self.devices.sample()
        self._memory = self._model_memory.sample(self.loaded_handlers())
        self._device_gauges.export(self._gpus, self._memory)

    async def _heartbeat_loop(self) -> None:
        while not self._aux_stop.is_set():
            self.sample_devices()
            await self._send_heartbeat()
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            model=self.model,
            device=self.device,
            pid=os.getpid(),
            max_batch=self.max_batch,
            max_wait_ms=self.max_wait_ms,
            p99_target_ms=self.batch_limits.p99_target_ms if self.batch_limits else None,
            max_batch_cost=self.max_batch_cost,
            state=self.state,  # type: ignore[arg-type]
            routing=self.routing,
            in_flight=len(self.held),
            loaded=self.loaded(),
            replicas=self.replicas,
            breaker=self.breaker.status,
            gpus=self._gpus,
            model_memory_bytes=self._memory,
            **self.stats.snapshot(),  # type: ignore[arg-type]
        )

    async def _send_heartbeat(self) -> None:
        try:
            await self.broker.emit(c.heartbeat_subject(self.model), self.heartbeat().model_dump_json().encode())
        except Exception as exc:
            log.warning("worker %s: heartbeat not sent: %s", self.worker_id, exc)

    # -- one batch ------------------------------------------------------------------------------------------
    async def _run_batch(self, jobs: list[Job], handler: ModelHandler[Any, Any] | None = None) -> None:
        """Compute running jobs (on ``handler``, default the worker's), then hand their results to a settle task
        and return for the next batch."""
        t0 = time.perf_counter()
        handler = handler or self.handler
        started_at = time.time()
        self._computing[id(jobs)] = jobs
        try:
            results = await self._predict(jobs, handler)
        finally:
            del self._computing[id(jobs)]
        compute_ms = (time.perf_counter() - t0) * 1000
        computed_at = time.time()
        for job in jobs:
            job.batch_started_at = started_at
            job.computed_at = computed_at
        weigh(jobs, handler)
        share_device_seconds(jobs, compute_ms / 1000)
        if self.breaker.config is not None:
            jobs, results = await self._after_outcome(jobs, results)
            if not jobs:
                return
        self.stats.record_batch(len(jobs), compute_ms)
        if self._control is not None:
            self._adapt(jobs, compute_ms)
        self._batch_size.observe(len(jobs))
        self._batch_seconds.observe(compute_ms / 1000)
        await self._settle_slots.acquire()
        task = asyncio.create_task(self.settler.results(jobs, results))
        self._settling.add(task)
        task.add_done_callback(self._settled)

    async def _after_outcome(self, jobs: list[Job], results: list[Any]) -> tuple[list[Job], list[Any]]:
        """Record the run's outcome; with the breaker open, hand back the jobs that failed with a model error
        (unblamed: the worker is sick, not they) and keep the rest to settle."""
        self.breaker.record(outcome_of(results))
        if self.breaker.closed:
            return jobs, results
        if self._announcer is not None:
            self._announcer.poke()  # retract the free slots it offered
        failed = [
            job for job, r in zip(jobs, results, strict=True) if isinstance(r, JobError) and r.type == "model_error"
        ]
        if not failed:
            return jobs, results
        items = [start_of(job, self.model, self.worker_id, DRAINING) for job in failed if job.job_id]
        try:
            async with asyncio.timeout(DRAIN_MARK_TIMEOUT_S):
                await self.store.start_many(items)
        except Exception as exc:  # left unmarked, the runs are judged as any vanished run is
            log.info("worker %s: runs handed back by the breaker are not marked (%s)", self.worker_id, exc)
        await asyncio.gather(*(self.settler.release(job.delivery) for job in failed))
        kept = [
            (job, r)
            for job, r in zip(jobs, results, strict=True)
            if not (isinstance(r, JobError) and r.type == "model_error")
        ]
        return [job for job, _ in kept], [r for _, r in kept]

    def _adapt(self, jobs: list[Job], compute_ms: float) -> None:
        """Feed the controller's window; at the end of a window, put its knobs in force."""
        assert self._control is not None and self.batch_limits is not None
        now = time.time()
        # An item's latency so far: queue wait since it was submitted, plus compute. Redeliveries are left out
        # (their age says how long ago a worker died, not how these knobs serve).
        latencies = [
            max(0.0, now - job.request.submitted_at) * 1000
            for job in jobs
            if job.request is not None and job.delivery.delivery_count == 1
        ]
        self._window.computed(len(jobs), compute_ms, latencies)
        if not self._window.ready():
            return
        knobs, self._control = control(self._window.observe(), self._control, self.batch_limits)
        if (knobs.max_batch, knobs.max_wait_ms) != (self.max_batch, self.max_wait_ms) and log.isEnabledFor(
            logging.DEBUG
        ):
            log.debug(
                "worker %s: batch %d -> %d, wait %.1f -> %.1f ms (%s)",
                self.worker_id,
                self.max_batch,
                knobs.max_batch,
                self.max_wait_ms,
                knobs.max_wait_ms,
                self._control.reason,
            )
        self.max_batch, self.max_wait_ms = knobs.max_batch, knobs.max_wait_ms

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._settling.discard(task)
        self._settle_slots.release()
        self._in_flight.set(len(self.held))
        if not task.cancelled() and task.exception() is not None:
            log.error("worker %s: settling a batch failed", self.worker_id, exc_info=task.exception())

    async def _predict(self, jobs: list[Job], handler: ModelHandler[Any, Any]) -> list[Any]:
        """Outputs (JSON-ready) or ``JobError`` per job; a failing batch is split until the bad item is alone."""
        inputs = [job.input for job in jobs]
        try:
            if handler.spec.inline:  # microseconds of work: a thread hop would cost more
                outputs = handler.run(inputs)
            else:
                loop = asyncio.get_running_loop()
                outputs = await loop.run_in_executor(self._model_thread, handler.run, inputs)  # checks types
        except Exception as exc:
            if len(jobs) == 1:
                return [self._error_from(exc)]
            mid = len(jobs) // 2
            log.info("worker %s: batch of %d raised %r; splitting to isolate it", self.worker_id, len(jobs), exc)
            return await self._predict(jobs[:mid], handler) + await self._predict(jobs[mid:], handler)
        return [self._to_json(handler, out, _encoding(job)) for job, out in zip(jobs, outputs, strict=True)]

    def _to_json(self, handler: ModelHandler[Any, Any], output: BaseModel | Exception, encoding: str) -> Any:
        if isinstance(output, Exception):
            return self._error_from(output)
        try:
            data = handler.output_json(output, encoding)
        except Exception as exc:  # e.g. a value JSON cannot hold: the job fails, the worker goes on
            return JobError(type="invalid_output", message=f"the model's output does not serialise: {exc}")
        where = non_finite_at(data)
        if where is not None:  # JSON writers would store it as null: refused, never changed
            message = f"the model's output holds NaN or Infinity at {where}, which JSON cannot carry"
            return JobError(type="invalid_output", message=message)
        return data

    @staticmethod
    def _error_from(exc: BaseException) -> JobError:
        if isinstance(exc, InvalidInput):  # the model refuses this input (a size it does not serve): not retried
            return JobError(type="invalid_input", message=exc.message, retriable=False)
        retriable = exc.retriable if isinstance(exc, FleetError) else True
        return JobError(type="model_error", message=f"{type(exc).__name__}: {exc}", retriable=retriable)


def _usage_store(stores: Stores | None, store: ResultStore) -> UsageStore | None:
    """The usage store beside ``store``; None beside a store no bundle is built for (a test's stand-in)."""
    if stores is not None:
        return stores.usage
    return Stores.beside(store).usage if has_bundle(store) else None


def _encoding(job: Job) -> str:
    return job.request.encoding_format if job.request is not None else DEFAULT_ENCODING
