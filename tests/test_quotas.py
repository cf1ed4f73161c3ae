"""Per-tenant rate limits and queued-job quotas (``fleet.store.quotas``, ``fleet.producers.gateway.access.ratelimit``).

The store contract runs on real Redis and in memory; the gateway tests submit over HTTP with API keys (one tenant
per test, so tests sharing the session's Redis never share a bucket). Rates are small (one admit per several
seconds) so that a loaded machine cannot refill a burst in the middle of a test; where a refill is the point, the
test counts admits against an upper bound computed from the time that passed, never a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from typer.testing import CliRunner

from fleet import constants as c
from fleet.cli import app as cli_app
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.limit_policy import TenantLimit
from fleet.producers.gateway.access.ratelimit import RATE_LIMITED as RATE_LIMITED_TOTAL
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.quotas import ADMITTED, QUOTA_EXCEEDED, RATE_LIMITED, Quotas
from tests.gateway_helpers import FAST_LIMITS, asgi_gateway, error_of, model_refs, private_server, urls_for
from tests.infra import connected_pair, eventually, settings_for

SLOW = 0.2  # admits per second: a burst does not come back within a test
STORES = ["memory", "redis"]


@contextlib.asynccontextmanager
async def quota_store(request: Any, kind: str) -> AsyncIterator[tuple[Quotas, ResultStore]]:
    pair = "memory" if kind == "memory" else f"memory+{kind}"
    settings = settings_for(pair, urls_for(request, kind) if kind != "memory" else {})
    async with connected_pair(settings) as (_, store):
        yield Stores.beside(store).quotas, store


# -- the store contract ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", STORES)
async def test_a_burst_is_admitted_then_refused(request: Any, kind: str, unique: str) -> None:
    async with quota_store(request, kind) as (quotas, _):
        limit = TenantLimit(rate=SLOW, burst=3)
        decisions = [await quotas.decide(unique, limit, None, 0) for _ in range(4)]
        assert [d.verdict for d in decisions] == [ADMITTED, ADMITTED, ADMITTED, RATE_LIMITED]
        assert [d.remaining for d in decisions[:3]] == [2, 1, 0]
        refused = decisions[3]
        assert 0 < refused.retry_after_s <= 1 / SLOW + 0.01  # one admit comes back after 1/rate
        assert 2 / SLOW - 1 < refused.reset_s <= 3 / SLOW + 0.01  # the whole burst after about 3/rate
        other = await quotas.decide(f"{unique}-other", limit, None, 0)  # tenants do not share a bucket
        assert other.admitted and other.remaining == 2


@pytest.mark.parametrize("kind", STORES)
async def test_the_rate_refills_over_time(request: Any, kind: str, unique: str) -> None:
    async with quota_store(request, kind) as (quotas, _):
        rate, burst = 20.0, 2
        limit = TenantLimit(rate=rate, burst=burst)
        started = time.monotonic()
        admitted = refused = 0
        while admitted < burst + 3:  # the burst, then three that only a refill admits
            decision = await quotas.decide(unique, limit, None, 0)
            admitted += decision.admitted
            refused += not decision.admitted
            if not decision.admitted:
                await asyncio.sleep(0.01)
            assert time.monotonic() - started < 15, (admitted, refused)
        elapsed = time.monotonic() - started
        assert refused > 0  # the burst ran out first
        assert admitted <= burst + math.ceil(elapsed * rate) + 1


@pytest.mark.parametrize("kind", STORES)
async def test_the_quota_counts_job_ids_and_frees_them(request: Any, kind: str, unique: str) -> None:
    async with quota_store(request, kind) as (quotas, _):
        limit = TenantLimit(max_queued=2)
        first, second = await quotas.decide(unique, limit, "j1", 60), await quotas.decide(unique, limit, "j2", 60)
        assert first.added and second.added and second.queued == 2
        full = await quotas.decide(unique, limit, "j3", 60)
        assert full.verdict == QUOTA_EXCEEDED and full.queued == 2 and not full.added
        again = await quotas.decide(unique, limit, "j1", 60)  # a job already counted is not counted twice
        assert again.admitted and not again.added and again.queued == 2
        assert sorted(await quotas.members(unique, 10)) == ["j1", "j2"]
        await quotas.release([(unique, "j1"), (f"{unique}-other", "j2")])  # the other tenant's j2 is not ours
        assert await quotas.members(unique, 10) == ["j2"]
        assert (await quotas.decide(unique, limit, "j3", 0.2)).added
        assert (await quotas.decide(unique, limit, "j4", 60)).verdict == QUOTA_EXCEEDED

        async def hold_ended() -> bool:  # j3's hold of 0.2 s ends: the admission script trims it
            return (await quotas.decide(unique, limit, "j4", 60)).admitted

        await eventually(hold_ended, what="a place whose hold ended is free again")
        assert sorted(await quotas.members(unique, 10)) == ["j2", "j4"]


@pytest.mark.parametrize("kind", STORES)
async def test_a_refusal_by_one_limit_consumes_neither(request: Any, kind: str, unique: str) -> None:
    async with quota_store(request, kind) as (quotas, _):
        limit = TenantLimit(rate=SLOW, burst=2, max_queued=1)
        assert (await quotas.decide(unique, limit, "a", 60)).remaining == 1
        assert (await quotas.decide(unique, limit, "b", 60)).verdict == QUOTA_EXCEEDED  # took no rate token
        await quotas.release([(unique, "a")])
        assert (await quotas.decide(unique, limit, "b", 60)).remaining == 0
        assert (await quotas.decide(unique, limit, "c", 60)).verdict == RATE_LIMITED
        assert await quotas.members(unique, 10) == ["b"]  # the refused c took no place


@pytest.mark.parametrize("kind", [*STORES, "redis_cluster"])  # one script on one Redis, two calls on a cluster
async def test_admit_create_creates_only_the_jobs_it_admits(request: Any, kind: str, unique: str) -> None:
    async with quota_store(request, kind) as (quotas, store):
        limit = TenantLimit(rate=SLOW, burst=2, max_queued=1)
        first, second, third = (
            JobRecord(job_id=f"{unique}-{n}", model="echo", state=JobState.queued, tenant=unique) for n in range(3)
        )
        decision, created = await quotas.decide_and_create(store, unique, limit, 60, first, b"message-0")
        assert (decision.admitted, decision.added, decision.queued, decision.remaining, created) == (
            True,
            True,
            1,
            1,
            True,
        )
        stored = await store.get(first.job_id)
        assert stored is not None and stored.state == JobState.queued and stored.tenant == unique
        claimed = dict(await store.claim_unpublished(0.0, 10_000))  # marked unpublished, as store.create does
        assert claimed.get(first.job_id) == b"message-0"

        decision, created = await quotas.decide_and_create(store, unique, limit, 60, second, b"message-1")
        assert decision.verdict == QUOTA_EXCEEDED and not created
        assert await store.get(second.job_id) is None, "a refused submit must leave no record"

        decision, created = await quotas.decide_and_create(store, unique, limit, 60, first, b"message-0")
        assert decision.admitted and not decision.added and not created  # a resubmit: its place is held already

        rate_only = TenantLimit(rate=SLOW, burst=2)  # the burst went to the first submit and the resubmit
        decision, created = await quotas.decide_and_create(store, unique, rate_only, 0, third, b"message-2")
        assert decision.verdict == RATE_LIMITED and not created
        assert await store.get(third.job_id) is None
        assert await quotas.members(unique, 10) == [first.job_id]


# -- the gateway ----------------------------------------------------------------------------------------------
@dataclass
class Limited:
    app: FastAPI
    client: httpx.AsyncClient
    store: ResultStore
    model: str
    tenant: str
    headers: dict[str, str]
    settings: FleetSettings

    async def submit(self, n: int, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
        return await self.client.post(
            "/v1/jobs", json={"model": self.model, "input": {"n": n}, **body}, headers=headers or self.headers
        )


@contextlib.asynccontextmanager
async def limited_gateway(
    request: Any, pair: str, unique: str, auth: str = "keys", **limits: Any
) -> AsyncIterator[Limited]:
    """A gateway with ``limits`` over ``pair``: with FLEET_AUTH=keys and a submitter key of tenant ``unique``, or
    with FLEET_AUTH=off (the ``default`` tenant)."""
    refs, (model,) = model_refs(unique, "echo")
    settings = settings_for(pair, urls_for(request, pair), models=refs, auth=auth, **limits)
    async with connected_pair(settings) as (broker, store):
        tenant, headers, stores = c.DEFAULT_TENANT, {}, Stores.beside(store)
        if auth == "keys":
            key, _ = await stores.keys.create(unique, "submitter", None)
            tenant, headers = unique, {"Authorization": f"Bearer {key}"}
        async with asgi_gateway(settings, broker, store, stores=stores) as (app, client):
            yield Limited(app, client, store, model, tenant, headers, settings)


def refused_count(tenant: str, reason: str) -> float:
    return RATE_LIMITED_TOTAL.labels(tenant, reason)._value.get()


@pytest.mark.parametrize("pair", ["memory", "nats+redis"])
async def test_submits_past_the_burst_get_429_with_the_headers(request: Any, pair: str, unique: str) -> None:
    async with limited_gateway(request, pair, unique, rate_limit=f"{SLOW}/s burst 3") as gw:
        answers = [await gw.submit(i) for i in range(3)]
        assert [a.status_code for a in answers] == [202, 202, 202]
        assert [a.headers["ratelimit-remaining"] for a in answers] == ["2", "1", "0"]
        assert {a.headers["ratelimit-limit"] for a in answers} == {"3"}
        assert answers[0].headers["ratelimit-policy"] == f"3;w={math.ceil(3 / SLOW)}"
        assert 0 < int(answers[2].headers["ratelimit-reset"]) <= math.ceil(3 / SLOW)
        before = refused_count(unique, "rate_limited")
        refused = await gw.submit(3)
        assert refused.status_code == 429
        error = error_of(refused)
        assert error["type"] == "rate_limited" and repr(unique) in error["message"]
        assert error["details"]["tenant"] == unique and error["details"]["burst"] == 3
        assert 1 <= int(refused.headers["retry-after"]) <= math.ceil(1 / SLOW)
        assert refused.headers["ratelimit-remaining"] == "0" and refused.headers["ratelimit-limit"] == "3"
        assert refused_count(unique, "rate_limited") == before + 1
        infer = await gw.client.post("/v1/infer", json={"model": gw.model, "input": {}}, headers=gw.headers)
        assert infer.status_code == 429 and error_of(infer)["type"] == "rate_limited"  # infer is a submit too
        poll = await gw.client.get(f"/v1/jobs/{answers[0].json()['job_id']}", headers=gw.headers)
        assert poll.status_code == 200 and "ratelimit-limit" not in poll.headers  # reads are not limited
        bad = await gw.client.post("/v1/jobs", json={"model": gw.model}, headers=gw.headers)
        assert bad.status_code == 422  # refused before the limits: it costs nothing
        metrics = (await gw.client.get("/metrics")).text
        assert f'fleet_rate_limited_total{{reason="rate_limited",tenant="{unique}"}}' in metrics


@pytest.mark.services
async def test_a_tenant_override_and_dag_runs(request: Any, unique: str) -> None:
    other = f"{unique}-big"
    overrides = {other: {"burst": 4}, f"{unique}-free": {"rate": None}}
    limits = {"rate_limit": f"{SLOW}/s burst 2", "tenant_limits": overrides}
    async with limited_gateway(request, "nats+redis", unique, **limits) as gw:
        key, _ = await gw.app.state.gateway.stores.keys.create(other, "submitter", None)
        big = {"Authorization": f"Bearer {key}"}
        small_codes = [(await gw.submit(i)).status_code for i in range(3)]
        big_codes = [(await gw.submit(i, big)).status_code for i in range(5)]
        assert small_codes == [202, 202, 429]
        assert big_codes == [202, 202, 202, 202, 429]
        assert gw.app.state.gateway.tenant_limiter.policy.for_tenant(other).rate == SLOW  # inherited from the default
        free, _ = await gw.app.state.gateway.stores.keys.create(f"{unique}-free", "submitter", None)
        free_codes = [(await gw.submit(i, {"Authorization": f"Bearer {free}"})).status_code for i in range(4)]
        assert free_codes == [202] * 4  # "rate": null: this tenant has no limit
        run = await gw.client.post("/v1/dags/nodag/runs", json={"input": {}}, headers=gw.headers)
        assert run.status_code == 429 and error_of(run)["type"] == "rate_limited"  # counted before the lookup


@pytest.mark.services
async def test_a_limit_holds_across_two_gateways_on_one_redis(request: Any, unique: str) -> None:
    burst = 6
    async with (
        limited_gateway(request, "nats+redis", unique, rate_limit=f"{SLOW}/s burst {burst}") as one,
        asgi_gateway(one.settings, limits=FAST_LIMITS) as (_, two),  # its own broker and store clients
    ):
        started = time.monotonic()
        calls = [
            one.submit(i) if i % 2 else two.post("/v1/jobs", json=body(one, i), headers=one.headers) for i in range(16)
        ]
        answers = await asyncio.gather(*calls)
        elapsed = time.monotonic() - started
        codes = [a.status_code for a in answers]
        assert set(codes) == {202, 429}, codes
        admitted = codes.count(202)
        assert burst <= admitted <= burst + math.ceil(elapsed * SLOW), (admitted, elapsed)


@pytest.mark.services
async def test_a_redis_outage_under_limits_is_503_and_the_gateway_keeps_serving(unique: str) -> None:
    """The one-script submit (limits and create together) answers a dead Redis as every store call does."""
    refs, (model,) = model_refs(unique, "echo")
    with private_server("redis") as (redis_url, proc):
        limits = {"rate_limit": "1000/s burst 1000", "tenant_max_queued": 1000}
        settings = FleetSettings.model_validate({"store_url": redis_url, "models": refs, **limits})
        async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
            first = await client.post("/v1/jobs", json={"model": model, "input": {"n": 1}})
            assert first.status_code == 202 and first.headers["ratelimit-remaining"] == "999"
            assert await Stores.beside(store).quotas.members(c.DEFAULT_TENANT, 10) == [first.json()["job_id"]]
            proc.terminate()
            proc.wait(10)
            for n in range(3):
                refused = await client.post("/v1/jobs", json={"model": model, "input": {"n": n}})
                assert refused.status_code == 503, refused.text
                assert error_of(refused)["type"] == "store_unavailable" and refused.headers["retry-after"].isdigit()
            assert (await client.get("/healthz")).status_code == 200


def body(gw: Limited, n: int) -> dict[str, Any]:
    return {"model": gw.model, "input": {"n": n}}


def echo_worker(gw: Limited) -> Worker:
    """A real echo worker with the gateway's limit settings: it gives quota places back as it settles."""
    settings = gw.settings.model_copy(update={"ack_wait_s": 5.0})
    state = gw.app.state.gateway
    return Worker(with_name(EchoHandler, gw.model)(), state.broker, gw.store, settings=settings, stores=state.stores)


