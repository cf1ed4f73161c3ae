"""A job id names one job of one model and one tenant: the worker never computes a message into another job's
record, nor answers a message from it (``fleet.store.transitions.foreign``,
``fleet.consumers.settle.Settler.conflicts``).

Attacks with two tenants' keys on a real gateway, a real worker and each broker/store pair: tenant B publishes a
message straight to a model's subject naming tenant A's job id (the forge), and tenant A's message (a DAG step, a
raw publish) lands on an id that B holds (the read). A's record stays as it was, B never sees A's input or output,
the message is dead-lettered with ``job_id_conflict`` and the subject goes on serving. The same rule per store is
in ``tests/contract/test_store_contract.py``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.producers.gateway import create_app
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, model_refs, served, urls_for
from tests.infra import connected_pair, eventually, request_bytes, settings_for

PAIRS = ["memory", "nats+redis", "kafka+redis"]
TOKEN = "operator-token-for-ownership-tests"


@dataclass
class Env:
    broker: Broker
    store: ResultStore
    echo: str  # served by a worker that each test starts
    idle: str  # no worker: its jobs stay queued
    a: httpx.AsyncClient
    b: httpx.AsyncClient
    token: httpx.AsyncClient
    tenant_a: str
    tenant_b: str

    async def submit(self, client: httpx.AsyncClient, model: str, value: dict[str, Any], job_id: str) -> None:
        response = await client.post("/v1/jobs", json={"model": model, "input": value, "job_id": job_id})
        assert response.status_code == 202, response.text

    async def raw(self, job_id: str, value: dict[str, Any], tenant: str | None, unread: bool = False) -> None:
        """A request published straight to the echo subject (anyone allowed to publish there can); ``unread``: with
        ``fleet-record: none`` (as ``fleet publish`` sends), so the worker starts it without reading a record."""
        data = request_bytes(self.echo, job_id, value, tenant=tenant)
        headers = {c.HEADER_RECORD: c.RECORD_NONE} if unread else None
        await self.broker.publish(c.request_subject(self.echo), data, msg_id=f"raw-{uuid.uuid4().hex}", headers=headers)

    async def letters(self) -> list[dict[str, Any]]:
        response = await self.token.get("/v1/deadletters", params={"model": self.echo, "limit": 100})
        assert response.status_code == 200, response.text
        latest: list[dict[str, Any]] = response.json()["models"][self.echo]["latest"]
        return latest

    async def conflict_letter(self, job_id: str) -> dict[str, Any]:
        """Wait for the dead letter of a conflicting message about ``job_id``."""
        found: list[dict[str, Any]] = []

        async def arrived() -> bool:
            found[:] = [letter for letter in await self.letters() if letter["job_id"] == job_id]
            return bool(found)

        await eventually(arrived, what=f"the dead letter of job {job_id}")
        return found[0]


@pytest.fixture(scope="module", params=PAIRS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    unique = uuid.uuid4().hex[:10]
    refs, (echo, idle) = model_refs(unique, "echo", "sleep")
    pair = request.param
    settings = settings_for(pair, urls_for(request, pair), models=refs, auth="keys", operator_token=TOKEN)
    tenant_a, tenant_b = f"a-{unique}", f"b-{unique}"
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        keys = stores.keys
        key_a = (await keys.create(tenant_a, "submitter", None))[0]
        key_b = (await keys.create(tenant_b, "submitter", None))[0]
        app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
        async with served(app) as base, contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
                )
                for key in (key_a, key_b, TOKEN)
            ]
            yield Env(broker, store, echo, idle, *clients, tenant_a=tenant_a, tenant_b=tenant_b)


async def test_a_raw_message_naming_another_tenants_job_of_another_model_does_not_forge_it(env: Env) -> None:
    job_id = f"a-job-{uuid.uuid4().hex[:8]}"
    await env.submit(env.a, env.idle, {"mean_ms": 1}, job_id)  # A's job, queued: no worker serves its model
    before = await env.store.get(job_id)
    await env.raw(job_id, {"secret": "B-INJECTED"}, env.tenant_b)
    async with ObservedWorker(env.broker, env.store, env.echo) as worker:
        await worker.handled(1)
        assert await env.store.get(job_id) == before, "A's record is untouched"
        letter = await env.conflict_letter(job_id)
        assert letter["error"]["type"] == "job_id_conflict", letter
        own = (await env.a.get(f"/v1/jobs/{job_id}")).json()
        assert own["state"] == "queued" and own["output"] is None
        assert (await env.b.get(f"/v1/jobs/{job_id}")).status_code == 404
        # the subject is not wedged: B's next job of its own is computed
        await env.submit(env.b, env.echo, {"after": 1}, f"b-after-{uuid.uuid4().hex[:8]}")
        await worker.handled(2)


@pytest.mark.parametrize("unread", [False, True], ids=["read", "unread"])
async def test_a_message_of_tenant_a_landing_on_an_id_b_holds_gives_b_nothing(env: Env, unread: bool) -> None:
    """The issue's read attack: B takes an id first, A's step (here its message, published as a runner does,
    also without a record read first) comes to it. B's record must not receive A's input or output."""
    job_id = f"b-holds-{uuid.uuid4().hex[:8]}"
    await env.submit(env.b, env.idle, {"mean_ms": 1}, job_id)
    before = await env.store.get(job_id)
    await env.raw(job_id, {"secret": "A-EXFIL-42"}, env.tenant_a, unread=unread)
    async with ObservedWorker(env.broker, env.store, env.echo) as worker:
        await worker.handled(1)
        seen_by_b = await env.b.get(f"/v1/jobs/{job_id}")
        assert seen_by_b.status_code == 200 and "A-EXFIL-42" not in seen_by_b.text
        assert await env.store.get(job_id) == before
        await env.conflict_letter(job_id)


async def test_a_raw_message_naming_another_tenants_job_of_the_same_model_does_not_forge_it(env: Env) -> None:
    """Same model, another tenant: B's message comes first on the subject; A's own message still computes A's
    input into A's job."""
    job_id = f"a-same-{uuid.uuid4().hex[:8]}"
    await env.raw(job_id, {"secret": "B-INJECTED"}, env.tenant_b)  # queued first, read after A's record exists
    await env.submit(env.a, env.echo, {"mine": "A"}, job_id)
    async with ObservedWorker(env.broker, env.store, env.echo) as worker:
        await worker.handled(2)
        own = await env.a.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert own.json()["state"] == "succeeded" and own.json()["output"] == {"mine": "A"}, own.text
        assert (await env.conflict_letter(job_id))["error"]["type"] == "job_id_conflict"
    assert "B-INJECTED" not in own.text


