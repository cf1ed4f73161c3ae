"""The autoscaler as a user relies on it: a burst on real NATS + Redis scales ``fleet worker`` processes out, the
backlog drains, the fleet scales back in after the stabilization window and no job is lost or computed twice;
only the lock holder acts; overrides and errors; the signals it reads; the ``fleet autoscaler`` command."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from fleet import constants as c
from fleet.autoscaler.backends.dry_run import DryRunBackend
from fleet.autoscaler.backends.process import ProcessBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.autoscaler.signals import SignalReader
from fleet.brokers.memory import MemoryBroker
from fleet.consumers.handlers import ModelHandler, with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.errors import ScalerError
from fleet.scaling import MemoryScalingStore, RedisScalingStore
from fleet.schemas.scaling import ScalingOverrides
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from tests.infra import HeartbeatTally, connected_pair, eventually, publish_requests, settings_for, wait_terminal
from tests.processes import run_fleet

pytestmark = pytest.mark.timeout(120)


def __getattr__(name: str) -> type[ModelHandler[Any, Any]]:
    """``tests.test_autoscaler_service:sleep_<token>``: the sleep handler as model ``sleep-<token>``, importable by
    the ``fleet worker`` processes the process backend starts."""
    base, sep, token = name.partition("_")
    if base == "sleep" and sep:
        return with_name(SleepHandler, f"sleep-{token}")
    raise AttributeError(name)


def heartbeat(model: str, worker: str, at: float, items: int, batches: int, **extra: object) -> Heartbeat:
    values: dict[str, object] = {"state": "ready", "in_flight": 0, "latency_ewma_ms": 100.0, **extra}
    return Heartbeat.model_validate(
        {
            "worker_id": worker,
            "model": model,
            "device": "cpu",
            "pid": 1,
            "max_batch": 1,
            "max_wait_ms": 0,
            "items": items,
            "batches": batches,
            "sent_at": at,
            **values,
        }
    )


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


# -- end to end: process backend on NATS + Redis --------------------------------------------------------------
async def test_a_burst_scales_out_drains_and_scales_in_without_losing_or_repeating_a_job(
    request: pytest.FixtureRequest, nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model = f"sleep-{unique}"
    refs = [f"{__name__}:sleep_{unique}"]
    settings = settings_for(
        "nats+redis", {"nats": nats_url, "redis": redis_url}, models=refs, heartbeat_interval_s=0.5, ack_wait_s=10
    )
    config = ScalingConfig(
        min_replicas=1,
        max_replicas=3,
        target_drain_s=3,
        scale_up_interval_s=0,
        scale_down_stabilization_s=3,
        stale_after_s=10,
    )
    jobs = 150  # 100 ms each: 15 s for one worker
    scaling = RedisScalingStore(redis_url, lock_key=f"fleet:scale:_lock-{unique}")
    await scaling.connect()
    backend = ProcessBackend(settings, log_dir=tmp_path)
    replicas_seen: list[int] = []
    async with connected_pair(settings) as (broker, store), HeartbeatTally().following(broker, model) as tally:
        autoscaler = Autoscaler(
            broker, scaling, backend, {model: config}, 0.3, "e2e", lock_ttl_s=5, heartbeat_interval_s=0.5
        )
        async with autoscaler:
            await eventually(lambda: _live(autoscaler, model, 1), 60, "one worker up (min_replicas)")

            async def watch() -> None:
                while True:
                    replicas_seen.append(await backend.current_replicas(model))
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())
            ids = await publish_requests(broker, model, [{"mean_ms": 100}] * jobs, prefix=f"burst-{unique}")
            records = await wait_terminal(store, ids, timeout_s=60)
            await eventually(lambda: _replicas(backend, model, 1), 30, "scale back in to min_replicas")
            await eventually(lambda: _drained(backend, model), 30, "the stopped workers exit")
            watcher.cancel()
            await eventually(lambda: _equal(lambda: tally.total, jobs), 10, "final heartbeat counts")
            decisions = next(s for s in await scaling.statuses() if s.model == model).decisions
    await scaling.close()

    assert max(replicas_seen) >= 2, f"no scale-out: {replicas_seen}"
    assert {r.state for r in records.values()} == {"succeeded"}
    assert tally.total == jobs, f"items computed per worker {tally.items}: a job was computed twice"
    reasons = [d.reason for d in decisions]
    assert any(r.startswith("scale up") for r in reasons) and any(r.startswith("scale down") for r in reasons)
    assert all(d.owner == "e2e" for d in decisions)


async def _live(autoscaler: Autoscaler, model: str, n: int) -> bool:
    return autoscaler.signals.live_workers(model) == n and await autoscaler.backend.current_replicas(model) == n


async def _replicas(backend: ProcessBackend, model: str, n: int) -> bool:
    return await backend.current_replicas(model) == n


async def _drained(backend: ProcessBackend, model: str) -> bool:
    return not backend.draining(model)


async def _equal(value: object, expected: int) -> bool:
    return value() == expected  # type: ignore[operator]


# -- the lock -------------------------------------------------------------------------------------------------
async def test_only_the_lock_holder_acts_and_a_standby_takes_over_when_it_stops(redis_url: str, unique: str) -> None:
    model = f"m-{unique}"
    config = ScalingConfig(min_replicas=2, max_replicas=4)
    broker = MemoryBroker.from_settings(FleetSettings())
    await broker.connect()
    stores = [RedisScalingStore(redis_url, lock_key=f"fleet:scale:_lock-{unique}") for _ in range(2)]
    for s in stores:
        await s.connect()
    first_backend, second_backend = DryRunBackend(), DryRunBackend()
    first = Autoscaler(broker, stores[0], first_backend, {model: config}, 0.1, "first", lock_ttl_s=2)
    second = Autoscaler(broker, stores[1], second_backend, {model: config}, 0.1, "second", lock_ttl_s=2)
    async with first:
        await eventually(lambda: _is(first_backend.current_replicas(model), 2), 5, "the holder scales to min")
        async with second:
            await eventually(lambda: _ticked(second, 5), 5, "the standby ticks")
            assert first.leader and not second.leader
            assert second_backend.calls == [], "a standby never acts"
            await first.stop()  # releases the lock
            await eventually(lambda: _is(second_backend.current_replicas(model), 2), 5, "the standby takes over")
            assert second.leader
            owners = {d.owner for s in await stores[1].statuses() if s.model == model for d in s.decisions}
            assert owners == {"first", "second"}
    for s in stores:
        await s.close()
    await broker.close()


async def _is(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]


async def _ticked(autoscaler: Autoscaler, n: int) -> bool:
    return autoscaler.ticks >= n


# -- overrides, errors, gauges --------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def memory_fleet(lag: int, unique: str) -> AsyncIterator[tuple[MemoryBroker, MemoryScalingStore, str]]:
    """A memory broker whose model has ``lag`` requests waiting and no worker, and a memory scaling store."""
    model = f"m-{unique}"
    broker = MemoryBroker.from_settings(FleetSettings())
    await broker.connect()
    await publish_requests(broker, model, [{}] * lag, prefix=unique)
    try:
        yield broker, MemoryScalingStore(), model
    finally:
        await broker.close()


async def test_overrides_apply_at_the_next_tick_and_pause_holds(unique: str) -> None:
    config = ScalingConfig(min_replicas=0, max_replicas=10, target_drain_s=1, default_throughput_per_replica=1)
    async with memory_fleet(lag=20, unique=unique) as (broker, scaling, model):
        backend = DryRunBackend()
        autoscaler = Autoscaler(broker, scaling, backend, {model: config}, 60, "o")
        await autoscaler.signals.start()
        await scaling.set_overrides(model, ScalingOverrides(max_replicas=3))
        decision = (await autoscaler.tick())[model]
        assert (decision.replicas, await backend.current_replicas(model)) == (3, 3)
        assert "max_replicas 3" in decision.reason
        status = (await scaling.statuses())[0]
        assert (status.max_replicas, status.configured) == (
            3,
            ScalingOverrides(min_replicas=0, max_replicas=10, paused=False),
        )
        assert (status.wanted_replicas, status.desired_replicas) == (20, 3), "lag 20 at 1/s in 1 s: 20, capped at 3"
        assert REGISTRY.get_sample_value("fleet_autoscaler_current_replicas", {"model": model}) == 3
        assert REGISTRY.get_sample_value("fleet_autoscaler_lag", {"model": model}) == 20

        await scaling.set_overrides(model, ScalingOverrides(max_replicas=8, paused=True))
        decision = (await autoscaler.tick())[model]
        assert decision.replicas == 3 and decision.reason.startswith("paused")
        await scaling.set_overrides(model, ScalingOverrides(max_replicas=8))
        assert (await autoscaler.tick())[model].replicas > 3
        await autoscaler.signals.stop()


class FailingOnce(DryRunBackend):
    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    async def set_replicas(self, model: str, replicas: int) -> None:
        if self.failures == 0:
            self.failures += 1
            raise ScalerError("the API server is away", backend="dry-run", target=model)
        await super().set_replicas(model, replicas)


async def test_a_failed_tick_is_logged_and_the_loop_recovers(unique: str, caplog: pytest.LogCaptureFixture) -> None:
    config = ScalingConfig(min_replicas=1, max_replicas=2)
    async with memory_fleet(lag=0, unique=unique) as (broker, scaling, model):
        backend = FailingOnce()
        async with Autoscaler(broker, scaling, backend, {model: config}, 0.05, "f"):
            await eventually(lambda: _is(backend.current_replicas(model), 1), 5, "the next tick succeeds")
        assert backend.failures == 1
        assert "the API server is away" in caplog.text
        changed = [d for d in (await scaling.statuses())[0].decisions if d.changed]
        assert [(d.current_replicas, d.replicas) for d in changed] == [(0, 1)], "the failed change is not recorded"


# -- signals --------------------------------------------------------------------------------------------------
async def test_arrival_is_completions_plus_lag_growth_and_zero_when_idle(unique: str) -> None:
    clock = Clock()
    async with memory_fleet(lag=10, unique=unique) as (broker, _, model):
        reader = SignalReader(broker, heartbeat_interval_s=1, rate_window_s=4, clock=clock)
        reader.observe(heartbeat(model, "w1", 0, items=100, batches=100), at_s=clock.now_s)
        first = await reader.read(model, current_replicas=1)
        assert (first.lag, first.arrival_rate) == (10, None), "one read: no rate yet"
        # 2 s later: the worker finished 6 more and 8 more arrived (lag 10 -> 12): 14 arrived in 2 s.
        clock.now_s += 2
        reader.observe(heartbeat(model, "w1", 2, items=106, batches=106), at_s=clock.now_s)
        await publish_requests(broker, model, [{}] * 2, prefix=f"{unique}-more")
        second = await reader.read(model, current_replicas=1)
        assert second.lag == 12 and second.arrival_rate == pytest.approx(4.0)
        assert reader.completion_rate(model) == pytest.approx(3.0)
        for _ in range(4):  # nothing arrives, nothing finishes: the window slides to exactly zero
            clock.now_s += 2
            idle = await reader.read(model, current_replicas=1)
        assert idle.arrival_rate == 0.0 and idle.at_s == clock.now_s


def test_throughput_comes_from_busy_workers_and_silent_workers_are_dropped() -> None:
    clock = Clock()
    reader = SignalReader(MemoryBroker.from_settings(FleetSettings()), heartbeat_interval_s=1, clock=clock)
    model = "m"
    # Saturated (messages held at both heartbeats): 20 items in 2 s -> 10/s, whatever the compute time says.
    reader.observe(heartbeat(model, "busy", 0, items=0, batches=0, in_flight=1), at_s=clock.now_s)
    reader.observe(heartbeat(model, "busy", 2, items=20, batches=20, in_flight=1), at_s=clock.now_s)
    assert reader.throughput_per_replica(model) == pytest.approx(10.0)
    # Mostly idle: 2 items in 2 s, but each took 100 ms of compute -> 10/s of capacity, not 1/s.
    reader.observe(heartbeat(model, "idle", 0, items=0, batches=0), at_s=clock.now_s)
    reader.observe(heartbeat(model, "idle", 2, items=2, batches=2), at_s=clock.now_s)
    assert reader.throughput_per_replica(model) == pytest.approx(10.0)
    assert reader.live_workers(model) == 2
    reader.observe(heartbeat(model, "idle", 3, items=2, batches=2, state="stopped"), at_s=clock.now_s)
    assert reader.live_workers(model) == 1, "a stopped worker is gone at once"
    clock.now_s += 3.5
    assert reader.live_workers(model) == 0, "silent for three heartbeat intervals: gone"
    assert reader.throughput_per_replica(model) == pytest.approx(10.0), "an idle fleet keeps its capacity estimate"


async def test_the_autoscaler_reads_heartbeats_from_the_broker(unique: str) -> None:
    async with memory_fleet(lag=0, unique=unique) as (broker, _, model):
        async with SignalReader(broker, heartbeat_interval_s=1) as reader:
            await broker.emit(
                c.heartbeat_subject(model), heartbeat(model, "w", time.time(), 0, 0).model_dump_json().encode()
            )
            await broker.emit(c.heartbeat_subject(model), b"not json")
            await eventually(lambda: _equal(lambda: reader.live_workers(model), 1), 5, "the heartbeat is heard")


# -- the command ----------------------------------------------------------------------------------------------
@pytest.mark.services
def test_the_command_explains_itself_and_refuses_conflicting_settings() -> None:
    help_text = run_fleet("autoscaler", "--help").stdout
    for flag in ("--backend", "--min-replicas", "--max-replicas", "--mode", "--target-drain-s", "--interval-s"):
        assert flag in help_text
    conflict = run_fleet(
        "autoscaler", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1",
        "--min-replicas", "3", "--max-replicas", "2",
    )  # fmt: skip
    assert conflict.returncode == 2 and "Traceback" not in conflict.stderr
    assert "min_replicas (3) is above max_replicas (2)" in conflict.stderr
    keda = run_fleet("autoscaler", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1", "--mode", "keda")
    assert keda.returncode == 2 and "lag_per_replica" in keda.stderr
    embedded = run_fleet("autoscaler")
    assert embedded.returncode == 2 and "needs a real broker and store" in embedded.stderr
