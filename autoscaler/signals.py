"""What the autoscaler measures per model: lag, arrival and completion rates, per-worker throughput, live workers.

* **Lag** is read through the broker seam (``Broker.lag`` of the model's request subject and consumer group:
  JetStream ``num_pending + num_ack_pending``, Kafka end minus committed offsets).
* **Completions** come from the worker heartbeats on ``fleet.ctl.heartbeat.<model>``: each heartbeat carries the
  worker's cumulative ``items`` counter, and the increase since its previous heartbeat is added to the model's
  completion count (a worker seen for the first time only sets its baseline, so an autoscaler that starts late does
  not count the past).
* **Arrival rate** over the last ``rate_window_s``: ``(completions + lag_now - lag_then) / window``. Whatever
  arrived either was completed or is still in the lag. It is never negative and is exactly 0 on an idle model.
* **Throughput per replica** is what one *busy* worker finishes per second: a worker that held messages at two
  successive heartbeats (saturated) gives its observed rate; otherwise its items per second of compute time
  (``items / (batches * latency_ewma_ms)``). An idle fleet keeps its last estimate: capacity does not vanish
  when there is nothing to do. The estimate is an exponentially weighted mean over workers and time.
* **Live workers** are those starting or ready whose last heartbeat is recent; a worker silent for
  ``SILENT_INTERVALS`` heartbeat intervals, or one that announced ``stopped``, is dropped.
* **Queue age** is the age of the oldest request a model's group has not finished, over its priority levels,
  read through the broker seam (``Broker.oldest_waiting_age_s``: JetStream the first message after the consumer's
  ack floor, by its stream timestamp; Kafka the record at the committed offset of each partition with a backlog, by
  its timestamp; in memory the oldest unacked entry). From the broker rather than the job records: the broker holds
  exactly the requests not finished, including those raw producers published without a record, in one or two
  requests per level, where the records would need an index by age. A failed read keeps the previous age.
* **Partitions** (Kafka) are passed in by the composition root (the count Fleet creates request topics with): the
  broker seam has no call that reports a topic's partition count.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet import constants as c
from fleet.autoscaler.policy import Signals
from fleet.brokers.base import Broker, EventStream
from fleet.brokers.events import Listener, validated
from fleet.lag import read_lag, read_queue_age
from fleet.schemas.wire import Heartbeat

log = logging.getLogger(__name__)

SILENT_INTERVALS = 3  # heartbeat intervals without news before a worker counts as gone
THROUGHPUT_ALPHA = 0.3  # weight of a new per-worker throughput sample in the model's estimate
LIVE_STATES = ("starting", "ready", "degraded")


@dataclass(slots=True)
class _Worker:
    last: Heartbeat
    seen_s: float


@dataclass(slots=True)
class _Model:
    workers: dict[str, _Worker] = field(default_factory=dict)
    completed: int = 0  # items finished since this reader started, summed over workers
    throughput: float | None = None
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)  # (at_s, completed, lag) per read
    lag_at_s: float | None = None
    lag: int | None = None
    queue_age_s: float | None = None


def _sample_throughput(prev: Heartbeat, hb: Heartbeat) -> float | None:
    """Jobs/s one busy worker finishes, from two of its heartbeats; None when it did nothing in between."""
    items, batches = hb.items - prev.items, hb.batches - prev.batches
    elapsed_s = hb.sent_at - prev.sent_at
    if items <= 0 or batches <= 0 or elapsed_s <= 0:
        return None
    if prev.in_flight > 0 and hb.in_flight > 0:  # saturated all along: the observed rate is its capacity
        return items / elapsed_s
    if hb.latency_ewma_ms > 0:
        return items / (batches * hb.latency_ewma_ms / 1000)
    return None


class SignalReader:
    """Follows the heartbeats of every model and reads ``Signals`` for one model on demand.

    Args:
        broker: a connected broker (lag and heartbeats).
        heartbeat_interval_s: the workers' heartbeat interval; a worker silent for three of them is gone.
        rate_window_s: window of the arrival and completion rates (default: three heartbeat intervals, at least 5s).
        partitions: the request topics' partition count on Kafka (caps the replicas); None elsewhere.
        clock: monotonic seconds (tests pass their own).

    ``async with`` starts and stops the heartbeat listener. ``observe`` feeds one heartbeat directly.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        heartbeat_interval_s: float = c.DEFAULT_HEARTBEAT_INTERVAL_S,
        rate_window_s: float | None = None,
        partitions: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.heartbeat_interval_s = heartbeat_interval_s
        self.rate_window_s = rate_window_s or max(3 * heartbeat_interval_s, 5.0)
        self.partitions = partitions
        self.clock = clock
        self._models: dict[str, _Model] = {}
        self._listener = Listener(broker, c.heartbeat_subject("*"), self._listen, "autoscaler-heartbeats")
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> SignalReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Listen to the heartbeats of every model (``fleet.ctl.heartbeat.*``)."""
        self._stopping = False
        await self._listener.start()

    async def stop(self) -> None:
        """Idempotent."""
        self._stopping = True
        await self._listener.stop()

    async def _listen(self, events: EventStream) -> None:
        async for heartbeat in validated(events, Heartbeat, "worker heartbeat"):
            if self._stopping:
                return
            self.observe(heartbeat)

    # -- heartbeats -----------------------------------------------------------------------------------------
    def observe(self, heartbeat: Heartbeat, at_s: float | None = None) -> None:
        """Account for one heartbeat received at ``at_s`` (default: now)."""
        now_s = self.clock() if at_s is None else at_s
        state = self._models.setdefault(heartbeat.model, _Model())
        known = state.workers.get(heartbeat.worker_id)
        if heartbeat.state == "stopped":
            state.workers.pop(heartbeat.worker_id, None)
        else:
            state.workers[heartbeat.worker_id] = _Worker(heartbeat, now_s)
        if known is None or heartbeat.items < known.last.items:  # new worker, or one restarted under the same id
            return
        state.completed += heartbeat.items - known.last.items
        sample = _sample_throughput(known.last, heartbeat)
        if sample is not None:
            prior = state.throughput
            state.throughput = sample if prior is None else THROUGHPUT_ALPHA * sample + (1 - THROUGHPUT_ALPHA) * prior
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: worker %s finishes %.2f/s", heartbeat.model, heartbeat.worker_id, sample)

    def _prune(self, state: _Model, now_s: float) -> None:
        silent_s = SILENT_INTERVALS * self.heartbeat_interval_s
        for worker_id in [w for w, seen in state.workers.items() if now_s - seen.seen_s > silent_s]:
            log.info("worker %s has been silent for over %.1fs; counting it as gone", worker_id, silent_s)
            del state.workers[worker_id]

    def live_workers(self, model: str) -> int:
        """Workers of ``model`` starting or serving with a recent heartbeat."""
        state = self._models.get(model)
        if state is None:
            return 0
        self._prune(state, self.clock())
        return sum(1 for w in state.workers.values() if w.last.state in LIVE_STATES)

    def live_workers_of(self, models: list[str]) -> int:
        """Distinct workers starting or serving any of ``models`` (a pool's worker heartbeats for each model)."""
        now_s = self.clock()
        ids: set[str] = set()
        for model in models:
            state = self._models.get(model)
            if state is not None:
                self._prune(state, now_s)
                ids.update(w for w, seen in state.workers.items() if seen.last.state in LIVE_STATES)
        return len(ids)

    def throughput_per_replica(self, model: str) -> float | None:
        state = self._models.get(model)
        return None if state is None else state.throughput

    # -- lag and rates --------------------------------------------------------------------------------------
    async def read(self, model: str, current_replicas: int) -> Signals:
        """Read the lag now and derive the rates. A failed lag read keeps the previous lag and its time, so the
        policy sees the signals go stale rather than a made-up number; before any read the lag is unknown."""
        state = self._models.setdefault(model, _Model())
        try:
            lag = await read_lag(self.broker, model)  # every priority level's backlog
        except Exception as exc:
            log.warning("lag of %s not read: %s", model, exc)
        else:
            state.lag, state.lag_at_s = lag, self.clock()
            self._add_sample(state, state.lag_at_s, lag)
        try:
            state.queue_age_s = await read_queue_age(self.broker, model)
        except Exception as exc:
            log.warning("queue age of %s not read: %s", model, exc)
        return Signals(
            at_s=state.lag_at_s if state.lag_at_s is not None else self.clock(),
            lag=state.lag,
            arrival_rate=self.arrival_rate(model),
            throughput_per_replica=state.throughput,
            current_replicas=current_replicas,
            partitions=self.partitions,
            queue_age_s=state.queue_age_s,
        )

    def _add_sample(self, state: _Model, at_s: float, lag: int) -> None:
        state.samples.append((at_s, state.completed, lag))
        # Keep one sample at or before the window's start, so the rates always span the full window.
        while len(state.samples) > 2 and state.samples[1][0] <= at_s - self.rate_window_s:
            state.samples.popleft()

    def _window(self, model: str) -> tuple[float, int, int] | None:
        """(seconds, completions, lag change) between the oldest kept read and the newest; None before two reads."""
        state = self._models.get(model)
        if state is None or len(state.samples) < 2:
            return None
        (t0, done0, lag0), (t1, done1, lag1) = state.samples[0], state.samples[-1]
        if t1 <= t0:
            return None
        return t1 - t0, done1 - done0, lag1 - lag0

    def arrival_rate(self, model: str) -> float | None:
        """Jobs/s arriving over the rate window: completions plus the lag's growth; never negative."""
        window = self._window(model)
        if window is None:
            return None
        elapsed_s, done, lag_change = window
        return max(0.0, (done + lag_change) / elapsed_s)

    def completion_rate_of(self, models: list[str]) -> float | None:
        """Jobs/s finished of all ``models`` (a pool); None while none has a rate."""
        rates = [r for r in (self.completion_rate(m) for m in models) if r is not None]
        return sum(rates) if rates else None

    def completion_rate(self, model: str) -> float | None:
        """Jobs/s finished by all workers of ``model`` over the rate window."""
        window = self._window(model)
        return None if window is None else max(0.0, window[1] / window[0])
