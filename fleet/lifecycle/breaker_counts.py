"""A version's circuit breaker judged from its running counts, for the controller's loop (``fleet.lifecycle.service``).

The breaker of ``fleet.lifecycle.breaker`` takes one outcome at a time. The loop sees a version's outcomes as counts
instead: its ``Tally`` (failures in a row, outcomes and failures in all, the times of the latest success and
failure; the workers' settle hook keeps it, ``RolloutStore.record_outcome``), read every tick. ``judge`` moves the
breaker through the same states and thresholds from those, purely (no I/O, no clock):

1. **closed**: the outcomes since the previous tick (the tally's growth) go into the state's sliding window of
   ``window_s`` (the same ten buckets as ``breaker.record``). It **opens** when the streak reaches
   ``consecutive_failures``, or when the window holds at least ``min_requests`` outcomes and the failed share
   reaches ``error_rate``. With no previous tally (a controller that just took over) nothing is added to the
   window; the streak still counts.
2. **open**: once ``cool_down_s`` has passed since it opened, it is **half-open** (as ``breaker.allow`` makes it on
   the gateways, which let their probes through).
3. **half-open** since ``opened_at_s + cool_down_s``: a failure after that moment **reopens** it with the cool-down
   multiplied by ``cool_down_factor`` (at most ``max_cool_down_s``); else a success after it **closes** it, with an
   empty window. A failure and a success in the same tick: the failure wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fleet.lifecycle.breaker import WINDOW_BUCKETS, BreakerConfig, BreakerState


@dataclass(frozen=True, slots=True)
class Tally:
    """One version's outcomes since its tally began: failures in a row, outcomes and failures in all, and the unix
    times of the latest success and failure (None: none yet)."""

    streak: int = 0
    total: int = 0
    failed: int = 0
    last_ok_at: float | None = None
    last_failed_at: float | None = None


def judge(state: BreakerState, config: BreakerConfig, now: Tally, before: Tally | None, now_s: float) -> BreakerState:
    """The breaker after the counts ``now`` (``before``: the counts at the previous tick, None when unknown).

    Returns ``state`` itself when nothing moved (the window may have grown: compare ``status``)."""
    if state.status == "open":
        if now_s < _half_open_at(state, config):
            return state
        state = replace(
            state, status="half_open", probes=(), reason=f"half-open after {_num(_cool_down(state, config))}s"
        )
    if state.status == "half_open":
        since = _half_open_at(state, config)
        if now.last_failed_at is not None and now.last_failed_at >= since:
            grown = min(_cool_down(state, config) * config.cool_down_factor, config.max_cool_down_s)
            why = f"reopened: a probe failed; open for {_num(grown)}s"
            return BreakerState(status="open", opened_at_s=now_s, cool_down_s=grown, reason=why)
        if now.last_ok_at is not None and now.last_ok_at >= since:
            return BreakerState(reason="closed: a probe succeeded")
        return state
    return _closed(state, config, now, before, now_s)


def _closed(state: BreakerState, config: BreakerConfig, now: Tally, before: Tally | None, now_s: float) -> BreakerState:
    if before is not None:
        outcomes, failures = max(0, now.total - before.total), max(0, now.failed - before.failed)
        if outcomes:
            state = replace(state, buckets=_add(state.buckets, config, now_s, outcomes, min(failures, outcomes)))
    if now.streak >= config.consecutive_failures:
        return _opened(config, now_s, f"opened: {now.streak} consecutive failures")
    total = sum(n for _, n, _ in _live(state.buckets, config, now_s))
    failed = sum(f for _, _, f in _live(state.buckets, config, now_s))
    if total >= config.min_requests and failed / total >= config.error_rate:
        why = (
            f"opened: {failed} of {total} requests failed in {_num(config.window_s)}s "
            f"({_num(failed / total * 100)} %, limit {_num(config.error_rate * 100)} %)"
        )
        return _opened(config, now_s, why)
    return state


def _opened(config: BreakerConfig, now_s: float, why: str) -> BreakerState:
    return BreakerState(status="open", opened_at_s=now_s, cool_down_s=config.cool_down_s, reason=why)


def _bucket(config: BreakerConfig, now_s: float) -> int:
    return math.floor(now_s / (config.window_s / WINDOW_BUCKETS))


def _live(buckets: tuple[tuple[int, int, int], ...], config: BreakerConfig, now_s: float) -> list[tuple[int, int, int]]:
    current = _bucket(config, now_s)
    return [b for b in buckets if current - WINDOW_BUCKETS < b[0] <= current]


def _add(
    buckets: tuple[tuple[int, int, int], ...], config: BreakerConfig, now_s: float, outcomes: int, failures: int
) -> tuple[tuple[int, int, int], ...]:
    current = _bucket(config, now_s)
    kept = _live(buckets, config, now_s)
    if kept and kept[-1][0] == current:
        _, n, f = kept.pop()
        kept.append((current, n + outcomes, f + failures))
    else:
        kept.append((current, outcomes, failures))
    return tuple(kept)


def _cool_down(state: BreakerState, config: BreakerConfig) -> float:
    return state.cool_down_s if state.cool_down_s is not None else config.cool_down_s


def _half_open_at(state: BreakerState, config: BreakerConfig) -> float:
    return (state.opened_at_s if state.opened_at_s is not None else 0.0) + _cool_down(state, config)


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")
