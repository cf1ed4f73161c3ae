"""The rollout controller: a pure function from what a canary and its primary measured to the canary's next weight.

``decide(state, observation, config, now_s) -> (Decision, RolloutState)`` does no I/O and reads no clock; all it
remembers between calls is in the returned ``RolloutState`` (start a rollout with ``RolloutState()``). The
observation is the counts of a window ending at ``now_s`` (the shell picks the window, e.g. the last minute of
metrics); the controller judges it against the primary's in the same window. The steps, in order:

1. **Finished.** A promoted or rolled-back rollout holds its final weight (1 or 0) until a new one starts.
2. **Override.** A manual promote or rollback (``override(state, ...)``) is carried out at once, whatever the
   samples say, and the reason names who asked.
3. **Start.** The first call puts the canary at the first step's weight.
4. **Baseline.** When the primary served at least ``min_requests`` in the window, its error rate and p99 become the
   baseline; with fewer (at weight 1 the primary serves nothing) the last baseline stands.
5. **Judge.** With at least ``min_requests`` canary requests in the window, the canary is held against the baseline
   (before there is one: against no errors, and p99 is not judged):
   error rate at most the primary's plus ``max_error_rate_increase``, p99 at most the primary's times
   ``max_p99_ratio``; and with at least ``min_agreement_samples`` shadow comparisons, mean agreement at least
   ``min_agreement``. Any breach rolls back **at once** (weight 0), naming every threshold that failed.
6. **Samples.** Too few canary requests (or, with ``agreement_required``, too few comparisons): hold.
7. **Hold time.** A step is kept at least ``hold_s``: hold until then.
8. **Step up** to the next weight, or **promote** after the last step (the canary becomes the primary).

``apply(policy, decision)`` carries a decision out on the model's ``TrafficPolicy``. Every decision carries a
reason a person reads, e.g. ``"canary errors 7.5 % against primary 0.4 % (limit +2 %):
rolled back from 10 % to 0 %"``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet.lifecycle.traffic import TrafficPolicy

Action = Literal["hold", "step_up", "promote", "roll_back"]
Phase = Literal["rolling", "promoted", "rolled_back"]
Threshold = Literal["error_rate", "p99", "agreement"]
# A measurement exactly at a limit passes; float noise (0.004 + 0.02 vs 6 / 250) must not make it a breach.
_TOLERANCE = 1e-9


class RolloutConfig(BaseModel):
    """How a canary is stepped up and when it is rolled back. Immutable, validated when parsed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: tuple[float, ...] = Field(
        (0.05, 0.1, 0.25, 0.5, 1.0), min_length=1, description="canary weights in order, rising, the last 1.0"
    )
    min_requests: int = Field(200, ge=1, description="canary requests in the window before it is judged")
    hold_s: float = Field(300.0, ge=0, description="the least time a step is kept before the next")
    max_error_rate_increase: float = Field(
        0.02, ge=0, le=1, description="canary error rate may exceed the primary's by at most this (0.02: +2 points)"
    )
    max_p99_ratio: float = Field(1.5, ge=1, description="canary p99 at most the primary's times this")
    min_agreement: float | None = Field(
        0.95, ge=0, le=1, description="mean shadow agreement at least this; None: not checked"
    )
    min_agreement_samples: int = Field(100, ge=1, description="shadow comparisons before agreement is judged")
    agreement_required: bool = Field(
        False, description="hold until min_agreement_samples comparisons exist (else unmeasured agreement passes)"
    )

    @field_validator("steps")
    @classmethod
    def _rising_to_one(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < s <= 1 for s in steps):
            raise ValueError(f"every step is a weight in (0, 1], got {list(steps)}")
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"steps must rise strictly, got {list(steps)}")
        if steps[-1] != 1.0:
            raise ValueError(f"the last step must be 1.0 (all traffic) before a promotion, got {steps[-1]}")
        return steps


@dataclass(frozen=True, slots=True)
class VersionStats:
    """One version's counts over the observation window."""

    requests: int
    errors: int
    p99_ms: float | None = None  # None: no latency measured

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class Observation:
    """What the primary and the canary measured over one window ending at ``now_s``, and the shadow agreement of
    the candidate with the primary (mean over ``agreement_samples`` comparisons; None: none)."""

    primary: VersionStats
    canary: VersionStats
    agreement: float | None = None
    agreement_samples: int = 0


