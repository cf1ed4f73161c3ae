"""Micro-batches sized from a P99 target: the pure controller, and the window that feeds it.

A model that declares ``p99_target_ms`` (``ModelSpec``, or ``FLEET_P99_TARGET_MS=embed=50``) gets its two batch
knobs, ``max_batch`` and ``max_wait_ms``, set by ``control`` instead of fixed: every window of batches the worker
measures an ``Observation`` and calls ``control(observation, state, limits) -> (knobs, state)``. The knobs never
leave the model's limits (``min_batch..max_batch``, ``0..max_wait_ms``). The latency it steers is an item's
latency as the worker sees it when its batch has computed: queue wait (since the request was submitted) plus
compute. The rules, in order:

1. **No evidence, no change**: a window without batches keeps the knobs.
2. **Over the high-water mark** (p99 > ``high_water`` x target): when the device has slack, the wait goes to 0
   first (the cheapest latency to give back; on a busy device the wait is spent while the batch before still
   computes, so it costs nothing and fills the next batch). Then: when batches close full, work is queueing at
   the device's capacity, and the batch grows, because a smaller one would drain the queue slower (with a
   per-batch overhead, bigger batches are cheaper per item) and the latency would only grow. When batches are
   not full and compute is what fills the target (an item waits for the batch in flight, then computes in its
   own: about twice the compute time, so more than ``compute_share`` of the target), and the device has slack
   (busy less than ``slack_busy`` of the time), the batch shrinks by ``shrink_factor``, but never below
   ``shrink_margin`` x the mean batch: a cap below what arrives would only make batches full and the queue grow.
3. **Under the low-water mark** (p99 < ``low_water`` x target) with full batches (work queueing): the batch grows
   by ``grow_factor`` while the grown batch's predicted compute stays within ``compute_share`` of the target.
4. **The wait**: 0 when no second message is coming (batches of about one item, never full): a lone request
   must not sit out ``max_wait_ms`` at low load; 0 too while the device computes less than ``idle_busy`` of the
   time, because then a wait is pure latency. On a busy device (at least ``slack_busy`` of the time) with
   company, the wait follows the batch compute time (capped by the limit): the worker collects the next batch
   while the device computes the one before, so waiting that long costs nothing and fills the next batch. Each
   time rule 2 took a wait back, the wait may rise again only to half of it (until the load is gone: lone
   requests), so it does not push p99 over the high-water mark and back forever.

Hysteresis: nothing moves between the two marks (of p99, and of busy time for the wait); a batch change needs
its condition in ``patience`` consecutive windows (a shrink only one: an overshoot is worse than a missed gain),
and the wait moves only by more than ``wait_deadband_ms`` or a quarter of itself, so noise does not make the
knobs oscillate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from fleet.consumers.stats import percentile

Direction = Literal["grow", "shrink", ""]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The model's bounds and the controller's tuning. ``max_batch`` and ``max_wait_ms`` are ceilings."""

    p99_target_ms: float
    max_batch: int
    max_wait_ms: float
    min_batch: int = 1
    low_water: float = 0.6
    high_water: float = 0.9
    compute_share: float = 0.45
    grow_factor: float = 1.25
    shrink_factor: float = 0.7
    shrink_margin: float = 1.25
    slack_busy: float = 0.8
    idle_busy: float = 0.6
    patience: int = 2
    wait_deadband_ms: float = 0.5

    def __post_init__(self) -> None:
        if not self.p99_target_ms > 0:
            raise ValueError(f"p99_target_ms must be > 0, got {self.p99_target_ms}")
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"batch limits must satisfy 1 <= min_batch ({self.min_batch}) <= max_batch ({self.max_batch})"
            )
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if not 0 < self.low_water < self.high_water:
            raise ValueError(f"need 0 < low_water ({self.low_water}) < high_water ({self.high_water})")

    def clamp(self, knobs: Knobs) -> Knobs:
        batch = min(self.max_batch, max(self.min_batch, knobs.max_batch))
        return Knobs(batch, min(self.max_wait_ms, max(0.0, knobs.max_wait_ms)))


@dataclass(frozen=True, slots=True)
class Knobs:
    """What the batcher uses for the next batches."""

    max_batch: int
    max_wait_ms: float


@dataclass(frozen=True, slots=True)
class Observation:
    """One window of batches: how many, how full, and the latencies they gave.

    ``full_share``: the share of batches that closed on their count or cost budget (more work was waiting).
    ``p99_ms``: p99 of item latency (queue wait + compute); ``compute_*``: of batch compute times;
    ``busy_share``: the share of the window's time the device computed.
    """

    batches: int
    mean_batch: float
    full_share: float
    p99_ms: float
    compute_p99_ms: float
    compute_mean_ms: float
    busy_share: float = 1.0


@dataclass(frozen=True, slots=True)
class ControlState:
    """The knobs in force and the hysteresis memory: the direction proposed in the last windows and how often."""

    knobs: Knobs
    pending: Direction = ""
    streak: int = 0
    reason: str = "start"
    wait_cap_ms: float | None = None  # the wait may not rise above this again (halved each time rule 2 fired)


def initial_state(limits: BatchLimits) -> ControlState:
    """Start from the largest batch and no wait: the first requests are answered at once, and the wait grows
    only once the device is busy (rule 4)."""
    return ControlState(Knobs(limits.max_batch, 0.0))


