"""``GET /v1/jobs`` and ``POST /v1/jobs:batch`` end to end (FLEET_AUTH=keys), on memory and on NATS + Redis: the
gateway in process, a real echo worker, API keys of several tenants.

The listing pages newest first without repeating or skipping a job while new ones arrive, filters by model, state
and time, and never shows another tenant's job: not to its key, not through a forged ``?tenant=``, not through a
cursor of another tenant's listing. Hostile queries answer 4xx at once. A batch answers one entry per item, in
order; items are idempotent by job id as single submits are; a bad item never fails the others; the tenant's quota
counts per item (on Redis through the one-script admit-and-create, which also writes the index).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.cli import app as cli_app
from fleet.producers.gateway import create_app
from fleet.producers.sdk import FleetClient, GatewayError
from fleet.producers.sdk_sync import FleetSyncClient
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.jobindex import Scope
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, error_of, served, urls_for
from tests.infra import connected_pair, eventually, request_bytes, settings_for

PAIRS = ["memory", "nats+redis"]
TOKEN = "operator-token-for-history-tests"
LIMITS = dataclasses.replace(FAST_LIMITS, batch_max_bytes=256 * 1024)


@dataclass
class Env:
    base: str
    keys: dict[str, str]
    broker: Broker
    store: ResultStore
    unique: str
    clients: dict[str, httpx.AsyncClient]
    tenants: dict[str, str]

    @property
    def echo(self) -> str:
        return f"echo-{self.unique}"

    @property
    def idle(self) -> str:
        """No worker serves it: its jobs stay queued."""
        return f"echo-{self.unique}q"

    async def submit(self, who: str, model: str, value: dict[str, Any], **extra: Any) -> str:
        response = await self.clients[who].post("/v1/jobs", json={"model": model, "input": value, **extra})
        assert response.status_code == 202, response.text
        job_id: str = response.json()["job_id"]
        return job_id

    async def page(self, who: str, **params: Any) -> dict[str, Any]:
        response = await self.clients[who].get("/v1/jobs", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def every(self, who: str, **params: Any) -> list[dict[str, Any]]:
        """Every page of a listing, followed by its cursors."""
        jobs: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = await self.page(who, **params, **({"cursor": cursor} if cursor else {}))
            jobs += page["jobs"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return jobs


@pytest.fixture(scope="module", params=PAIRS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    unique = uuid.uuid4().hex[:10]
    tenants = {"a": f"a-{unique}", "b": f"b-{unique}", "c": f"c-{unique}", "d": f"d-{unique}"}
    settings: FleetSettings = settings_for(
        request.param,
        urls_for(request, request.param),
        models=[f"tests.gateway_helpers:echo_{unique}", f"tests.gateway_helpers:echo_{unique}q"],
        auth="keys",
        operator_token=TOKEN,
        tenant_limits={tenants["c"]: {"max_queued": 3}},
    )
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        made = stores.keys
        keys = {
            "a": (await made.create(tenants["a"], "submitter", None))[0],
            "b": (await made.create(tenants["b"], "submitter", None))[0],
            "c": (await made.create(tenants["c"], "submitter", None))[0],
            "d": (await made.create(tenants["d"], "submitter", None))[0],
            "a_operator": (await made.create(tenants["a"], "operator", None))[0],
            "default_operator": (await made.create(c.DEFAULT_TENANT, "operator", None))[0],
            "token": TOKEN,
        }
        async with contextlib.AsyncExitStack() as stack:
            app = create_app(settings, broker=broker, stores=stores, limits=LIMITS)
            base = await stack.enter_async_context(served(app))
            clients = {}
            for name, key in keys.items():
                headers = {"Authorization": f"Bearer {key}"}
                client = httpx.AsyncClient(base_url=base, headers=headers, timeout=30)
                clients[name] = await stack.enter_async_context(client)
            await stack.enter_async_context(ObservedWorker(broker, store, f"echo-{unique}"))
            yield Env(base, keys, broker, store, unique, clients, tenants)


# -- listing ----------------------------------------------------------------------------------------------------
async def test_pages_repeat_and_skip_nothing_while_new_jobs_arrive(env: Env) -> None:
    first = [await env.submit("a", env.idle, {"n": i}) for i in range(23)]
    seen: list[dict[str, Any]] = []
    cursor = None
    arrived = []
    while True:
        page = await env.page("a", model=env.idle, limit=5, **({"cursor": cursor} if cursor else {}))
        seen += page["jobs"]
        arrived.append(await env.submit("a", env.idle, {"late": len(arrived)}))  # newer than every page so far
        cursor = page.get("next_cursor")
        if cursor is None:
            break
    ids = [j["job_id"] for j in seen]
    assert len(ids) == len(set(ids)), "a job was listed twice"
    assert set(first) <= set(ids), "a job was skipped"
    assert not set(arrived[1:]) & set(ids)  # jobs that arrived after the first page sit above it
    created = [j["created_at"] for j in seen]
    assert created == sorted(created, reverse=True)
    assert all(j["tenant"] == env.tenants["a"] and j["state"] == "queued" and "output" not in j for j in seen)
    fresh = await env.page("a", model=env.idle, limit=1)
    assert fresh["jobs"][0]["job_id"] == arrived[-1]


async def test_filters_by_model_state_and_time(env: Env) -> None:
    before = time.time()
    done = [await env.submit("b", env.echo, {"d": i}) for i in range(3)]
    waiting = [await env.submit("b", env.idle, {"w": i}) for i in range(2)]
    for job_id in done:
        assert (await env.clients["b"].get(f"/v1/jobs/{job_id}", params={"wait": 10})).json()["state"] == "succeeded"
    mine = {*done, *waiting}
    listed = {j["job_id"] for j in await env.every("b", since=before) if j["job_id"] in mine}
    assert listed == mine
    assert {j["job_id"] for j in await env.every("b", model=env.echo, since=before)} == set(done)
    assert {j["job_id"] for j in await env.every("b", state="succeeded", since=before)} == set(done)
    assert {j["job_id"] for j in await env.every("b", state="queued,running", since=before)} == set(waiting)
    assert await env.every("b", state="failed", since=before) == []
    # since / until bound created_at (RFC 3339 or unix seconds)
    newer, older = (await env.page("b", model=env.idle, limit=2, since=before))["jobs"]
    middle = (newer["created_at"] + older["created_at"]) / 2
    stamp = datetime.fromtimestamp(middle, UTC).isoformat()  # microseconds: the jobs are further apart
    assert [j["job_id"] for j in await env.every("b", model=env.idle, since=stamp)] == [waiting[1]]
    assert [j["job_id"] for j in await env.every("b", model=env.idle, since=before, until=middle)] == [waiting[0]]


async def test_another_tenants_jobs_are_never_listed(env: Env) -> None:
    secret = await env.submit("a", env.idle, {"secret": "of a"})
    await env.submit("a", env.idle, {"secret": "of a, 2"})
    # B's own listing, its listing of A by name, by A's model: nothing of A
    assert secret not in {j["job_id"] for j in await env.every("b", limit=500)}
    for who in ("b", "a_operator", "c"):
        other = env.tenants["b" if who == "a_operator" else "a"]
        forged = await env.clients[who].get("/v1/jobs", params={"tenant": other})
        assert forged.status_code == 403 and error_of(forged)["type"] == "forbidden", forged.text
        assert "of a" not in forged.text
    # A's cursor in B's hands: refused, not a view into A's listing
    cursor = (await env.page("a", limit=1))["next_cursor"]
    stolen = await env.clients["b"].get("/v1/jobs", params={"limit": 1, "cursor": cursor})
    assert stolen.status_code == 400 and error_of(stolen)["type"] == "invalid_cursor", stolen.text
    assert secret not in stolen.text
    # ... and with A's own filters changed, too
    changed = await env.clients["a"].get("/v1/jobs", params={"limit": 1, "cursor": cursor, "model": env.idle})
    assert changed.status_code == 400
    # the operator token and a default-tenant operator key list any tenant, and every tenant at once
    for who in ("token", "default_operator"):
        of_a = {j["job_id"] for j in await env.every(who, tenant=env.tenants["a"], limit=500)}
        assert secret in of_a
        everyone = await env.every(who, model=env.idle, limit=500)
        assert secret in {j["job_id"] for j in everyone} and {j["tenant"] for j in everyone} >= {env.tenants["a"]}
    # an operator key of tenant A lists A only
    assert {j["tenant"] for j in await env.every("a_operator", limit=500)} == {env.tenants["a"]}


async def test_a_job_published_straight_to_the_topic_is_listed_for_its_tenant(env: Env) -> None:
    """No gateway made its record: the worker that creates it enters it in the index, under the wire's tenant."""
    job_id = f"raw-{env.unique}"
    message = request_bytes(env.echo, job_id, {"raw": 1}, tenant=env.tenants["b"])
    await env.broker.publish(c.request_subject(env.echo), message, msg_id=job_id)

    async def listed() -> bool:
        return job_id in {j["job_id"] for j in await env.every("b", model=env.echo, limit=500)}

    await eventually(listed, what="the raw job in its tenant's history")
    assert job_id not in {j["job_id"] for j in await env.every("a", limit=500)}


