"""The result caches end to end: gateway (served by uvicorn) + the real worker, on memory, NATS + Redis and Kafka +
Redis. Each level hits and misses, a hit is a job like any other (record, long-poll, WebSocket, SSE), bypass by
header and by field, version invalidation, TTL expiry, and an L3 index rebuilt by a gateway that starts later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from websockets.asyncio.client import connect as ws_connect

from fleet.brokers.base import Broker
from fleet.producers.gateway import CacheParts
from fleet.producers.sdk import ws_url
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.cachestore import RedisCacheStore
from fleet.store.redis import RedisStore
from tests.cache_helpers import Gateway, cache_count, gateway, shared_text_model, worker
from tests.gateway_helpers import private_server, urls_for
from tests.infra import PAIRS, connected_pair, eventually, settings_for


@dataclass
class Env:
    settings: FleetSettings
    broker: Broker
    store: ResultStore
    gw: Gateway
    echo: str
    text: str

    async def computed(self, model: str, value: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Submit a job that must miss, let the worker compute it, and wait until the gateway filled the caches."""
        answer = await self.gw.submit(model, value, **extra)
        assert answer["status"] == "queued", answer
        record = await self.gw.record(answer["job_id"])
        assert record["state"] == "succeeded" and record["cache"] is None
        await asyncio.sleep(0.05)  # the gateway's fill task runs right after the terminal notice
        return record


def settings_with(request: pytest.FixtureRequest, pair: str, unique: str, **overrides: Any) -> FleetSettings:
    echo, text = f"echo-{unique}", f"echotext-{unique}"
    refs = [f"tests.gateway_helpers:echo_{unique}", f"tests.cache_helpers:echotext_{unique}"]
    values: dict[str, Any] = {"cache": {echo: ["l1", "l2"], text: ["l1", "l2", "l3"]}, "cache_l3_sync_interval_s": 0.1}
    return settings_for(pair, urls_for(request, pair), models=refs, **{**values, **overrides})


@contextlib.asynccontextmanager
async def open_env(request: pytest.FixtureRequest, pair: str, unique: str, **overrides: Any) -> AsyncIterator[Env]:
    settings = settings_with(request, pair, unique, **overrides)
    echo, text = f"echo-{unique}", f"echotext-{unique}"
    async with connected_pair(settings) as (broker, store), gateway(settings, broker, store) as gw:
        async with worker(broker, store, echo), worker(broker, store, text):
            yield Env(settings, broker, store, gw, echo, text)


@pytest.fixture(params=PAIRS)
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    async with open_env(request, request.param, unique) as e:
        yield e


async def test_l1_hit_is_a_succeeded_job_with_its_own_record(env: Env) -> None:
    first = await env.computed(env.echo, {"q": "the same input", "n": 1})
    before = cache_count(env.echo, "l1", "hit")
    answer = await env.gw.submit(env.echo, {"n": 1, "q": "the same input"})  # key order does not matter
    assert answer["status"] == "succeeded" and answer["cache"] == "l1"
    assert answer["job_id"] != first["job_id"]
    record = (await env.gw.client.get(f"/v1/jobs/{answer['job_id']}")).json()
    assert record["state"] == "succeeded" and record["cache"] == "l1" and record["cache_similarity"] is None
    assert record["output"] == first["output"] and record["finished_at"] is not None
    assert cache_count(env.echo, "l1", "hit") == before + 1
    assert (await env.gw.submit(env.echo, {"q": "another input"}))["status"] == "queued"  # a miss is queued


async def test_a_hit_reads_the_same_over_long_poll_websocket_and_sse(env: Env) -> None:
    await env.computed(env.echo, {"push": True})
    job_id = (await env.gw.submit(env.echo, {"push": True}))["job_id"]
    polled = await env.gw.record(job_id, wait_s=5)
    async with ws_connect(ws_url(env.gw.base, f"/v1/jobs/{job_id}/ws")) as ws:
        pushed = json.loads(await asyncio.wait_for(ws.recv(), 5))
    async with env.gw.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        body = "".join([chunk async for chunk in stream.aiter_text()])
    assert polled["cache"] == pushed["cache"] == "l1" and pushed["output"] == {"push": True}
    assert "event: result" in body and '"cache":"l1"' in body


async def test_infer_answers_a_hit_at_once_and_says_which_level(env: Env) -> None:
    await env.computed(env.echo, {"infer": 1})
    response = await env.gw.client.post("/v1/infer", json={"model": env.echo, "input": {"infer": 1}})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["output"] == {"infer": 1} and answer["cache"] == "l1" and answer["cache_similarity"] is None
    bypassed = await env.gw.client.post(
        "/v1/infer", json={"model": env.echo, "input": {"infer": 1}}, headers={"X-Cache-Control": "bypass"}
    )
    assert bypassed.status_code == 200 and bypassed.json()["cache"] is None  # computed by the worker


async def test_l2_answers_a_second_gateway_and_l1_takes_it_over(env: Env) -> None:
    await env.computed(env.echo, {"shared": 2})
    async with gateway(env.settings, env.broker, env.store, stores=env.gw.app.state.gateway.stores) as other:
        first = await other.submit(env.echo, {"shared": 2})
        second = await other.submit(env.echo, {"shared": 2})
    assert (first["status"], first["cache"]) == ("succeeded", "l2")
    assert second["cache"] == "l1"