async def test_a_foreign_job_id_answers_exactly_as_any_conflict(env: Env) -> None:
    """No existence oracle beyond the conflict itself: B's submit under A's id answers what B's submit under its
    own used id answers, word for word (the id aside), whatever differs and whatever A's job is."""
    a_id, b_id = f"a-oracle-{uuid.uuid4().hex[:8]}", f"b-oracle-{uuid.uuid4().hex[:8]}"
    await env.submit(env.a, env.idle, {"mean_ms": 11}, a_id)
    await env.submit(env.b, env.idle, {"mean_ms": 2}, b_id)
    bodies = [
        {"model": env.idle, "input": {"mean_ms": 3}},  # another input
        {"model": env.echo, "input": {"x": 1}},  # another model
        {"model": env.idle, "input": {"mean_ms": 11}},  # A's very job: still not B's
    ]
    for route in ("/v1/jobs", "/v1/infer"):
        answers = set()
        for body in bodies:
            for job_id in (a_id, b_id):
                response = await env.b.post(route, json={**body, "job_id": job_id})
                assert response.status_code == 409, response.text
                assert "queued" not in response.text and env.tenant_a not in response.text
                answers.add((response.status_code, response.text.replace(job_id, "ID")))
        assert len(answers) == 1, answers
    assert (await env.a.get(f"/v1/jobs/{a_id}")).json()["state"] == "queued"