async def test_expired_records_leave_the_listing(env: Env) -> None:
    job_id = await env.submit("b", env.idle, {"gone": 1})
    await env.store.delete(job_id)  # as an expired record: the entry stays until a page meets it
    assert job_id not in {j["job_id"] for j in await env.every("b", limit=500)}
    page = await env.store.index_page(Scope(env.tenants["b"]), None, None, None, 500)
    assert job_id not in {p.job_id for p in page}  # removed by the page that met it


async def test_a_rare_state_is_found_through_bounded_pages(env: Env) -> None:
    """More jobs than one request reads: a page answers what it found (nothing) with a cursor where it stopped,
    within its read budget, and following the cursors finds the one failed job at the bottom."""
    tenant, now = env.tenants["d"], time.time()
    failed = JobRecord(
        job_id=f"{env.unique}-failed", model=env.idle, state=JobState.failed, tenant=tenant, created_at=now - 100
    )
    await env.store.create(failed)
    for i in range(c.JOB_LIST_SCAN_MAX + 10):
        record = JobRecord(
            job_id=f"{env.unique}-{i}",
            model=env.idle,
            state=JobState.queued,
            tenant=tenant,
            created_at=now - 50 + i / 1000,
        )
        await env.store.create(record)
    began = time.monotonic()
    first = await env.page("d", state="failed")
    assert time.monotonic() - began < 5
    assert first["jobs"] == [] and first["scanned"] == c.JOB_LIST_SCAN_MAX and first["next_cursor"]
    found = await env.every("d", state="failed")
    assert [j["job_id"] for j in found] == [failed.job_id] and found[0]["state"] == "failed"


