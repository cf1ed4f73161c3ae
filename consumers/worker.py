"""The worker: pull micro-batches, run the model off the event loop, store each result, then ack.

Pipeline (one worker, one model, one device)::

    fetch loop (fetch, parse) --(admission task: start_many; queue, depth 1)--> compute loop
        --(settle tasks)--> finish_many -> ack

The fetch loop fills the next batch and starts its admission in a task (invalid, duplicate and expired messages
are settled there; the rest are moved to running) while the model computes the current one in a thread; the
compute loop runs a batch once its admission is done, and results of batch N are written while batch N+1
computes. Admitting in a task lets the fetch of batch N+2 overlap the admission of batch N+1 when the model is
fast, and changes nothing when it is slow: at most one batch is taken ahead of the one computing (on Kafka, where
a partition's messages can only go to this worker anyway, one more is fetched while that one waits in the queue).
Heartbeats and ack-deadline extensions run in their own tasks, so a long batch neither looks dead nor gets
redelivered.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel

from consumers import metrics
from consumers.acks import Action, decide, exhausted
from consumers.batcher import collect_batch
from consumers.handlers.base import ModelHandler
from consumers.idle import IdleAnnouncer
from consumers.requests import Job, parse_delivery
from consumers.stats import WorkerStats
from fleet import constants as c
from fleet.brokers.base import Broker, Delivery, Subscription
from fleet.errors import BrokerError, FleetError, StoreError
from fleet.settings import FleetSettings
from fleet.store.base import Finish, ResultStore, Start
from fleet.tasks import cancel_and_wait
from schemas.jobs import JobError, JobRecord, JobState
from schemas.wire import DeadLetter, Heartbeat

log = logging.getLogger(__name__)

IDLE_FETCH_TIMEOUT_S = 1.0
SETTLE_CONCURRENCY = 2  # batches whose results may be written while the next batch computes
YOUNG_GC_THRESHOLD = 10_000  # at least this many new container objects between two young garbage collections
YOUNG_GC_OBJECTS_PER_ITEM = 50  # ... and room for this many per item of a batch (a job in flight holds ~30)


def new_worker_id(model: str) -> str:
    host = socket.gethostname().replace(".", "_")  # the id becomes a subject token and a group name
    return f"{model}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def count_prior_deliveries(batch: list[Delivery]) -> None:
    """An inbox message carries how often its request was handed out before (by the broker to dispatchers, and by
    dispatchers to workers that died): add it, so a request that kills every worker it reaches is still
    dead-lettered after ``max_deliveries``."""
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
        max_batch, max_wait_ms: override the settings and the model's preferences.
        routing: override ``settings.routing`` for this model: ``pull`` competes on the request subject,
            ``dispatch`` reads this worker's inbox and announces free slots to the dispatchers.
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
    ) -> None:
        self.handler = handler
        self.spec = handler.spec
        self.model = self.spec.name
        self.broker = broker
        self.store = store
        self.settings = settings
        self.worker_id = worker_id or new_worker_id(self.model)
        self.device = device
        self.max_batch: int = _pick(max_batch, settings, "max_batch", self.spec.max_batch)
        self.max_wait_ms: float = _pick(max_wait_ms, settings, "max_wait_ms", self.spec.max_wait_ms)
        self.max_deliveries = settings.max_deliveries
        self.routing = routing or settings.routing_for(self.model)
        self.stats = WorkerStats()
        self.state = "starting"
        self._held: dict[int, Delivery] = {}
        self._queue: asyncio.Queue[asyncio.Task[list[Job]] | None] = asyncio.Queue(maxsize=1)  # None: wake up
        self._admissions: set[asyncio.Task[list[Job]]] = set()
        self._settling: set[asyncio.Task[None]] = set()
        self._settle_slots = asyncio.Semaphore(SETTLE_CONCURRENCY)
        self._sub: Subscription | None = None
        self._fetch_task: asyncio.Task[None] | None = None
        self._compute_task: asyncio.Task[None] | None = None
        self._aux_tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._stopped = False
        self._counters: dict[str, Any] = {}
        self._taken = asyncio.Event()
        self._aux_stop = asyncio.Event()  # heartbeats and keep-alives run through the drain, then stop
        self._in_flight = metrics.IN_FLIGHT.labels(self.model)
        self._batch_size = metrics.BATCH_SIZE.labels(self.model)
        self._batch_seconds = metrics.BATCH_SECONDS.labels(self.model)
        self._announcer: IdleAnnouncer | None = None
        # One thread of its own for the model's batches: they run one at a time, in order, and never wait behind
        # the loop's default executor (load, warm-up and close use that one).
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.worker_id}-model")
        self._gc_tuned = False

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Check the broker, load and warm up the model, then start taking work. On failure nothing is left running."""
        try:
            await self.broker.ensure_model(self.model)  # a broker misconfiguration surfaces before a slow load
            self._aux_tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"{self.worker_id}-heartbeat"))
            t0 = time.perf_counter()
            await asyncio.to_thread(self.handler.load)
            await asyncio.to_thread(self.handler.warmup)
            log.info("worker %s: %s ready in %.1fs", self.worker_id, self.model, time.perf_counter() - t0)
            YOUNG_GC.acquire(self.max_batch)
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
        self._fetch_task = asyncio.create_task(self._fetch_loop(), name=f"{self.worker_id}-fetch")
        self._compute_task = asyncio.create_task(self._compute_loop(), name=f"{self.worker_id}-compute")
        self._aux_tasks.append(asyncio.create_task(self._keepalive_loop(), name=f"{self.worker_id}-keepalive"))

    async def _subscribe(self) -> Subscription:
        """Pull routing: compete with the model's other workers. Dispatch routing: read our own inbox, and
        announce free slots to the dispatchers that fill it."""
        if self.routing == "pull":
            return await self.broker.subscribe(c.request_subject(self.model), c.consumer_name(self.model))
        sub = await self.broker.subscribe(c.inbox_subject(self.worker_id), c.inbox_group(self.worker_id))
        self._announcer = IdleAnnouncer(
            self.broker,
            model=self.model,
            worker_id=self.worker_id,
            free_slots=lambda: 0 if self._stopping.is_set() else self.max_batch - len(self._held),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
        )
        await self._announcer.start()
        return sub

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain: stop pulling, finish in-flight work within the deadline, hand the rest back. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.state = "draining"
        self._stopping.set()
        deadline_s = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
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
        try:
            await asyncio.to_thread(self.handler.close)  # not behind a batch still running past the deadline
        except Exception:
            log.exception("worker %s: model close failed", self.worker_id)
        self._model_thread.shutdown(wait=False)
        self._aux_stop.set()
        await cancel_and_wait(self._aux_tasks)
        self._release_gc()
        log.info("worker %s stopped after %d items", self.worker_id, self.stats.items)

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
                await self._nak_quietly(job.delivery)
        self._queue.put_nowait(None)  # wakes the compute loop so it sees the stop

    async def _finish_in_flight(self, deadline_s: float) -> None:
        """Wait for the batch computing and the results being written; the compute task may add a settle task."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while pending := [t for t in (self._compute_task, *self._settling) if t is not None and not t.done()]:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("worker %s: drain deadline of %.1fs passed; handing work back", self.worker_id, deadline_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return
            await asyncio.wait(pending, timeout=remaining)

    async def _release_held(self) -> None:
        for delivery in list(self._held.values()):
            await self._nak_quietly(delivery)

    async def _nak_quietly(self, delivery: Delivery) -> None:
        self._forget(delivery)
        try:
            await delivery.nak()
        except Exception:
            log.exception("worker %s: nak failed; the message returns after the ack wait", self.worker_id)

    # -- loops ----------------------------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        assert self._sub is not None
        while not self._stopping.is_set():
            try:
                batch = await collect_batch(self._sub, self.max_batch, self.max_wait_ms / 1000, IDLE_FETCH_TIMEOUT_S)
            except BrokerError as exc:
                log.warning("worker %s: fetch failed (%s); retrying in 1s", self.worker_id, exc)
                await asyncio.sleep(1.0)
                continue
            if not batch:
                continue
            for delivery in batch:
                self._held[id(delivery)] = delivery
            if self._announcer is not None:
                self._announcer.on_assigned(batch)
                count_prior_deliveries(batch)
            self._in_flight.set(len(self._held))
            # Parsing and moving jobs to running overlap the previous batch's compute, and the next fetch.
            admission = asyncio.create_task(self._admit_batch(batch), name=f"{self.worker_id}-admit")
            self._admissions.add(admission)
            admission.add_done_callback(self._admissions.discard)
            # Hand over, then wait until the compute loop takes the batch: at most one batch is taken ahead of
            # the one computing, so a worker never hoards work its peers could be doing. On Kafka no peer could
            # (a partition belongs to one member of the group), so there the next fetch, whose delivery-count
            # commit is a round trip, overlaps the wait instead: one more batch ahead, bounded by the queue.
            self._taken.clear()
            await self._queue.put(admission)
            if not self.broker.partitioned:
                await self._taken.wait()

    async def _admit_batch(self, batch: list[Delivery]) -> list[Job]:
        """Parse and admit a fetched batch; the jobs to compute, already running. Never raises (but cancellation)."""
        try:
            return await self._admit([parse_delivery(d, self.spec) for d in batch])
        except Exception:
            log.exception("worker %s: could not admit a batch; handing it back", self.worker_id)
            await asyncio.gather(*(self._nak_quietly(d) for d in batch))
            return []

    async def _compute_loop(self) -> None:
        while True:
            admission = await self._queue.get()
            self._taken.set()
            if admission is None:
                if self._stopping.is_set():
                    return
                continue
            jobs = await admission
            if not jobs:
                continue
            try:
                await self._run_batch(jobs)
            except Exception:
                log.exception("worker %s: batch failed unexpectedly; handing it back", self.worker_id)
                await asyncio.gather(*(self._nak_quietly(job.delivery) for job in jobs))

    async def _keepalive_loop(self) -> None:
        interval_s = max(0.2, self.settings.ack_wait_s / 3)
        while not self._aux_stop.is_set():
            await asyncio.sleep(interval_s)
            for delivery in list(self._held.values()):
                try:
                    await delivery.in_progress()
                except Exception as exc:
                    log.warning("worker %s: could not extend an ack deadline: %s", self.worker_id, exc)

    async def _heartbeat_loop(self) -> None:
        while not self._aux_stop.is_set():
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
            state=self.state,  # type: ignore[arg-type]
            routing=self.routing,
            in_flight=len(self._held),
            **self.stats.snapshot(),  # type: ignore[arg-type]
        )

    async def _send_heartbeat(self) -> None:
        try:
            await self.broker.emit(c.heartbeat_subject(self.model), self.heartbeat().model_dump_json().encode())
        except Exception as exc:
            log.warning("worker %s: heartbeat not sent: %s", self.worker_id, exc)

    # -- one batch ------------------------------------------------------------------------------------------
    async def _run_batch(self, jobs: list[Job]) -> None:
        """Compute admitted (running) jobs, then hand their results to a settle task and return for the next."""
        t0 = time.perf_counter()
        results = await self._predict(jobs)
        compute_ms = (time.perf_counter() - t0) * 1000
        self.stats.record_batch(len(jobs), compute_ms)
        self._batch_size.observe(len(jobs))
        self._batch_seconds.observe(compute_ms / 1000)
        await self._settle_slots.acquire()
        task = asyncio.create_task(self._settle_all(jobs, results))
        self._settling.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._settling.discard(task)
        self._settle_slots.release()
        self._in_flight.set(len(self._held))

    async def _admit(self, jobs: list[Job]) -> list[Job]:
        """Settle what must not run (invalid, exhausted, already terminal, expired); return the rest, running."""
        runnable: list[Job] = []
        rejected: list[Any] = []
        for job in jobs:
            if job.error is None and not exhausted(job.delivery.delivery_count, self.max_deliveries):
                runnable.append(job)  # the common case, checked without building an error first
                continue
            error = job.error or self._exhausted_error(job)
            assert error is not None
            rejected.append(self._reject(job, error))
        if not rejected:
            return await self._start_all(runnable)
        started, *_ = await asyncio.gather(self._start_all(runnable), *rejected)
        return started  # type: ignore[no-any-return]

    def _exhausted_error(self, job: Job) -> JobError | None:
        count = job.delivery.delivery_count
        if not exhausted(count, self.max_deliveries):
            return None
        return JobError(
            type="max_deliveries",
            message=f"delivered {count} times without completing (max_deliveries={self.max_deliveries}); "
            "a worker probably crashed or timed out on it each time",
        )

    async def _start_all(self, jobs: list[Job]) -> list[Job]:
        """Mark the jobs running in one store call; settle at once those already terminal or past their deadline."""
        if not jobs:
            return []
        items = [Start(job.job_id or "", self.model, self.worker_id, job.delivery.delivery_count) for job in jobs]
        try:
            records = await self.store.start_many(items)
        except StoreError as exc:
            log.warning("worker %s: store unavailable (%s); handing %d messages back", self.worker_id, exc, len(jobs))
            await asyncio.gather(*(self._nak_quietly(job.delivery) for job in jobs))
            return []
        runnable: list[Job] = []
        settled: list[Any] = []
        for job, record in zip(jobs, records, strict=True):
            if record.terminal:
                log.debug("job %s already %s; settling without recomputing", job.job_id, record.state)
                settled.append(self._settle_terminal(job, record))
            elif self._past_deadline(job, record):
                settled.append(self._expire(job))
            else:
                runnable.append(job)
        if settled:
            await asyncio.gather(*settled)
        return runnable

    @staticmethod
    def _past_deadline(job: Job, record: JobRecord) -> bool:
        deadline = (job.request.deadline if job.request else None) or record.expires_at
        return deadline is not None and time.time() > deadline

    async def _expire(self, job: Job) -> None:
        assert job.job_id is not None
        error = JobError(type="expired", message="the job's deadline passed before a worker could start it")
        try:
            await self.store.finish(
                job.job_id, JobState.expired, model=self.model, error=error, worker_id=self.worker_id
            )
        except StoreError as exc:
            log.warning("job %s: store unavailable (%s); handing the message back", job.job_id, exc)
            await self._nak_quietly(job.delivery)
            return
        await self._ack(job, "expired")

    async def _predict(self, jobs: list[Job]) -> list[Any]:
        """Outputs (JSON-ready) or ``JobError`` per job; a failing batch is split until the bad item is alone."""
        inputs = [job.input for job in jobs]
        try:
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(self._model_thread, self.handler.run, inputs)  # checks count, types
        except Exception as exc:
            if len(jobs) == 1:
                return [self._error_from(exc)]
            mid = len(jobs) // 2
            log.info("worker %s: batch of %d raised %r; splitting to isolate it", self.worker_id, len(jobs), exc)
            return await self._predict(jobs[:mid]) + await self._predict(jobs[mid:])
        return [self._to_json(out) for out in outputs]

    def _to_json(self, output: BaseModel | Exception) -> Any:
        if isinstance(output, Exception):
            return self._error_from(output)
        try:
            return output.model_dump(mode="json")
        except (TypeError, ValueError) as exc:  # e.g. a value JSON cannot hold: the job fails, the worker goes on
            return JobError(type="invalid_output", message=f"the model's output does not serialise: {exc}")

    @staticmethod
    def _error_from(exc: BaseException) -> JobError:
        retriable = exc.retriable if isinstance(exc, FleetError) else True
        return JobError(type="model_error", message=f"{type(exc).__name__}: {exc}", retriable=retriable)

    # -- settling -------------------------------------------------------------------------------------------
    async def _settle_all(self, jobs: list[Job], results: list[Any]) -> None:
        """Write every terminal result of a batch in one store call, then ack or dead-letter; retry the rest."""
        final: list[tuple[Job, Any]] = []
        retries: list[Any] = []
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, JobError):  # decide() acks every success: ask it only about failures
                decision = decide(result, job.delivery.delivery_count, self.max_deliveries)
                if decision.action is Action.retry:
                    retries.append(self._retry(job, result, decision.delay_s))
                    continue
            final.append((job, result))
        if retries:
            await asyncio.gather(*retries)
        if not final:
            return
        try:
            stored = await self.store.finish_many([self._outcome(job, result) for job, result in final])
        except StoreError as exc:
            log.warning("worker %s: results not stored (%s); handing %d messages back", self.worker_id, exc, len(final))
            await asyncio.gather(*(self._nak_quietly(job.delivery) for job, _ in final))
            return
        await self._settle_stored([(job, record, won) for (job, _), (won, record) in zip(final, stored, strict=True)])

    async def _settle_stored(self, settled: list[tuple[Job, JobRecord, bool]]) -> None:
        """Settle messages whose jobs ended, maybe elsewhere: ack each (counted ``succeeded`` when this worker's
        write won, else ``duplicate``), but a ``failed`` job (re)sends its dead letter first: its earlier publish may
        not have happened, and the dead letter's message id de-duplicates a repeat. Acks go one after the other (an
        ack does not wait for the broker, so a task per ack would only add overhead), dead letters concurrently
        (each waits for its publish)."""
        letters = []
        won_count = 0
        for job, record, won in settled:
            if record.state is JobState.failed and record.error is not None:
                letters.append(self._send_dead_letter(job, record.error))
                continue
            await self._ack_only(job)
            won_count += won
        acked = len(settled) - len(letters)
        if won_count:
            self._count("succeeded", won_count)
        if acked > won_count:
            self._count("duplicate", acked - won_count)
        if letters:
            await asyncio.gather(*letters)

    async def _settle_terminal(self, job: Job, record: JobRecord, won: bool = False) -> None:
        """``_settle_stored`` for one message."""
        await self._settle_stored([(job, record, won)])

    def _outcome(self, job: Job, result: Any) -> Finish:
        assert job.job_id is not None
        if isinstance(result, JobError):
            return Finish(job.job_id, JobState.failed, self.model, error=result, worker_id=self.worker_id)
        return Finish(job.job_id, JobState.succeeded, self.model, output=result, worker_id=self.worker_id)

    async def _retry(self, job: Job, error: JobError, delay_s: float) -> None:
        log.info(
            "job %s failed (%s), delivery %d; retrying in %.1fs",
            job.job_id,
            error.message,
            job.delivery.delivery_count,
            delay_s,
        )
        self.stats.failures += 1
        self._count("retried")
        self._forget(job.delivery)
        try:
            await job.delivery.nak(delay_s)
        except BrokerError as exc:
            log.warning("job %s: nak not confirmed (%s); it returns after the ack wait", job.job_id, exc)

    async def _reject(self, job: Job, error: JobError) -> None:
        """A message that must not run: store 'failed' (when it has a job id), then dead-letter it."""
        if job.job_id is None:
            await self._send_dead_letter(job, error)
            return
        try:
            won, record = await self.store.finish(
                job.job_id, JobState.failed, model=self.model, error=error, worker_id=self.worker_id
            )
        except StoreError as exc:
            log.warning("job %s: could not store its failure (%s); handing it back", job.job_id, exc)
            await self._nak_quietly(job.delivery)
            return
        await self._settle_terminal(job, record, won)

    async def _send_dead_letter(self, job: Job, error: JobError) -> None:
        """Publish to the dead-letter subject, then settle; the failure is already stored."""
        self.stats.failures += 1
        letter = DeadLetter(
            job_id=job.job_id,
            model=self.model,
            error=error,
            deliveries=job.delivery.delivery_count,
            worker_id=self.worker_id,
            request=job.body if job.request is None else job.request.model_dump(mode="json"),
            raw=None if job.body or job.request else job.delivery.data.decode("utf-8", "replace")[:65536],
        )
        log.warning("job %s dead-lettered: %s", job.job_id, error.message)
        msg_id = f"{job.job_id}.dlq" if job.job_id else None
        headers = {c.HEADER_ERROR: error.type, c.HEADER_MODEL: self.model}
        if job.job_id:
            headers[c.HEADER_JOB_ID] = job.job_id
        try:
            await self.broker.publish(
                c.dlq_subject(self.model), letter.model_dump_json().encode(), msg_id=msg_id, headers=headers
            )
            self._forget(job.delivery)
            await job.delivery.term()
        except BrokerError as exc:
            log.warning("job %s: dead letter not published (%s); handing the message back", job.job_id, exc)
            await self._nak_quietly(job.delivery)
            return
        self._count("dead_lettered")

    async def _ack(self, job: Job, outcome: str) -> None:
        """Settle a message whose result is stored. A lost ack only means a redelivery, acked as a duplicate."""
        await self._ack_only(job)
        self._count(outcome)

    async def _ack_only(self, job: Job) -> None:
        self._forget(job.delivery)
        try:
            await job.delivery.ack()
        except BrokerError as exc:
            log.warning("job %s: ack not confirmed (%s); a redelivery will be acked as a duplicate", job.job_id, exc)

    def _forget(self, delivery: Delivery) -> None:
        if self._held.pop(id(delivery), None) is not None and self._announcer is not None:
            self._announcer.poke()

    def _count(self, outcome: str, amount: int = 1) -> None:
        counter = self._counters.get(outcome)
        if counter is None:
            counter = self._counters[outcome] = metrics.ITEMS.labels(self.model, outcome)
        counter.inc(amount)
