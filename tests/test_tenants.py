"""Tenant isolation end to end (FLEET_AUTH=keys), on memory and on NATS + Redis: one gateway served by uvicorn,
real echo workers (one of them continuing DAG runs), and API keys of two tenants.

Another tenant's job or run answers exactly as an unknown id does (status, body, message pattern) on GET, ?wait,
cancel, SSE, both WebSockets and the DAG routes; the owner and the operator token read them; a submit that reuses
another tenant's job id is refused without anything of it (run ids and DAG names: tests/test_dag_trust.py); a
request published straight to the broker names its tenant and the worker writes it into the record; the result
caches (L1, L2, L3, and an L3 index rebuilt by a later gateway) answer only the tenant that filled them, unless the
model is shared (FLEET_CACHE_SHARED).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect as ws_connect

from fleet import constants as c
from fleet import tenancy
from fleet.brokers.base import Broker
from fleet.cli import app as cli_app
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.producers.publish import prepare, publish_all
from fleet.producers.sdk import ws_url
from fleet.schemas.jobs import JobRecord
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.cache_helpers import Gateway, gateway, worker
from tests.gateway_helpers import WORKER_SETTINGS, error_of, urls_for
from tests.infra import connected_pair, eventually, request_bytes, settings_for

PAIRS = ["memory", "nats+redis"]  # the tenant travels in the JSON body: Kafka carries the same bytes
TOKEN = "operator-token-for-tenant-tests"


@dataclass
class Env:
    pair: str
    settings: FleetSettings
    broker: Broker
    store: ResultStore
    gw: Gateway
    unique: str
    a: httpx.AsyncClient  # tenant A's submitter key
    b: httpx.AsyncClient  # tenant B's submitter key
    a_operator: httpx.AsyncClient  # tenant A's operator key
    token: httpx.AsyncClient  # the operator token: no tenant
    keys: dict[str, str]
    tenant_a: str
    tenant_b: str

    @property
    def echo(self) -> str:
        return f"echo-{self.unique}"

    @property
    def idle(self) -> str:
        """A model no worker serves: its jobs stay queued."""
        return f"echo-{self.unique}q"

    @property
    def text(self) -> str:
        return f"echotext-{self.unique}"

    @property
    def shared(self) -> str:
        return f"echotext-{self.unique}s"

    async def submit(self, client: httpx.AsyncClient, model: str, value: dict[str, Any], **extra: Any) -> Any:
        response = await client.post("/v1/jobs", json={"model": model, "input": value, **extra})
        assert response.status_code == 202, response.text
        return response.json()

    async def done(self, client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
        response = await client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert response.status_code == 200, response.text
        record: dict[str, Any] = response.json()
        assert record["state"] == "succeeded", record
        return record

    async def computed(self, client: httpx.AsyncClient, model: str, value: dict[str, Any]) -> dict[str, Any]:
        """A job that must miss the caches, computed, with the caches filled after it."""
        answer = await self.submit(client, model, value)
        assert answer["status"] == "queued", answer
        record = await self.done(client, answer["job_id"])
        await asyncio.sleep(0.05)  # the gateway's fill task runs right after the terminal notice
        return record


def _settings(request: pytest.FixtureRequest, pair: str, unique: str) -> FleetSettings:
    refs = [
        f"tests.gateway_helpers:echo_{unique}",
        f"tests.gateway_helpers:echo_{unique}q",
        f"tests.cache_helpers:echotext_{unique}",
        f"tests.cache_helpers:echotext_{unique}s",
    ]
    cache = {f"echo-{unique}": ["l1", "l2"], f"echotext-{unique}": ["all"], f"echotext-{unique}s": ["all"]}
    return settings_for(
        pair,
        urls_for(request, pair),
        models=refs,
        auth="keys",
        operator_token=TOKEN,
        cache=cache,
        cache_shared=[f"echotext-{unique}s"],
        cache_l3_sync_interval_s=0.1,
    )


@contextlib.asynccontextmanager
async def _dag_worker(broker: Broker, store: ResultStore, stores: Stores, model: str) -> AsyncIterator[None]:
    runner = DagRunner(broker, store, stores.dags)
    handler = with_name(EchoHandler, model)()
    settled = [runner.on_settled]
    async with Worker(
        handler,
        broker,
        store,
        settings=WORKER_SETTINGS,
        worker_id=f"tenants-{model}",
        max_wait_ms=2,
        on_settled=settled,
    ):
        yield


@pytest.fixture(scope="module", params=PAIRS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    unique = uuid.uuid4().hex[:10]
    pair = request.param
    settings = _settings(request, pair, unique)
    tenant_a, tenant_b = f"a-{unique}", f"b-{unique}"
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        made = stores.keys
        keys = {
            "a": (await made.create(tenant_a, "submitter", None))[0],
            "b": (await made.create(tenant_b, "submitter", None))[0],
            "a_operator": (await made.create(tenant_a, "operator", None))[0],
            "token": TOKEN,
        }
        async with contextlib.AsyncExitStack() as stack:
            gw = await stack.enter_async_context(gateway(settings, broker, store, stores=stores))
            clients = {}
            for name, key in keys.items():
                headers = {"Authorization": f"Bearer {key}"}
                clients[name] = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=gw.base, headers=headers, timeout=30)
                )
            await stack.enter_async_context(_dag_worker(broker, store, stores, f"echo-{unique}"))
            for model in (f"echotext-{unique}", f"echotext-{unique}s"):
                await stack.enter_async_context(worker(broker, store, model))
            yield Env(
                pair, settings, broker, store, gw, unique, **clients, keys=keys, tenant_a=tenant_a, tenant_b=tenant_b
            )


def same_as_unknown(refused: httpx.Response, unknown: httpx.Response, real_id: str, unknown_id: str) -> None:
    """The answer for another tenant's id is the answer for an unknown id, the id aside."""
    assert refused.status_code == unknown.status_code == 404, (refused.text, unknown.text)
    assert refused.headers.get("content-type") == unknown.headers.get("content-type")
    assert refused.text.replace(real_id, "ID") == unknown.text.replace(unknown_id, "ID")
    error_of(refused)


