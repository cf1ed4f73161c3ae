"""``GET /v1/usage`` over a real gateway (FLEET_AUTH=keys) on memory and on NATS + Redis: what each caller sees
(a tenant's keys, submitter or operator, see their tenant alone; the operator token sees all), the cost arithmetic
from ``FLEET_PRICE_PER_DEVICE_HOUR``, and hostile query parameters answered 422 with a message, quickly."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from fleet import constants as c
from fleet.store.bundle import Stores
from fleet.store.usage import UsageCount, UsageKey
from tests.gateway_helpers import asgi_gateway, error_of, urls_for
from tests.infra import connected_pair, settings_for

TOKEN = "operator-token-for-usage-tests"
PRICES = '{"cpu": 0.05, "cuda": 2.5}'


@dataclass
class Env:
    clients: dict[str, httpx.AsyncClient]
    a: str
    b: str
    model: str


@pytest.fixture(scope="module", params=["memory", "nats+redis"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    unique = uuid.uuid4().hex[:10]
    settings = settings_for(
        request.param, urls_for(request, request.param), auth="keys", operator_token=TOKEN, price_per_device_hour=PRICES
    )
    a, b, model = f"a-{unique}", f"b-{unique}", f"m-{unique}"
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        keys = {
            "a": (await stores.keys.create(a, "submitter", None))[0],
            "a_operator": (await stores.keys.create(a, "operator", None))[0],
            "b": (await stores.keys.create(b, "submitter", None))[0],
            "default_operator": (await stores.keys.create(c.DEFAULT_TENANT, "operator", None))[0],
            "token": TOKEN,
        }
        now = time.time()
        await stores.usage.add(
            {
                UsageKey(a, model, "1", "cpu"): UsageCount(jobs=4, items=40, device_seconds=7200.0),
                UsageKey(a, model, "1", "cuda"): UsageCount(jobs=6, items=60, device_seconds=3600.0),
                UsageKey(b, model, "2", "cuda"): UsageCount(jobs=1, items=3, device_seconds=36.0),
            },
            now,
        )
        async with asgi_gateway(settings, broker, store, stores=stores) as (app, client):
            clients = {}
            for name, key in keys.items():
                clients[name] = httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app),
                    base_url="http://gateway",
                    headers={"Authorization": f"Bearer {key}"},
                )
            clients["none"] = client
            yield Env(clients, a, b, model)
            for name, made in clients.items():
                if name != "none":
                    await made.aclose()


async def usage(client: httpx.AsyncClient, **params: str) -> dict:
    response = await client.get("/v1/usage", params=params)
    assert response.status_code == 200, response.text
    body: dict = response.json()
    return body


def tenants_of(body: dict) -> set[str]:
    return {row["tenant"] for row in body["rows"]}


async def test_a_tenant_sees_its_own_usage_only_whatever_it_groups_by(env: Env) -> None:
    for name in ("a", "a_operator"):
        body = await usage(env.clients[name], group_by="tenant,model")
        assert tenants_of(body) == {env.a}, (name, body)
        assert body["total"]["jobs"] == 10
    body = await usage(env.clients["b"], group_by="tenant,model,version,device")
    assert [(r["tenant"], r["version"], r["device"], r["jobs"]) for r in body["rows"]] == [(env.b, "2", "cuda", 1)]
    assert env.a not in str(body)
    by_model = await usage(env.clients["b"], group_by="model")
    assert [r["jobs"] for r in by_model["rows"] if r["model"] == env.model] == [1]  # b's 1 job, not a's 10


async def test_the_operator_token_and_default_operator_keys_see_every_tenant(env: Env) -> None:
    for name in ("token", "default_operator"):
        body = await usage(env.clients[name], group_by="tenant")
        assert {env.a, env.b} <= tenants_of(body), (name, body)


async def test_cost_is_device_hours_times_the_price_of_their_kind(env: Env) -> None:
    body = await usage(env.clients["a"], group_by="tenant,device")
    rows = {r["device"]: r for r in body["rows"]}
    assert rows["cpu"]["cost"] == pytest.approx(2 * 0.05)  # 7200 s = 2 h of CPU
    assert rows["cuda"]["cost"] == pytest.approx(1 * 2.5)
    assert rows["cpu"]["cost_per_1k_requests"] == pytest.approx(0.1 * 1000 / 4)
    merged = (await usage(env.clients["a"], group_by="model"))["rows"]
    assert merged == [
        {
            "tenant": None,
            "model": env.model,
            "version": None,
            "device": None,
            "jobs": 10,
            "items": 100,
            "device_seconds": pytest.approx(10800.0),
            "cost": pytest.approx(2.6),  # each kind priced before the kinds are merged
            "cost_per_1k_requests": pytest.approx(260.0),
        }
    ]
    assert body["prices"] == {"cpu": 0.05, "cuda": 2.5} and body["currency"] == "USD"
    assert body["bucket_s"] == c.USAGE_BUCKET_S and body["from"] <= time.time() - 86400 + c.USAGE_BUCKET_S


async def test_a_range_without_usage_is_empty_and_a_call_without_a_key_is_refused(env: Env) -> None:
    body = await usage(env.clients["token"], **{"from": "2001-01-01T00:00:00Z", "to": "2001-01-02T00:00:00Z"})
    assert body["rows"] == [] and body["total"]["jobs"] == 0 and body["total"]["cost_per_1k_requests"] is None
    assert (await env.clients["none"].get("/v1/usage")).status_code == 401


HOSTILE = [
    ({"group_by": "tenant,secrets"}, "group_by 'secrets' is not one of"),
    ({"group_by": "model,model"}, "twice"),
    ({"group_by": "m" * 5000}, "at most 64 characters"),
    ({"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}, "is after to"),
    ({"from": "400d"}, "longer than 31 days"),
    ({"from": "nan"}, "is not a time"),
    ({"from": "inf"}, "is not a time"),
    ({"to": "1e308"}, "is not a time"),
    ({"from": "-5"}, "is not a time"),
    ({"from": "yesterday"}, "is not a time"),
    ({"to": "9999999d"}, "is not a time"),
    ({"from": "1" * 10000}, "at most 64 characters"),
    ({"to": "2999-01-01T00:00:00"}, "is not a time"),
]


@pytest.mark.parametrize(("params", "words"), HOSTILE)
async def test_hostile_queries_are_refused_with_a_message_within_milliseconds(
    env: Env, params: dict, words: str
) -> None:
    for name in ("a", "token"):
        started = time.perf_counter()
        response = await env.clients[name].get("/v1/usage", params=params)
        elapsed_s = time.perf_counter() - started
        assert response.status_code == 422, response.text
        assert words in error_of(response)["message"]
        assert elapsed_s < 0.25, elapsed_s  # checked before any store call
