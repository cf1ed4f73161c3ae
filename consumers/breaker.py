"""A worker's circuit breaker: the pure ``fleet.lifecycle.breaker`` with a clock, a metric and a log line.

A worker whose batches keep failing with model errors (a broken GPU, a model that lost its weights, a dependency
gone) should stop taking its model's work, so that the model's healthy workers take it. Every run of a batch is one
outcome (``outcome_of``): a **failure** when the model raised for it or answered every job with a model error
(nothing computed), a **success** when at least one job got an output; a run whose jobs were all refused as
invalid input says nothing about the worker and is a success. ``record`` feeds the pure breaker; the breaker opens
on its consecutive failures or its error rate over a window (``BreakerConfig``).

What the worker does with it (``fleet.consumers.worker``):

1. **closed**: fetches and computes as always.
2. **open**: fetches nothing (pull) and announces no free slot (dispatch). A batch taken before it opened is
   handed back unstarted (its record never moves: nothing counts against its jobs). A batch that was computing
   when it opened, and the run that opened it, hand back the jobs that failed with a model error instead of
   retrying or failing them: the run is marked as a draining worker's (``crashes.DRAINING``), so a healthy job is
   never charged for a sick worker. A poison job is still bounded: on healthy workers its failures count as
   always, and every run it starts counts toward the last resort (``crashes.RAW_RUNS_FACTOR``).
3. After the cool-down, **half-open**: ``fetch_limit`` lets one probe batch of ``PROBE_BATCH`` item(s) through;
   its outcome closes the breaker (a success) or opens it again with a longer cool-down (a failure).

Each transition is logged at WARNING (opened) or INFO (half-open, closed) with the pure breaker's reason, sets the
gauge ``fleet_worker_breaker_state`` (0 closed, 1 half-open, 2 open) and counts in
``fleet_worker_breaker_transitions_total``; heartbeats carry ``status`` as ``Heartbeat.breaker``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from fleet.consumers import metrics
from fleet.lifecycle.breaker import BreakerConfig, BreakerState, Outcome, Status, allow, record, retry_after_s
from fleet.schemas.jobs import JobError

log = logging.getLogger(__name__)

PROBE_BATCH = 1  # items in a half-open probe: one small batch says whether the model computes again
STATE_VALUES: dict[Status, int] = {"closed": 0, "half_open": 1, "open": 2}


def outcome_of(results: Sequence[Any]) -> Outcome:
    """A run's outcome for the breaker: failure when no job got an output and at least one failed with a model
    error (``JobError`` of type ``model_error``); anything else (an output, or only refused inputs) is a success."""
    errors = [r for r in results if isinstance(r, JobError)]
    if len(errors) < len(results):
        return "success"
    return "failure" if any(e.type == "model_error" for e in errors) else "success"


class WorkerBreaker:
    """One worker's breaker for its model. ``config`` None: a breaker that never opens (the default)."""

    def __init__(
        self,
        config: BreakerConfig | None,
        *,
        model: str,
        worker_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model = model
        self.worker_id = worker_id
        self._clock = clock
        self.state = BreakerState()
        self._gauge = metrics.BREAKER_STATE.labels(model, worker_id)
        self._gauge.set(0)

    @property
    def status(self) -> Status:
        return self.state.status

    @property
    def closed(self) -> bool:
        return self.state.status == "closed"

    def fetch_limit(self) -> int | None:
        """How many items the worker may take now: None (any: closed), 0 (none: open, or a probe in flight) or
        ``PROBE_BATCH`` (half-open: the next batch is the probe). Changes nothing; ``take_probe`` takes the place."""
        if self.config is None or self.closed:
            return None
        allowed, _ = allow(self.state, self.config, self._clock())
        return PROBE_BATCH if allowed else 0

    def take_probe(self) -> bool:
        """Take the half-open probe's place for a batch about to run; False when it is not the breaker's to give."""
        if self.config is None or self.closed:
            return False
        allowed, state = allow(self.state, self.config, self._clock())
        self._move(state)
        return allowed

    def cancel_probe(self) -> None:
        """The probe's batch had nothing to run (its jobs ended elsewhere): free its place for the next batch."""
        if self.state.status == "half_open":
            self.state = replace(self.state, probes=())

    def close(self) -> None:
        """The worker stopped: its gauge goes away."""
        with contextlib.suppress(KeyError):
            metrics.BREAKER_STATE.remove(self.model, self.worker_id)

    def wait_s(self) -> float:
        """Seconds until ``fetch_limit`` may change by itself (the cool-down's end, or a lost probe's timeout)."""
        if self.config is None or self.closed:
            return 0.0
        return retry_after_s(self.state, self.config, self._clock())

    def record(self, outcome: Outcome) -> None:
        """A run's outcome (``outcome_of``)."""
        if self.config is None:
            return
        self._move(record(self.state, self.config, outcome, self._clock()))

    def _move(self, state: BreakerState) -> None:
        before, self.state = self.state.status, state
        if state.status == before:
            return
        self._gauge.set(STATE_VALUES[state.status])
        metrics.BREAKER_TRANSITIONS.labels(self.model, state.status).inc()
        level = logging.WARNING if state.status == "open" else logging.INFO
        log.log(
            level,
            "worker %s: breaker of %s %s -> %s (%s)",
            self.worker_id,
            self.model,
            before,
            state.status,
            state.reason,
        )