# -- jobs -----------------------------------------------------------------------------------------------------
async def test_another_tenants_job_answers_as_an_unknown_id_on_every_read(env: Env) -> None:
    job_id = (await env.submit(env.a, env.echo, {"secret": "of tenant a"}))["job_id"]
    record = await env.done(env.a, job_id)
    assert record["tenant"] == env.tenant_a and record["output"] == {"secret": "of tenant a"}
    ghost = f"ghost-{env.unique}"
    for method, path, params in (
        ("GET", "/v1/jobs/{}", None),
        ("GET", "/v1/jobs/{}", {"wait": 2}),
        ("POST", "/v1/jobs/{}/cancel", None),
        ("GET", "/v1/jobs/{}/events", None),
    ):
        refused = await env.b.request(method, path.format(job_id), params=params)
        unknown = await env.b.request(method, path.format(ghost), params=params)
        same_as_unknown(refused, unknown, job_id, ghost)
        assert "of tenant a" not in refused.text
        # an operator key reads only its own tenant's jobs: tenant A's operator reads it, B's submitter does not
        assert (await env.a_operator.request(method, path.format(job_id), params=params)).status_code != 404
    assert (await env.token.get(f"/v1/jobs/{job_id}")).json()["output"] == {"secret": "of tenant a"}
    assert (await env.a.get(f"/v1/jobs/{job_id}")).json() == record


