"""The operator feed: one sampler per gateway process, a 15-minute ring of samples, one encoding fanned out.

Once a second (``interval_s``) the feed reads every served model's broker lag, the scaling store (statuses,
decisions, overrides), the dead-letter counts and latest letters, the recent DAG runs, and what ``Beats`` heard
from the workers and dispatchers; it appends one ``Sample`` per model to the ring (``window_s`` long) and encodes
one ``event: snapshot`` whose ``series`` holds only the new samples. That event is kept in a short shared
backlog (``BACKLOG_EVENTS``) under a sequence number; each open stream remembers the last number it sent and takes
what is newer, so 50 streams cost one sampling and one encoding. A stream that falls further behind than the
backlog (a slow client) gets one full snapshot instead of the events it missed: nothing queues per subscriber,
so a slow reader never holds up the others nor grows the gateway's memory.

A source that fails (the store or the broker away) is logged and leaves its part of the sample unknown; the
sampler goes on.

A pool (``FLEET_POOLS``) is one panel, named for the pool, like the autoscaler's target: its models' lags, counts
and workers added up (a pool worker heartbeats once per model; it counts once), and ``ModelPanel.pool`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet.brokers.base import Broker
from fleet.lag import read_lag
from fleet.pools import scaling_targets
from fleet.producers.gateway.operator.beats import Beats
from fleet.producers.gateway.operator.status import shown_status
from fleet.producers.gateway.operator.words import collapse_decisions, scaling_reason, wanted_replicas
from fleet.scaling import ScalingStore
from fleet.schemas.operator import (
    DeadLetterGroup,
    DeadLetterView,
    ModelPanel,
    OperatorSnapshot,
    RunSummary,
    Sample,
)
from fleet.schemas.scaling import DecisionRecord, ScalingOverrides, ScalingStatus
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from fleet.store.dagstore import DagStore, RunDoc
from fleet.store.deadletters import DeadLetterStore, StoredLetter
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

WINDOW_S = 15 * 60.0
BACKLOG_EVENTS = 8  # encoded events kept for streams a little behind; further behind get a full snapshot
RATE_WINDOW_S = 5.0  # rates are measured over this many seconds of samples
LATEST_LETTERS = 10
RECENT_RUNS = 20
WARN_EVERY_S = 30.0


def sse_event(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()


def dead_letter_view(stored: StoredLetter) -> DeadLetterView:
    letter = stored.letter
    return DeadLetterView(
        letter_id=stored.letter_id,
        job_id=letter.job_id,
        model=letter.model,
        error=letter.error,
        deliveries=letter.deliveries,
        worker_id=letter.worker_id,
        at=letter.failed_at,
        redrivable=letter.request is not None,
    )


def run_summary(run_id: str, doc: RunDoc) -> RunSummary:
    run = doc.get("run", {})
    return RunSummary(
        run_id=run_id,
        dag=str(run.get("dag", "")),
        # a run's doc stores only a bad outcome; "succeeded" is derived: no outcome, and finished (dags/state.py)
        state=str(run.get("outcome") or ("succeeded" if doc.get("finished_at") is not None else "running")),
        started_at=float(doc.get("created_at") or 0.0),
        finished_at=doc.get("finished_at"),
    )


def unheard_replicas(status: ScalingStatus, heard: int) -> int:
    """Replicas the autoscaler's backend runs that no heartbeat names yet: started, still loading their model.
    None for a dry run (its replicas exist only on paper) or without an autoscaler."""
    if status.backend in (None, "dry-run") or status.updated_at is None:
        return 0
    return max(0, status.current_replicas - heard)


@dataclass(slots=True)
class _Counts:
    """Cumulative counters of one model at one sample, for the rates."""

    at: float
    completed: int
    failed: int
    dead_letters: int
    lag: int | None


@dataclass(slots=True)
class _Read:
    """What one sampling read from the stores."""

    statuses: dict[str, ScalingStatus] = field(default_factory=dict)
    overrides: dict[str, ScalingOverrides] = field(default_factory=dict)
    lags: dict[str, int | None] = field(default_factory=dict)
    letters: dict[str, DeadLetterGroup] = field(default_factory=dict)
    runs: list[RunSummary] = field(default_factory=list)


class OperatorFeed:
    """The sampler and its fan-out. ``async with`` (or start/stop) runs the sampling loop."""

    def __init__(
        self,
        *,
        settings: FleetSettings,
        models: list[str],
        broker: Broker,
        scaling: ScalingStore,
        beats: Beats,
        dead_letters: DeadLetterStore | None = None,
        dag_store: DagStore | None = None,
        interval_s: float = 1.0,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.models = models
        self.targets = scaling_targets(models, settings.pools)  # panel name -> the models it shows
        self.broker = broker
        self.scaling = scaling
        self.beats = beats
        self.dead_letters = dead_letters
        self.dag_store = dag_store
        self.interval_s = interval_s
        self.clock = clock
        size = max(1, math.ceil(window_s / interval_s))
        self.series: dict[str, deque[Sample]] = {m: deque(maxlen=size) for m in self.targets}
        self.seq = 0
        self.samplings = 0
        self.subscribers = 0  # open streams
        self.latest: OperatorSnapshot = self._empty()
        self._history: dict[str, deque[_Counts]] = {m: deque() for m in self.targets}
        self._backlog: deque[tuple[int, bytes]] = deque(maxlen=BACKLOG_EVENTS)
        self._full: tuple[int, bytes] | None = None
        self._new = asyncio.Event()
        self._stop = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._warned: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> OperatorFeed:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await self.sample()
        self._task = asyncio.create_task(self._run(), name="operator-feed")

    async def stop(self) -> None:
        """Idempotent; wakes every stream so it can see the feed stopped."""
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        self._wake()

    @property
    def stopped(self) -> bool:
        """True once the feed stopped or its streams were closed: every stream then ends."""
        return self._stop.is_set() or self._closing

    def close_streams(self) -> None:
        """End every open stream (sampling goes on): a server shutting down waits for its open responses, and a
        dashboard stream would otherwise never end. Browsers reconnect to the next gateway."""
        self._closing = True
        self._wake()

    async def _run(self) -> None:
        while not self._stop.is_set():
            await wait_event(self._stop, self.interval_s)
            if self._stop.is_set():
                return
            try:
                await self.sample()
            except Exception:
                log.exception("operator feed: sampling failed; trying again in %.1fs", self.interval_s)

    # -- reading for streams --------------------------------------------------------------------------------
    def full_event(self) -> tuple[int, bytes]:
        """The latest snapshot with the whole ring, encoded once per sampling whoever asks."""
        if self._full is None or self._full[0] != self.seq:
            self._full = (self.seq, sse_event("snapshot", self.snapshot().model_dump_json()))
        return self._full

    async def events_after(self, seq: int, timeout_s: float) -> tuple[int, list[bytes]]:
        """The events newer than ``seq`` (waiting up to ``timeout_s`` for one): the backlog's deltas, or one full
        snapshot when the stream fell behind the backlog. ``[]`` on timeout or when the feed stopped."""
        if seq >= self.seq and not self._stop.is_set():
            await wait_event(self._new, timeout_s)
        if seq >= self.seq:
            return seq, []
        oldest = self._backlog[0][0] if self._backlog else self.seq + 1
        if seq + 1 < oldest:
            return self.full_event()[0], [self.full_event()[1]]
        return self.seq, [data for n, data in self._backlog if n > seq]

    def snapshot(self) -> OperatorSnapshot:
        """The latest snapshot, ``series`` holding the whole ring."""
        return self.latest.model_copy(update={"series": {m: list(s) for m, s in self.series.items()}})

    def _wake(self) -> None:
        woken, self._new = self._new, asyncio.Event()
        woken.set()

    # -- sampling -------------------------------------------------------------------------------------------
    async def sample(self) -> OperatorSnapshot:
        """Read every source once, append the samples, publish the delta event."""
        now = self.clock()
        read = await self._read_sources()
        self.beats.forget_silent()
        panels, samples = [], {}
        for model in self.targets:
            panel, sample = self._model(model, now, read)
            panels.append(panel)
            samples[model] = [sample]
            self.series[model].append(sample)
        decisions = {m: collapse_decisions(self._recent_decisions(read.statuses.get(m), now)) for m in self.targets}
        self.latest = OperatorSnapshot(
            at=now,
            models=panels,
            series=samples,
            decisions=decisions,
            workers=self.beats.worker_views(),
            dispatchers=self.beats.dispatcher_views(),
            dead_letters=read.letters,
            runs=read.runs,
        )
        self.seq += 1
        self.samplings += 1
        self._backlog.append((self.seq, sse_event("snapshot", self.latest.model_dump_json())))
        self._wake()
        return self.latest

    def _recent_decisions(self, status: ScalingStatus | None, now: float) -> list[DecisionRecord]:
        if status is None:
            return []
        return [d for d in status.decisions if d.at >= now - WINDOW_S]

    async def _read_sources(self) -> _Read:
        read = _Read()
        statuses = await self._try("scaling statuses", self.scaling.statuses())
        read.statuses = {s.model: s for s in statuses or []}
        for target, models in self.targets.items():
            read.overrides[target] = await self._try("scaling overrides", self.scaling.get_overrides(target)) or (
                ScalingOverrides()
            )
            for model in models:
                read.lags[model] = await self._try("broker lag", read_lag(self.broker, model))
        read.letters = await self._letters()
        if self.dag_store is not None:
            runs = await self._try("recent DAG runs", self.dag_store.recent_runs(RECENT_RUNS)) or []
            read.runs = [run_summary(run_id, doc) for run_id, doc in runs]
        return read

    async def _letters(self) -> dict[str, DeadLetterGroup]:
        if self.dead_letters is None:
            return {}
        counts = await self._try("dead-letter counts", self.dead_letters.counts()) or {}
        out = {}
        for model, count in counts.items():
            latest = await self._try("dead letters", self.dead_letters.latest(model, LATEST_LETTERS)) or []
            out[model] = DeadLetterGroup(count=count, latest=[dead_letter_view(s) for s in latest])
        return out

    async def _try(self, what: str, call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            now = time.monotonic()
            if now - self._warned.get(what, -WARN_EVERY_S) >= WARN_EVERY_S:
                self._warned[what] = now
                log.warning("operator feed: %s not read: %s", what, exc)
            return None

    def _model(self, model: str, now: float, read: _Read) -> tuple[ModelPanel, Sample]:
        members = self.targets[model]
        beats = [hb for m in members for hb in self.beats.of_model(m)]
        counters = [c for c in (self.beats.counters.get(m) for m in members) if c is not None]
        letters = [g for g in (read.letters.get(m) for m in members) if g is not None]
        lags = [read.lags.get(m) for m in members]
        lag = None if any(v is None for v in lags) else sum(v or 0 for v in lags)
        counts = _Counts(
            now,
            sum(c.completed for c in counters),
            sum(c.failed for c in counters),
            sum(g.count for g in letters),
            lag,
        )
        rates = self._rates(model, counts)
        status = shown_status(model, read.statuses.get(model), read.overrides[model], self.settings, 1)
        working = [hb for hb in beats if hb.items > 0]
        heard = _workers(beats, ("starting", "ready", "degraded"))
        warming = _workers(beats, ("starting",))
        unheard = unheard_replicas(status, heard)
        sample = Sample(
            at=now,
            lag=lag,
            arrival_rate=rates.get("arrival"),
            throughput_per_s=round(sum(hb.throughput_per_s for hb in beats), 3) if beats else None,
            latency_p50_ms=round(sum(hb.latency_p50_ms for hb in working) / len(working), 3) if working else None,
            latency_p99_ms=max(hb.latency_p99_ms for hb in working) if working else None,
            error_rate=rates.get("failed"),
            current_replicas=status.current_replicas,
            desired_replicas=status.desired_replicas,
        )
        panel = ModelPanel(
            model=model,
            **sample.model_dump(exclude={"at"}),
            dead_letter_rate=rates.get("dead_letters"),
            dead_letters=counts.dead_letters,
            min_replicas=status.min_replicas,
            max_replicas=status.max_replicas,
            paused=status.paused,
            pinned=status.pinned,
            live_workers=heard,
            ready_workers=_workers(beats, ("ready",)),
            starting_workers=warming + unheard,
            unheard_replicas=unheard,
            wanted_replicas=wanted_replicas(status),
            reason=scaling_reason(status),
            pool=list(members) if model in self.settings.pools else None,
        )
        return panel, sample

    def _rates(self, model: str, now: _Counts) -> dict[str, float]:
        """Per-second rates over the last ``RATE_WINDOW_S`` of samples (none before two samples)."""
        history = self._history[model]
        history.append(now)
        while len(history) > 2 and history[1].at <= now.at - RATE_WINDOW_S:
            history.popleft()
        first = history[0]
        elapsed = now.at - first.at
        if elapsed <= 0:
            return {}
        done = now.completed - first.completed
        rates = {
            "failed": max(0.0, (now.failed - first.failed) / elapsed),
            "dead_letters": max(0.0, (now.dead_letters - first.dead_letters) / elapsed),
        }
        if now.lag is not None and first.lag is not None:
            rates["arrival"] = max(0.0, (done + now.lag - first.lag) / elapsed)
        return {k: round(v, 3) for k, v in rates.items()}

    def _empty(self) -> OperatorSnapshot:
        return OperatorSnapshot(
            at=self.clock(), models=[], series={}, decisions={}, workers=[], dispatchers=[], dead_letters={}, runs=[]
        )


def _workers(beats: list[Heartbeat], states: tuple[str, ...]) -> int:
    """Distinct workers heard in one of ``states`` (a pool worker heartbeats once per model it serves)."""
    return len({hb.worker_id for hb in beats if hb.state in states})
