"""Scale-to-N: ``POST/DELETE /v1/scaling/{model}/scale`` stores an override with an expiry next to min/max/pause
(memory and Redis scaling stores), and the autoscaler holds N until the expiry, recording a decision that says so,
then returns to its policy. Hostile bodies get 4xx in Fleet's error format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from fleet.autoscaler.backends.dry_run import DryRunBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.scaling import MemoryScalingStore, RedisScalingStore, ScalingStore
from fleet.schemas.scaling import ScalingOverrides, ScalingStatus
from tests.gateway_helpers import error_of
from tests.test_autoscaler_service import memory_fleet
from tests.test_scaling_api import Api, open_api


@pytest.fixture(params=["memory", "memory+redis"])
async def api(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Api]:
    async with open_api(request, request.param, unique) as a:
        yield a


async def test_scale_to_n_is_stored_shown_and_removed(api: Api) -> None:
    before = time.time()
    response = await api.client.post(f"/v1/scaling/{api.echo}/scale", json={"replicas": 5, "ttl_s": 120})
    assert response.status_code == 200, response.text
    pinned = response.json()["pinned"]
    assert pinned["replicas"] == 5 and before + 119 < pinned["until"] < time.time() + 121
    stored = await api.scaling.get_overrides(api.echo)  # the autoscaler's side of the store
    assert stored.pinned_replicas == 5 and stored.pin(time.time()) is not None
    assert (await api.get())[api.echo]["pinned"]["replicas"] == 5

    # min/max/pause set later keep the pin, and the pin keeps them
    assert (await api.client.put(f"/v1/scaling/{api.echo}", json={"max_replicas": 3})).status_code == 200
    shown = (await api.get())[api.echo]
    assert shown["max_replicas"] == 3 and shown["pinned"]["replicas"] == 5

    default_ttl = await api.client.post(f"/v1/scaling/{api.echo}/scale", json={"replicas": 0})
    assert 590 < default_ttl.json()["pinned"]["until"] - time.time() <= 600

    removed = await api.client.delete(f"/v1/scaling/{api.echo}/scale")
    assert removed.status_code == 200 and removed.json()["pinned"] is None
    overrides = await api.scaling.get_overrides(api.echo)
    assert overrides == ScalingOverrides(max_replicas=3)


async def test_an_expired_pin_is_not_shown(api: Api) -> None:
    await api.scaling.set_overrides(api.echo, ScalingOverrides(pinned_replicas=2, pinned_until=time.time() - 1))
    assert (await api.get())[api.echo]["pinned"] is None


@pytest.mark.parametrize(
    "body",
    [
        {"replicas": -1},
        {"replicas": "three"},
        {"replicas": 2, "ttl_s": 0},
        {"replicas": 2, "ttl_s": -5},
        {"replicas": 2, "ttl_s": "long"},
        {"replicas": 10**12},
        {"ttl_s": 30},
        {"replicas": 2, "extra": True},
        [1, 2, 3],
        None,
    ],
)
async def test_bad_bodies_are_422(api: Api, body: object) -> None:
    response = await api.client.post(f"/v1/scaling/{api.echo}/scale", json=body)
    assert response.status_code == 422, response.text
    assert error_of(response)["type"] == "invalid_request"
    assert (await api.scaling.get_overrides(api.echo)).pinned_replicas is None


async def test_malformed_json_and_unknown_model(api: Api) -> None:
    bad = await api.client.post(
        f"/v1/scaling/{api.echo}/scale", content=b"{replicas: 2", headers={"content-type": "application/json"}
    )
    assert bad.status_code in (400, 422) and error_of(bad)["type"] in ("malformed_json", "invalid_request")
    for method in ("POST", "DELETE"):
        unknown = await api.client.request(method, "/v1/scaling/nope/scale", json={"replicas": 1})
        assert unknown.status_code == 404 and error_of(unknown)["type"] == "unknown_model"


@given(
    body=st.dictionaries(
        st.text(max_size=10),
        st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(), st.none()),
    )
)
@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_any_body_is_200_or_422(api: Api, body: dict[str, object]) -> None:
    response = await api.client.post(f"/v1/scaling/{api.echo}/scale", json=body)
    assert response.status_code in (200, 422), response.text


async def status_of(store: ScalingStore, model: str) -> ScalingStatus:
    (status,) = [s for s in await store.statuses() if s.model == model]
    return status


# -- the autoscaler holds N -------------------------------------------------------------------------------------
class WallClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def scaling_store(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[ScalingStore]:
    if request.param == "memory":
        yield MemoryScalingStore()
        return
    store = RedisScalingStore(request.getfixturevalue("redis_url"), lock_key=f"fleet:scale:_lock-{unique}")
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


async def test_the_autoscaler_holds_n_until_the_expiry_then_follows_its_policy(
    scaling_store: ScalingStore, unique: str
) -> None:
    config = ScalingConfig(
        min_replicas=1, max_replicas=3, target_drain_s=1, default_throughput_per_replica=1, scale_up_interval_s=0
    )
    wall = WallClock()
    async with memory_fleet(lag=20, unique=unique) as (broker, _, model):
        backend = DryRunBackend()
        autoscaler = Autoscaler(broker, scaling_store, backend, {model: config}, 60, "o", wall_clock=wall)
        await autoscaler.signals.start()
        try:
            assert (await autoscaler.tick())[model].replicas == 3  # the policy: lag 20, capped at max 3

            until = wall.now + 300
            await scaling_store.set_overrides(
                model, ScalingOverrides(pinned_replicas=6, pinned_until=until, paused=True)
            )
            held = (await autoscaler.tick())[model]
            assert (held.replicas, await backend.current_replicas(model)) == (6, 6)  # above max, despite pause
            assert "scale-to-N until" in held.reason and "held at 6" in held.reason
            status = await status_of(scaling_store, model)
            assert status.pinned is not None and status.pinned.replicas == 6
            assert status.decisions[0].reason == held.reason and status.desired_replicas == 6

            wall.now = until - 1
            assert (await autoscaler.tick())[model].replicas == 6  # still held

            wall.now = until + 1
            await scaling_store.set_overrides(
                model,
                ScalingOverrides(pinned_replicas=6, pinned_until=until),  # expired, left in the store
            )
            after = (await autoscaler.tick())[model]
            assert after.replicas == 3 and after.reason.startswith("scale-to-N ended")
            status = await status_of(scaling_store, model)
            assert status.pinned is None and status.decisions[0].reason == after.reason
        finally:
            await autoscaler.signals.stop()


async def test_a_pin_is_capped_at_the_partition_count(unique: str) -> None:
    config = ScalingConfig(min_replicas=0, max_replicas=10, target_drain_s=1, default_throughput_per_replica=1)
    async with memory_fleet(lag=0, unique=unique) as (broker, scaling, model):
        backend = DryRunBackend()
        autoscaler = Autoscaler(broker, scaling, backend, {model: config}, 60, "o", partitions=4)
        await autoscaler.signals.start()
        try:
            await scaling.set_overrides(model, ScalingOverrides(pinned_replicas=9, pinned_until=time.time() + 60))
            decision = (await autoscaler.tick())[model]
            assert decision.replicas == 4 and "capped at 4 partitions" in decision.reason
        finally:
            await autoscaler.signals.stop()