async def test_another_tenant_cannot_cancel_or_wait_on_a_queued_job(env: Env) -> None:
    job_id = (await env.submit(env.a, env.idle, {"waits": True}))["job_id"]  # no worker: it stays queued
    ghost = f"ghost-{env.unique}"
    same_as_unknown(
        await env.b.post(f"/v1/jobs/{job_id}/cancel"), await env.b.post(f"/v1/jobs/{ghost}/cancel"), job_id, ghost
    )
    waited = await env.b.get(f"/v1/jobs/{job_id}", params={"wait": 30})  # refused at the first read, not waited
    same_as_unknown(waited, await env.b.get(f"/v1/jobs/{ghost}", params={"wait": 1}), job_id, ghost)
    assert (await env.a.get(f"/v1/jobs/{job_id}")).json()["state"] == "queued"
    cancelled = await env.a.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"


async def test_a_job_id_of_another_tenant_is_refused_without_its_content(env: Env) -> None:
    job_id = f"taken-{env.unique}"
    await env.submit(env.a, env.echo, {"private": 1}, job_id=job_id)
    before = await env.done(env.a, job_id)
    for body in (
        {"model": env.echo, "input": {"private": 1}, "job_id": job_id},  # the same job: still not B's
        {"model": env.text, "input": {"text": "x"}, "job_id": job_id},  # another model: the same answer
    ):
        refused = await env.b.post("/v1/jobs", json=body)
        assert refused.status_code == 409, refused.text
        error = error_of(refused)
        assert error["type"] == "job_id_conflict" and error["details"] == {"job_id": job_id}
        assert env.echo not in error["message"] and "succeeded" not in error["message"]
    assert (
        await env.b.post("/v1/infer", json={"model": env.echo, "input": {"private": 1}, "job_id": job_id})
    ).status_code == 409
    assert (await env.a.get(f"/v1/jobs/{job_id}")).json() == before  # untouched
    again = await env.a.post("/v1/jobs", json={"model": env.echo, "input": {"private": 1}, "job_id": job_id})
    assert again.status_code == 202 and again.json()["status"] == "succeeded"  # the owner's resubmit is idempotent


async def test_websockets_treat_another_tenants_job_as_unknown(env: Env) -> None:
    job_id = (await env.submit(env.a, env.echo, {"ws": 1}))["job_id"]
    await env.done(env.a, job_id)
    ghost = f"ghost-{env.unique}"

    async def one(key: str, jid: str) -> tuple[str, int | None]:
        url = ws_url(env.gw.base, f"/v1/jobs/{jid}/ws")
        async with ws_connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            frame = str(await ws.recv())
            with contextlib.suppress(Exception):
                await ws.recv()
            return frame, ws.close_code

    refused, unknown = await one(env.keys["b"], job_id), await one(env.keys["b"], ghost)
    assert refused[1] == unknown[1] == 4404
    assert refused[0].replace(job_id, "ID") == unknown[0].replace(ghost, "ID")
    own = await one(env.keys["a"], job_id)
    assert own[1] == 1000 and json.loads(own[0])["output"] == {"ws": 1}

    url = ws_url(env.gw.base, "/v1/ws")
    async with ws_connect(url, additional_headers={"Authorization": f"Bearer {env.keys['b']}"}) as ws:
        await ws.send(json.dumps({"subscribe": [job_id, ghost]}))
        frames = {f["job_id"]: f for f in [json.loads(await ws.recv()) for _ in range(2)]}
    assert set(frames) == {job_id, ghost}
    assert json.dumps(frames[job_id]).replace(job_id, "ID") == json.dumps(frames[ghost]).replace(ghost, "ID")
    async with ws_connect(url, additional_headers={"Authorization": f"Bearer {env.keys['a']}"}) as ws:
        await ws.send(json.dumps({"subscribe": [job_id]}))
        frame = json.loads(await ws.recv())
    assert frame["type"] == "result" and frame["job"]["output"] == {"ws": 1}


# -- DAG runs -------------------------------------------------------------------------------------------------
def one_step_dag(name: str, echo: str) -> str:
    return f"""
name: {name}
steps:
  - id: one
    model: {echo}
    input: {{said: "${{input.said}}"}}
output: "${{steps.one.output}}"
"""


