"""The pure rollout controller, by tables: start, holds (samples, baseline, hold time), steps up, promotion,
rollback on each threshold, manual overrides, finished rollouts, config conflicts, and whole rollouts driven
through simulated windows (a healthy canary reaches 100 %, an injected failure rate rolls back within a window)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from fleet.lifecycle.controller import (
    Decision,
    Observation,
    RolloutConfig,
    RolloutState,
    VersionStats,
    apply,
    decide,
    override,
    weight_of,
)
from fleet.lifecycle.traffic import TrafficPolicy

CONFIG = RolloutConfig(steps=(0.05, 0.1, 0.5, 1.0), min_requests=100, hold_s=60, min_agreement_samples=50)
PRIMARY = VersionStats(requests=1000, errors=4, p99_ms=40.0)  # 0.4 % errors


def obs(
    requests: int = 200,
    errors: int = 1,
    p99_ms: float | None = 42.0,
    agreement: float | None = None,
    samples: int = 0,
    primary: VersionStats = PRIMARY,
) -> Observation:
    return Observation(primary, VersionStats(requests, errors, p99_ms), agreement, samples)


def at_step(step: int, since_s: float = 0.0, baseline: VersionStats | None = PRIMARY) -> RolloutState:
    return RolloutState(step=step, step_since_s=since_s, baseline=baseline)


# -- one decision ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "observation", "now_s", "action", "weight", "reason"),
    [
        (RolloutState(), obs(), 0, "step_up", 0.05, "canary started: weight 0 % -> 5 %"),
        (at_step(0), obs(requests=99), 600, "hold", 0.05, "holding canary at 5 %: too few samples (99 of 100"),
        (at_step(0), obs(), 30, "hold", 0.05, "holding canary at 5 %: held 30s of 60s"),
        (
            at_step(0, baseline=None),
            obs(primary=VersionStats(50, 0, 40.0)),
            600,
            "hold",
            0.05,
            "no primary baseline yet",
        ),
        (at_step(0), obs(), 60, "step_up", 0.1, "canary within limits (200 requests, errors 0.5 % vs 0.4 %, p99 42"),
        (at_step(1), obs(), 60, "step_up", 0.5, "weight 10 % -> 50 %"),
        (at_step(3), obs(primary=VersionStats(0, 0)), 60, "promote", 1.0, "canary within limits at 100 %"),
        (
            at_step(1),
            obs(errors=15),
            0,
            "roll_back",
            0.0,
            "canary errors 7.5 % against primary 0.4 % (limit +2 %): rolled back from 10 % to 0 %",
        ),
        (
            at_step(1),
            obs(p99_ms=61.0),
            0,
            "roll_back",
            0.0,
            "canary p99 61 ms against primary 40 ms (limit x1.5): rolled back",
        ),
        (
            at_step(1),
            obs(agreement=0.9, samples=50),
            0,
            "roll_back",
            0.0,
            "shadow agreement 0.9 over 50 comparisons (limit at least 0.95): rolled back",
        ),
        (
            at_step(1),
            obs(requests=250, errors=6, p99_ms=60.0),
            60,
            "step_up",
            0.5,
            "errors 2.4 % vs 0.4 %",
        ),  # at the limits
        (at_step(1), obs(agreement=0.5, samples=49), 60, "step_up", 0.5, "canary within limits"),  # too few to judge
        (at_step(1), obs(p99_ms=None), 60, "step_up", 0.5, "canary within limits (200 requests, errors"),
        (at_step(1), obs(requests=99, errors=99), 0, "hold", 0.1, "too few samples"),  # no verdict on 99
    ],
    ids=[
        "start",
        "too-few-samples",
        "holding",
        "no-baseline",
        "step-up",
        "step-up-again",
        "promote-after-the-last-step",
        "error-rate-rolls-back",
        "p99-rolls-back",
        "agreement-rolls-back",
        "at-the-limits-passes",
        "agreement-with-few-samples-not-judged",
        "unmeasured-latency-passes",
        "breach-on-few-samples-not-judged",
    ],
)
def test_one_decision(
    state: RolloutState, observation: Observation, now_s: float, action: str, weight: float, reason: str
) -> None:
    decision, _ = decide(state, observation, CONFIG, now_s)
    assert (decision.action, decision.weight) == (action, weight), decision.reason
    assert reason in decision.reason, decision.reason


def test_every_breached_threshold_is_named() -> None:
    decision, state = decide(at_step(2), obs(errors=100, p99_ms=500, agreement=0.1, samples=60), CONFIG, 0)
    assert decision.breached == ("error_rate", "p99", "agreement")
    assert decision.reason.count(";") == 2 and decision.reason.endswith("rolled back from 50 % to 0 %")
    assert (state.phase, decision.previous_weight, decision.changed) == ("rolled_back", 0.5, True)


def test_a_step_up_restarts_the_hold_clock() -> None:
    decision, state = decide(at_step(0, since_s=0), obs(), CONFIG, now_s=100)
    assert (decision.action, state.step, state.step_since_s) == ("step_up", 1, 100)
    decision, _ = decide(state, obs(), CONFIG, now_s=130)
    assert decision.reason == "holding canary at 10 %: held 30s of 60s"


def test_the_baseline_survives_a_window_where_the_primary_served_little() -> None:
    _, state = decide(at_step(2, baseline=None), obs(primary=VersionStats(500, 50, 30.0)), CONFIG, 0)
    assert state.baseline == VersionStats(500, 50, 30.0)
    decision, state = decide(state, obs(errors=20, primary=VersionStats(3, 0, 1.0)), CONFIG, 60)
    assert decision.action == "step_up" and "errors 10 % vs 10 %" in decision.reason, decision.reason
    assert state.baseline == VersionStats(500, 50, 30.0)


def test_agreement_required_holds_until_enough_comparisons() -> None:
    config = CONFIG.model_copy(update={"agreement_required": True})
    decision, _ = decide(at_step(0), obs(agreement=1.0, samples=10), config, 600)
    assert decision.reason == "holding canary at 5 %: too few samples (10 of 50 shadow comparisons)"
    decision, _ = decide(at_step(0), obs(agreement=0.99, samples=50), config, 600)
    assert decision.action == "step_up" and "agreement 0.99" in decision.reason


# -- overrides and finished rollouts ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("wish", "observation", "action", "weight", "phase", "reason"),
    [
        ("promote", obs(requests=3), "promote", 1.0, "promoted", "promoted by alice at 10 %"),
        ("roll_back", obs(), "roll_back", 0.0, "rolled_back", "rolled back by alice from 10 % to 0 %"),
        (
            "promote",
            obs(errors=200),
            "promote",
            1.0,
            "promoted",
            "promoted by alice at 10 %",
        ),  # a person overrides a breach
    ],
    ids=["promote-with-few-samples", "roll-back-while-healthy", "promote-over-a-breach"],
)
def test_a_manual_override_is_carried_out_at_once(
    wish: Any, observation: Observation, action: str, weight: float, phase: str, reason: str
) -> None:
    decision, state = decide(override(at_step(1), wish, "alice"), observation, CONFIG, 0)
    assert (decision.action, decision.weight, state.phase, state.override) == (action, weight, phase, None)
    assert decision.reason == reason


@pytest.mark.parametrize(("phase", "weight"), [("promoted", 1.0), ("rolled_back", 0.0)])
def test_a_finished_rollout_holds_whatever_it_observes(phase: Any, weight: float) -> None:
    state = RolloutState(phase=phase, step=1)
    for observation in (obs(), obs(errors=200), obs(agreement=0.0, samples=1000)):
        decision, _ = decide(override(state, "promote", "bob"), observation, CONFIG, 1000)
        assert (decision.action, decision.weight, decision.changed) == ("hold", weight, False)
        assert decision.reason.startswith("rollout finished")
    assert weight_of(state, CONFIG) == weight


# -- applying a decision to the traffic policy ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("action", "weight", "expected"),
    [
        ("step_up", 0.25, {"primary": "1", "canary": "2", "canary_weight": 0.25}),
        ("hold", 0.1, {"primary": "1", "canary": "2", "canary_weight": 0.1}),
        ("roll_back", 0.0, {"primary": "1", "canary": "2", "canary_weight": 0.0}),
        ("promote", 1.0, {"primary": "2", "canary": None, "canary_weight": 0.0}),
    ],
    ids=["step-up", "hold", "roll-back-keeps-the-canary-named", "promote-makes-it-primary"],
)
def test_apply(action: Any, weight: float, expected: dict[str, Any]) -> None:
    policy = TrafficPolicy(primary="1", canary="2", canary_weight=0.1, shadow="3", shadow_share=0.2)
    after = apply(policy, Decision(action, weight, 0.1, "why"))
    assert after.model_dump(include={"primary", "canary", "canary_weight"}) == expected
    assert (after.shadow, after.shadow_share) == ("3", 0.2)


def test_apply_needs_a_canary() -> None:
    with pytest.raises(ValueError, match="no canary version"):
        apply(TrafficPolicy(primary="1"), Decision("step_up", 0.05, 0.0, "why"))


# -- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": (0.1, 0.05, 1.0)}, "steps must rise strictly"),
        ({"steps": (0.1, 0.1, 1.0)}, "steps must rise strictly"),
        ({"steps": (0.1, 0.5)}, "the last step must be 1.0"),
        ({"steps": (0.0, 1.0)}, r"every step is a weight in \(0, 1\]"),
        ({"steps": (0.5, 1.5)}, r"every step is a weight in \(0, 1\]"),
        ({"steps": ()}, "at least 1 item"),
        ({"max_p99_ratio": 0.9}, "greater than or equal to 1"),
        ({"min_agreement": 1.1}, "less than or equal to 1"),
        ({"min_requests": 0}, "greater than or equal to 1"),
    ],
    ids=[
        "falling",
        "repeated",
        "not-to-one",
        "zero-step",
        "above-one",
        "no-steps",
        "ratio-below-one",
        "agreement",
        "no-samples",
    ],
)
def test_invalid_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RolloutConfig.model_validate(fields)


def test_a_single_step_rollout_promotes_after_its_hold() -> None:
    config = RolloutConfig(steps=(1.0,), min_requests=10, hold_s=0)
    decision, state = decide(RolloutState(), obs(), config, 0)
    assert (decision.action, decision.weight) == ("step_up", 1.0)
    decision, state = decide(state, obs(), config, 0)
    assert (decision.action, state.phase) == ("promote", "promoted")


# -- whole rollouts through simulated windows -----------------------------------------------------------------
@dataclass
class Rollout:
    """Drives the controller once per window: each window's requests split by the weight, errors drawn at the
    given rates, as a shell reading its metrics would."""

    config: RolloutConfig
    canary_error_rate: float = 0.002
    primary_error_rate: float = 0.004
    rate_per_window: int = 4_000
    window_s: float = 30.0
    state: RolloutState = field(default_factory=RolloutState)
    rng: random.Random = field(default_factory=lambda: random.Random(5))
    weights: list[float] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def window(self, now_s: float) -> Decision:
        weight = weight_of(self.state, self.config)
        canary_n = round(self.rate_per_window * weight)
        primary_n = self.rate_per_window - canary_n
        canary = VersionStats(canary_n, self._errors(canary_n, self.canary_error_rate), 45.0)
        primary = VersionStats(primary_n, self._errors(primary_n, self.primary_error_rate), 40.0)
        decision, self.state = decide(self.state, Observation(primary, canary), self.config, now_s)
        self.weights.append(decision.weight)
        self.decisions.append(decision)
        return decision

    def _errors(self, n: int, rate: float) -> int:
        return sum(self.rng.random() < rate for _ in range(n))

    def run(self, windows: int) -> None:
        for i in range(windows):
            self.window(i * self.window_s)


def test_a_healthy_canary_steps_up_to_a_promotion() -> None:
    rollout = Rollout(RolloutConfig(min_requests=150, hold_s=60))
    rollout.run(20)
    actions = [d.action for d in rollout.decisions]
    assert "roll_back" not in actions
    assert actions.count("step_up") == 5 and actions.count("promote") == 1
    assert rollout.state.phase == "promoted" and rollout.weights[-1] == 1.0
    assert rollout.weights == sorted(rollout.weights)  # never down


def test_an_injected_failure_rate_rolls_back_within_one_window() -> None:
    rollout = Rollout(RolloutConfig(min_requests=150, hold_s=60))
    rollout.run(6)
    weight = rollout.weights[-1]
    assert rollout.state.phase == "rolling" and weight >= 0.1
    rollout.canary_error_rate = 0.10  # the canary starts failing one request in ten
    decision = rollout.window(6 * rollout.window_s)
    assert decision.action == "roll_back" and decision.weight == 0.0
    assert decision.breached == ("error_rate",)
    assert decision.reason.endswith(f"rolled back from {weight * 100:g} % to 0 %"), decision.reason
    rollout.canary_error_rate = 0.0
    rollout.run(3)
    assert {d.action for d in rollout.decisions[-3:]} == {"hold"} and rollout.weights[-1] == 0.0
