"""The pure scaling policy and its config, by tables: formulas, bounds, activation, rate limit, stabilization,
stale and paused signals, the predictive term, config conflicts, and flapping under sawtooth loads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.policy import Decision, PolicyState, Signals, decide

# A config without smoothing, so that a single decision shows the formula's result.
IMMEDIATE: dict[str, Any] = {"max_replicas": 100, "scale_up_step": 100, "scale_down_stabilization_s": 0}


def sig(
    *,
    lag: int | None = 0,
    arrival: float | None = 0.0,
    throughput: float | None = 4.0,
    current: int = 1,
    at_s: float = 0.0,
    partitions: int | None = None,
) -> Signals:
    return Signals(
        at_s=at_s,
        lag=lag,
        arrival_rate=arrival,
        throughput_per_replica=throughput,
        current_replicas=current,
        partitions=partitions,
    )


def once(signals: Signals, **config: Any) -> Decision:
    decision, _ = decide(signals, ScalingConfig(**config), PolicyState(), now_s=signals.at_s)
    return decision


@dataclass
class Run:
    """Successive decisions where each one is carried out at once (the backend follows the policy)."""

    config: ScalingConfig
    replicas: int = 0
    state: PolicyState = PolicyState()  # noqa: RUF009 - frozen dataclass, safe as a default

    def step(self, t: float, lag: int, arrival: float = 0.0, throughput: float | None = 4.0) -> Decision:
        signals = Signals(t, lag, arrival, throughput, self.replicas)
        decision, self.state = decide(signals, self.config, self.state, now_s=t)
        self.replicas = decision.replicas
        return decision


def changes(history: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(history) if a != b)


def down_then_up(history: list[int]) -> int:
    """How often a scale-down is followed by a scale-up: the flapping a stabilization window must prevent."""
    moves = [b - a for a, b in itertools.pairwise(history) if a != b]
    return sum(1 for m1, m2 in itertools.pairwise(moves) if m1 < 0 < m2)


# -- formulas -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("signals", "config", "expected"),
    [
        (sig(lag=900, arrival=0), {}, 8),  # 900 / 30 = 30 jobs/s over 4/s
        (sig(lag=0, arrival=12), {}, 3),
        (sig(lag=900, arrival=12), {}, 11),  # (12 + 30) / 4 = 10.5
        (sig(lag=900, arrival=12), {"target_drain_s": 90}, 6),  # (12 + 10) / 4 = 5.5
        (sig(lag=0, arrival=0.3, throughput=0.1), {}, 3),  # 3.0000000000000004 is still 3
        (sig(lag=0, arrival=12, throughput=None), {"default_throughput_per_replica": 6}, 2),
        (sig(lag=0, arrival=12, throughput=0.0), {"default_throughput_per_replica": 6}, 2),  # idle heartbeats
        (sig(lag=0, arrival=12, throughput=4), {"default_throughput_per_replica": 1}, 3),  # measured wins
        (sig(lag=0, arrival=0.5, throughput=4), {}, 1),
    ],
    ids=[
        "backlog-only",
        "arrivals-only",
        "backlog-plus-arrivals",
        "longer-drain-target",
        "float-noise-not-rounded-up",
        "default-throughput-without-heartbeats",
        "default-throughput-when-heartbeats-say-zero",
        "heartbeat-throughput-beats-default",
        "trickle-keeps-one",
    ],
)
def test_rate_mode_formula(signals: Signals, config: dict[str, Any], expected: int) -> None:
    decision = once(signals, **IMMEDIATE, **config)
    assert (decision.desired, decision.replicas) == (expected, expected)
    assert decision.changed == (expected != signals.current_replicas)
    assert f"-> {expected}" in decision.reason


def test_rate_mode_reason_names_the_numbers() -> None:
    decision = once(sig(lag=900, arrival=12, current=2), **IMMEDIATE)
    assert decision.reason == ("scale up 2 -> 11: lag 900 / drain 30s + arrival 12/s = 42/s over 4/s per replica -> 11")


def test_a_fast_models_throughput_reads_without_its_decimals() -> None:
    decision = once(sig(lag=5, arrival=0, throughput=222568.58, current=1), **IMMEDIATE)
    assert "over 223k/s per replica" in decision.reason, decision.reason
    decision = once(sig(lag=5, arrival=0, throughput=1234.5, current=1), **IMMEDIATE)
    assert "over 1234/s per replica" in decision.reason, decision.reason


@pytest.mark.parametrize(
    ("lag", "current", "expected"),
    [(0, 1, 0), (1, 1, 1), (100, 1, 10), (101, 1, 11), (5000, 3, 100)],
    ids=["no-lag-scales-to-zero", "one-job-one-replica", "exact-multiple", "remainder-rounds-up", "max-bounds"],
)
def test_keda_mode_formula(lag: int, current: int, expected: int) -> None:
    decision = once(
        sig(lag=lag, arrival=None, throughput=None, current=current), mode="keda", lag_per_replica=10, **IMMEDIATE
    )
    assert decision.replicas == expected
    assert f"lag {lag} / 10 per replica" in decision.reason


@pytest.mark.parametrize(
    ("current", "lag", "arrival", "expected_replicas", "expected_reason"),
    [
        (0, 5, 0.0, 1, "scale up 0 -> 1: throughput unknown"),
        (3, 5, 0.0, 3, "hold 3: throughput unknown"),
        (3, 0, 2.0, 3, "keeping 3 while lag is 0 and arrival 2/s"),
        (3, 0, 0.0, 0, "scale down 3 -> 0: throughput unknown; no lag and no arrivals"),
    ],
    ids=["wakes-one-for-a-backlog", "keeps-what-it-has-with-backlog", "keeps-what-it-has-with-traffic", "idle-to-zero"],
)
def test_unknown_throughput_keeps_at_least_one_replica_while_there_is_work(
    current: int, lag: int, arrival: float, expected_replicas: int, expected_reason: str
) -> None:
    decision = once(sig(lag=lag, arrival=arrival, throughput=None, current=current), **IMMEDIATE)
    assert decision.replicas == expected_replicas
    assert expected_reason in decision.reason


# -- bounds ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("signals", "config", "desired", "expected", "note"),
    [
        (sig(lag=900, arrival=12), {"max_replicas": 8}, 11, 8, "capped at max_replicas 8"),
        (sig(lag=0, arrival=0), {"min_replicas": 2}, 0, 2, "raised to min_replicas 2"),
        (sig(lag=900, arrival=12, partitions=3), {"max_replicas": 8}, 11, 3, "capped at 3 partitions"),
        (sig(lag=0, arrival=40, partitions=3), {"min_replicas": 5, "max_replicas": 8}, 10, 3, "capped at 3 partitions"),
        (sig(lag=900, arrival=12, partitions=16), {"max_replicas": 8}, 11, 8, "capped at max_replicas 8"),
        (sig(lag=900, arrival=12, partitions=0), {"max_replicas": 8}, 11, 8, "capped at max_replicas 8"),
    ],
    ids=[
        "max",
        "min",
        "partitions-below-max",
        "partitions-win-over-min",
        "partitions-above-max",
        "zero-partitions-means-unknown",
    ],
)
def test_bounds_and_partition_cap(
    signals: Signals, config: dict[str, Any], desired: int, expected: int, note: str
) -> None:
    decision = once(signals, **{**IMMEDIATE, **config})
    assert (decision.desired, decision.replicas) == (desired, expected)  # desired is the unbounded recommendation
    assert note in decision.reason


def test_lowered_max_takes_effect_at_once_despite_the_stabilization_window() -> None:
    run = Run(ScalingConfig(max_replicas=8, scale_up_step=8, scale_down_stabilization_s=300))
    assert run.step(0, lag=900, arrival=12).replicas == 8
    run.config = run.config.with_changes(max_replicas=3)
    decision = run.step(5, lag=900, arrival=12)
    assert decision.replicas == 3
    assert decision.reason.startswith("scale down 8 -> 3")


# -- activation: 0 <-> 1 --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("current", "lag", "arrival", "config", "expected", "note"),
    [
        (0, 5, 0.0, {"activation_lag": 10}, 0, "inactive: lag 5 <= activation_lag 10"),
        (0, 10, 0.0, {"activation_lag": 10}, 0, "inactive: lag 10 <= activation_lag 10"),
        (0, 11, 0.0, {"activation_lag": 10}, 1, "scale up 0 -> 1"),
        (0, 1, 0.0, {}, 1, "scale up 0 -> 1"),
        (0, 0, 5.0, {}, 0, "inactive: lag 0 <= activation_lag 0"),
        (1, 5, 0.0, {"activation_lag": 10}, 1, "hold 1"),
        (1, 0, 2.0, {}, 1, "hold 1"),
        (1, 0, 0.0, {}, 0, "scale down 1 -> 0"),
        (1, 0, 0.0, {"min_replicas": 1}, 1, "raised to min_replicas 1"),
        (2, 0, 0.0, {"mode": "keda", "lag_per_replica": 10}, 0, "scale down 2 -> 0"),
    ],
    ids=[
        "zero-stays-below-threshold",
        "zero-stays-at-threshold",
        "zero-wakes-above-threshold",
        "zero-wakes-on-any-lag-by-default",
        "arrivals-alone-do-not-wake",
        "running-keeps-a-backlog-below-threshold",
        "running-keeps-serving-traffic",
        "idle-goes-to-zero",
        "min-one-never-sleeps",
        "keda-idle-goes-to-zero",
    ],
)
def test_activation_both_ways(
    current: int, lag: int, arrival: float, config: dict[str, Any], expected: int, note: str
) -> None:
    decision = once(sig(lag=lag, arrival=arrival, current=current), **{**IMMEDIATE, **config})
    assert decision.replicas == expected
    assert note in decision.reason


# -- scale-up rate limit --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "times_s", "expected"),
    [
        ({"scale_up_step": 2, "scale_up_interval_s": 10}, [0, 2, 4, 10, 12, 20, 30], [2, 2, 2, 4, 4, 6, 8]),
        ({"scale_up_step": 3, "scale_up_interval_s": 0}, [0, 1, 2, 3], [3, 6, 9, 10]),
        ({"scale_up_step": 100, "scale_up_interval_s": 60}, [0, 1], [10, 10]),
    ],
    ids=["two-per-ten-seconds", "interval-zero-is-per-decision", "large-step-is-immediate"],
)
def test_scale_up_is_rate_limited_over_successive_calls(
    config: dict[str, Any], times_s: list[float], expected: list[int]
) -> None:
    run = Run(ScalingConfig(max_replicas=10, **config))
    assert [run.step(t, lag=3000, arrival=0).replicas for t in times_s] == expected


def test_rate_limited_reason_says_so() -> None:
    decision = once(sig(lag=900, arrival=12, current=0), max_replicas=8)
    assert decision.reason.startswith("scale up 0 -> 4: ")
    assert decision.reason.endswith("capped at max_replicas 8; limited to +4 per 5s")


# -- stabilization --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("window_s", "max_changes", "max_down_then_up"),
    [(60, 2, 0), (0, 40, 19)],
    ids=["stabilized-does-not-flap", "without-window-it-flaps"],
)
def test_flapping_input_does_not_flap_the_fleet(window_s: float, max_changes: int, max_down_then_up: int) -> None:
    run = Run(ScalingConfig(max_replicas=10, scale_up_step=10, scale_down_stabilization_s=window_s))
    history = [run.step(t, lag=600 if (t // 5) % 2 == 0 else 0, arrival=8).replicas for t in range(0, 200, 5)]
    assert changes(history) <= max_changes
    assert down_then_up(history) <= max_down_then_up
    if window_s:
        assert history[0] == max(history) == history[-1] == 7  # (8 + 600 / 30) / 4 = 7, held throughout
    else:
        assert down_then_up(history) > 10  # the control: the same input flaps without a window


def test_scale_down_waits_for_the_whole_window_then_goes_to_the_highest_recent_recommendation() -> None:
    run = Run(ScalingConfig(max_replicas=10, scale_up_step=10, scale_down_stabilization_s=30), replicas=1)
    assert run.step(0, lag=0, arrival=32).replicas == 8
    assert run.step(10, lag=0, arrival=16).replicas == 8  # recommends 4
    assert run.step(20, lag=0, arrival=8).replicas == 8  # recommends 2
    held = run.step(30, lag=0, arrival=4)  # recommends 1; 8 from t=0 is just out of the window
    assert (held.replicas, held.desired) == (4, 1)
    assert "down to 4, the highest recommendation within the last 30s" in held.reason
    assert run.step(40, lag=0, arrival=4).replicas == 2
    assert run.step(50, lag=0, arrival=4).replicas == 1
    hold = run.step(55, lag=0, arrival=4)
    assert (hold.replicas, hold.changed, hold.reason.split(":")[0]) == (1, False, "hold 1")


# -- stale and paused -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("signals", "now_s", "expected_reason"),
    [
        (sig(lag=900, arrival=12, current=2, at_s=0), 31.0, "stale signals (read 31s ago, stale after 30s): holding 2"),
        (sig(lag=None, arrival=12, current=2, at_s=0), 0.0, "lag unknown: holding 2"),
        (sig(lag=0, arrival=0, current=2, at_s=0), 100.0, "stale signals (read 100s ago, stale after 30s): holding 2"),
    ],
    ids=["old-signals-do-not-scale-up", "unknown-lag", "old-idle-signals-do-not-scale-to-zero"],
)
def test_stale_signals_keep_the_current_replicas(signals: Signals, now_s: float, expected_reason: str) -> None:
    state = PolicyState(recommendations=((now_s - 1, 2),))
    decision, after = decide(signals, ScalingConfig(**IMMEDIATE), state, now_s=now_s)
    assert (decision.replicas, decision.changed, decision.reason) == (2, False, expected_reason)
    assert after == state  # stale readings leave no trace in the windows


def test_signals_at_the_staleness_limit_are_still_used() -> None:
    decision, _ = decide(sig(lag=900, arrival=12, current=2, at_s=0), ScalingConfig(**IMMEDIATE), PolicyState(), 30.0)
    assert decision.replicas == 11


@pytest.mark.parametrize(
    ("signals", "now_s", "expected_desired", "expected_reason"),
    [
        (sig(lag=900, arrival=12, current=2), 0.0, 11, "paused: holding 2; signals ask for 11 (lag 900 / drain 30s"),
        (sig(lag=0, arrival=0, current=2), 0.0, 0, "paused: holding 2; signals ask for 0"),
        (sig(lag=900, arrival=12, current=2), 60.0, 2, "paused: holding 2 (stale signals"),
    ],
    ids=["would-scale-up", "would-scale-to-zero", "paused-and-stale"],
)
def test_paused_keeps_the_current_replicas_and_shows_the_recommendation(
    signals: Signals, now_s: float, expected_desired: int, expected_reason: str
) -> None:
    decision, state = decide(signals, ScalingConfig(paused=True, **IMMEDIATE), PolicyState(), now_s=now_s)
    assert (decision.replicas, decision.desired, decision.changed) == (2, expected_desired, False)
    assert decision.reason.startswith(expected_reason)
    assert state == PolicyState()


# -- predictive term ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arrivals", "horizon_s", "expected"),
    [
        ([4, 8, 12], 10, 5),  # +0.8/s per s: 20/s expected in 10s over 4/s
        ([12, 12, 12], 10, 3),
        ([20, 16, 12], 10, 3),  # a falling trend never removes capacity below the current need
        ([4, 8, 12], None, 3),
        ([12], 10, 3),  # one sample is no trend
    ],
    ids=["rising-adds-ahead", "flat-adds-nothing", "falling-removes-nothing", "off-by-default", "single-sample"],
)
def test_predictive_term(arrivals: list[float], horizon_s: float | None, expected: int) -> None:
    run = Run(ScalingConfig(predictive_horizon_s=horizon_s, **IMMEDIATE), replicas=3)
    decisions = [run.step(5.0 * i, lag=0, arrival=rate) for i, rate in enumerate(arrivals)]
    assert decisions[-1].desired == expected
    assert ("arrival rising 0.8/s per s: 20/s expected in 10s -> 5" in decisions[-1].reason) == (expected == 5)


def test_predictive_trend_forgets_samples_older_than_its_window() -> None:
    run = Run(ScalingConfig(predictive_horizon_s=10, trend_window_s=12, min_replicas=1, **IMMEDIATE), replicas=3)
    for i, rate in enumerate([0, 0, 0, 12, 12, 12]):  # the ramp from 0 to 12 is more than 12s old at the end
        decision = run.step(5.0 * i, lag=0, arrival=rate)
    assert decision.desired == 3
    assert len(run.state.arrivals) == 3


# -- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"min_replicas": 5, "max_replicas": 4}, ("min_replicas", "max_replicas")),
        ({"mode": "keda"}, ("mode", "lag_per_replica")),
        ({"lag_per_replica": 100}, ("lag_per_replica", "mode")),
        ({"mode": "keda", "lag_per_replica": 10, "predictive_horizon_s": 20}, ("predictive_horizon_s", "mode")),
        (
            {"mode": "keda", "lag_per_replica": 10, "default_throughput_per_replica": 5},
            ("default_throughput_per_replica", "mode"),
        ),
        ({"activation_lag": 10, "min_replicas": 1}, ("activation_lag", "min_replicas")),
    ],
    ids=[
        "min-above-max",
        "keda-without-lag-per-replica",
        "lag-per-replica-in-rate-mode",
        "predictive-in-keda-mode",
        "default-throughput-in-keda-mode",
        "activation-without-scale-to-zero",
    ],
)
def test_conflicting_settings_are_rejected_naming_both(settings: dict[str, Any], names: tuple[str, str]) -> None:
    with pytest.raises(ValueError) as raised:
        ScalingConfig(**settings)
    message = str(raised.value)
    assert names[0] in message and names[1] in message


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"max_replicas": 0}, "max_replicas"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"predictive_horizon_s": 0}, "predictive_horizon_s"),
        ({"predictive_horizon_s": -5}, "predictive_horizon_s"),
        ({"stale_after_s": 0}, "stale_after_s"),
        ({"target_drain_s": 0}, "target_drain_s"),
        ({"scale_up_step": 0}, "scale_up_step"),
        ({"mode": "keda", "lag_per_replica": 0}, "lag_per_replica"),
        ({"default_throughput_per_replica": 0}, "default_throughput_per_replica"),
        ({"mode": "hpa"}, "mode"),
        ({"max_replica": 4}, "max_replica"),
    ],
    ids=[
        "max-zero",
        "min-negative",
        "horizon-zero",
        "horizon-negative",
        "stale-zero",
        "drain-zero",
        "step-zero",
        "lag-per-replica-zero",
        "throughput-zero",
        "unknown-mode",
        "misspelt-setting",
    ],
)
def test_out_of_range_settings_are_rejected(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ScalingConfig(**settings)
    assert field in str(raised.value)


def test_every_conflict_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        ScalingConfig(min_replicas=5, max_replicas=4, lag_per_replica=3)
    assert "min_replicas (5) is above max_replicas (4)" in str(raised.value)
    assert "lag_per_replica (3) only applies with mode 'keda'" in str(raised.value)


def test_with_changes_validates_again_and_the_config_is_frozen() -> None:
    config = ScalingConfig(activation_lag=10)
    assert config.with_changes(max_replicas=9, paused=True).max_replicas == 9
    assert config.with_changes(max_replicas=9).activation_lag == 10
    with pytest.raises(ValueError, match=r"activation_lag.*min_replicas"):
        config.with_changes(min_replicas=1)
    with pytest.raises(ValidationError):
        config.max_replicas = 9  # type: ignore[misc]


def test_every_setting_is_documented() -> None:
    undocumented = [name for name, f in ScalingConfig.model_fields.items() if not f.description]
    assert undocumented == []


# -- whole runs -----------------------------------------------------------------------------------------------
def simulate(config: ScalingConfig, arrivals: list[float], *, step_s: float = 5.0) -> tuple[list[int], list[float]]:
    """A fleet whose replicas each finish 4 jobs/s and start at once; returns the replicas and lag over time."""
    run, lag, replicas, lags = Run(config), 0.0, [], []
    for i, arrival in enumerate(arrivals):
        replicas.append(run.step(i * step_s, lag=round(lag), arrival=arrival).replicas)
        lag = max(0.0, lag + (arrival - run.replicas * 4.0) * step_s)
        lags.append(lag)
    return replicas, lags


def sawtooth(teeth: int, period_s: float = 60.0, peak: float = 20.0, step_s: float = 5.0) -> list[float]:
    per_tooth = int(period_s / step_s)
    return [peak * (i % per_tooth) / per_tooth for i in range(teeth * per_tooth)]


@pytest.mark.parametrize(
    ("config", "max_changes"),
    [
        ({"scale_down_stabilization_s": 60}, 6),
        ({"scale_down_stabilization_s": 60, "predictive_horizon_s": 10}, 6),
    ],
    ids=["rate", "rate-predictive"],
)
def test_sawtooth_load_scales_out_drains_and_does_not_flap(config: dict[str, Any], max_changes: int) -> None:
    load = [*sawtooth(teeth=10), *[0.0] * 24]  # ten one-minute ramps from 0 to 20 jobs/s, then two idle minutes
    replicas, lags = simulate(ScalingConfig(max_replicas=8, **config), load)
    naive, _ = simulate(ScalingConfig(max_replicas=8, scale_down_stabilization_s=0, scale_up_step=8), load)
    assert changes(replicas) <= max_changes
    assert down_then_up(replicas) == 0
    assert changes(naive) >= 5 * changes(replicas)  # the control: without a window the same load flaps
    assert max(lags) < 400  # the backlog stays bounded...
    assert lags[-1] == 0 and replicas[-1] == 0  # ...drains, and the fleet scales to zero afterwards


def test_keda_mode_on_a_sawtooth_cycles_at_most_once_per_stabilization_window() -> None:
    """Lag-only scaling cycles by nature (capacity that keeps up empties the lag, and the lag was its only signal);
    the window bounds how often: a scale-up after a scale-down needs a whole window of low recommendations between.
    Rate mode, above, also counts the arrivals and holds steady instead."""
    load = [*sawtooth(teeth=10), *[0.0] * 24]  # 720 s in all
    config = ScalingConfig(mode="keda", lag_per_replica=20, max_replicas=8, scale_down_stabilization_s=60)
    replicas, lags = simulate(config, load)
    naive, _ = simulate(ScalingConfig(max_replicas=8, scale_down_stabilization_s=0, scale_up_step=8), load)
    assert 1 <= down_then_up(replicas) <= 720 // 60
    assert changes(replicas) < changes(naive) / 2
    assert max(lags) < 400
    assert lags[-1] == 0 and replicas[-1] == 0
