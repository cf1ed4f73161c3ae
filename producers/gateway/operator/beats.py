"""What the operator feed hears on the control events: every worker's heartbeat (``fleet.ctl.heartbeat.<model>``)
and every dispatcher's beat (``fleet.ctl.dispatcher.<model>``).

``Beats`` keeps the latest beat of each worker and dispatcher with the time it arrived, and per model the
cumulative completions and failures summed from the workers' counters (a worker seen for the first time only sets
its baseline, as in ``fleet.autoscaler.signals``). A worker or dispatcher silent for ``SILENT_INTERVALS`` heartbeat
intervals, or one that said ``stopped``, is forgotten. It also answers whether a worker id was heard from, which is
how ``POST /v1/workers/{id}/drain`` knows a worker exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from fleet import constants as c
from fleet.brokers.base import Broker, EventStream
from fleet.brokers.events import Listener, validated
from fleet.readiness import WorkerTracker
from fleet.schemas.operator import DispatcherView, WorkerView
from fleet.schemas.wire import DispatcherBeat, Heartbeat

log = logging.getLogger(__name__)

SILENT_INTERVALS = 3


@dataclass(slots=True)
class Counters:
    completed: int = 0
    failed: int = 0


@dataclass(slots=True)
class Beats:
    """The latest beats; ``observe_worker`` / ``observe_dispatcher`` feed it (``BeatListener`` from the broker)."""

    heartbeat_interval_s: float
    clock: Callable[[], float] = time.monotonic
    workers: dict[str, tuple[Heartbeat, float]] = field(default_factory=dict)
    dispatchers: dict[str, tuple[DispatcherBeat, float]] = field(default_factory=dict)
    counters: dict[str, Counters] = field(default_factory=dict)

    @property
    def silent_s(self) -> float:
        return SILENT_INTERVALS * self.heartbeat_interval_s

    def observe_worker(self, beat: Heartbeat) -> None:
        known = self.workers.get(beat.worker_id)
        if beat.state == "stopped":
            self.workers.pop(beat.worker_id, None)
        else:
            self.workers[beat.worker_id] = (beat, self.clock())
        if known is None or beat.items < known[0].items:  # new, or restarted under the same id: a new baseline
            return
        counts = self.counters.setdefault(beat.model, Counters())
        counts.completed += beat.items - known[0].items
        counts.failed += max(0, beat.failures - known[0].failures)

    def observe_dispatcher(self, beat: DispatcherBeat) -> None:
        if beat.state == "stopped":
            self.dispatchers.pop(beat.dispatcher_id, None)
        else:
            self.dispatchers[beat.dispatcher_id] = (beat, self.clock())

    def forget_silent(self) -> None:
        oldest = self.clock() - self.silent_s
        for worker_id in [w for w, (_, seen) in self.workers.items() if seen < oldest]:
            del self.workers[worker_id]
        for dispatcher_id in [d for d, (_, seen) in self.dispatchers.items() if seen < oldest]:
            del self.dispatchers[dispatcher_id]

    def knows_worker(self, worker_id: str) -> bool:
        self.forget_silent()
        return worker_id in self.workers

    def worker_views(self) -> list[WorkerView]:
        now = self.clock()
        return [
            WorkerView(
                worker_id=hb.worker_id,
                model=hb.model,
                device=hb.device,
                state=hb.state,
                routing=hb.routing,
                in_flight=hb.in_flight,
                mean_batch_size=hb.mean_batch_size,
                items=hb.items,
                latency_ewma_ms=hb.latency_ewma_ms if hb.items else None,  # idle since start: no latency, not 0 ms
                latency_p99_ms=hb.latency_p99_ms if hb.items else None,
                heartbeat_age_s=round(now - seen, 3),
                loaded=hb.loaded,
                replicas=hb.replicas,
                breaker=hb.breaker,
                gpus=hb.gpus,
                model_memory_bytes=hb.model_memory_bytes,
            )
            for hb, seen in sorted(self.workers.values(), key=lambda item: (item[0].model, item[0].worker_id))
        ]

    def dispatcher_views(self) -> list[DispatcherView]:
        now = self.clock()
        return [
            DispatcherView(
                dispatcher_id=beat.dispatcher_id,
                model=beat.model,
                policy=beat.policy,
                idle_queue_length=beat.idle_length,
                idle_share=beat.route_shares.get("idle", 0.0) if beat.route_shares else None,
                amnesia_share=beat.route_shares.get("amnesia", 0.0) if beat.route_shares else None,
                fallback_share=beat.route_shares.get("fallback", 0.0) if beat.route_shares else None,
                outstanding=beat.worker_outstanding,
                outstanding_total=beat.outstanding,
                heartbeat_age_s=round(now - seen, 3),
            )
            for beat, seen in sorted(self.dispatchers.values(), key=lambda item: item[0].dispatcher_id)
        ]

    def of_model(self, model: str) -> list[Heartbeat]:
        return [hb for hb, _ in self.workers.values() if hb.model == model]


class BeatListener:
    """Feeds ``beats``: worker heartbeats through ``heartbeats`` (the gateway's readiness tracker, so the process
    subscribes to them once) and dispatcher beats from the broker. ``async with`` starts and stops both."""

    def __init__(self, broker: Broker, beats: Beats, heartbeats: WorkerTracker) -> None:
        self.beats = beats
        self.heartbeats = heartbeats
        self._dispatchers = Listener(broker, c.dispatcher_subject("*"), self._read_dispatchers, "operator-beats")
        self._unobserve: Callable[[], None] | None = None

    async def __aenter__(self) -> BeatListener:
        await self._dispatchers.start()
        self._unobserve = self.heartbeats.add_observer(self._worker_beat)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None
        await self._dispatchers.stop()

    def _worker_beat(self, data: bytes) -> None:
        try:
            beat = Heartbeat.model_validate_json(data)
        except ValidationError as exc:
            log.warning("ignoring a malformed worker heartbeat: %s", exc)
            return
        self.beats.observe_worker(beat)

    async def _read_dispatchers(self, events: EventStream) -> None:
        async for beat in validated(events, DispatcherBeat, "dispatcher beat"):
            self.beats.observe_dispatcher(beat)