async def test_bypass_by_header_and_by_field_skips_lookup_and_fill(env: Env) -> None:
    value = {"bypassed": True}
    await env.computed(env.echo, value, headers={"X-Cache-Control": "bypass"})  # computed, and not filled
    await env.computed(env.echo, value, cache=False)  # still not cached: so it is computed again
    bad = await env.gw.client.post(
        "/v1/jobs", json={"model": env.echo, "input": value}, headers={"X-Cache-Control": "maybe"}
    )
    assert bad.status_code == 422 and "X-Cache-Control" in bad.json()["error"]["message"]
    await env.computed(env.echo, value)  # now filled
    assert (await env.gw.submit(env.echo, value, headers={"X-Cache-Control": "BYPASS"}))["status"] == "queued"
    assert (await env.gw.submit(env.echo, value))["cache"] == "l1"


async def test_l3_hits_a_paraphrase_and_misses_a_different_meaning(env: Env) -> None:
    first = await env.computed(env.text, {"text": "How do I open a new bank account?"})
    hit = await env.gw.submit(env.text, {"text": "how do I open a new bank account"})
    assert (hit["status"], hit["cache"]) == ("succeeded", "l3"), hit
    record = await env.gw.record(hit["job_id"])
    assert record["output"] == first["output"] and 0.9 <= record["cache_similarity"] <= 1.0
    for other in ("How do I close a new bank account?", "How do I open 2 new bank accounts?"):
        assert (await env.gw.submit(env.text, {"text": other}))["status"] == "queued", other


async def test_l3_index_is_rebuilt_by_a_gateway_that_starts_later(env: Env) -> None:
    await env.computed(env.text, {"text": "Where can I buy train tickets to Berlin?"})
    async with gateway(env.settings, env.broker, env.store, stores=env.gw.app.state.gateway.stores) as later:
        hit = await later.submit(env.text, {"text": "Where can I buy train tickets to Berlin"})
    assert hit["cache"] == "l3", hit


async def test_a_new_version_never_serves_an_old_versions_entries(env: Env, unique: str) -> None:
    await env.computed(env.echo, {"versioned": 1})
    assert (await env.gw.submit(env.echo, {"versioned": 1}))["cache"] == "l1"
    v2 = env.settings.model_copy(
        update={"models": [f"tests.cache_helpers:echov2_{unique}", f"tests.cache_helpers:echotext_{unique}"]}
    )
    async with gateway(v2, env.broker, env.store) as gw2:  # same store: the v1 entry is there, under v1's key
        answer = await gw2.submit(env.echo, {"versioned": 1})
        assert answer["status"] == "queued"
        await gw2.record(answer["job_id"])
        await asyncio.sleep(0.05)
        assert (await gw2.submit(env.echo, {"versioned": 1}))["cache"] == "l1"  # v2 caches its own output
    assert (await env.gw.submit(env.echo, {"versioned": 1}))["cache"] == "l1"


@pytest.mark.parametrize("pair", PAIRS)
async def test_l2_entries_expire_after_their_ttl(request: pytest.FixtureRequest, pair: str, unique: str) -> None:
    only_l2 = {f"echo-{unique}": ["l2"]}
    async with open_env(request, pair, unique, cache=only_l2, cache_l2_ttl_s=1) as env:
        await env.computed(env.echo, {"ttl": 1})
        assert (await env.gw.submit(env.echo, {"ttl": 1}))["cache"] == "l2"

        async def expired() -> bool:
            return (await env.gw.submit(env.echo, {"ttl": 1}))["status"] == "queued"

        await eventually(expired, 5, "the L2 entry to expire")


@pytest.mark.services
async def test_a_cache_redis_outage_never_fails_a_request(request: pytest.FixtureRequest, unique: str) -> None:
    """The result store stays up (memory); the Redis of the caches goes down: submits are misses, jobs run."""
    settings = settings_with(request, "memory", unique, cache_timeout_ms=300)
    echo = f"echo-{unique}"
    with private_server("redis") as (url, proc):
        redis = RedisStore(url, job_ttl_s=60, socket_timeout_s=0.5, connect_timeout_s=0.5)
        await redis.connect()
        parts = CacheParts(store=RedisCacheStore(redis.redis, redis.display_url), load_text_model=shared_text_model)
        try:
            async with connected_pair(settings) as (broker, store), gateway(settings, broker, store, parts) as gw:
                async with worker(broker, store, echo):
                    proc.terminate()
                    proc.wait(10)
                    errors = cache_count(echo, "l2", "error")
                    for i in range(2):
                        answer = await gw.submit(echo, {"redis": "down", "i": i})
                        assert answer["status"] == "queued"
                        assert (await gw.record(answer["job_id"]))["state"] == "succeeded"
                    assert cache_count(echo, "l2", "error") == errors + 2
                    assert (await gw.submit(echo, {"redis": "down", "i": 0}))["cache"] == "l1"  # L1 was filled
        finally:
            await redis.close()
