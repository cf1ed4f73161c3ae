"""A pool on the operator surface: the dashboard feed shows it as one panel with its models and their summed
numbers, and ``/v1/scaling`` lists and overrides it by its name (a model of the pool is refused with the pool's
name); in memory and over the Redis scaling store."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from fleet.brokers import make_broker
from fleet.producers.gateway import create_app
from fleet.producers.gateway.operator.beats import Beats
from fleet.producers.gateway.operator.feed import OperatorFeed
from fleet.scaling import MemoryScalingStore, make_scaling_store
from fleet.schemas.scaling import PoolMember, ScalingStatus
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from tests.gateway_helpers import FAST_LIMITS, error_of, model_refs, urls_for
from tests.infra import connected_pair, publish_requests, settings_for


def heartbeat(worker_id: str, model: str, **fields: Any) -> Heartbeat:
    values: dict[str, Any] = {"device": "cpu", "pid": 1, "max_batch": 8, "max_wait_ms": 5.0, "state": "ready"}
    return Heartbeat(worker_id=worker_id, model=model, **{**values, **fields})


def pool_status(pool: str, members: dict[str, int]) -> ScalingStatus:
    return ScalingStatus(
        model=pool,
        current_replicas=2,
        desired_replicas=2,
        lag=sum(members.values()),
        arrival_rate=0.0,
        min_replicas=0,
        max_replicas=4,
        paused=False,
        backend="dry-run",
        updated_at=time.time(),
        pool=[PoolMember(model=m, lag=lag, arrival_rate=0.0) for m, lag in members.items()],
    )


async def test_the_feed_shows_a_pool_as_one_panel_with_its_models_summed() -> None:
    settings = FleetSettings(models="a,b,c", pools="nlp=a+b@2")
    broker = make_broker(settings)
    await broker.connect()
    await publish_requests(broker, "a", [{}] * 3, "pa")
    await publish_requests(broker, "b", [{}] * 4, "pb")
    await broker.ensure_model("c")
    beats = Beats(1.0)
    beats.observe_worker(heartbeat("pool-1", "a"))  # one pool worker heartbeats once per model it serves
    beats.observe_worker(heartbeat("pool-1", "b"))
    beats.observe_worker(heartbeat("pool-2", "a", state="starting"))
    beats.observe_worker(heartbeat("alone", "c"))
    scaling = MemoryScalingStore()
    await scaling.put_status(pool_status("nlp", {"a": 3, "b": 4}))
    feed = OperatorFeed(
        settings=settings, models=["a", "b", "c"], broker=broker, scaling=scaling, beats=beats, interval_s=60
    )
    try:
        snapshot = await feed.sample()
    finally:
        await broker.close()
    panels = {p.model: p for p in snapshot.models}
    assert set(panels) == {"nlp", "c"}, "the pool's models have no panels of their own"
    nlp = panels["nlp"]
    assert nlp.pool == ["a", "b"] and panels["c"].pool is None
    assert (nlp.lag, nlp.current_replicas, nlp.live_workers, nlp.ready_workers) == (7, 2, 2, 1)
    assert set(snapshot.series) == {"nlp", "c"} and set(snapshot.decisions) == {"nlp", "c"}


@pytest.mark.parametrize("pair", ["memory", "memory+redis"])
async def test_scaling_lists_and_overrides_a_pool_by_its_name(request: pytest.FixtureRequest, pair: str, unique: str):
    refs, (echo, sleep) = model_refs(unique, "echo", "sleep")
    pool = f"pool-{unique}"
    settings = settings_for(pair, urls_for(request, pair), models=refs, pools={pool: [echo]})
    scaling = make_scaling_store(settings)
    await scaling.connect()
    shared = scaling if settings.store_scheme == "memory" else None
    try:
        await scaling.put_status(pool_status(pool, {echo: 5}))
        async with connected_pair(settings) as (broker, store):
            app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS, scaling=shared)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    listed = {item["model"]: item for item in (await client.get("/v1/scaling")).json()}
                    put = await client.put(f"/v1/scaling/{pool}", json={"max_replicas": 3})
                    member = await client.put(f"/v1/scaling/{echo}", json={"max_replicas": 3})
                    unknown = await client.put(f"/v1/scaling/nope-{unique}", json={"max_replicas": 3})
        overrides = await scaling.get_overrides(pool)
    finally:
        await scaling.close()
    assert set(listed) == {pool, sleep}
    assert [m["model"] for m in listed[pool]["pool"]] == [echo] and listed[pool]["lag"] == 5
    assert put.status_code == 200 and put.json()["max_replicas"] == 3 and overrides.max_replicas == 3
    assert member.status_code == 422
    assert f"scaled with its pool {pool!r}" in error_of(member)["message"]
    assert unknown.status_code == 404 and pool in error_of(unknown)["message"]
