"""The live dispatcher: direct assignment of a model's requests to worker inboxes.

One dispatcher of ``m`` consumes the model's request subject as a competing consumer (the same group pull-mode
workers use), picks a worker with its policy (``fleet.dispatcher.policies``) and publishes the request to that worker's
inbox. It holds the source message until the job's terminal result is in the store and only then acks it, so:

* a worker that dies (stops heartbeating, or says ``stopped`` with work unfinished) has its assignments given to
  other workers; the store's compare-and-set keeps one terminal result if the first worker finishes after all;
* a dispatcher that dies leaves its source messages unacked, and the broker redelivers them to another
  dispatcher, which assigns them again (a job already finished is acked at once by the worker and here);
* several dispatchers never complete a job twice: completion is the store's, not theirs.

Workers tell the dispatcher they are idle (``IdleAnnouncement`` on ``fleet.ctl.idle.<model>.<id>``) and the
dispatcher tells workers its policy and idle-queue length (``DispatcherBeat`` on ``fleet.ctl.dispatcher.<model>``).

Affinity (``fleet.dispatcher.affinity``): the heartbeats name the model versions each worker has loaded; a request
(its version in the ``fleet-version`` header, else in its body; none: the default version) goes to a worker that
has its version warm, and to a cold one only when no warm worker can take it within ``affinity_wait_s`` (cut to the
job's deadline). The inbox message carries the version header on to the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery, EventStream, Subscription
from fleet.brokers.events import validated
from fleet.brokers.prioritized import subscribe_priorities
from fleet.deadletter import dead_letter_bytes, publish_dead_letter
from fleet.dispatcher import affinity, metrics
from fleet.dispatcher.policies import Choice, Policy, make_policy
from fleet.dispatcher.roster import Roster
from fleet.dispatcher.state import DispatcherState
from fleet.errors import BrokerError, StoreError
from fleet.keepalive import keep_alive
from fleet.priorities import priority_of_subject, rank
from fleet.schemas.jobs import JobError
from fleet.schemas.wire import JOB_ID_PATTERN, VERSION_PATTERN, DispatcherBeat, Heartbeat, IdleAnnouncement
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 1.0
FETCH_MAX = 64
WAIT_SLICE_S = 5.0  # a result wait is renewed this often, so a stop or a store outage is noticed
_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
_VERSION_RE = re.compile(VERSION_PATTERN)


def new_dispatcher_id(model: str) -> str:
    return f"{model}-d-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class Assignment:
    """A request held until its result is stored: the source message(s) and the worker it went to."""

    job_id: str
    data: bytes
    deliveries: list[Delivery]
    worker: str | None = None
    route: str = ""
    assigned_at: float = 0.0
    attempts: int = 0  # deliveries of the source before us + assignments made here
    priority: str = c.DEFAULT_PRIORITY  # the level of the subject it came from: requests waiting here go highest first
    version: str | None = None  # the model version it is for (None: the worker's default)
    deadline: float | None = None  # unix seconds, from the request
    cold: bool = False  # its worker did not have the version loaded when it was assigned
    waiter: asyncio.Task[None] | None = field(default=None, repr=False)

    def inbox_msg_id(self, worker: str) -> str:
        """The message id of its assignment to ``worker``: a repeat to the same worker is de-duplicated, but a
        request published again under a new id (an operator's redrive) is a new assignment."""
        source = next((d.msg_id for d in self.deliveries if d.msg_id), None) or self.job_id
        return f"{source}@{worker}"


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the dispatcher reads from a raw request; the worker validates the rest."""

    job_id: str | None  # None: no usable id (the message is dead-lettered)
    version: str | None = None
    deadline: float | None = None


def request_facts(delivery: Delivery) -> RequestFacts:
    """The job id (the body's ``job_id``, else the header's, else the message id), the model version (the
    ``fleet-version`` header, else the body's ``version``) and the deadline of a raw request. A value of the
    wrong shape is ignored: the worker refuses the request with the parser's reason."""
    body: Any = None
    with contextlib.suppress(Exception):  # whatever the body does to the parser (nesting, numbers), it is data
        body = json.loads(delivery.data)
    if not isinstance(body, dict):
        body = {}
    candidate = body.get("job_id")
    if not isinstance(candidate, str):
        candidate = delivery.headers.get(c.HEADER_JOB_ID) or delivery.msg_id
    job_id = candidate if isinstance(candidate, str) and _JOB_ID_RE.match(candidate) else None
    version = delivery.headers.get(c.HEADER_VERSION) or body.get("version")
    deadline = body.get("deadline")
    return RequestFacts(
        job_id,
        version if isinstance(version, str) and _VERSION_RE.match(version) else None,
        float(deadline) if isinstance(deadline, int | float) and not isinstance(deadline, bool) else None,
    )


def job_id_of(delivery: Delivery) -> str | None:
    """The job id of a raw request: the body's ``job_id``, else the message id; ``None`` when neither is usable."""
    return request_facts(delivery).job_id


class Dispatcher:
    """Assigns ``model``'s requests to workers in ``dispatch`` routing. ``async with`` or start()/stop().

    Args:
        broker, store: connected seam implementations (not closed here).
        settings: policy, d, amnesia window, heartbeat interval, ack wait, max outstanding.
        policy: overrides ``settings.dispatch_policy``.
    """

    def __init__(
        self,
        broker: Broker,
        store: ResultStore,
        *,
        model: str,
        settings: FleetSettings,
        policy: Policy | None = None,
        dispatcher_id: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.broker = broker
        self.store = store
        self.model = model
        self.settings = settings
        self.policy = policy or make_policy(settings.dispatch_policy, settings.dispatch_d)
        self.dispatcher_id = dispatcher_id or new_dispatcher_id(model)
        self.state: DispatcherState[str] = DispatcherState(amnesia_window_s=settings.amnesia_window_s)
        # A load outlives a heartbeat or two: until then the worker counts as loading what it was sent.
        grace_s = max(affinity.DEFAULT_LOAD_GRACE_S, 3 * settings.heartbeat_interval_s)
        self.loaded: affinity.LoadedVersions[str] = affinity.LoadedVersions(load_grace_s=grace_s)
        self.cold_assignments = 0
        self.roster = Roster(stale_after_s=3 * settings.heartbeat_interval_s)
        self.routes: dict[str, int] = {}
        self.completed = 0
        self._rng = rng or random.Random()
        self._held: dict[str, Assignment] = {}
        self._unassigned: dict[str, Assignment] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._workers_changed = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = False
        self._sub: Subscription | None = None
        self._streams: list[EventStream] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._labels = (model, self.dispatcher_id)

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await self.broker.ensure_model(self.model)
        beats = await self.broker.listen(c.heartbeat_subject(self.model))
        idle = await self.broker.listen(c.idle_subject(self.model, self.dispatcher_id))
        self._streams = [beats, idle]
        self._sub = await subscribe_priorities(self.broker, self.model, self.settings.priority_weights)
        name = self.dispatcher_id
        self._tasks = [
            asyncio.create_task(self._read_heartbeats(beats), name=f"{name}-heartbeats"),
            asyncio.create_task(self._read_idle(idle), name=f"{name}-idle"),
            asyncio.create_task(self._beat_loop(), name=f"{name}-beat"),
            asyncio.create_task(self._sweep_loop(), name=f"{name}-sweep"),
            asyncio.create_task(
                keep_alive(self._held_deliveries, self.settings.ack_wait_s, self._stopping, f"dispatcher {name}"),
                name=f"{name}-keepalive",
            ),
            asyncio.create_task(self._intake_loop(), name=f"{name}-intake"),
        ]
        log.info("dispatcher %s: %s with policy %s", name, self.model, self.policy.name)

    async def stop(self) -> None:
        """Stop taking requests; hand held ones back to the broker (another dispatcher takes them). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        await cancel_and_wait(self._tasks, timeout_s=FETCH_TIMEOUT_S + 2)
        waiters = [a.waiter for a in self._held.values() if a.waiter is not None]
        await cancel_and_wait(waiters)
        for assignment in [*self._held.values(), *self._unassigned.values()]:
            for delivery in assignment.deliveries:
                with contextlib.suppress(Exception):
                    await delivery.nak()
        self._held.clear()
        self._unassigned.clear()
        await self._send_beat("stopped")
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.close()
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.close()
        log.info("dispatcher %s stopped after %d results", self.dispatcher_id, self.completed)

    # -- intake ---------------------------------------------------------------------------------------------
    async def _intake_loop(self) -> None:
        assert self._sub is not None
        limit = self.settings.dispatch_max_outstanding
        while not self._stopping.is_set():
            room = limit - len(self._held) - len(self._unassigned)
            if room <= 0:
                self._room.clear()
                await wait_event(self._room, FETCH_TIMEOUT_S)
                continue
            if not len(self.state.live):
                self._workers_changed.clear()  # no worker to give work to: leave it on the broker
                await wait_event(self._workers_changed, FETCH_TIMEOUT_S)
                continue
            try:
                batch = await self._sub.fetch(min(FETCH_MAX, room), FETCH_TIMEOUT_S)
            except BrokerError as exc:
                log.warning("dispatcher %s: fetch failed (%s); retrying in 1s", self.dispatcher_id, exc)
                await asyncio.sleep(1.0)
                continue
            for delivery in batch:
                await self._take(delivery)

    async def _take(self, delivery: Delivery) -> None:
        facts = request_facts(delivery)
        job_id = facts.job_id
        if job_id is None:
            await self._dead_letter(delivery)
            return
        held = self._held.get(job_id) or self._unassigned.get(job_id)
        if held is not None:  # the same job again (a redelivery or a duplicate publish): settle both together
            held.deliveries.append(delivery)
            return
        priority = priority_of_subject(delivery.subject, self.model)
        assignment = Assignment(
            job_id,
            delivery.data,
            [delivery],
            attempts=delivery.delivery_count - 1,
            priority=priority,
            version=facts.version,
            deadline=facts.deadline,
        )
        self._held[job_id] = assignment
        assignment.waiter = asyncio.create_task(self._await_result(assignment), name=f"wait-{job_id}")
        await self._assign(assignment)

    async def _assign(self, assignment: Assignment, route: str | None = None) -> None:
        """Choose a worker and publish to its inbox; with no live worker the request waits here for one."""
        budget_s = affinity.wait_budget_s(self.settings.affinity_wait_s, assignment.deadline, time.time())
        choice: Choice | None = affinity.choose(
            self.policy, self.state, self.loaded, assignment.version, budget_s, time.monotonic(), self._rng
        )
        if choice is None:
            self._unassigned[assignment.job_id] = assignment
            return
        self._unassigned.pop(assignment.job_id, None)
        worker = choice.worker
        headers = {
            c.HEADER_JOB_ID: assignment.job_id,
            c.HEADER_MODEL: self.model,
            c.HEADER_DISPATCHER: self.dispatcher_id,
            c.HEADER_DELIVERIES: str(assignment.attempts),
        }
        if choice.token is not None:
            headers[c.HEADER_TOKEN] = str(choice.token)
        if assignment.version is not None:
            headers[c.HEADER_VERSION] = assignment.version
        if assignment.deliveries:  # the request's trace context goes on to the worker as it came (fleet.tracing)
            carried = assignment.deliveries[0].headers
            for name in (c.HEADER_TRACEPARENT, c.HEADER_TRACESTATE):
                if name in carried:
                    headers[name] = carried[name]
        assignment.attempts += 1
        try:
            await self.broker.publish(
                c.inbox_subject(worker, assignment.priority),
                assignment.data,
                msg_id=assignment.inbox_msg_id(worker),
                headers=headers,
            )
        except BrokerError as exc:
            log.warning("dispatcher %s: assignment of %s failed (%s); retrying", self.dispatcher_id, worker, exc)
            self._unassigned[assignment.job_id] = assignment
            return
        self._record_assignment(assignment, worker, route or choice.route, choice.cold)

    def _record_assignment(self, assignment: Assignment, worker: str, route: str, cold: bool) -> None:
        now = time.monotonic()
        assignment.worker, assignment.route, assignment.assigned_at = worker, route, now
        assignment.cold = cold
        self.state.on_assign(worker, now)
        self.loaded.on_assign(worker, assignment.version, now)
        if cold:
            self.cold_assignments += 1
            metrics.COLD_ASSIGNMENTS.labels(*self._labels).inc()
        self._by_worker.setdefault(worker, set()).add(assignment.job_id)
        self.routes[route] = self.routes.get(route, 0) + 1
        metrics.ASSIGNMENTS.labels(*self._labels, route).inc()
        metrics.WORKER_ASSIGNMENTS.labels(*self._labels, worker).inc()
        self._worker_gauge(worker)

    # -- results --------------------------------------------------------------------------------------------
    async def _await_result(self, assignment: Assignment) -> None:
        while True:
            try:
                record = await self.store.wait(assignment.job_id, WAIT_SLICE_S)
            except StoreError as exc:
                log.warning("dispatcher %s: store unavailable (%s); waiting", self.dispatcher_id, exc)
                await asyncio.sleep(1.0)
                continue
            if record is not None and record.terminal:
                break
        await self._complete(assignment)

    async def _complete(self, assignment: Assignment) -> None:
        now = time.monotonic()
        self._held.pop(assignment.job_id, None)
        self._unassigned.pop(assignment.job_id, None)
        worker = assignment.worker
        if worker is not None:
            self._by_worker.get(worker, set()).discard(assignment.job_id)
            self.state.on_complete(worker, now - assignment.assigned_at, now)
            metrics.LATENCY.labels(*self._labels).observe(now - assignment.assigned_at)
            self._worker_gauge(worker)
        for delivery in assignment.deliveries:
            try:
                await delivery.ack()
            except BrokerError as exc:
                log.warning("job %s: ack not confirmed (%s); a redelivery is acked as done", assignment.job_id, exc)
        self.completed += 1
        metrics.COMPLETED.labels(*self._labels).inc()
        self._room.set()

    async def _dead_letter(self, delivery: Delivery) -> None:
        error = JobError(type="invalid_request", message="message has no usable job id (body job_id or message id)")
        letter = dead_letter_bytes(
            job_id=None,
            model=self.model,
            error=error,
            deliveries=delivery.delivery_count,
            sender=self.dispatcher_id,
            request=None,
            data=delivery.data,
        )
        try:
            await publish_dead_letter(self.broker, self.model, None, error, letter)
            await delivery.term()
        except BrokerError as exc:
            log.warning("dispatcher %s: dead letter not published (%s)", self.dispatcher_id, exc)
            with contextlib.suppress(Exception):
                await delivery.nak(1.0)
            return
        metrics.DEAD_LETTERED.labels(*self._labels).inc()
        log.warning("dispatcher %s: dead-lettered a message without a job id", self.dispatcher_id)

    # -- workers --------------------------------------------------------------------------------------------
    async def _read_heartbeats(self, stream: EventStream) -> None:
        async for beat in validated(stream, Heartbeat, "worker heartbeat"):
            if beat.model != self.model:
                continue
            now = time.monotonic()
            status = self.roster.observe(beat, now)
            if status != "gone":
                self.loaded.report(beat.worker_id, beat.loaded, now)
            if status == "ready" and not self.state.is_live(beat.worker_id):
                self.state.add_worker(beat.worker_id)
                self._workers_changed.set()
                await self._assign_waiting()
            elif status == "draining":
                self.state.remove_worker(beat.worker_id)  # no new work; it finishes what it has
            elif status == "gone" and beat.routing == "dispatch" and beat.worker_id in self.state.views:
                await self._worker_gone(beat.worker_id)

    async def _read_idle(self, stream: EventStream) -> None:
        async for note in validated(stream, IdleAnnouncement, "idle announcement"):
            if note.free_slots <= 0:
                self.state.retract(note.worker_id, note.seq)
            elif self.state.add_token(note.worker_id, note.seq) and self._unassigned:
                await self._assign_waiting()

    async def _worker_gone(self, worker: str) -> None:
        """The worker stopped or fell silent: it gets nothing more, and what it held goes to others."""
        self.state.remove_worker(worker)
        self.roster.forget(worker)
        self.loaded.forget(worker)
        jobs = self._by_worker.pop(worker, set())
        with contextlib.suppress(KeyError):
            metrics.WORKER_OUTSTANDING.remove(*self._labels, worker)
        if jobs:
            log.warning("dispatcher %s: worker %s is gone; reassigning %d jobs", self.dispatcher_id, worker, len(jobs))
        for job_id in jobs:
            assignment = self._held.get(job_id)
            if assignment is not None:
                await self._assign(assignment, route="reassigned")

    async def _assign_waiting(self) -> None:
        """Assign the requests waiting for a worker: higher priorities first, then in arrival order."""
        for assignment in sorted(self._unassigned.values(), key=lambda a: rank(a.priority)):
            if not len(self.state.live):
                return
            await self._assign(assignment)

    async def _sweep_loop(self) -> None:
        interval_s = self.settings.heartbeat_interval_s
        while not self._stopping.is_set():
            await wait_event(self._stopping, interval_s)
            try:
                for worker in self.roster.silent(time.monotonic()):
                    await self._worker_gone(worker)
                await self._assign_waiting()
            except Exception:
                log.exception("dispatcher %s: sweep failed; continuing", self.dispatcher_id)

    # -- housekeeping ---------------------------------------------------------------------------------------
    def _held_deliveries(self) -> list[Delivery]:
        return [delivery for assignment in self._held.values() for delivery in assignment.deliveries]

    async def _beat_loop(self) -> None:
        while not self._stopping.is_set():
            await self._send_beat("ready")
            metrics.IDLE_QUEUE.labels(*self._labels).set(self.state.idle_length)
            metrics.LIVE_WORKERS.labels(*self._labels).set(len(self.state.live))
            metrics.OUTSTANDING.labels(*self._labels).set(len(self._held))
            await wait_event(self._stopping, min(1.0, self.settings.heartbeat_interval_s))

    def beat(self, state: str = "ready") -> DispatcherBeat:
        return DispatcherBeat(
            dispatcher_id=self.dispatcher_id,
            model=self.model,
            policy=self.policy.name,
            announce=self.policy.announce,
            d=self.policy.d,
            idle_length=self.state.idle_length,
            live_workers=len(self.state.live),
            outstanding=len(self._held),
            state=state,  # type: ignore[arg-type]
            route_shares=self._route_shares(),
            worker_outstanding={view.worker: view.outstanding for view in self.state.views.values()},
        )

    def _route_shares(self) -> dict[str, float]:
        total = sum(self.routes.values())
        return {route: round(count / total, 4) for route, count in self.routes.items()} if total else {}

    async def _send_beat(self, state: str) -> None:
        try:
            await self.broker.emit(c.dispatcher_subject(self.model), self.beat(state).model_dump_json().encode())
        except Exception as exc:
            log.warning("dispatcher %s: heartbeat not sent: %s", self.dispatcher_id, exc)

    def _worker_gauge(self, worker: str) -> None:
        view = self.state.views.get(worker)
        if view is not None:
            metrics.WORKER_OUTSTANDING.labels(*self._labels, worker).set(view.outstanding)

    # -- status ---------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What the dashboard reads: the idle queue, the routes taken, and each worker's share and load."""
        total = sum(self.routes.values())
        now = time.monotonic()
        return {
            "dispatcher_id": self.dispatcher_id,
            "model": self.model,
            "policy": self.policy.name,
            "idle_queue_length": self.state.idle_length,
            "live_workers": len(self.state.live),
            "outstanding": len(self._held),
            "unassigned": len(self._unassigned),
            "completed": self.completed,
            "assignments": dict(self.routes),
            "cold_assignments": self.cold_assignments,
            "idle_share": round(self.routes.get("idle", 0) / total, 4) if total else None,
            "workers": [
                {
                    "worker_id": view.worker,
                    "live": self.state.is_live(view.worker),
                    "has_idle_token": self.state.has_token(view.worker),
                    "on_amnesia_list": view.worker in self.state.amnesia
                    and now - view.active_at <= self.state.amnesia_window_s,
                    "outstanding": view.outstanding,
                    "assigned": view.assigned,
                    "completed": view.completed,
                    "latency_ewma_ms": round(view.ewma_s * 1000, 3),
                    "loaded": sorted(self.loaded.versions(view.worker)),
                }
                for view in self.state.views.values()
            ],
        }
