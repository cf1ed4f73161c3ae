"""Which workers of each model can serve now, from their heartbeats on ``fleet.ctl.heartbeat.<model>``.

A worker counts as *ready* while its latest heartbeat says ``ready`` and is fresh: sent within ``FRESH_INTERVALS``
heartbeat intervals. Every other state (``starting``, ``draining``, ``stopped``, or one this version does not know,
such as a future ``degraded``) is not ready. Heartbeats are read leniently (only ``worker_id``, ``model`` and
``state``), so a newer worker's states never make an older gateway drop its beats.

``ReadyWorkers`` is the bookkeeping (pure, with an injectable clock); ``WorkerTracker`` feeds it from the broker.
The gateway's ``/readyz`` reports ``ReadyWorkers.counts``, and ``fleet up`` waits on ``WorkerTracker.wait_ready``
before it says it is ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Gauge

from fleet import constants as c
from fleet.brokers.base import Broker, EventStream
from fleet.brokers.events import Listener
from fleet.tasks import wait_event

log = logging.getLogger(__name__)

FRESH_INTERVALS = 3  # a heartbeat older than this many intervals no longer vouches for its worker
READY = "ready"

READY_WORKERS = Gauge(
    "fleet_ready_workers",
    "Workers of a model whose fresh heartbeat says ready, as this process hears them (read at each scrape)",
    ["model"],
)


@dataclass(frozen=True, slots=True)
class Beat:
    worker_id: str
    model: str
    state: str


def parse_beat(data: bytes) -> Beat | None:
    """The fields readiness needs from a heartbeat, or None for a body that is not one."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    fields = (body.get("worker_id"), body.get("model"), body.get("state"))
    if not all(isinstance(f, str) and f for f in fields):
        return None
    return Beat(*fields)  # type: ignore[arg-type]


class ReadyWorkers:
    """The latest state and time of each worker's heartbeat, per model."""

    def __init__(self, heartbeat_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_s = FRESH_INTERVALS * heartbeat_interval_s
        self.clock = clock
        self._workers: dict[str, dict[str, tuple[str, float]]] = {}  # model -> worker id -> (state, seen at)

    def observe(self, beat: Beat) -> None:
        workers = self._workers.setdefault(beat.model, {})
        if beat.state == "stopped":
            workers.pop(beat.worker_id, None)
        else:
            workers[beat.worker_id] = (beat.state, self.clock())
        self._forget_stale(workers)

    def count(self, model: str) -> int:
        """Workers of ``model`` whose fresh heartbeat says ``ready``."""
        workers = self._workers.get(model, {})
        self._forget_stale(workers)
        return sum(state == READY for state, _ in workers.values())

    def fresh_count(self, model: str) -> int:
        """``count`` without forgetting anything: safe from another thread (a metrics scrape)."""
        oldest = self.clock() - self.fresh_s
        states = list(self._workers.get(model, {}).values())
        return sum(state == READY and seen >= oldest for state, seen in states)

    def counts(self, models: Iterable[str]) -> dict[str, int]:
        return {model: self.count(model) for model in models}

    def all_ready(self, models: Iterable[str]) -> bool:
        """Whether every model in ``models`` has at least one ready worker."""
        return all(self.count(model) > 0 for model in models)

    def _forget_stale(self, workers: dict[str, tuple[str, float]]) -> None:
        oldest = self.clock() - self.fresh_s
        for worker_id in [w for w, (_, seen) in workers.items() if seen < oldest]:
            del workers[worker_id]


class WorkerTracker:
    """Listens to every model's heartbeats and keeps ``ready`` (a ``ReadyWorkers``) up to date.

    ``async with WorkerTracker(broker, heartbeat_interval_s)`` starts and stops the listener; the broker must be
    connected and stays open. Other readers of the heartbeats in the same process (the gateway's operator feed)
    register with ``add_observer`` instead of subscribing a second time.
    """

    def __init__(
        self, broker: Broker, heartbeat_interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.broker = broker
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ready = ReadyWorkers(heartbeat_interval_s, clock)
        self._changed = asyncio.Event()
        self._observers: list[Callable[[bytes], None]] = []
        self._exported: set[str] = set()
        self._listener = Listener(broker, c.heartbeat_subject("*"), self._listen, "readiness-heartbeats")

    async def __aenter__(self) -> WorkerTracker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await self._listener.start()

    async def stop(self) -> None:
        """Idempotent."""
        await self._listener.stop()

    def add_observer(self, observer: Callable[[bytes], None]) -> Callable[[], None]:
        """Hand each heartbeat's body to ``observer`` as well; returns the function that removes it again.

        An observer that raises is logged and keeps getting the next heartbeats.
        """
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    async def wait_ready(self, models: Iterable[str], stop: asyncio.Event | None = None) -> bool:
        """Wait until every model in ``models`` has a ready worker (True), or until ``stop`` is set (False)."""
        names = list(models)
        stop = stop or asyncio.Event()
        while not self.ready.all_ready(names):
            if stop.is_set():
                return False
            self._changed.clear()
            await wait_event(self._changed, min(1.0, self.heartbeat_interval_s))
        return True

    async def _listen(self, events: EventStream) -> None:
        async for _subject, data in events:
            self._tell_observers(data)
            beat = parse_beat(data)
            if beat is None:
                log.warning("ignoring a malformed worker heartbeat: %r", data[:200])
                continue
            self.ready.observe(beat)
            self._export(beat.model)
            self._changed.set()

    def _export(self, model: str) -> None:
        """``fleet_ready_workers{model}`` follows this tracker from the first heartbeat of ``model`` on."""
        if model not in self._exported:
            self._exported.add(model)
            READY_WORKERS.labels(model).set_function(lambda: self.ready.fresh_count(model))

    def _tell_observers(self, data: bytes) -> None:
        for observer in list(self._observers):
            try:
                observer(data)
            except Exception:
                log.exception("a heartbeat observer failed; it keeps getting the next heartbeats")