@dataclass(frozen=True, slots=True)
class Override:
    """A person's promote or rollback, carried out on the next ``decide``."""

    action: Literal["promote", "roll_back"]
    by: str  # who asked (the audit log's principal)


@dataclass(frozen=True, slots=True)
class RolloutState:
    """What the controller remembers between calls. Pass back what ``decide`` returned."""

    phase: Phase = "rolling"
    step: int = -1  # index into config.steps; -1: not started (weight 0)
    step_since_s: float | None = None
    baseline: VersionStats | None = None  # the primary's latest stats with enough requests
    override: Override | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one ``decide`` call: set the canary's weight to ``weight``."""

    action: Action
    weight: float  # the canary weight to apply now
    previous_weight: float
    reason: str
    breached: tuple[Threshold, ...] = ()  # on a rollback by measurement: the thresholds that failed

    @property
    def changed(self) -> bool:
        return self.weight != self.previous_weight


def override(state: RolloutState, action: Literal["promote", "roll_back"], by: str) -> RolloutState:
    """The state with a manual promote or rollback pending; the next ``decide`` carries it out."""
    return replace(state, override=Override(action=action, by=by))


def weight_of(state: RolloutState, config: RolloutConfig) -> float:
    """The canary weight ``state`` stands at."""
    if state.phase == "promoted":
        return 1.0
    if state.phase == "rolled_back" or state.step < 0:
        return 0.0
    return config.steps[min(state.step, len(config.steps) - 1)]


def apply(policy: TrafficPolicy, decision: Decision) -> TrafficPolicy:
    """The traffic policy after ``decision``: the canary's new weight; on a promotion the canary becomes the primary
    (and the policy has no canary); after a rollback the canary stays named at weight 0, for the dashboard to show.

    Raises:
        ValueError: the policy has no canary to move.
    """
    if policy.canary is None:
        raise ValueError("the traffic policy has no canary version; set one before a rollout")
    if decision.action == "promote":
        return TrafficPolicy.model_validate(
            {**policy.model_dump(), "primary": policy.canary, "canary": None, "canary_weight": 0.0}
        )
    return policy.with_canary_weight(decision.weight)


def decide(
    state: RolloutState, observation: Observation, config: RolloutConfig, now_s: float
) -> tuple[Decision, RolloutState]:
    """The canary's next weight (see the module docstring for the steps).

    Args:
        state: what the previous call returned; ``RolloutState()`` to start a rollout.
        observation: the primary's and the canary's counts over the window ending at ``now_s``.
        config: the validated rollout settings.
        now_s: the current time (any clock, the same on every call).

    Returns:
        The decision and the state for the next call. Pure: no I/O, no clock reads.
    """
    current = weight_of(state, config)
    if state.phase != "rolling":
        return _hold(
            current, f"rollout finished ({state.phase.replace('_', ' ')}): weight stays {_pct(current)}"
        ), state
    if state.override is not None:
        return _overridden(state, state.override, current)
    if state.step < 0:
        return _step_to(state, 0, config, now_s, current, "canary started")
    state = _remember_baseline(state, observation.primary, config)
    breaches = _breaches(state.baseline, observation, config)
    if breaches:
        return _rolled_back(state, current, breaches)
    waiting = _waiting(state, observation, config, now_s)
    if waiting is not None:
        return _hold(current, f"holding canary at {_pct(current)}: {waiting}"), state
    within = _within(state.baseline, observation, config)
    if state.step + 1 >= len(config.steps):
        decision = Decision("promote", 1.0, current, f"canary within limits at {_pct(current)} ({within}): promoted")
        return decision, replace(state, phase="promoted")
    return _step_to(state, state.step + 1, config, now_s, current, f"canary within limits ({within})")


# -- 2, 3, 8: actions ------------------------------------------------------------------------------------------
def _hold(weight: float, reason: str) -> Decision:
    return Decision("hold", weight, weight, reason)


def _overridden(state: RolloutState, wish: Override, current: float) -> tuple[Decision, RolloutState]:
    state = replace(state, override=None)
    if wish.action == "promote":
        return Decision("promote", 1.0, current, f"promoted by {wish.by} at {_pct(current)}"), replace(
            state, phase="promoted"
        )
    reason = f"rolled back by {wish.by} from {_pct(current)} to 0 %"
    return Decision("roll_back", 0.0, current, reason), replace(state, phase="rolled_back")