@pytest.mark.parametrize("auth", ["off", "keys"])  # the default tenant, and a key's tenant read from the records
@pytest.mark.parametrize("pair", ["memory", "nats+redis"])
async def test_the_quota_refuses_then_frees_places_as_jobs_finish(
    request: Any, pair: str, auth: str, unique: str
) -> None:
    async with limited_gateway(request, pair, unique, auth=auth, tenant_max_queued=2) as gw:
        await gw.app.state.gateway.tenant_limiter.quotas.release(
            [(gw.tenant, i) for i in await gw.app.state.gateway.tenant_limiter.quotas.members(gw.tenant, 100)]
        )  # what an earlier run against this Redis may have left
        first = [await gw.submit(i) for i in range(2)]
        assert [a.status_code for a in first] == [202, 202]
        assert "ratelimit-limit" not in first[0].headers  # a quota alone has no rate to announce
        full = await gw.submit(2)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        error = error_of(full)
        assert error["type"] == "quota_exceeded"
        assert error["details"] == {"tenant": gw.tenant, "max_queued": 2, "queued": 2, "retry_after_s": 1}
        again = await gw.submit(0, job_id=first[0].json()["job_id"])  # a resubmit creates nothing: not refused
        assert again.status_code == 202
        quotas = gw.app.state.gateway.tenant_limiter.quotas
        worker = echo_worker(gw)
        await worker.start()
        try:

            async def released() -> bool:  # by the settle path: the gateway has not swept (it was not asked)
                return await quotas.members(gw.tenant, 10) == []

            await eventually(released, timeout_s=15, what="the settle path gives the places back")
            assert (await gw.submit(3)).status_code == 202
        finally:
            await worker.stop()


