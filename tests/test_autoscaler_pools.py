"""Pools in the autoscaler: the pool settings and targets, the summed demand (pure tables), the decision it leads
to, the pool worker's command, and a pool scaled on NATS + Redis on the sum of its models' backlogs."""

from __future__ import annotations

import pytest

from fleet.autoscaler.backends.dry_run import DryRunBackend
from fleet.autoscaler.backends.process import ProcessBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.policy import PolicyState, Signals, decide
from fleet.autoscaler.pools import mix_throughput, pool_signals
from fleet.autoscaler.service import Autoscaler
from fleet.pools import check_pools, members, pool_of, scaling_targets
from fleet.scaling import RedisScalingStore
from fleet.settings import FleetSettings
from tests.infra import connected_pair, publish_requests, settings_for
from tests.processes import run_fleet


def sig(lag: int | None, arrival: float | None, throughput: float | None, at_s: float = 100.0) -> Signals:
    return Signals(at_s=at_s, lag=lag, arrival_rate=arrival, throughput_per_replica=throughput, current_replicas=1)


# -- settings and targets ---------------------------------------------------------------------------------------
def test_pools_parse_from_pairs_or_json_and_name_their_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_POOLS", "nlp=sentiment+ner@2+embed, vision=clip")
    settings = FleetSettings()
    assert settings.pools == {"nlp": ["sentiment", "ner@2", "embed"], "vision": ["clip"]}
    assert members(settings.pools) == {"nlp": ("sentiment", "ner", "embed"), "vision": ("clip",)}
    assert FleetSettings(pools='{"nlp": ["a", "b@2"]}').pools == {"nlp": ["a", "b@2"]}
    assert pool_of(settings.pools, "ner") == "nlp" and pool_of(settings.pools, "echo") is None


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ({"nlp": ["a", "a@2"]}, "model 'a' of pool 'nlp' is twice in it"),
        ({"nlp": ["a"], "cv": ["b", "a"]}, "model 'a' of pool 'cv' is also in pool 'nlp'"),
        ({"nlp": []}, "pool 'nlp' has no models"),
        ({"NLP": ["a"]}, "pool name 'NLP'"),
        ({"nlp": ["a@"]}, "'a@' in pool 'nlp' is not a model reference"),
        ({"nlp": ["pkg.mod:Handler"]}, "is not a model reference"),
        ({"nlp": ["a"], "a": ["b"]}, "pool 'a' is named like a model of pool 'nlp'"),
        ({"nlp": [f"m{i}" for i in range(65)]}, "at most 64"),
    ],
)
def test_bad_pools_are_refused_naming_the_pool_and_the_model(pools: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ValueError, match="pools: ") as caught:
        check_pools(pools)
    assert message in str(caught.value)


def test_a_pool_named_like_a_model_served_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="pool 'embed' is named like a served model"):
        FleetSettings(models="embed,echo", pools="embed=a+b")


def test_targets_are_the_pools_then_the_models_in_no_pool() -> None:
    targets = scaling_targets(["echo", "sentiment", "ner", "embed"], {"nlp": ["sentiment", "ner@2"]})
    assert targets == {"nlp": ("sentiment", "ner"), "echo": ("echo",), "embed": ("embed",)}


# -- summed demand ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("members_", "expected"),
    [
        # lag and arrivals add up; the read time is the oldest
        (
            {"a": sig(10, 2.0, 4.0, at_s=90), "b": sig(5, 1.0, 4.0)},
            {"lag": 15, "arrival_rate": 3.0, "throughput_per_replica": 4.0, "at_s": 90},
        ),
        # one unknown lag makes the pool's unknown: the policy holds, as for one model
        ({"a": sig(None, 2.0, 4.0), "b": sig(5, 1.0, 4.0)}, {"lag": None}),
        # an arrival rate not yet known counts as none; with none known at all it is unknown
        ({"a": sig(0, None, 4.0), "b": sig(0, 1.5, 4.0)}, {"arrival_rate": 1.5}),
        ({"a": sig(0, None, 4.0), "b": sig(0, None, 4.0)}, {"arrival_rate": None}),
        # no throughput known anywhere: unknown (the policy's rule keeps a worker while there is work)
        ({"a": sig(3, 1.0, None), "b": sig(0, 0.0, None)}, {"throughput_per_replica": None}),
    ],
)
def test_pool_signals(members_: dict[str, Signals], expected: dict[str, object]) -> None:
    pooled = pool_signals(members_, current_replicas=2, target_drain_s=10.0)
    assert pooled.current_replicas == 2
    for name, value in expected.items():
        assert getattr(pooled, name) == value, name


