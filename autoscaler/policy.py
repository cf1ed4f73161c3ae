"""The scaling policy: a pure function from what the fleet looks like now to how many workers it should run.

``decide(signals, config, state, now_s) -> (Decision, PolicyState)`` does no I/O and reads no clock; everything it
remembers between calls is in the returned ``PolicyState`` (start with ``PolicyState()``). The steps, in order:

1. **Paused** (``config.paused``): keep the current replicas. The recommendation is still worked out from fresh
   signals, so an operator sees what the fleet would do.
2. **Stale**: signals read more than ``stale_after_s`` before ``now_s``, or an unknown lag, keep the current replicas.
   A broken metrics path must never scale a fleet to zero.
3. **Raw desired.** Rate mode: ``ceil((arrival_rate + lag / target_drain_s) / throughput_per_replica)``, the
   capacity that keeps up with arrivals and drains the backlog within ``target_drain_s``. The throughput comes from
   the heartbeats, else ``default_throughput_per_replica``; with neither, the policy keeps at least one replica
   (and never fewer than it has) while there is work, and says so. KEDA mode: ``ceil(lag / lag_per_replica)``.
4. **Predictive term** (rate mode, ``predictive_horizon_s`` set): a least-squares line through the arrival rates of
   the last ``trend_window_s`` is extrapolated ``predictive_horizon_s`` ahead (a worker's start-up time), so workers
   are started before a rising load arrives. It only ever adds capacity: a flat or falling trend changes nothing.
5. **Activation** (0 <-> 1, separate from 1 <-> N as in KEDA): from zero replicas the fleet wakes only when
   ``lag > activation_lag``; arrivals alone do not wake it (with nobody consuming they turn into lag at once, and
   counting them would defeat the threshold). A running fleet may go to zero only when there is no lag and no
   arrivals, so scale-in never strands a backlog below the threshold. The gap between the two is a hysteresis.
5b. **Queue age** (``max_queue_age_s`` set, ``signals.queue_age_s`` known): the oldest request not yet finished
   waited longer than the target -> ``ceil(current * age / target)`` replicas, at least one more than now (from zero:
   one; the HPA's rule for a value metric). Younger than ``queue_age_scale_in_ratio`` of the target -> the age rule
   asks for nothing; in between it asks to hold the current count (a dead band, so a fleet sitting just under its
   target does not shrink into breaching it). The larger of the lag rule's and the age rule's counts wins, so the
   age rule only ever adds to what the backlog and the arrivals ask for. The result is ``Decision.desired``.
6. **Bounds**: clamp to ``[min_replicas, max_replicas]``, then cap at the partition count when it is known (never
   more consumers than partitions, even above ``min_replicas``).
7. **Scale down** only to the highest bounded recommendation seen within ``scale_down_stabilization_s`` (the
   Kubernetes HPA / KEDA stabilization-window rule): a dip must last the whole window, so no flapping.
8. **Scale up** at once, but at most ``scale_up_step`` replicas added within any ``scale_up_interval_s``.
9. **Bounds again**, so that a lowered ``max_replicas`` or a raised ``min_replicas`` (operator overrides) takes
   effect at once, as in the HPA.

Every step that changes the number adds a note; ``Decision.reason`` joins them after the action, e.g.
``"scale up 2 -> 6: lag 900 / drain 30s + arrival 12/s = 42/s over 4/s per replica -> 11; capped at
max_replicas 8; limited to +4 per 5s"``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import TypeVar

from fleet.autoscaler.config import ScalingConfig

# Bound on each history in PolicyState, whatever the call rate.
MAX_HISTORY = 256
# ceil() of a float that is a whole number plus rounding noise must not add a replica: (0.1 + 0.2) / 0.1.
_CEIL_TOLERANCE = 1e-9
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Signals:
    """What the autoscaler read for one model. Rates are jobs per second."""

    at_s: float  # monotonic time the signals were read
    lag: int | None  # None: unknown
    arrival_rate: float | None
    throughput_per_replica: float | None  # per busy worker, from heartbeats
    current_replicas: int
    partitions: int | None = None  # Kafka partition count; caps the replicas
    queue_age_s: float | None = None  # seconds the oldest unfinished request has waited; None: none waits (or unknown)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between calls. Opaque to callers: pass back what ``decide`` returned."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (now_s, bounded recommendation), stabilization window
    scale_ups: tuple[tuple[float, int], ...] = ()  # (now_s, replicas added), scale-up interval
    arrivals: tuple[tuple[float, float], ...] = ()  # (at_s, arrival_rate), trend window


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one ``decide`` call."""

    replicas: int  # what to scale to
    desired: int  # the recommendation before bounds, stabilization and rate limit
    reason: str  # human readable, names the numbers
    changed: bool  # replicas != signals.current_replicas