def control(obs: Observation, state: ControlState, limits: BatchLimits) -> tuple[Knobs, ControlState]:
    """The knobs for the next window, and the state to pass to the next call. Pure."""
    knobs = limits.clamp(state.knobs)
    if obs.batches == 0:
        return knobs, replace(state, knobs=knobs, reason="no batches")
    target = limits.p99_target_ms
    if obs.p99_ms > limits.high_water * target and knobs.max_wait_ms > 0 and obs.busy_share < limits.slack_busy:
        new = Knobs(knobs.max_batch, 0.0)
        return new, ControlState(new, reason="over high water: wait to 0", wait_cap_ms=knobs.max_wait_ms / 2)
    cap = None if obs.mean_batch < 1.5 and obs.full_share == 0 else state.wait_cap_ms  # load gone: forget it
    limits = replace(limits, max_wait_ms=min(limits.max_wait_ms, cap)) if cap is not None else limits
    direction = _direction(obs, knobs, limits)
    streak = state.streak + 1 if direction and direction == state.pending else int(bool(direction))
    needed = 1 if direction == "shrink" else limits.patience
    if direction and streak >= needed:
        batch = _resized(knobs.max_batch, direction, limits)
        if direction == "shrink":
            batch = max(batch, min(knobs.max_batch, math.ceil(obs.mean_batch * limits.shrink_margin)))
        if batch != knobs.max_batch:
            new = Knobs(batch, _wait(obs, knobs, limits))
            return new, ControlState(new, reason=f"{direction} {knobs.max_batch} -> {batch}", wait_cap_ms=cap)
    new = Knobs(knobs.max_batch, _wait(obs, knobs, limits))
    reason = f"{direction} pending ({streak}/{needed})" if direction else "hold"
    return new, ControlState(new, direction, streak, reason, cap)


def _direction(obs: Observation, knobs: Knobs, limits: BatchLimits) -> Direction:
    target = limits.p99_target_ms
    compute_bound = limits.compute_share * target
    full = obs.full_share >= 0.5
    if obs.p99_ms > limits.high_water * target:
        if full:
            return "grow"
        slack = obs.busy_share < limits.slack_busy
        trimmable = math.ceil(obs.mean_batch * limits.shrink_margin) < knobs.max_batch
        return "shrink" if obs.compute_p99_ms > compute_bound and slack and trimmable else ""
    if obs.p99_ms < limits.low_water * target and full and _grown_fits(obs, knobs, limits):
        return "grow"
    return ""


def _grown_fits(obs: Observation, knobs: Knobs, limits: BatchLimits) -> bool:
    """Would a grown batch still compute within its share of the target? Compute is taken as linear in size."""
    grown = _resized(knobs.max_batch, "grow", limits)
    if grown == knobs.max_batch:
        return False
    per_batch = obs.compute_p99_ms * grown / max(1.0, obs.mean_batch)
    return per_batch <= limits.compute_share * limits.p99_target_ms


def _resized(batch: int, direction: Direction, limits: BatchLimits) -> int:
    if direction == "grow":
        batch = max(batch + 1, math.ceil(batch * limits.grow_factor))
    elif direction == "shrink":
        batch = min(batch - 1, math.floor(batch * limits.shrink_factor))
    return min(limits.max_batch, max(limits.min_batch, batch))


def _wait(obs: Observation, knobs: Knobs, limits: BatchLimits) -> float:
    """Rule 4: no wait for lone requests nor on a device with slack; on a busy one, about the batch compute
    time. Between the two busy marks, or with 1.5 to 2 items a batch, the wait stays as it is."""
    if obs.mean_batch < 1.5 and obs.full_share == 0:
        return 0.0
    if obs.busy_share < limits.idle_busy:
        return 0.0  # the device waits for work: a wait is pure latency, and batches gain nothing from it
    if obs.busy_share < limits.slack_busy or obs.mean_batch < 2.0:
        return knobs.max_wait_ms
    wanted = min(limits.max_wait_ms, obs.compute_mean_ms)  # spent while the batch before computes
    moved = abs(wanted - knobs.max_wait_ms)
    if moved <= max(limits.wait_deadband_ms, 0.25 * knobs.max_wait_ms):
        return knobs.max_wait_ms
    return round(wanted, 2)


@dataclass(slots=True)
class ControlWindow:
    """Accumulates what the worker sees between two ``control`` calls; not pure (it reads the clock)."""

    min_batches: int = 8
    max_span_s: float = 1.0
    started_s: float = field(default_factory=time.monotonic)
    sizes: list[int] = field(default_factory=list)
    full: int = 0
    computes_ms: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)

    def fetched(self, closed_full: bool) -> None:
        self.full += int(closed_full)

    def computed(self, size: int, compute_ms: float, latencies_ms: list[float]) -> None:
        self.sizes.append(size)
        self.computes_ms.append(compute_ms)
        self.latencies_ms.extend(latencies_ms)

    def ready(self, now_s: float | None = None) -> bool:
        """Enough batches for a decision, or a batch and the window's time is up."""
        now_s = time.monotonic() if now_s is None else now_s
        return len(self.sizes) >= self.min_batches or (bool(self.sizes) and now_s - self.started_s >= self.max_span_s)

    def observe(self, now_s: float | None = None) -> Observation:
        """The window as an ``Observation``; the window starts over."""
        batches = len(self.sizes)
        computes = sorted(self.computes_ms)
        now_s = time.monotonic() if now_s is None else now_s
        span_ms = max(1e-3, now_s - self.started_s) * 1000
        obs = Observation(
            batches=batches,
            mean_batch=sum(self.sizes) / batches if batches else 0.0,
            full_share=min(1.0, self.full / batches) if batches else 0.0,
            p99_ms=percentile(sorted(self.latencies_ms), 0.99),
            compute_p99_ms=percentile(computes, 0.99),
            compute_mean_ms=sum(computes) / batches if batches else 0.0,
            busy_share=min(1.0, sum(computes) / span_ms),
        )
        self.started_s = now_s
        self.sizes, self.computes_ms, self.latencies_ms, self.full = [], [], [], 0
        return obs
