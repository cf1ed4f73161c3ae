"""What the dashboard says in words: the reason behind a model's desired replicas, and its decisions listed once.

Both are pure functions of what the operator feed already read (the model's scaling status and its stored
decisions), tested with tables.

``scaling_reason`` turns the autoscaler's inputs into one sentence an operator reads at a glance, e.g.
``"77 waiting, draining at 8/s per worker: 10 wanted, capped at max 4"``. The policy's own text (``reason`` of
each decision, e.g. ``lag 77 / drain 30s + arrival 0/s = 2.57/s over 8/s per replica -> 1``) stays in the
decision list for whoever wants the arithmetic.

``collapse_decisions`` lists a decision once while nothing changes: the autoscaler stores a no-change decision
every ``record_every_s`` (its proof of life), and a run of them with the same replica counts is one line with a
count and the time of the first.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fleet.schemas.operator import DecisionLine
from fleet.schemas.scaling import DecisionRecord, ScalingStatus


def rate_text(value: float) -> str:
    """A rate as a person writes it: 0.25 -> '0.25', 7.96 -> '8', 12.4 -> '12', 222568.58 -> '223k'."""
    if value >= 999_500:
        return f"{value / 1e6:.3g}M"
    if value >= 9_995:
        return f"{value / 1e3:.3g}k"
    if value >= 5:
        return f"{value:.0f}"
    return f"{value:.2f}".rstrip("0").rstrip(".") or "0"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def wanted_replicas(status: ScalingStatus) -> int | None:
    """The policy's recommendation before min, max and smoothing, from the same tick as the status's lag and
    rates; from the newest stored decision for an autoscaler that does not report it."""
    if status.wanted_replicas is not None:
        return status.wanted_replicas
    return status.decisions[0].desired_replicas if status.decisions else None


def _load(status: ScalingStatus) -> str:
    lag = status.lag or 0
    arrival = status.arrival_rate or 0.0
    parts = [f"{lag} waiting"]
    if arrival > 0:
        parts.append(f"{rate_text(arrival)}/s arriving")
    throughput = status.throughput_per_replica
    if throughput is not None and throughput > 0:
        return f"{', '.join(parts)}, draining at {rate_text(throughput)}/s per worker"
    return f"{', '.join(parts)}, throughput per worker not measured yet"


def _bounds(wanted: int, status: ScalingStatus) -> str:
    if wanted > status.max_replicas:
        return f", capped at max {status.max_replicas}"
    if wanted < status.min_replicas:
        return f", raised to min {status.min_replicas}"
    if status.desired_replicas < wanted:  # a partition cap (Kafka): desired is within min/max and the partitions
        return f", capped at {status.desired_replicas} (one per partition)"
    return ""


def _heading(status: ScalingStatus) -> str:
    running, desired = status.current_replicas, status.desired_replicas
    if running < desired:
        return f"; {running} running, adding {desired - running}"
    if running > desired:
        return f"; {running} running, removing {running - desired} once the load has stayed low"
    return ""


def _clock(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%H:%M:%S UTC")


def scaling_reason(status: ScalingStatus) -> str:
    """Why ``status.desired_replicas`` is what it is, in one sentence (see the module docstring)."""
    if status.backend is None or status.updated_at is None:
        return "no autoscaler has reported for this model: replicas are whatever was started by hand"
    if status.pinned is not None:
        return f"held at {status.pinned.replicas} by an operator until {_clock(status.pinned.until)}"
    wanted = wanted_replicas(status)
    if status.paused:
        asks = f" (the signals ask for {wanted})" if wanted is not None else ""
        return f"autoscaling paused: holding {status.current_replicas}{asks}"
    if status.lag is None:
        return f"queue length unknown: holding {status.current_replicas}"
    if wanted is None:
        wanted = status.desired_replicas
    if not status.lag and not status.arrival_rate:
        text = f"idle: nothing waiting or arriving, {wanted} wanted"
    else:
        text = f"{_load(status)}: {_plural(wanted, 'worker')} wanted"
    return text + _bounds(wanted, status) + _heading(status)


def _same(a: DecisionRecord, b: DecisionRecord) -> bool:
    """Two no-change decisions that would read the same to an operator: same replicas, same recommendation."""
    keys = ("current_replicas", "replicas", "desired_replicas")
    return not a.changed and not b.changed and all(getattr(a, k) == getattr(b, k) for k in keys)


def collapse_decisions(decisions: list[DecisionRecord]) -> list[DecisionLine]:
    """Newest first in, newest first out; a run of alike no-change decisions becomes one line (the newest, with
    ``repeats`` and ``since``, the time of the first of the run)."""
    lines: list[DecisionLine] = []
    for decision in decisions:
        last = lines[-1] if lines else None
        if last is not None and _same(last, decision):
            last.repeats += 1
            last.since = decision.at
            continue
        lines.append(DecisionLine(**decision.model_dump(), since=decision.at))
    return lines