@dataclass(slots=True)
class _Notes:
    items: list[str] = field(default_factory=list)

    def add(self, note: str | None) -> None:
        if note:
            self.items.append(note)

    def text(self) -> str:
        return "; ".join(self.items)


def decide(signals: Signals, config: ScalingConfig, state: PolicyState, now_s: float) -> tuple[Decision, PolicyState]:
    """Turn ``signals`` into a replica count for one model (see the module docstring for the steps).

    Args:
        signals: lag, rates and replica count as read at ``signals.at_s``.
        config: the model's validated settings (with any operator overrides applied).
        state: what the previous call returned; ``PolicyState()`` the first time.
        now_s: the current monotonic time, on the same clock as ``signals.at_s``.

    Returns:
        The decision and the state to pass to the next call. Pure: no I/O, no clock reads.
    """
    stale = _staleness(signals, config, now_s)
    if config.paused:
        return _paused(signals, config, state, stale), state
    if stale is not None:
        current = signals.current_replicas
        return _hold(current, current, f"{stale}: holding {current}"), state
    state = _remember_arrival(state, signals, config)
    notes = _Notes()
    desired = _recommend(signals, config, state, notes)
    bounded = _bound(desired, config, signals.partitions, notes)
    state = _remember_recommendation(state, config, now_s, bounded)
    replicas = _smooth(bounded, signals.current_replicas, config, state, now_s, notes)
    replicas = _bound(replicas, config, signals.partitions, notes)
    state = _remember_scale_up(state, config, now_s, replicas - signals.current_replicas)
    return _decision(signals.current_replicas, replicas, desired, notes), state


# -- 1, 2: paused and stale -----------------------------------------------------------------------------------
def _staleness(signals: Signals, config: ScalingConfig, now_s: float) -> str | None:
    if signals.lag is None:
        return "lag unknown"
    age_s = now_s - signals.at_s
    if age_s > config.stale_after_s:
        return f"stale signals (read {_num(age_s)}s ago, stale after {_num(config.stale_after_s)}s)"
    return None


def _paused(signals: Signals, config: ScalingConfig, state: PolicyState, stale: str | None) -> Decision:
    current = signals.current_replicas
    if stale is not None:
        return _hold(current, current, f"paused: holding {current} ({stale})")
    notes = _Notes()
    desired = _recommend(signals, config, _remember_arrival(state, signals, config), notes)
    return _hold(current, desired, f"paused: holding {current}; signals ask for {desired} ({notes.text()})")


def _hold(current: int, desired: int, reason: str) -> Decision:
    return Decision(replicas=current, desired=desired, reason=reason, changed=False)


# -- 3, 4, 5: the recommendation ------------------------------------------------------------------------------
def _recommend(signals: Signals, config: ScalingConfig, state: PolicyState, notes: _Notes) -> int:
    lag = max(0, signals.lag or 0)
    if config.mode == "keda":
        raw = _keda_desired(lag, config, notes)
    else:
        throughput = _throughput(signals, config)
        if throughput is None:
            raw = _unknown_throughput_desired(lag, signals, notes)
        else:
            raw = _rate_desired(lag, signals.arrival_rate or 0.0, throughput, config, notes)
            raw = max(raw, _predictive_desired(lag, signals, throughput, config, state, notes))
    activated = _activate(raw, lag, signals, config, notes)
    by_age = _age_desired(signals, config, notes)
    if by_age > activated:
        notes.add(f"queue age asks for {by_age}, more than {activated}")
    return max(activated, by_age)


