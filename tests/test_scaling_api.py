"""``GET /v1/scaling`` and ``PUT /v1/scaling/{model}`` on the gateway, over the in-memory and the Redis scaling
store: the shape a dashboard relies on, validation in the gateway's error style, and overrides shown at once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from fleet.producers.gateway import create_app
from fleet.scaling import ScalingStore, make_scaling_store
from fleet.schemas.scaling import DecisionRecord, ScalingOverrides, ScalingStatus
from fleet.settings import FleetSettings
from tests.gateway_helpers import FAST_LIMITS, error_of, model_refs, urls_for
from tests.infra import connected_pair, settings_for

FIELDS = {
    "model",
    "current_replicas",
    "desired_replicas",
    "lag",
    "arrival_rate",
    "min_replicas",
    "max_replicas",
    "paused",
    "decisions",
}


@dataclass
class Api:
    settings: FleetSettings
    scaling: ScalingStore  # a second client of the same state (the autoscaler's side)
    client: httpx.AsyncClient
    echo: str
    sleep: str

    async def get(self) -> dict[str, dict]:
        response = await self.client.get("/v1/scaling")
        assert response.status_code == 200, response.text
        return {item["model"]: item for item in response.json()}


@contextlib.asynccontextmanager
async def open_api(request: pytest.FixtureRequest, pair: str, unique: str) -> AsyncIterator[Api]:
    refs, (echo, sleep) = model_refs(unique, "echo", "sleep")
    settings = settings_for(pair, urls_for(request, pair), models=refs)
    scaling = make_scaling_store(settings)
    await scaling.connect()
    # The in-memory store is shared with the app as `fleet up` does; with Redis the app opens its own client.
    shared = scaling if settings.store_scheme == "memory" else None
    try:
        async with connected_pair(settings) as (broker, store):
            app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS, scaling=shared)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    yield Api(settings, scaling, client, echo, sleep)
    finally:
        await scaling.close()


@pytest.fixture(params=["memory", "memory+redis"])
async def api(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Api]:
    async with open_api(request, request.param, unique) as a:
        yield a


async def report(api: Api, model: str, replicas: int, configured_min: int = 1, configured_max: int = 4) -> None:
    """What an autoscaler stores after a tick: a decision and the status."""
    await api.scaling.record(
        DecisionRecord(
            at=time.time(),
            model=model,
            current_replicas=1,
            desired_replicas=replicas,
            replicas=replicas,
            lag=120,
            arrival_rate=4.0,
            throughput_per_replica=2.0,
            reason=f"scale up 1 -> {replicas}: lag 120",
            changed=True,
        )
    )
    await api.scaling.put_status(
        ScalingStatus(
            model=model,
            current_replicas=replicas,
            desired_replicas=replicas,
            lag=120,
            arrival_rate=4.0,
            min_replicas=configured_min,
            max_replicas=configured_max,
            paused=False,
            backend="process",
            updated_at=time.time(),
            configured=ScalingOverrides(min_replicas=configured_min, max_replicas=configured_max, paused=False),
        )
    )


async def test_get_lists_every_served_model_with_its_scaling_state(api: Api) -> None:
    await report(api, api.sleep, 3)
    found = await api.get()
    assert set(found) == {api.echo, api.sleep}
    for item in found.values():
        assert FIELDS <= set(item), item
    sleep = found[api.sleep]
    assert {k: sleep[k] for k in FIELDS - {"decisions"}} == {
        "model": api.sleep,
        "current_replicas": 3,
        "desired_replicas": 3,
        "lag": 120,
        "arrival_rate": 4.0,
        "min_replicas": 1,
        "max_replicas": 4,
        "paused": False,
    }
    assert [d["reason"] for d in sleep["decisions"]] == ["scale up 1 -> 3: lag 120"]
    assert sleep["decisions"][0]["lag"] == 120 and sleep["decisions"][0]["throughput_per_replica"] == 2.0
    echo = found[api.echo]  # not reported by an autoscaler yet: the fleet's default limits, nothing measured
    assert (echo["current_replicas"], echo["lag"], echo["arrival_rate"], echo["decisions"]) == (0, None, None, [])
    assert (echo["min_replicas"], echo["max_replicas"], echo["paused"]) == (1, 4, False)


async def test_put_is_reflected_in_get_and_stored_for_the_autoscaler(api: Api) -> None:
    await report(api, api.sleep, 2)
    response = await api.client.put(f"/v1/scaling/{api.sleep}", json={"max_replicas": 8, "paused": True})
    assert response.status_code == 200, response.text
    assert (response.json()["max_replicas"], response.json()["paused"]) == (8, True)
    shown = (await api.get())[api.sleep]
    assert (shown["min_replicas"], shown["max_replicas"], shown["paused"]) == (1, 8, True)
    assert await api.scaling.get_overrides(api.sleep) == ScalingOverrides(max_replicas=8, paused=True)

    response = await api.client.put(f"/v1/scaling/{api.sleep}", json={"min_replicas": 0})
    assert response.status_code == 200, response.text
    shown = (await api.get())[api.sleep]
    assert (shown["min_replicas"], shown["max_replicas"], shown["paused"]) == (0, 8, True), "fields left out keep"

    response = await api.client.put(f"/v1/scaling/{api.sleep}", json={"max_replicas": None, "paused": False})
    assert response.status_code == 200, response.text
    shown = (await api.get())[api.sleep]
    assert (shown["min_replicas"], shown["max_replicas"], shown["paused"]) == (0, 4, False), "null: configured value"
    assert (await api.get())[api.echo]["max_replicas"] == 4, "other models are untouched"


async def test_min_above_max_is_refused_naming_both(api: Api) -> None:
    await report(api, api.sleep, 2, configured_max=4)
    for body in ({"min_replicas": 5}, {"min_replicas": 3, "max_replicas": 2}):
        response = await api.client.put(f"/v1/scaling/{api.sleep}", json=body)
        assert response.status_code == 422, response.text
        error = error_of(response)
        assert error["type"] == "invalid_request"
        assert "min_replicas" in error["message"] and "max_replicas" in error["message"], error
        assert {d["loc"] for d in error["details"]} == {"body.min_replicas", "body.max_replicas"}
    await api.client.put(f"/v1/scaling/{api.sleep}", json={"max_replicas": 6})
    response = await api.client.put(f"/v1/scaling/{api.sleep}", json={"max_replicas": 0})
    assert response.status_code == 422 and "max_replicas" in error_of(response)["message"]
    assert await api.scaling.get_overrides(api.sleep) == ScalingOverrides(max_replicas=6), "refused: nothing stored"


@pytest.mark.parametrize(
    ("body", "field"),
    [({"min_replicas": -1}, "min_replicas"), ({"paused": "maybe"}, "paused"), ({"replicas": 3}, "replicas")],
)
async def test_bad_bodies_are_refused_in_the_gateway_error_style(api: Api, body: dict, field: str) -> None:
    response = await api.client.put(f"/v1/scaling/{api.echo}", json=body)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request" and field in error["message"], error


async def test_an_unknown_model_is_404_with_the_known_ones(api: Api) -> None:
    response = await api.client.put("/v1/scaling/nosuchmodel", json={"paused": True})
    assert response.status_code == 404, response.text
    error = error_of(response)
    assert error["type"] == "unknown_model"
    assert error["details"] == {"model": "nosuchmodel", "known": sorted([api.echo, api.sleep])}
    assert await api.scaling.get_overrides("nosuchmodel") == ScalingOverrides()


async def test_the_scaling_routes_are_documented(api: Api) -> None:
    spec = (await api.client.get("/openapi.json")).json()
    assert spec["paths"]["/v1/scaling"]["get"]["tags"] == ["scaling"]
    put = spec["paths"]["/v1/scaling/{model}"]["put"]
    assert put["summary"] and {"404", "422"} <= set(put["responses"])