@pytest.mark.parametrize(
    ("params", "status", "kind", "words"),
    [
        ({"limit": 100000}, 422, "invalid_request", "query.limit"),
        ({"limit": 0}, 422, "invalid_request", "query.limit"),
        ({"limit": "many"}, 422, "invalid_request", "limit"),
        ({"cursor": "not-a-cursor"}, 400, "invalid_cursor", "query.cursor"),
        ({"cursor": "x" * 5000}, 400, "invalid_cursor", "query.cursor"),
        ({"state": "done"}, 422, "invalid_request", "unknown state 'done'"),
        ({"since": "200", "until": "100"}, 422, "invalid_request", "after until"),
        ({"since": "nan"}, 422, "invalid_request", "query.since"),
        ({"since": "1e400"}, 422, "invalid_request", "query.since"),
        ({"until": "2026-01-01T00:00:00"}, 422, "invalid_request", "offset"),
        ({"until": "yesterday"}, 422, "invalid_request", "RFC 3339"),
        ({"tenant": "../etc"}, 422, "invalid_request", "query.tenant"),
        ({"model": "Bad Model!"}, 422, "invalid_request", "query.model"),
    ],
)
async def test_hostile_queries_answer_4xx_at_once(
    env: Env, params: dict[str, Any], status: int, kind: str, words: str
) -> None:
    began = time.monotonic()
    response = await env.clients["a"].get("/v1/jobs", params=params)
    assert time.monotonic() - began < 0.5
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["type"] == kind and words in error["message"], error


