"""A circuit breaker as a pure state machine, one per (model, version) or per (worker, model).

``allow(state, config, now_s) -> (bool, state)`` asks before sending a request; ``record(state, config, outcome,
now_s) -> state`` tells the outcome after. Neither does I/O nor reads a clock; keep the returned state. The states:

- **closed**: every request goes through. Outcomes are counted in a sliding window of ``window_s`` (ten buckets,
  so the state stays small whatever the rate). It **opens** on ``consecutive_failures`` failures in a row, or when
  the window holds at least ``min_requests`` outcomes and the failed share reaches ``error_rate``.
- **open**: every request is refused (the caller falls back to the previous version, or answers 503 with
  ``Retry-After: retry_after_s(...)``) until ``cool_down_s`` has passed since it opened; then the next ``allow``
  moves it to half-open.
- **half-open**: at most ``half_open_probes`` requests are let through at a time (a probe whose outcome never comes
  frees its place after ``probe_timeout_s``, so a lost probe cannot wedge the breaker). A success **closes** it
  (counts cleared, the cool-down back to ``cool_down_s``); a failure **reopens** it with the cool-down multiplied
  by ``cool_down_factor``, capped at ``max_cool_down_s``.

An outcome recorded while open (a request let through before the breaker opened) changes nothing. ``state.reason``
says in words why the breaker is where it is, e.g. ``"opened: 5 consecutive failures"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Status = Literal["closed", "open", "half_open"]
Outcome = Literal["success", "failure"]
WINDOW_BUCKETS = 10


class BreakerConfig(BaseModel):
    """When a breaker opens and how it recovers. Immutable, validated when parsed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    consecutive_failures: int = Field(5, ge=1, description="failures in a row that open the circuit")
    error_rate: float = Field(0.5, gt=0, le=1, description="failed share of the window that opens the circuit")
    window_s: float = Field(30.0, gt=0, description="the sliding window the error rate is measured over")
    min_requests: int = Field(20, ge=1, description="outcomes in the window before the error rate counts")
    cool_down_s: float = Field(5.0, gt=0, description="how long the circuit stays open the first time")
    cool_down_factor: float = Field(2.0, ge=1, description="each reopening multiplies the cool-down by this")
    max_cool_down_s: float = Field(120.0, gt=0, description="the cool-down never grows past this")
    half_open_probes: int = Field(1, ge=1, description="requests let through at a time while half-open")
    probe_timeout_s: float = Field(30.0, gt=0, description="a probe without an outcome frees its place after this")

    @model_validator(mode="after")
    def _cool_downs_ordered(self) -> BreakerConfig:
        if self.max_cool_down_s < self.cool_down_s:
            raise ValueError(
                f"max_cool_down_s {self.max_cool_down_s} is below cool_down_s {self.cool_down_s}; raise it or "
                "lower cool_down_s"
            )
        return self


@dataclass(frozen=True, slots=True)
class BreakerState:
    """What a breaker remembers. Start with ``BreakerState()`` (closed); pass back what the functions return."""

    status: Status = "closed"
    consecutive_failures: int = 0
    buckets: tuple[tuple[int, int, int], ...] = ()  # (bucket number, outcomes, failures) within the window
    opened_at_s: float | None = None
    cool_down_s: float | None = None  # the current cool-down; None: config.cool_down_s
    probes: tuple[float, ...] = ()  # start times of the probes in flight (half-open)
    reason: str = "closed"


def allow(state: BreakerState, config: BreakerConfig, now_s: float) -> tuple[bool, BreakerState]:
    """Whether a request may go now, and the state with it counted (a half-open probe takes a place)."""
    if state.status == "closed":
        return True, state
    if state.status == "open":
        if now_s < _reopens_at(state, config):
            return False, state
        state = replace(
            state, status="half_open", probes=(), reason=f"half-open after {_num(_cool_down(state, config))}s"
        )
    probes = tuple(t for t in state.probes if now_s - t < config.probe_timeout_s)
    if len(probes) >= config.half_open_probes:
        return False, replace(state, probes=probes)
    return True, replace(state, probes=(*probes, now_s))


