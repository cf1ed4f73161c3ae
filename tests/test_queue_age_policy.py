"""Scaling on waiting time, by tables: the age rule of the pure policy (``max_queue_age_s``) alone and with the lag
rule (the larger count wins), its dead band, activation from zero, the bounds and smoothing it goes through, a
pool's age, and the config's checks."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.policy import PolicyState, Signals, decide
from fleet.autoscaler.pools import pool_signals

IMMEDIATE: dict[str, Any] = {"max_replicas": 100, "scale_up_step": 100, "scale_down_stabilization_s": 0}


def sig(current: int, age: float | None, *, lag: int = 10, arrival: float = 0.0, throughput: float = 100.0) -> Signals:
    return Signals(
        at_s=0.0,
        lag=lag,
        arrival_rate=arrival,
        throughput_per_replica=throughput,
        current_replicas=current,
        queue_age_s=age,
    )


# (current, age, lag, arrival, target, expected replicas, words in the reason)
# With throughput 100/s and drain 30 s, a lag of 10 asks the lag rule for 1 replica.
TABLE = [
    (2, 6.0, 10, 0.0, 2.0, 6, "waited 6s > max_queue_age_s 2s -> 6"),  # ceil(2 * 6 / 2)
    (2, 2.1, 10, 0.0, 2.0, 3, "-> 3"),  # just over: at least one more
    (4, 1.5, 10, 0.0, 2.0, 4, "hold 4"),  # dead band (0.5 * 2 < 1.5 <= 2): hold, though the lag asks for 1
    (4, 0.5, 10, 0.0, 2.0, 1, "scale down 4 -> 1"),  # well under: the lag rule decides
    (4, None, 10, 0.0, 2.0, 1, "scale down 4 -> 1"),  # nothing waits (or unknown): the lag rule decides
    (1, 9.0, 9000, 0.0, 2.0, 5, "queue age asks for 5, more than 3"),  # lag rule 3 (300/s over 100/s), age 5
    (1, 3.0, 9000, 0.0, 2.0, 3, "scale up 1 -> 3: lag 9000"),  # the lag rule's 3 beats the age rule's 2
    (0, 5.0, 0, 0.0, 2.0, 1, "-> 1"),  # from zero: the age wakes the fleet, though the lag is under activation
    (3, 50.0, 10, 0.0, None, 1, "scale down 3 -> 1"),  # no target: age ignored
    (3, 1000.0, 10, 0.0, 2.0, 100, "capped at max_replicas 100"),
]


@pytest.mark.parametrize(("current", "age", "lag", "arrival", "target", "replicas", "words"), TABLE)
def test_queue_age_table(
    current: int, age: float | None, lag: int, arrival: float, target: float | None, replicas: int, words: str
) -> None:
    config = ScalingConfig(
        **IMMEDIATE, max_queue_age_s=target, activation_lag=100 if current == 0 else 0, min_replicas=0
    )
    decision, _ = decide(sig(current, age, lag=lag, arrival=arrival), config, PolicyState(), now_s=0.0)
    assert decision.replicas == replicas, decision.reason
    assert words in decision.reason, decision.reason


def test_the_age_rule_goes_through_the_scale_up_limit_and_the_stabilization_window() -> None:
    config = ScalingConfig(max_replicas=50, scale_up_step=2, scale_up_interval_s=10, max_queue_age_s=1.0)
    decision, state = decide(sig(2, 10.0), config, PolicyState(), now_s=0.0)
    assert (decision.desired, decision.replicas) == (20, 4)  # asked for 20, limited to +2 per 10 s
    assert "limited to +2" in decision.reason
    calm, _ = decide(sig(4, 0.1, lag=10), config, state, now_s=5.0)
    assert calm.replicas == 4  # well under the target now, but 20 was recommended within the window


def test_a_custom_scale_in_ratio_moves_the_dead_band() -> None:
    config = ScalingConfig(**IMMEDIATE, max_queue_age_s=10.0, queue_age_scale_in_ratio=0.9)
    held, _ = decide(sig(5, 9.5), config, PolicyState(), now_s=0.0)
    free, _ = decide(sig(5, 8.5), config, PolicyState(), now_s=0.0)
    assert (held.replicas, free.replicas) == (5, 1)


def test_a_pool_waits_as_long_as_its_longest_waiting_model() -> None:
    members = {"a": sig(2, 0.5), "b": sig(2, 7.0), "c": sig(2, None)}
    assert pool_signals(members, 2, 30.0).queue_age_s == 7.0
    assert pool_signals({"c": sig(2, None)}, 2, 30.0).queue_age_s is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_queue_age_s": 0}, "greater than 0"),
        ({"max_queue_age_s": -1}, "greater than 0"),
        ({"max_queue_age_s": 1e9}, "less than or equal to 86400"),
        ({"max_queue_age_s": 2, "queue_age_scale_in_ratio": 1}, "less than 1"),
        ({"max_queue_age_s": 2, "queue_age_scale_in_ratio": 0}, "greater than 0"),
        ({"max_queue_age_s": "soon"}, "valid number"),
    ],
)
def test_bad_age_targets_are_refused_when_parsed(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ScalingConfig(**fields)
    assert words in str(caught.value)


def test_per_model_targets_reach_their_models_and_a_target_for_no_model_is_refused() -> None:
    from fleet.cli.autoscaler_cmd import scaling_configs

    configs = scaling_configs(["embed", "echo"], {"max_queue_age_s": 5.0}, {"echo": 0.5})
    assert (configs["embed"].max_queue_age_s, configs["echo"].max_queue_age_s) == (5.0, 0.5)
    with pytest.raises(ValueError, match="autoscale_max_queue_age_s names embedd, not among embed, echo"):
        scaling_configs(["embed", "echo"], {}, {"embedd": 2.0})
    with pytest.raises(ValueError, match="greater than 0"):
        scaling_configs(["echo"], {}, {"echo": -1.0})


def test_fleet_up_gives_each_model_its_queue_age_target_and_refuses_one_for_no_model() -> None:
    from fleet.brokers.memory import MemoryBroker
    from fleet.cli.serving import up_autoscaler
    from fleet.errors import ConfigError
    from fleet.scaling import MemoryScalingStore
    from fleet.settings import FleetSettings
    from fleet.store.bundle import Stores
    from fleet.store.memory import MemoryStore

    settings = FleetSettings(models="echo,sleep", autoscale_max_queue_age_s="echo=0.5")
    broker, stores = MemoryBroker.from_settings(settings), Stores.beside(MemoryStore(job_ttl_s=60))
    autoscaler = up_autoscaler(settings, broker, stores, MemoryScalingStore())
    assert {m: cfg.max_queue_age_s for m, cfg in autoscaler.configs.items()} == {"echo": 0.5, "sleep": None}
    wrong = FleetSettings(models="echo", autoscale_max_queue_age_s="ecko=1")
    with pytest.raises(ConfigError, match="autoscale_max_queue_age_s names ecko, which this fleet does not scale"):
        up_autoscaler(wrong, broker, stores, MemoryScalingStore())