async def test_a_tampered_cursor_is_refused(env: Env) -> None:
    for i in range(3):
        await env.submit("a", env.idle, {"t": i})
    cursor = (await env.page("a", limit=1))["next_cursor"]
    outer = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    inner = json.loads(outer["b"])
    inner["s"] = inner["s"] + 1000
    outer["b"] = json.dumps(inner)
    forged = base64.urlsafe_b64encode(json.dumps(outer).encode()).decode()
    response = await env.clients["a"].get("/v1/jobs", params={"limit": 1, "cursor": forged})
    assert response.status_code == 400 and error_of(response)["type"] == "invalid_cursor"


# -- batch submit -----------------------------------------------------------------------------------------------
async def test_batch_answers_each_item_in_order_and_a_bad_item_fails_alone(env: Env) -> None:
    items: list[Any] = [
        {"model": env.echo, "input": {"i": 0}},
        {"model": "no-such-model", "input": {}},
        {"model": env.echo, "input": {"i": 2}, "job_id": f"own-{env.unique}"},
        "not an object",
        {"model": env.echo, "input": {"i": 4}, "priority": "urgent"},
        {"model": env.echo, "input": {"i": 5}},
    ]
    response = await env.clients["b"].post("/v1/jobs:batch", json=items)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["index"] for r in body["items"]] == list(range(6))
    assert [r["status"] for r in body["items"]] == [202, 404, 202, 422, 422, 202]
    assert body["accepted"] == 3 and body["refused"] == 3
    assert body["items"][2]["job_id"] == f"own-{env.unique}"
    assert body["items"][1]["error"]["type"] == "unknown_model"
    assert "items.4.priority" in body["items"][4]["error"]["message"]
    for item in body["items"]:
        if item["status"] == 202:
            record = (await env.clients["b"].get(f"/v1/jobs/{item['job_id']}", params={"wait": 10})).json()
            assert record["state"] == "succeeded" and record["tenant"] == env.tenants["b"]


async def test_batch_items_are_idempotent_by_job_id(env: Env) -> None:
    ids = [f"idem-{env.unique}-{i}" for i in range(4)]
    items = [{"model": env.idle, "input": {"i": i}, "job_id": job_id} for i, job_id in enumerate(ids)]
    first = (await env.clients["a"].post("/v1/jobs:batch", json=items)).json()
    assert [r["status"] for r in first["items"]] == [202] * 4
    items[2] = {**items[2], "input": {"other": True}}  # the same id with another input: that item alone is 409
    again = (await env.clients["a"].post("/v1/jobs:batch", json=items)).json()
    assert [r["status"] for r in again["items"]] == [202, 202, 409, 202]
    assert [r.get("job_id") for r in again["items"]] == [ids[0], ids[1], None, ids[3]]
    assert again["items"][2]["error"]["type"] == "job_id_conflict"
    listed = [j["job_id"] for j in await env.every("a", model=env.idle, limit=500) if j["job_id"] in ids]
    assert sorted(listed) == sorted(ids)  # one job each, listed once
    # another tenant's batch under those ids: 409 for each, nothing of A's jobs
    stolen = (await env.clients["b"].post("/v1/jobs:batch", json=items)).json()
    assert [r["status"] for r in stolen["items"]] == [409] * 4