def _age_desired(signals: Signals, config: ScalingConfig, notes: _Notes) -> int:
    """Step 5b: what the age of the oldest waiting request asks for (0: nothing)."""
    target, age = config.max_queue_age_s, signals.queue_age_s
    if target is None or age is None:
        return 0
    current = max(0, signals.current_replicas)
    if age > target:
        desired = max(current + 1, _ceil(current * age / target))
        notes.add(f"oldest request waited {_num(age)}s > max_queue_age_s {_num(target)}s -> {desired}")
        return desired
    if age > target * config.queue_age_scale_in_ratio:
        notes.add(
            f"oldest request waited {_num(age)}s, within {_num(config.queue_age_scale_in_ratio)} of "
            f"max_queue_age_s {_num(target)}s -> hold {current}"
        )
        return current
    return 0


def _keda_desired(lag: int, config: ScalingConfig, notes: _Notes) -> int:
    per_replica = config.lag_per_replica or 1  # validated: set in keda mode
    desired = _ceil(lag / per_replica)
    notes.add(f"lag {lag} / {per_replica} per replica -> {desired}")
    return desired


def _throughput(signals: Signals, config: ScalingConfig) -> float | None:
    measured = signals.throughput_per_replica
    if measured is not None and measured > 0:
        return measured
    return config.default_throughput_per_replica


def _rate_desired(lag: int, arrival: float, throughput: float, config: ScalingConfig, notes: _Notes) -> int:
    need = arrival + lag / config.target_drain_s
    desired = _ceil(need / throughput)
    notes.add(
        f"lag {lag} / drain {_num(config.target_drain_s)}s + arrival {_num(arrival)}/s = {_num(need)}/s "
        f"over {_num(throughput)}/s per replica -> {desired}"
    )
    return desired


def _unknown_throughput_desired(lag: int, signals: Signals, notes: _Notes) -> int:
    arrival = signals.arrival_rate or 0.0
    if lag == 0 and arrival <= 0:
        notes.add("throughput unknown; no lag and no arrivals -> 0")
        return 0
    desired = max(signals.current_replicas, 1)
    notes.add(
        f"throughput unknown (no heartbeats, no default_throughput_per_replica); keeping {desired} "
        f"while lag is {lag} and arrival {_num(arrival)}/s"
    )
    return desired


def _predictive_desired(
    lag: int, signals: Signals, throughput: float, config: ScalingConfig, state: PolicyState, notes: _Notes
) -> int:
    horizon_s = config.predictive_horizon_s
    slope = _arrival_trend(state.arrivals)
    if horizon_s is None or signals.arrival_rate is None or slope is None or slope <= 0:
        return 0
    expected = signals.arrival_rate + slope * horizon_s
    desired = _ceil((expected + lag / config.target_drain_s) / throughput)
    notes.add(f"arrival rising {_num(slope)}/s per s: {_num(expected)}/s expected in {_num(horizon_s)}s -> {desired}")
    return desired


def _arrival_trend(samples: tuple[tuple[float, float], ...]) -> float | None:
    """Least-squares slope of the arrival rate, in jobs/s per second; None with fewer than two distinct times."""
    if len({t for t, _ in samples}) < 2:
        return None
    times, rates = zip(*samples, strict=True)
    return statistics.linear_regression(times, rates).slope


def _activate(raw: int, lag: int, signals: Signals, config: ScalingConfig, notes: _Notes) -> int:
    if signals.current_replicas <= 0:
        if lag > config.activation_lag:
            return max(raw, 1)
        notes.add(f"inactive: lag {lag} <= activation_lag {config.activation_lag}")
        return 0
    if lag > 0 or (signals.arrival_rate or 0.0) > 0:
        return max(raw, 1)
    if raw > 0:
        notes.add("idle: no lag and no arrivals -> 0")
    return 0


# -- 6, 9: bounds ---------------------------------------------------------------------------------------------
def _bound(replicas: int, config: ScalingConfig, partitions: int | None, notes: _Notes) -> int:
    bounded = min(max(replicas, config.min_replicas), config.max_replicas)
    if bounded > replicas:
        notes.add(f"raised to min_replicas {config.min_replicas}")
    elif bounded < replicas:
        notes.add(f"capped at max_replicas {config.max_replicas}")
    if partitions is not None and 0 < partitions < bounded:
        notes.add(f"capped at {partitions} partitions")
        bounded = partitions
    return bounded