async def test_dag_runs_and_their_steps_belong_to_the_starting_tenant(env: Env) -> None:
    dag, run_id, ghost = f"tenants-{env.unique}", f"run-{env.unique}", f"ghost-{env.unique}"
    registered = await env.a.post(
        "/v1/dags", content=one_step_dag(dag, env.echo), headers={"content-type": "application/yaml"}
    )
    assert registered.status_code == 201, registered.text
    started = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {"said": "a's words"}, "run_id": run_id})
    assert started.status_code == 202, started.text
    view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 20})).json()
    assert view["state"] == "succeeded" and view["output"] == {"said": "a's words"}
    for method, path, params in (
        ("GET", "/v1/runs/{}", None),
        ("GET", "/v1/runs/{}", {"wait": 2}),
        ("POST", "/v1/runs/{}/cancel", None),
        ("GET", "/v1/runs/{}/events", None),
    ):
        refused = await env.b.request(method, path.format(run_id), params=params)
        same_as_unknown(refused, await env.b.request(method, path.format(ghost), params=params), run_id, ghost)
    assert (await env.token.get(f"/v1/runs/{env.tenant_a}:{run_id}")).status_code == 200  # the store's id

    async def socket(key: str, rid: str) -> tuple[str, int | None]:
        url = ws_url(env.gw.base, f"/v1/runs/{rid}/ws")
        async with ws_connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            frame = str(await ws.recv())
            with contextlib.suppress(Exception):
                while True:
                    await ws.recv()
            return frame, ws.close_code

    refused_ws, unknown_ws = await socket(env.keys["b"], run_id), await socket(env.keys["b"], ghost)
    assert refused_ws[1] == unknown_ws[1] == 4404
    assert refused_ws[0].replace(run_id, "ID") == unknown_ws[0].replace(ghost, "ID")
    assert json.loads((await socket(env.keys["a"], run_id))[0])["type"] == "run"

    (step_job,) = view["steps"]["one"]["job_ids"]
    assert (await env.a.get(f"/v1/jobs/{step_job}")).json()["tenant"] == env.tenant_a  # inherited over the wire
    assert (await env.b.get(f"/v1/jobs/{step_job}")).status_code == 404


# -- the wire -------------------------------------------------------------------------------------------------
async def test_a_raw_broker_message_names_its_tenant(env: Env) -> None:
    named, unnamed = f"raw-{env.unique}", f"raw-default-{env.unique}"
    subject = c.request_subject(env.echo)
    await env.broker.publish(subject, request_bytes(env.echo, named, {"raw": 1}, tenant=env.tenant_b), msg_id=named)
    await env.broker.publish(subject, request_bytes(env.echo, unnamed, {"raw": 2}), msg_id=unnamed)

    async def stored(job_id: str) -> JobRecord | None:
        return await env.store.get(job_id)

    await eventually(lambda: _terminal(stored(named)), what="the raw job's record")
    await eventually(lambda: _terminal(stored(unnamed)), what="the raw default job's record")
    record = await env.done(env.b, named)
    assert record["tenant"] == env.tenant_b and record["output"] == {"raw": 1}
    assert (await env.a.get(f"/v1/jobs/{named}")).status_code == 404
    assert (await env.b.get(f"/v1/jobs/{unnamed}")).status_code == 404  # no tenant on the wire: the default one
    default = (await env.token.get(f"/v1/jobs/{unnamed}")).json()
    assert default["tenant"] is None and tenancy.owner(default["tenant"]) == c.DEFAULT_TENANT


async def _terminal(reading: Any) -> bool:
    record = await reading
    return record is not None and record.terminal