async def test_batch_as_json_lines(env: Env) -> None:
    lines = [
        b'{"model": "%s", "input": {"line": 0}}' % env.echo.encode(),
        b"",
        b'{"model": "%s", "input": {"line": 1}' % env.echo.encode(),  # cut short
        b'{"model": "%s", "input": {"line": 2}}' % env.echo.encode(),
    ]
    for kind in ("application/x-ndjson", "application/jsonl; charset=utf-8"):
        response = await env.clients["b"].post(
            "/v1/jobs:batch", content=b"\n".join(lines) + b"\n", headers={"Content-Type": kind}
        )
        assert response.status_code == 200, response.text
        statuses = [r["status"] for r in response.json()["items"]]
        assert statuses == [202, 400, 202]
        assert response.json()["items"][1]["error"]["type"] == "malformed_json"


async def test_batch_bounds(env: Env) -> None:
    too_many = [{"model": env.echo, "input": {}}] * (c.JOB_BATCH_MAX_ITEMS + 1)
    response = await env.clients["b"].post("/v1/jobs:batch", json=too_many)
    assert response.status_code == 413 and error_of(response)["type"] == "batch_too_large", response.text
    big = [{"model": env.echo, "input": {"x": "y" * 1000}}] * 300  # over this gateway's 256 KiB
    response = await env.clients["b"].post("/v1/jobs:batch", json=big)
    assert response.status_code == 413 and error_of(response)["type"] == "payload_too_large", response.text
    for body, kind, status in (
        (b"[]", "application/json", 422),
        (b'{"model": "x"}', "application/json", 422),
        (b"[", "application/json", 400),
        (b"a,b", "text/csv", 415),
        (b"\n\n", "application/x-ndjson", 422),
    ):
        response = await env.clients["b"].post("/v1/jobs:batch", content=body, headers={"Content-Type": kind})
        assert response.status_code == status, (body, response.text)
        error_of(response)
    anonymous = await env.clients["b"].post("/v1/jobs:batch", json=[], headers={"Authorization": "Bearer nope"})
    assert anonymous.status_code == 401


async def test_batch_counts_each_item_against_the_tenants_quota(env: Env) -> None:
    items = [{"model": env.idle, "input": {"q": i}} for i in range(5)]
    body = (await env.clients["c"].post("/v1/jobs:batch", json=items)).json()
    statuses = sorted(r["status"] for r in body["items"])
    assert statuses == [202, 202, 202, 429, 429], body
    refused = [r for r in body["items"] if r["status"] == 429]
    assert all(r["error"]["type"] == "quota_exceeded" for r in refused)
    accepted = {r["job_id"] for r in body["items"] if r["status"] == 202}
    assert {j["job_id"] for j in await env.every("c", limit=500)} == accepted  # indexed with the admit script


async def test_batch_items_run_concurrently(env: Env) -> None:
    items = [{"model": env.echo, "input": {"n": i}} for i in range(100)]
    body = (await env.clients["a"].post("/v1/jobs:batch", json=items)).json()
    assert body["accepted"] == 100
    ids = [r["job_id"] for r in body["items"]]

    async def all_done() -> bool:
        records = await env.store.get_many(ids)
        return all(r is not None and r.state == "succeeded" for r in records)

    await eventually(all_done, what="the batch's jobs to succeed")


# -- the SDK ----------------------------------------------------------------------------------------------------
def _client(env: Env, who: str) -> FleetClient:
    return FleetClient(env.base, api_key=env.keys[who])