# -- 7, 8: stabilization and rate limit -----------------------------------------------------------------------
def _smooth(bounded: int, current: int, config: ScalingConfig, state: PolicyState, now_s: float, notes: _Notes) -> int:
    if bounded < current:
        return _stabilized_down(bounded, current, config, state, notes)
    if bounded > current:
        return _limited_up(bounded, current, config, state, now_s, notes)
    return current


def _stabilized_down(bounded: int, current: int, config: ScalingConfig, state: PolicyState, notes: _Notes) -> int:
    highest = max(r for _, r in state.recommendations)  # includes this call's recommendation
    window = _num(config.scale_down_stabilization_s)
    if highest >= current:
        notes.add(f"recommended {highest} within the last {window}s, so not below {current} yet")
        return current
    if highest > bounded:
        notes.add(f"down to {highest}, the highest recommendation within the last {window}s")
    return highest


def _limited_up(
    bounded: int, current: int, config: ScalingConfig, state: PolicyState, now_s: float, notes: _Notes
) -> int:
    added = sum(n for t, n in state.scale_ups if t > now_s - config.scale_up_interval_s)
    allowed = max(0, config.scale_up_step - added)
    target = min(bounded, current + allowed)
    if target < bounded:
        already = f" ({added} added within it)" if added else ""
        notes.add(f"limited to +{config.scale_up_step} per {_num(config.scale_up_interval_s)}s{already}")
    return target


# -- state ----------------------------------------------------------------------------------------------------
def _remember_arrival(state: PolicyState, signals: Signals, config: ScalingConfig) -> PolicyState:
    if signals.arrival_rate is None:
        return state
    since_s = signals.at_s - config.trend_window_s
    kept = [(t, r) for t, r in state.arrivals if since_s < t < signals.at_s]
    return replace(state, arrivals=_capped([*kept, (signals.at_s, signals.arrival_rate)]))


def _remember_recommendation(state: PolicyState, config: ScalingConfig, now_s: float, bounded: int) -> PolicyState:
    since_s = now_s - config.scale_down_stabilization_s
    kept = [(t, r) for t, r in state.recommendations if since_s < t <= now_s]
    return replace(state, recommendations=_capped([*kept, (now_s, bounded)]))


def _remember_scale_up(state: PolicyState, config: ScalingConfig, now_s: float, added: int) -> PolicyState:
    since_s = now_s - config.scale_up_interval_s
    kept = [(t, n) for t, n in state.scale_ups if since_s < t <= now_s]
    if added > 0:
        kept.append((now_s, added))
    return replace(state, scale_ups=_capped(kept))


def _capped(items: list[T]) -> tuple[T, ...]:
    return tuple(items[-MAX_HISTORY:])


# -- output ---------------------------------------------------------------------------------------------------
def _decision(current: int, replicas: int, desired: int, notes: _Notes) -> Decision:
    if replicas > current:
        action = f"scale up {current} -> {replicas}"
    elif replicas < current:
        action = f"scale down {current} -> {replicas}"
    else:
        action = f"hold {current}"
    reason = f"{action}: {notes.text()}" if notes.items else action
    return Decision(replicas=replicas, desired=desired, reason=reason, changed=replicas != current)


def pinned(signals: Signals, replicas: int, until: str, policy: Decision) -> Decision:
    """Scale-to-N (an operator's override with an expiry): run ``replicas``, whatever the signals, the bounds and
    the smoothing say, capped only at the partition count. ``policy`` is what the normal policy would have done;
    its recommendation is named in the reason. Pure, like ``decide``.
    """
    current = signals.current_replicas
    notes = _Notes()
    target = replicas
    if signals.partitions and target > signals.partitions:
        target = signals.partitions
        notes.add(f"capped at {signals.partitions} partitions")
    notes.add(f"held at {replicas} by the operator's scale-to-N until {until}")
    notes.add(f"the policy alone would run {policy.replicas}")
    return _decision(current, target, target, notes)


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _CEIL_TOLERANCE))


def _num(value: float) -> str:
    """12 -> '12', 0.5 -> '0.5', 4.256 -> '4.26', 1234.5 -> '1234', 222568.58 -> '223k': numbers as a person
    writes them (a fast model's throughput is hundreds of thousands per second; its decimals say nothing)."""
    if abs(value) >= 9_995:
        return f"{value / 1000:.3g}k"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}".rstrip("0").rstrip(".")