def record(state: BreakerState, config: BreakerConfig, outcome: Outcome, now_s: float) -> BreakerState:
    """The state after a request's ``outcome``: counted while closed, deciding while half-open, ignored while open."""
    if state.status == "open":
        return state
    if state.status == "half_open":
        return _closed("closed: a probe succeeded") if outcome == "success" else _reopened(state, config, now_s)
    return _counted(state, config, outcome, now_s)


def retry_after_s(state: BreakerState, config: BreakerConfig, now_s: float) -> float:
    """Seconds until the breaker may let a request through again (0 when it would now): the 503's
    ``Retry-After``, which wants a whole number of seconds (``math.ceil``, at least 1)."""
    if state.status == "closed":
        return 0.0
    if state.status == "open":
        return max(0.0, _reopens_at(state, config) - now_s)
    live = [t for t in state.probes if now_s - t < config.probe_timeout_s]
    if len(live) < config.half_open_probes:
        return 0.0
    return max(0.0, min(live) + config.probe_timeout_s - now_s)


def retry_after_header(state: BreakerState, config: BreakerConfig, now_s: float) -> str:
    """``retry_after_s`` as a ``Retry-After`` header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(retry_after_s(state, config, now_s))))


# -- transitions ----------------------------------------------------------------------------------------------
def _counted(state: BreakerState, config: BreakerConfig, outcome: Outcome, now_s: float) -> BreakerState:
    failed = outcome == "failure"
    consecutive = state.consecutive_failures + 1 if failed else 0
    buckets = _add(state.buckets, config, now_s, failed)
    state = replace(state, consecutive_failures=consecutive, buckets=buckets)
    if consecutive >= config.consecutive_failures:
        return _opened(config, now_s, f"opened: {consecutive} consecutive failures")
    total = sum(n for _, n, _ in buckets)
    failures = sum(f for _, _, f in buckets)
    if total >= config.min_requests and failures / total >= config.error_rate:
        why = (
            f"opened: {failures} of {total} requests failed in {_num(config.window_s)}s "
            f"({_num(failures / total * 100)} %, limit {_num(config.error_rate * 100)} %)"
        )
        return _opened(config, now_s, why)
    return state


def _opened(config: BreakerConfig, now_s: float, why: str) -> BreakerState:
    return BreakerState(status="open", opened_at_s=now_s, cool_down_s=config.cool_down_s, reason=why)


def _reopened(state: BreakerState, config: BreakerConfig, now_s: float) -> BreakerState:
    grown = min(_cool_down(state, config) * config.cool_down_factor, config.max_cool_down_s)
    why = f"reopened: a probe failed; open for {_num(grown)}s"
    return BreakerState(status="open", opened_at_s=now_s, cool_down_s=grown, reason=why)


def _closed(why: str) -> BreakerState:
    return BreakerState(reason=why)


# -- the window -----------------------------------------------------------------------------------------------
def _add(
    buckets: tuple[tuple[int, int, int], ...], config: BreakerConfig, now_s: float, failed: bool
) -> tuple[tuple[int, int, int], ...]:
    width_s = config.window_s / WINDOW_BUCKETS
    current = math.floor(now_s / width_s)
    kept = [b for b in buckets if current - WINDOW_BUCKETS < b[0] <= current]
    if kept and kept[-1][0] == current:
        _, n, f = kept.pop()
        kept.append((current, n + 1, f + failed))
    else:
        kept.append((current, 1, int(failed)))
    return tuple(kept)


def _cool_down(state: BreakerState, config: BreakerConfig) -> float:
    return state.cool_down_s if state.cool_down_s is not None else config.cool_down_s


def _reopens_at(state: BreakerState, config: BreakerConfig) -> float:
    opened = state.opened_at_s if state.opened_at_s is not None else 0.0
    return opened + _cool_down(state, config)


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")
