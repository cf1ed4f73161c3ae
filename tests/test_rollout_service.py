"""The rollout controller's loop (``fleet.lifecycle.service``) on real Redis and in memory: outcomes recorded through
``RolloutStore.record_outcome`` (as the workers' settle hook records them) step a healthy canary up to a promotion,
roll a failing one back within the window with the reason on the timeline, and open, half-open and close a version's
breaker; one controller acts per Redis; holds reach the timeline once per reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleet.lifecycle.breaker import BreakerConfig
from fleet.lifecycle.controller import RolloutConfig
from fleet.lifecycle.service import RolloutService, manual
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from fleet.store.rollouts import RolloutDoc, RolloutStore
from tests.processes import fleet_process, run_fleet, stop

T0 = 1_700_000_000.0
CONFIG = RolloutConfig(steps=(0.1, 0.5, 1.0), min_requests=50, hold_s=30, min_agreement=None)
WINDOW_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def rollouts(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        yield Stores.beside(store).rollouts
    finally:
        await store.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def service(rollouts: RolloutStore, clock: Clock) -> AsyncIterator[RolloutService]:
    svc = RolloutService(rollouts, interval_s=1.0, window_s=WINDOW_S, clock=clock)
    try:
        yield svc
    finally:
        await rollouts.release_lock(svc.owner_id)


async def start(rollouts: RolloutStore, model: str, breaker: BreakerConfig | None = None) -> None:
    policy = TrafficPolicy(primary="1", canary="2")
    doc = RolloutDoc(model=model, policy=policy, rollout=CONFIG, breaker=breaker or BreakerConfig())
    assert await rollouts.write(doc, 0)


async def traffic(rollouts: RolloutStore, model: str, at: float, primary: int, canary: int, canary_failed: int) -> None:
    for _ in range(primary):
        await rollouts.record_outcome(model, "1", ok=True, latency_ms=20.0, now=at)
    for i in range(canary):
        await rollouts.record_outcome(model, "2", ok=i >= canary_failed, latency_ms=22.0, now=at)


async def weight(rollouts: RolloutStore, model: str) -> float:
    doc = await rollouts.read(model)
    assert doc is not None
    return doc.policy.canary_weight


async def test_a_healthy_canary_steps_up_and_is_promoted(
    rollouts: RolloutStore, service: RolloutService, clock: Clock, unique: str
) -> None:
    model = f"m-{unique}"
    await start(rollouts, model)
    await service.tick()
    assert await weight(rollouts, model) == 0.1  # started at the first step
    for expected in (0.1, 0.5):
        await traffic(rollouts, model, clock.now, primary=100, canary=60, canary_failed=0)
        await service.tick()  # enough samples, but the step is younger than hold_s
        assert await weight(rollouts, model) == expected
        clock.now += CONFIG.hold_s
        await traffic(rollouts, model, clock.now, primary=100, canary=60, canary_failed=0)
        await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.policy.canary_weight == 1.0 and doc.state.step == 2
    clock.now += CONFIG.hold_s
    await traffic(rollouts, model, clock.now, primary=0, canary=60, canary_failed=0)  # at 100 %: the last baseline
    await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.policy.primary == "2" and doc.policy.canary is None and doc.state.phase == "promoted"
    actions = [d.action for d in reversed(await rollouts.decisions(model))]
    assert [a for a in actions if a != "hold"] == ["step", "step", "step", "promote"]
    assert actions.count("hold") <= 4, actions  # one per new reason, not one per tick
    assert "promoted" in (await rollouts.decisions(model, 1))[0].reason


async def test_a_canary_failing_30_percent_rolls_back_within_the_window_with_the_reason(
    rollouts: RolloutStore, service: RolloutService, clock: Clock, unique: str
) -> None:
    model = f"m-{unique}"
    await start(rollouts, model)
    await service.tick()
    assert await weight(rollouts, model) == 0.1
    # the injected failures land over less than one window: the tick after them rolls back, hold or no hold
    for second in range(0, 50, 10):
        clock.now = T0 + second
        await traffic(rollouts, model, clock.now, primary=40, canary=10, canary_failed=3)
        await service.tick()
        if await weight(rollouts, model) == 0.0:
            break
    assert clock.now - T0 < WINDOW_S
    doc = await rollouts.read(model)
    assert doc is not None and doc.policy.canary_weight == 0.0 and doc.policy.canary == "2"
    assert doc.state.phase == "rolled_back"
    [last] = await rollouts.decisions(model, 1)
    assert last.action == "roll_back" and last.by == "controller" and last.version == "2"
    assert last.reason.startswith("canary errors 30 % against primary 0 % (limit +2 %)"), last.reason
    assert last.reason.endswith("rolled back from 10 % to 0 %")
    await service.tick()
    await service.tick()
    assert await weight(rollouts, model) == 0.0  # finished: stays rolled back
    assert len([d for d in await rollouts.decisions(model) if d.reason.startswith("rollout finished")]) == 1


async def test_a_breaker_opens_on_failures_half_opens_and_closes_on_a_probe(
    rollouts: RolloutStore, service: RolloutService, clock: Clock, unique: str
) -> None:
    model = f"m-{unique}"
    await start(rollouts, model, BreakerConfig(consecutive_failures=5, cool_down_s=10, max_cool_down_s=60))
    await service.tick()
    for _ in range(5):
        await rollouts.record_outcome(model, "2", ok=False, latency_ms=5.0, now=clock.now)
    clock.now += 1
    steps = await service.tick()
    assert steps[model].breakers["2"].status == "open"
    doc = await rollouts.read(model)
    assert (
        doc is not None and doc.breakers["2"].status == "open" and "5 consecutive failures" in doc.breakers["2"].reason
    )
    assert doc.breakers.get("1") is None or doc.breakers["1"].status == "closed"
    clock.now += 10  # the cool-down has passed
    await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.breakers["2"].status == "half_open"
    # a probe fails: open again, for twice as long
    await rollouts.record_outcome(model, "2", ok=False, latency_ms=5.0, now=clock.now + 0.5)
    clock.now += 1
    await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.breakers["2"].status == "open" and doc.breakers["2"].cool_down_s == 20
    clock.now += 20
    await service.tick()
    await rollouts.record_outcome(model, "2", ok=True, latency_ms=5.0, now=clock.now + 0.5)
    clock.now += 1
    await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.breakers["2"].status == "closed" and "probe succeeded" in doc.breakers["2"].reason
    timeline = [d.reason for d in reversed(await rollouts.decisions(model)) if d.action == "breaker"]
    assert [r.split(":")[1].strip() for r in timeline] == [
        "opened",
        "half-open after 10s",
        "reopened",
        "half-open after 20s",
        "closed",
    ]


async def test_a_breaker_opens_on_the_error_rate_of_its_window(
    rollouts: RolloutStore, service: RolloutService, clock: Clock, unique: str
) -> None:
    model = f"m-{unique}"
    await start(rollouts, model, BreakerConfig(consecutive_failures=50, error_rate=0.5, min_requests=20, window_s=30))
    await service.tick()  # the tally's baseline
    for i in range(30):  # alternating: never 50 in a row, but 50 % of the window
        await rollouts.record_outcome(model, "1", ok=i % 2 == 0, latency_ms=5.0, now=clock.now)
    clock.now += 1
    await service.tick()
    doc = await rollouts.read(model)
    assert doc is not None and doc.breakers["1"].status == "open"
    assert doc.breakers["1"].reason == "opened: 15 of 30 requests failed in 30s (50 %, limit 50 %)"


async def test_one_controller_acts_per_store(rollouts: RolloutStore, clock: Clock, unique: str) -> None:
    model = f"m-{unique}"
    await start(rollouts, model)
    first = RolloutService(rollouts, interval_s=1.0, clock=clock, lock_ttl_s=30)
    second = RolloutService(rollouts, interval_s=1.0, clock=clock, lock_ttl_s=30)
    try:
        assert model in await first.tick()
        assert await second.tick() == {} and not second.leader
        await first.stop()
        assert model in await second.tick()
    finally:
        await rollouts.release_lock(first.owner_id)
        await rollouts.release_lock(second.owner_id)


async def test_a_manual_promote_or_rollback_names_who_and_works_on_a_finished_rollout(unique: str) -> None:
    model = f"m-{unique}"
    doc = RolloutDoc(model=model, policy=TrafficPolicy(primary="1", canary="2", canary_weight=0.3), rollout=None)
    rolled, entry = manual(doc, "roll_back", "key:abc", T0)
    assert rolled.policy.canary_weight == 0.0 and rolled.state.phase == "rolled_back"
    assert (entry.action, entry.by, entry.reason) == ("roll_back", "key:abc", "rolled back by key:abc from 30 % to 0 %")
    promoted, entry = manual(rolled, "promote", "operator", T0 + 1)
    assert promoted.policy.primary == "2" and promoted.policy.canary is None and promoted.state.phase == "promoted"
    assert (entry.action, entry.reason) == ("promote", "promoted by operator at 0 %")
    with pytest.raises(ValueError, match="no canary"):
        manual(promoted, "promote", "operator", T0 + 2)


# -- the processes that run it ----------------------------------------------------------------------------------
def test_fleet_autoscaler_runs_the_controller_and_stops_cleanly(
    nats_url: str, redis_url: str, tmp_path: Path, unique: str
) -> None:
    model = f"m-{unique}"

    async def put() -> None:
        store = make_store(FleetSettings(store_url=redis_url))
        await store.connect()
        try:
            await start(Stores.beside(store).rollouts, model)
        finally:
            await store.close()

    async def weight_now() -> float:
        store = make_store(FleetSettings(store_url=redis_url))
        await store.connect()
        try:
            return await weight(Stores.beside(store).rollouts, model)
        finally:
            await store.close()

    asyncio.run(put())
    env = {"FLEET_ROLLOUT_INTERVAL_S": "0.2"}
    args = ("autoscaler", "--backend", "dry-run", "--model", "echo", "--broker", nats_url, "--store", redis_url)
    log = tmp_path / "autoscaler.log"
    with fleet_process(*args, env=env, log=log) as proc:
        deadline = time.monotonic() + 30
        while asyncio.run(weight_now()) != CONFIG.steps[0]:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert stop(proc) == 0, log.read_text()[-2000:]
    assert "rollout controller" in log.read_text()


@pytest.mark.services  # a fleet process (that stops at once)
@pytest.mark.parametrize(
    ("env", "named"),
    [({"FLEET_ROLLOUT_WINDOW_S": "5"}, "rollout_window_s"), ({"FLEET_ROLLOUT_INTERVAL_S": "0"}, "rollout_interval_s")],
)
def test_bad_rollout_settings_stop_the_process_naming_them(env: dict[str, str], named: str) -> None:
    result = run_fleet("up", "--port", "0", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: invalid settings:") and f"  {named}: " in result.stderr, result.stderr