def test_the_mix_throughput_weighs_each_model_by_its_work() -> None:
    """a: 10 jobs/s at 10/s per worker (1 worker's work); b: 3 jobs/s at 1/s (3 workers'). 13 jobs/s need 4
    workers, so one pool worker finishes 13 / 4 = 3.25 jobs/s of this mix, not the plain mean 5.5."""
    assert mix_throughput([sig(0, 10.0, 10.0), sig(0, 3.0, 1.0)], 30.0) == pytest.approx(3.25)
    assert mix_throughput([sig(0, 0.0, 10.0), sig(0, 0.0, 1.0)], 30.0) == pytest.approx(5.5), "idle: plain mean"
    # a model not yet measured is left out of the mix rather than counted as infinitely fast
    assert mix_throughput([sig(0, 10.0, 10.0), sig(0, 3.0, None)], 30.0) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("members_", "config", "replicas"),
    [
        # rate mode: the pool runs the sum of its models' worker needs (1 + 3), not the larger (3)
        ({"a": sig(0, 10.0, 10.0), "b": sig(0, 3.0, 1.0)}, ScalingConfig(max_replicas=10), 4),
        # the backlogs add up: (30 + 30) / drain 10 s = 6 jobs/s at 2/s -> 3 (each alone: 2)
        ({"a": sig(30, 0.0, 2.0), "b": sig(30, 0.0, 2.0)}, ScalingConfig(max_replicas=10, target_drain_s=10), 3),
        # keda mode: ceil((6 + 7) / 5) = 3 where each model alone asks for 2
        ({"a": sig(6, 0.0, None), "b": sig(7, 0.0, None)}, ScalingConfig(mode="keda", lag_per_replica=5), 3),
        # bounds apply to the pool as to a model
        ({"a": sig(0, 10.0, 1.0), "b": sig(0, 10.0, 1.0)}, ScalingConfig(max_replicas=8, scale_up_step=20), 8),
        # nothing anywhere: the pool may go to zero
        ({"a": sig(0, 0.0, 1.0), "b": sig(0, 0.0, 1.0)}, ScalingConfig(scale_down_stabilization_s=0), 0),
    ],
)
def test_a_pool_decision_sums_its_models_demand(
    members_: dict[str, Signals], config: ScalingConfig, replicas: int
) -> None:
    signals = pool_signals(members_, current_replicas=1, target_drain_s=config.target_drain_s)
    decision, _ = decide(signals, config.with_changes(scale_up_step=20), PolicyState(), now_s=100.0)
    assert decision.replicas == replicas, decision.reason


# -- backends ---------------------------------------------------------------------------------------------------
def test_a_pool_worker_is_started_with_the_pool_models() -> None:
    settings = FleetSettings(
        broker_url="nats://127.0.0.1:1", store_url="redis://127.0.0.1:1", models="echo", pools="nlp=a+b@2"
    )
    backend = ProcessBackend(settings, python="py", worker_args={"nlp": ["--memory-budget", "0.5"]})
    assert backend.argv("nlp")[3:] == ["worker", "--models", "a,b@2", "--memory-budget", "0.5"]
    assert backend.argv("echo")[3:] == ["worker", "--model", "echo"]


# -- the service on NATS + Redis --------------------------------------------------------------------------------
async def test_a_pool_is_scaled_on_the_sum_of_its_models_backlogs(nats_url: str, redis_url: str, unique: str) -> None:
    """Two models of a pool with 6 and 7 requests waiting and no worker: KEDA at 5 per replica scales the pool to
    3 workers (each model alone would get 2), records one decision naming both models, and the status lists them.
    A third model outside the pool is scaled on its own."""
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    a, b, alone, pool = f"pa-{unique}", f"pb-{unique}", f"pc-{unique}", f"pool-{unique}"
    config = ScalingConfig(mode="keda", lag_per_replica=5, max_replicas=10)
    async with connected_pair(settings) as (broker, _):
        await publish_requests(broker, a, [{}] * 6, f"{unique}-a")
        await publish_requests(broker, b, [{}] * 7, f"{unique}-b")
        await publish_requests(broker, alone, [{}] * 6, f"{unique}-c")
        scaling = RedisScalingStore(settings.store_url, lock_key=f"fleet:scale:_lock-{unique}")
        await scaling.connect()
        backend = DryRunBackend()
        autoscaler = Autoscaler(
            broker, scaling, backend, {pool: config, alone: config}, 60, "pools", pools={pool: (a, b)}
        )
        await autoscaler.signals.start()
        try:
            decisions = await autoscaler.tick()
            statuses = {s.model: s for s in await scaling.statuses()}
        finally:
            await autoscaler.signals.stop()
            await scaling.close()
    assert decisions[pool].replicas == 3 and decisions[alone].replicas == 2
    assert {call.model for call in backend.calls} == {pool, alone}, "the pool's models are not scaled alone"
    assert "lag 13 / 5 per replica" in decisions[pool].reason and f"{a}: lag 6" in decisions[pool].reason
    status = statuses[pool]
    assert (status.lag, status.current_replicas) == (13, 3)
    assert status.pool is not None and [(m.model, m.lag) for m in status.pool] == [(a, 6), (b, 7)]
    assert statuses[alone].pool is None
    assert statuses[pool].decisions[0].reason == decisions[pool].reason


def test_a_pool_without_a_config_is_refused() -> None:
    from fleet.brokers.memory import MemoryBroker
    from fleet.scaling import MemoryScalingStore

    with pytest.raises(ValueError, match="every pool needs a scaling config"):
        Autoscaler(
            MemoryBroker.from_settings(FleetSettings()),
            MemoryScalingStore(),
            DryRunBackend(),
            {"a": ScalingConfig()},
            pools={"nlp": ("a", "b")},
        )


@pytest.mark.services  # starts fleet processes
@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        # fleet up in memory runs its workers in process, and a pool worker is not built there (yet)
        (("up", "--models", "echo,sleep", "--port", "0"), {"FLEET_POOLS": "nlp=echo"}, "pools (FLEET_POOLS) need"),
        (("autoscaler", "--backend", "dry-run"), {"FLEET_POOLS": "nlp=echo+echo"}, "model 'echo' of pool 'nlp'"),
    ],
)
def test_the_commands_refuse_pools_they_cannot_run_in_one_line(
    args: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    result = run_fleet(*args, env=env)
    assert result.returncode != 0 and expected in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