def _step_to(
    state: RolloutState, step: int, config: RolloutConfig, now_s: float, current: float, why: str
) -> tuple[Decision, RolloutState]:
    weight = config.steps[step]
    decision = Decision("step_up", weight, current, f"{why}: weight {_pct(current)} -> {_pct(weight)}")
    return decision, replace(state, step=step, step_since_s=now_s)


def _rolled_back(
    state: RolloutState, current: float, breaches: list[tuple[Threshold, str]]
) -> tuple[Decision, RolloutState]:
    why = "; ".join(text for _, text in breaches)
    reason = f"{why}: rolled back from {_pct(current)} to 0 %"
    decision = Decision("roll_back", 0.0, current, reason, breached=tuple(name for name, _ in breaches))
    return decision, replace(state, phase="rolled_back")


# -- 4, 5: baseline and thresholds ----------------------------------------------------------------------------
def _remember_baseline(state: RolloutState, primary: VersionStats, config: RolloutConfig) -> RolloutState:
    if primary.requests >= config.min_requests:
        return replace(state, baseline=primary)
    return state


def _breaches(
    baseline: VersionStats | None, observation: Observation, config: RolloutConfig
) -> list[tuple[Threshold, str]]:
    found: list[tuple[Threshold, str]] = []
    canary = observation.canary
    if canary.requests >= config.min_requests:
        primary_rate = baseline.error_rate if baseline is not None else 0.0
        limit = primary_rate + config.max_error_rate_increase
        if canary.error_rate > limit + _TOLERANCE:
            found.append(
                (
                    "error_rate",
                    f"canary errors {_pct(canary.error_rate)} against primary {_pct(primary_rate)} "
                    f"(limit +{_pct(config.max_error_rate_increase)})",
                )
            )
        primary_p99 = baseline.p99_ms if baseline is not None else None
        if (
            canary.p99_ms is not None
            and primary_p99 is not None
            and canary.p99_ms > primary_p99 * config.max_p99_ratio + _TOLERANCE
        ):
            found.append(
                (
                    "p99",
                    f"canary p99 {_num(canary.p99_ms)} ms against primary {_num(primary_p99)} ms "
                    f"(limit x{_num(config.max_p99_ratio)})",
                )
            )
    if _agreement_judged(observation, config) and observation.agreement is not None:
        floor = config.min_agreement or 0.0
        if observation.agreement < floor - _TOLERANCE:
            found.append(
                (
                    "agreement",
                    f"shadow agreement {_num(observation.agreement)} over {observation.agreement_samples} "
                    f"comparisons (limit at least {_num(floor)})",
                )
            )
    return found


def _agreement_judged(observation: Observation, config: RolloutConfig) -> bool:
    return config.min_agreement is not None and observation.agreement_samples >= config.min_agreement_samples


# -- 6, 7: waiting --------------------------------------------------------------------------------------------
def _waiting(state: RolloutState, observation: Observation, config: RolloutConfig, now_s: float) -> str | None:
    canary = observation.canary
    if canary.requests < config.min_requests:
        return f"too few samples ({canary.requests} of {config.min_requests} canary requests)"
    if state.baseline is None:
        return f"no primary baseline yet (the primary needs {config.min_requests} requests in a window)"
    if config.agreement_required and not _agreement_judged(observation, config):
        return f"too few samples ({observation.agreement_samples} of {config.min_agreement_samples} shadow comparisons)"
    held_s = now_s - (state.step_since_s if state.step_since_s is not None else now_s)
    if held_s < config.hold_s:
        return f"held {_num(held_s)}s of {_num(config.hold_s)}s"
    return None


def _within(baseline: VersionStats | None, observation: Observation, config: RolloutConfig) -> str:
    canary = observation.canary
    parts = [f"{canary.requests} requests"]
    if baseline is not None:
        parts.append(f"errors {_pct(canary.error_rate)} vs {_pct(baseline.error_rate)}")
        if canary.p99_ms is not None and baseline.p99_ms is not None:
            parts.append(f"p99 {_num(canary.p99_ms)} ms vs {_num(baseline.p99_ms)} ms")
    if _agreement_judged(observation, config) and observation.agreement is not None:
        parts.append(f"agreement {_num(observation.agreement)}")
    return ", ".join(parts)


def _pct(fraction: float) -> str:
    """0.075 -> '7.5 %', 0.004 -> '0.4 %', 1.0 -> '100 %'."""
    return f"{_num(fraction * 100)} %"


def _num(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}".rstrip("0").rstrip(".")