async def test_sdk_submits_many_and_lists_them(env: Env) -> None:
    since = time.time()
    async with _client(env, "b") as fleet:
        jobs = [{"model": env.idle, "input": {"sdk": i}} for i in range(7)] + [{"model": "nope", "input": {}}]
        answer = await fleet.submit_many(jobs)
        assert [r.status for r in answer.items] == [202] * 7 + [404] and answer.refused == 1
        ids = [r.job_id for r in answer.items[:7]]
        page = await fleet.list_jobs(model=env.idle, since=since, limit=3)
        assert [j.job_id for j in page.jobs] == ids[::-1][:3] and page.next_cursor is not None
        walked = [j.job_id async for j in fleet.iter_jobs(model=env.idle, since=since, limit=3)]
        assert walked == ids[::-1]
        assert [j.job_id async for j in fleet.iter_jobs(state=["succeeded"], model=env.idle, since=since)] == []
        with pytest.raises(GatewayError) as refused:
            await fleet.list_jobs(tenant=env.tenants["a"])
        assert refused.value.status == 403


async def test_sdk_splits_a_long_batch(env: Env) -> None:
    async with _client(env, "a") as fleet:
        jobs = [{"model": "nope", "input": {}}] * (c.JOB_BATCH_MAX_ITEMS + 5)  # refused fast, each one
        answer = await fleet.submit_many(jobs)
    assert [r.index for r in answer.items] == list(range(c.JOB_BATCH_MAX_ITEMS + 5))
    assert answer.refused == c.JOB_BATCH_MAX_ITEMS + 5


async def test_sync_client_wraps_both(env: Env) -> None:
    def use() -> None:
        with FleetSyncClient(env.base, api_key=env.keys["a"]) as fleet:
            answer = fleet.submit_many([{"model": env.idle, "input": {"sync": 1}}])
            job_id = answer.items[0].job_id
            assert fleet.list_jobs(model=env.idle, limit=1).jobs[0].job_id == job_id
            assert job_id in [j.job_id for j in fleet.iter_jobs(model=env.idle, limit=500)]

    await asyncio.to_thread(use)  # the gateway goes on serving on this loop


# -- the CLI ----------------------------------------------------------------------------------------------------
async def test_cli_submits_a_file_and_lists_jobs(env: Env, tmp_path: Any) -> None:
    runner = CliRunner()
    file = tmp_path / "items.jsonl"
    lines = [json.dumps({"model": env.idle, "input": {"cli": i}}) for i in range(3)]
    file.write_text("\n".join([lines[0], "", lines[1], json.dumps({"model": "nope", "input": {}}), lines[2]]) + "\n")
    since = time.time()
    auth = {"FLEET_API_KEY": env.keys["b"], "FLEET_URL": env.base, "COLUMNS": "200"}

    def cli(*argv: str) -> Any:
        return runner.invoke(cli_app, list(argv), env=auth)

    submitted = await asyncio.to_thread(cli, "jobs", "submit", "--file", str(file))
    assert submitted.exit_code == 1, submitted.output  # one line was refused
    assert "3 accepted, 1 refused" in submitted.stdout and "line 4: 404 unknown_model" in submitted.stderr
    listed = await asyncio.to_thread(cli, "jobs", "list", "--json", "--model", env.idle, "--since", str(since))
    assert listed.exit_code == 0, listed.output
    jobs = json.loads(listed.stdout)["jobs"]
    assert len(jobs) == 3 and {j["tenant"] for j in jobs} == {env.tenants["b"]}
    table = await asyncio.to_thread(cli, "jobs", "list", "--model", env.idle, "--limit", "2", "--since", str(since))
    assert table.exit_code == 0 and jobs[0]["job_id"] in table.stdout and "more: --cursor" in table.stdout
    for argv, words in (
        (["jobs", "list", "--tenant", env.tenants["a"]], "lists only its jobs"),
        (["jobs", "list", "--state", "done"], "unknown state 'done'"),
        (["jobs", "list", "--cursor", "forged"], "not a cursor of this listing"),
        (["jobs", "list", "--url", "http://127.0.0.1:9"], "cannot reach the gateway"),
    ):
        refused = await asyncio.to_thread(cli, *argv)
        assert refused.exit_code == 1 and words in refused.stderr and "Traceback" not in refused.output, argv