@pytest.mark.parametrize("pair", ["memory", "nats+redis"])
async def test_a_job_that_ended_without_a_release_frees_its_place(request: Any, pair: str, unique: str) -> None:
    async with limited_gateway(request, pair, unique, tenant_max_queued=1) as gw:
        job_id = (await gw.submit(0)).json()["job_id"]
        assert (await gw.submit(1)).status_code == 429
        cancelled = await gw.client.post(f"/v1/jobs/{job_id}/cancel", headers=gw.headers)
        assert cancelled.json()["state"] == JobState.cancelled
        await asyncio.sleep(c.QUOTA_SWEEP_INTERVAL_S)  # the sweep runs at most once a second per tenant

        async def admitted() -> bool:
            return (await gw.submit(2)).status_code == 202

        await eventually(admitted, what="a sweep frees the cancelled job's place")


async def test_a_failed_release_never_fails_the_job(unique: str) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(name)

        async def release(self, items: list[tuple[str, str]]) -> None:
            raise OSError("redis went away")

    refs, (model,) = model_refs(unique, "echo")
    settings = settings_for("memory", {}, models=refs, tenant_max_queued=5)
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
        worker = Worker(with_name(EchoHandler, model)(), broker, store, settings=settings)
        assert worker.settler.quotas is not None
        worker.settler.quotas = Broken()  # type: ignore[assignment]
        await worker.start()
        try:
            answer = await client.post("/v1/infer", json={"model": model, "input": {"x": 1}})
            assert answer.status_code == 200 and answer.json()["output"] == {"x": 1}
        finally:
            await worker.stop()
        assert worker.stats.failures == 0


def test_bad_limit_settings_are_refused_at_start_up() -> None:
    cases = {
        "fast": ("rate_limit", "COUNT/UNIT"),
        '{"a": {"rat": 1}}': ("tenant_limits", "unknown field(s) rat"),
        '{"a": {"burst": 0}}': ("tenant_limits", "burst: a whole number of at least 1"),
        '{"a": {"rate": -1}}': ("tenant_limits", "rate: a number"),
        '{"a b": {"rate": 1}}': ("tenant_limits", "tenant 'a b'"),
        "{nope": ("tenant_limits", "not valid JSON"),
    }
    for value, (name, message) in cases.items():
        with pytest.raises(ValidationError, match=re_escape(message)):
            FleetSettings(**{name: value})
    result = CliRunner().invoke(
        cli_app, ["gateway", "--store", "redis://127.0.0.1:1/0"], prog_name="fleet", env={"FLEET_RATE_LIMIT": "lots"}
    )
    assert result.exit_code != 0
    assert result.stderr.startswith("error: ") and "rate_limit" in result.stderr, result.stderr
    assert "COUNT/UNIT burst N" in result.stderr and "Traceback" not in result.output


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