async def test_the_publish_path_puts_the_tenant_on_the_wire(env: Env) -> None:
    spec = env.gw.app.state.gateway.specs[env.echo]
    prepared = prepare(['{"sdk": 1}'], spec, tenant=env.tenant_b)
    assert not prepared.errors and [m.tenant for m in prepared.messages] == [env.tenant_b]
    (job_id,) = await publish_all(env.broker, prepared.messages)
    # a job published to the broker has no record until a worker takes it: wait for that, then read it
    await eventually(lambda: _terminal(env.store.get(job_id)), what="the published job's record")
    record = await env.done(env.b, job_id)
    assert record["tenant"] == env.tenant_b and (await env.a.get(f"/v1/jobs/{job_id}")).status_code == 404
    line = json.dumps({"job_id": f"x-{env.unique}", "model": env.echo, "input": {}, "tenant": env.tenant_a})
    other = prepare([line], spec, requests=True, tenant=env.tenant_b)
    assert not other.messages and "tenant" in other.errors[0].message  # a line naming another tenant is invalid


@pytest.mark.parametrize("env", ["nats+redis"], indirect=True)  # fleet publish refuses the in-process broker
async def test_fleet_publish_tenant_puts_the_tenant_on_the_wire(env: Env, tmp_path: Any) -> None:
    lines = tmp_path / "inputs.jsonl"
    lines.write_text('{"cli": 1}\n')
    result = await asyncio.to_thread(
        CliRunner().invoke,
        cli_app,
        ["publish", str(lines), "--model", f"tests.gateway_helpers:echo_{env.unique}", "--tenant", env.tenant_a],
        env={"FLEET_BROKER_URL": env.settings.broker_url},
    )
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip().splitlines()[-1]
    await eventually(lambda: _terminal(env.store.get(job_id)), what="the published job's record")
    record = await env.done(env.a, job_id)
    assert record["tenant"] == env.tenant_a and record["output"] == {"cli": 1}
    assert (await env.b.get(f"/v1/jobs/{job_id}")).status_code == 404
    bad = await asyncio.to_thread(
        CliRunner().invoke,
        cli_app,
        ["publish", str(lines), "--model", f"tests.gateway_helpers:echo_{env.unique}", "--tenant", "no spaces"],
        env={"FLEET_BROKER_URL": env.settings.broker_url},
    )
    assert bad.exit_code != 0 and "tenant" in bad.output and "Traceback" not in bad.output


# -- caches ---------------------------------------------------------------------------------------------------
async def test_l1_and_l2_hits_answer_only_the_tenant_that_filled_them(env: Env) -> None:
    cache = env.gw.app.state.gateway.cache
    value = {"cached": "by a"}
    first = await env.computed(env.a, env.echo, value)
    assert (await env.submit(env.b, env.echo, value))["status"] == "queued"  # neither A's L1 nor its L2 entry
    hit = await env.submit(env.a, env.echo, value)
    assert (hit["status"], hit["cache"]) == ("succeeded", "l1")
    only_a = {"cached": "by a only"}
    await env.computed(env.a, env.echo, only_a)
    cache.l1.clear()  # L2 answers on its own now
    assert (await env.submit(env.b, env.echo, only_a))["status"] == "queued"
    cache.l1.clear()
    l2 = await env.submit(env.a, env.echo, value)
    assert (l2["status"], l2["cache"]) == ("succeeded", "l2")
    assert (await env.done(env.a, l2["job_id"]))["output"] == first["output"]


async def test_l3_matches_only_entries_of_the_same_tenant(env: Env) -> None:
    await env.computed(env.a, env.text, {"text": "How do I reset the password of my account?"})
    assert (await env.submit(env.b, env.text, {"text": "how do I reset the password of my account"}))["status"] == (
        "queued"
    )  # a semantic hit would leak what A asked
    hit = await env.submit(env.a, env.text, {"text": "How do I reset the password of my account"})
    assert (hit["status"], hit["cache"]) == ("succeeded", "l3"), hit


