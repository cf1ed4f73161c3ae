"""A pool's signals: the sum of its models' demand, in the shape the scaling policy reads for one model. Pure.

A pool's workers serve every model of the pool, so the pool needs as many workers as its models' needs add up to.
``pool_signals`` turns the per-model ``Signals`` into one:

* **lag** and **arrival rate**: the sums (the lag is unknown when any model's is: a broken read must hold the pool,
  as it holds a model; an arrival rate not yet known counts as 0 once another model's is known);
* **throughput per replica**: what one pool worker finishes per second *of this mix*. A job of model ``m`` takes a
  worker ``1 / throughput_m`` seconds, so with each model's need ``need_m = arrival_m + lag_m / target_drain_s``
  the pool needs ``sum(need_m / throughput_m)`` workers; the throughput that makes the policy's
  ``ceil(sum(need_m) / throughput)`` come out at exactly that is ``sum(need_m) / sum(need_m / throughput_m)``
  (the demand-weighted harmonic mean). A slow model therefore weighs by its work, not its job count. With no
  demand at all it is the plain mean (capacity does not vanish when there is nothing to do); models whose
  throughput is not yet known are left out of it, and with none known it is unknown (the policy's usual rule);
* **queue age**: the oldest member's (the pool must serve its longest-waiting request);
* **read time**: the oldest member's, so a pool is as stale as its stalest model; **partitions**: the smallest cap.

``describe`` names each model's share for the decision's reason.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet.autoscaler.policy import Signals, _num


def pool_signals(members: Mapping[str, Signals], current_replicas: int, target_drain_s: float) -> Signals:
    """One ``Signals`` for the pool from each member model's (see the module docstring).

    Raises:
        ValueError: no members.
    """
    if not members:
        raise ValueError("a pool has at least one model")
    signals = list(members.values())
    lags = [s.lag for s in signals]
    lag = None if any(v is None for v in lags) else sum(v or 0 for v in lags)
    rates = [s.arrival_rate for s in signals if s.arrival_rate is not None]
    partitions = [s.partitions for s in signals if s.partitions]
    ages = [s.queue_age_s for s in signals if s.queue_age_s is not None]
    return Signals(
        at_s=min(s.at_s for s in signals),
        lag=lag,
        arrival_rate=sum(rates) if rates else None,
        throughput_per_replica=mix_throughput(signals, target_drain_s),
        current_replicas=current_replicas,
        partitions=min(partitions) if partitions else None,
        queue_age_s=max(ages) if ages else None,
    )


def need(signals: Signals, target_drain_s: float) -> float:
    """Jobs/s a model asks for: its arrivals plus its backlog drained within ``target_drain_s``."""
    return (signals.arrival_rate or 0.0) + max(0, signals.lag or 0) / target_drain_s


def mix_throughput(signals: list[Signals], target_drain_s: float) -> float | None:
    known = [(s, s.throughput_per_replica) for s in signals if s.throughput_per_replica]
    if not known:
        return None
    needs = [(need(s, target_drain_s), rate) for s, rate in known if rate is not None]
    total = sum(n for n, _ in needs)
    if total <= 0:
        return sum(rate for _, rate in needs) / len(needs)
    return total / sum(n / rate for n, rate in needs)


def describe(members: Mapping[str, Signals]) -> str:
    """``"a: lag 12, 3/s; b: lag 0, 0.5/s"``: each model's part of the pool's demand."""
    parts = []
    for model, s in members.items():
        lag = "?" if s.lag is None else str(s.lag)
        rate = "?" if s.arrival_rate is None else f"{_num(s.arrival_rate)}/s"
        parts.append(f"{model}: lag {lag}, {rate}")
    return "; ".join(parts)