async def test_a_later_gateway_replays_the_l3_log_into_per_tenant_indexes(env: Env) -> None:
    await env.computed(env.a, env.text, {"text": "Which documents do I need to renew my passport?"})
    stores = env.gw.app.state.gateway.stores  # a later gateway of the same process: the same stores
    async with (
        gateway(env.settings, env.broker, env.store, stores=stores) as later,
        contextlib.AsyncExitStack() as stack,
    ):
        a_later, b_later = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=later.base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            )
            for key in (env.keys["a"], env.keys["b"])
        ]
        await eventually(lambda: _replayed(later), what="the later gateway's replay of the L3 log")
        missed = await env.submit(b_later, env.text, {"text": "which documents do I need to renew my passport"})
        hit = await env.submit(a_later, env.text, {"text": "Which documents do I need to renew my passport"})
    assert missed["status"] == "queued", missed
    assert (hit["status"], hit["cache"]) == ("succeeded", "l3"), hit


async def _replayed(later: Gateway) -> bool:
    semantic = later.app.state.gateway.cache.semantic
    return bool(semantic.entries(*next(iter(semantic._slots))))


async def test_a_model_marked_shared_shares_its_entries_across_tenants(env: Env) -> None:
    first = await env.computed(env.a, env.shared, {"text": "Where is the nearest train station?"})
    exact = await env.submit(env.b, env.shared, {"text": "Where is the nearest train station?"})
    assert (exact["status"], exact["cache"]) == ("succeeded", "l1")
    semantic = await env.submit(env.b, env.shared, {"text": "where is the nearest train station"})
    assert (semantic["status"], semantic["cache"]) == ("succeeded", "l3"), semantic
    assert (await env.done(env.b, semantic["job_id"]))["output"] == first["output"]
    assert (await env.a.get(f"/v1/jobs/{semantic['job_id']}")).status_code == 404  # the hit is B's own job


# -- without services: the rules themselves ----------------------------------------------------------------------
def test_visibility_and_the_default_tenant() -> None:
    assert tenancy.visible(None, c.DEFAULT_TENANT) and tenancy.visible("team-a", "team-a")
    assert not tenancy.visible(None, "team-a") and not tenancy.visible("team-a", c.DEFAULT_TENANT)
    assert tenancy.visible("team-a", tenancy.ALL_TENANTS) and tenancy.visible(None, tenancy.ALL_TENANTS)
    assert tenancy.stored(c.DEFAULT_TENANT) is None and tenancy.stored("team-a") == "team-a"
    old = JobRecord.model_validate_json('{"job_id": "j", "model": "echo", "state": "queued"}')  # before tenants
    assert old.tenant is None and tenancy.owner(old.tenant) == c.DEFAULT_TENANT
    assert FleetSettings.model_validate({"cache_shared": "embed, echo"}).cache_shared == ["embed", "echo"]


async def test_l3_sync_routes_each_logged_entry_to_its_tenants_index_only() -> None:
    import numpy as np

    from fleet.producers.gateway.cache.l3 import L3Options, SemanticLevel
    from fleet.store.cachestore import MemoryCacheStore, VectorEntry

    store, dim = MemoryCacheStore(), 8
    options = L3Options(dim=dim, max_entries=100, nprobe=4, sync_interval_s=60, ttl_s=60, timeout_s=1)
    vector = (np.ones(dim) / np.sqrt(dim)).astype(np.float32)
    for log_model, tenant in (("m", "a"), ("m", None), ("s", None), ("s", "a")):
        entry = VectorEntry(f"{log_model}-{tenant}", "same text", vector.tobytes(), tenant)
        await store.append_vector(c.cache_vectors_key(log_model, "1"), entry, 100, 60)
    level = SemanticLevel(store, options)
    level.serve("m", "1")
    level.serve("s", "1", shared=True)
    await level.sync_once()
    found = await level.match("m", "1", vector, "same text", 0.9, "a")
    assert found is not None and found.key == "m-a"
    assert await level.match("m", "1", vector, "same text", 0.9, "b") is None  # another tenant: nothing
    assert await level.match("m", "1", vector, "same text", 0.9, None) is None  # an entry from before tenants
    shared = await level.match("s", "1", vector, "same text", 0.9, None)
    assert shared is not None and shared.key == "s-None" and level.entries("s", "1") == 1
