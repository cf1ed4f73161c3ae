"""DAG trust between tenants, end to end (FLEET_AUTH=keys, on memory and on NATS + Redis): the attacks of issue 26
against a real gateway and a real worker continuing DAG runs, with the API keys of two tenants (the ``env`` of
``tests.test_tenants``).

- Step job ids cannot be claimed: a client's job id of the shape ``<run>.<step>.<index>[.<anything>]`` is refused
  at submit (``422`` naming the rule), and a step's real id carries its run's key, so tenant B can neither read
  A's step output (the read attack) nor complete A's step first (the forge attack); a result published straight
  to the broker under an id that is not the step's is ignored by the run.
- DAG specs belong to a tenant: B's ``POST /v1/dags`` of A's DAG name makes B's own version 1 and A's runs keep
  A's spec (the replacement attack); A's DAG is to B one that does not exist. A run start may pin a version.
- Run ids are per tenant: A's run id is a free id to B (no ``409 run_id_taken`` oracle); each tenant's
  re-submission stays idempotent.
- A run the code before keys and namespaces wrote goes on with its old ids (a rolling upgrade).
- A run that is over at its start (an empty ``for_each``, every ``when`` false, a fan-out over the bound) answers
  every waiter at once: ``?wait``, the WebSocket, SSE, ``fleet dag run --wait`` and a start on ``fleet.req._dagrun``.
"""

# ruff: noqa: F811  (``env`` is the fixture of tests.test_tenants, imported: each test's argument names it)
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect as ws_connect

from fleet import constants as c
from fleet.cli import app as cli_app
from fleet.dags import evaluate
from fleet.dags.runner import DagRunner
from fleet.dags.starter import DagStarter
from fleet.dags.state import MAX_FAN_OUT, parse_job_id
from fleet.producers.publish import prepare
from fleet.producers.sdk import FleetClient, ws_url
from fleet.schemas.models import BUILTIN_SPECS
from fleet.schemas.wire import DagContext, DagStartMessage, RequestMessage
from tests.gateway_helpers import error_of
from tests.infra import eventually
from tests.test_tenants import Env, env, same_as_unknown  # noqa: F401  (the two tenants' gateway and worker)

YAML = {"content-type": "application/yaml"}
RESERVED = "reserved for the steps of DAG runs"


def echo_dag(name: str, model: str, output: str = '"${steps.s.output}"') -> str:
    """The issue's ``echo`` DAG: one step ``s`` echoing the run's input; ``output`` is YAML."""
    return f'name: {name}\nsteps:\n  - {{id: s, model: {model}, input: "${{input}}"}}\noutput: {output}\n'


async def register(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
    response = await client.post("/v1/dags", content=text, headers=YAML)
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


async def run_to_end(client: httpx.AsyncClient, dag: str, **body: Any) -> dict[str, Any]:
    started = await client.post(f"/v1/dags/{dag}/runs", json=body)
    assert started.status_code == 202, started.text
    view = await client.get(f"/v1/runs/{started.json()['run_id']}", params={"wait": 20})
    assert view.status_code == 200 and view.json()["finished_at"] is not None, view.text
    result: dict[str, Any] = view.json()
    return result


def cli_target(env: Env) -> list[str]:
    """The CLI options naming the gateway and tenant A's key."""
    return ["--url", env.gw.base, "--api-key", env.keys["a"]]


def refused_as_reserved(response: httpx.Response) -> None:
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request" and RESERVED in error["message"], error


# -- step ids -------------------------------------------------------------------------------------------------
async def test_the_read_attack_b_cannot_pre_create_a_step_id_and_read_a_s_output(env: Env) -> None:
    run_id, dag = f"nightly-9-{env.unique}", f"echo-{env.unique}"
    step_id = f"{run_id}.s.0"
    # B parks a job under A's future step id on a model whose queue does not move (the busy sleep worker)
    for route in ("/v1/jobs", "/v1/infer"):
        claim = {"model": env.idle, "input": {"mean_ms": 1}, "job_id": step_id}
        refused_as_reserved(await env.b.post(route, json=claim))
    await register(env.a, echo_dag(dag, env.echo))
    view = await run_to_end(env.a, dag, input={"secret": "A-EXFIL-42"}, run_id=run_id)
    assert (view["state"], view["output"]) == ("succeeded", {"secret": "A-EXFIL-42"})
    (real,) = view["steps"]["s"]["job_ids"]
    assert parse_job_id(real) == (run_id, "s", 0) and real != step_id  # <run>.s.0.<the run's key>
    ghost = f"ghost-{env.unique}"
    for jid in (step_id, real):
        read = await env.b.get(f"/v1/jobs/{jid}")
        same_as_unknown(read, await env.b.get(f"/v1/jobs/{ghost}"), jid, ghost)
        assert "A-EXFIL-42" not in read.text
    own = (await env.a.get(f"/v1/jobs/{real}")).json()
    assert (own["tenant"], own["output"]) == (env.tenant_a, {"secret": "A-EXFIL-42"})


async def test_the_forge_attack_b_cannot_complete_a_s_step_first(env: Env) -> None:
    run_id, dag = f"nightly-1-{env.unique}", f"echo-forge-{env.unique}"
    forged = {"model": env.echo, "input": {"secret": "B-INJECTED"}, "job_id": f"{run_id}.s.0"}
    refused_as_reserved(await env.b.post("/v1/jobs", json=forged))
    refused_as_reserved(await env.b.post("/v1/jobs", json={**forged, "job_id": f"{run_id}.s.0.0123456789abcdef"}))
    await register(env.a, echo_dag(dag, env.echo))
    view = await run_to_end(env.a, dag, input={"secret": "A-OWN"}, run_id=run_id)
    assert (view["state"], view["output"]) == ("succeeded", {"secret": "A-OWN"})


async def test_a_result_under_another_id_than_the_steps_is_ignored_by_the_run(env: Env) -> None:
    """Past the gateway: a request published straight to the broker naming A's run in its DAG context, under a
    guessed id, is computed (the broker is not the boundary) but does not complete A's step."""
    run_id, dag = f"nightly-2-{env.unique}", f"echo-idle-{env.unique}"
    await register(env.a, echo_dag(dag, env.idle))  # its step waits on a queue no worker takes
    started = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {"secret": "A"}, "run_id": run_id})
    assert started.status_code == 202, started.text
    context = DagContext(run=run_id, dag=dag, version=1, step="s", index=0)
    for guessed in (f"{run_id}.s.0", f"{run_id}.s.0.0123456789abcdef"):  # the old shape; a key that is not the run's
        message = RequestMessage(
            job_id=guessed, model=env.echo, input={"x": "B-INJECTED"}, dag=context, tenant=env.tenant_a
        )
        await env.broker.publish(
            c.request_subject(env.echo), message.model_dump_json().encode(), msg_id=f"forged-{guessed}"
        )

        async def computed(job_id: str = guessed) -> bool:
            record = await env.store.get(job_id)
            return record is not None and record.terminal

        await eventually(computed, what="the forged job's record")
    view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 0.5})).json()
    assert (view["state"], view["steps"]["s"]["state"], view["output"]) == ("running", "running", None)
    assert (await env.a.post(f"/v1/runs/{run_id}/cancel")).json()["state"] == "cancelled"


# -- specs ----------------------------------------------------------------------------------------------------
async def test_the_replacement_attack_b_registers_its_own_dag_and_a_keeps_its_own(env: Env) -> None:
    dag, only_a = f"shared-name-{env.unique}", f"only-a-{env.unique}"
    assert await register(env.a, echo_dag(dag, env.echo)) == {"name": dag, "version": 1}
    await register(env.a, echo_dag(only_a, env.echo))
    hostile = echo_dag(dag, env.echo, output="{secret: B-OWNS-THIS}")
    assert await register(env.b, hostile) == {"name": dag, "version": 1}  # B's own DAG of that name
    view = await run_to_end(env.a, dag, input={"secret": "A's"})
    assert (view["output"], view["version"]) == ({"secret": "A's"}, 1)
    assert (await run_to_end(env.b, dag, input={}))["output"] == {"secret": "B-OWNS-THIS"}
    assert (await env.a.get(f"/v1/dags/{dag}")).json()["versions"] == [1]
    assert (await env.a.get(f"/v1/dags/{dag}")).json()["spec"]["output"] == "${steps.s.output}"
    # A's other DAG is to B a DAG that does not exist: show, show a version, run, list
    ghost = f"ghost-dag-{env.unique}"
    for method, path, body in (
        ("GET", "/v1/dags/{}", None),
        ("GET", "/v1/dags/{}?version=1", None),
        ("POST", "/v1/dags/{}/runs", {"input": {}}),
        ("POST", "/v1/dags/{}/runs", {"input": {}, "version": 1}),
    ):
        refused = await env.b.request(method, path.format(only_a), json=body)
        same_as_unknown(refused, await env.b.request(method, path.format(ghost), json=body), only_a, ghost)
    names_b = {d["name"] for d in (await env.b.get("/v1/dags")).json()["dags"]}
    names_a = {d["name"] for d in (await env.a.get("/v1/dags")).json()["dags"]}
    assert dag in names_b and only_a not in names_b and {dag, only_a} <= names_a
    listed = {d["name"] for d in (await env.token.get("/v1/dags")).json()["dags"]}  # the operator sees every one
    assert {f"{env.tenant_a}:{dag}", f"{env.tenant_b}:{dag}", f"{env.tenant_a}:{only_a}"} <= listed


async def test_a_run_start_may_pin_a_version_and_names_the_version_it_ran(env: Env) -> None:
    dag = f"versions-{env.unique}"
    assert (await register(env.a, echo_dag(dag, env.echo, output="v1")))["version"] == 1
    assert (await register(env.a, echo_dag(dag, env.echo, output="v2")))["version"] == 2
    pinned = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {}, "version": 1})
    assert pinned.status_code == 202 and pinned.json()["version"] == 1, pinned.text
    view = (await env.a.get(f"/v1/runs/{pinned.json()['run_id']}", params={"wait": 20})).json()
    assert (view["version"], view["output"]) == (1, "v1")
    assert (await run_to_end(env.a, dag, input={}))["version"] == 2
    unknown = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {}, "version": 3})
    assert unknown.status_code == 404 and error_of(unknown)["type"] == "dag_not_found", unknown.text
    async with FleetClient(env.gw.base, api_key=env.keys["a"]) as fleet:
        run_id = await fleet.start_run(dag, {}, version=1)
        assert (await fleet.wait_run(run_id, timeout_s=20))["output"] == "v1"
    result = await asyncio.to_thread(
        CliRunner().invoke,
        cli_app,
        ["dag", "run", dag, "--version", "1", "--wait", *cli_target(env)],
    )
    assert result.exit_code == 0 and json.loads(result.stdout) == "v1", result.output
    async with raw_starter(env):
        pinned_raw = DagStartMessage(dag=dag, input={}, run_id=f"raw-v1-{env.unique}", tenant=env.tenant_a, version=1)
        await start_raw(env, pinned_raw)
    view = (await env.a.get(f"/v1/runs/raw-v1-{env.unique}", params={"wait": 20})).json()
    assert (view["version"], view["output"]) == (1, "v1")


# -- run ids --------------------------------------------------------------------------------------------------
async def test_another_tenants_run_id_is_a_free_id_and_each_tenant_resubmits_idempotently(env: Env) -> None:
    dag, run_id = f"ids-{env.unique}", f"nightly-9-ids-{env.unique}"
    await register(env.a, echo_dag(dag, env.echo))
    await register(env.b, echo_dag(dag, env.echo))
    a_first = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {"who": "a"}, "run_id": run_id})
    assert a_first.status_code == 202 and a_first.json()["created"] is True
    a_view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 20})).json()
    b_first = await env.b.post(f"/v1/dags/{dag}/runs", json={"input": {"who": "b"}, "run_id": run_id})
    assert b_first.status_code == 202 and b_first.json()["created"] is True, b_first.text  # no 409 run_id_taken
    b_view = (await env.b.get(f"/v1/runs/{run_id}", params={"wait": 20})).json()
    assert (a_view["output"], b_view["output"]) == ({"who": "a"}, {"who": "b"})
    assert set(a_view["steps"]["s"]["job_ids"]).isdisjoint(b_view["steps"]["s"]["job_ids"])
    for client, view in ((env.a, a_view), (env.b, b_view)):
        again = await client.post(f"/v1/dags/{dag}/runs", json={"input": {"who": "x"}, "run_id": run_id})
        assert again.status_code == 202 and again.json()["created"] is False, again.text
        assert (await client.get(f"/v1/runs/{run_id}")).json() == view
    # a tenant with no DAG of that name gets the answer of an unknown DAG, whoever holds the run id
    ghost = f"ghost-dag-{env.unique}"
    refused = await env.b.post(f"/v1/dags/{ghost}/runs", json={"input": {}, "run_id": run_id})
    assert refused.status_code == 404 and error_of(refused)["type"] == "dag_not_found"


# -- runs over at their start ---------------------------------------------------------------------------------
def at_start_dags(model: str, unique: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """name -> (spec, the state the run ends in at its start, its input)."""
    fan = f"""name: fan-{unique}
steps:
  - {{id: each, model: {model}, for_each: "${{input.items}}", input: {{x: "${{item}}"}}}}
output: "${{steps.each.outputs}}"
"""
    skipped = f"""name: never-{unique}
steps:
  - {{id: a, model: {model}, when: "${{input.go}}", input: {{x: 1}}}}
  - {{id: b, model: {model}, when: "${{input.go}}", input: {{x: 2}}}}
output: {{a: "${{steps.a.state}}", b: "${{steps.b.state}}"}}
"""
    return {
        "empty": (fan, "succeeded", {"items": []}),
        "skipped": (skipped, "succeeded", {"go": False}),
        "over": (fan, "failed", {"items": list(range(MAX_FAN_OUT + 1))}),
    }


@contextlib.asynccontextmanager
async def raw_starter(env: Env) -> AsyncIterator[None]:
    """A ``DagStarter`` (as every worker runs) taking the starts published on ``fleet.req._dagrun``."""
    starter = DagStarter(
        DagRunner(env.broker, env.store, env.gw.app.state.gateway.stores.dags), f"starter-{env.unique}"
    )
    await starter.start()
    try:
        yield
    finally:
        await starter.stop()


async def start_raw(env: Env, message: DagStartMessage) -> None:
    """Publish a start on ``fleet.req._dagrun``; returns once tenant A reads the run."""
    assert message.run_id is not None
    await env.broker.publish(c.DAG_START_SUBJECT, message.model_dump_json().encode(), msg_id=message.run_id)

    async def started() -> bool:
        return (await env.a.get(f"/v1/runs/{message.run_id}")).status_code == 200

    await eventually(started, what="the run started from fleet.req._dagrun")


async def follow_ws(base: str, key: str, run_id: str) -> tuple[list[dict[str, Any]], int | None]:
    async with ws_connect(
        ws_url(base, f"/v1/runs/{run_id}/ws"), additional_headers={"Authorization": f"Bearer {key}"}
    ) as ws:
        frames = [json.loads(frame) async for frame in ws]
    return frames, ws.close_code


def sse_types(text: str) -> list[str]:
    return [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]


@pytest.mark.parametrize("case", ["empty", "skipped", "over"])
async def test_a_run_over_at_its_start_answers_every_waiter_at_once(env: Env, case: str) -> None:
    spec, end, run_input = at_start_dags(env.echo, env.unique)[case]
    dag = (await register(env.a, spec))["name"]
    run_id = f"at-start-{case}-{env.unique}"
    async with asyncio.timeout(15):  # before: ?wait held to its deadline and the streams never ended
        started = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": run_input, "run_id": run_id})
        assert started.status_code == 202 and started.json()["state"] == end, started.text
        view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 10})).json()
        assert view["state"] == end and view["finished_at"] is not None, view
        assert view["finished_at"] >= view["created_at"]
        events = await env.a.get(f"/v1/runs/{run_id}/events")
        assert sse_types(events.text) == ["run", "result"], events.text
        frames, code = await follow_ws(env.gw.base, env.keys["a"], run_id)
        assert [f["type"] for f in frames] == ["run", "result"] and code == 1000
        assert frames[-1]["run"]["state"] == end
        result = await asyncio.to_thread(
            CliRunner().invoke,
            cli_app,
            ["dag", "run", dag, "--input", json.dumps(run_input), "--wait", *cli_target(env)],
        )
    assert result.exit_code == (0 if end == "succeeded" else 1), result.output
    if case == "over":
        assert view["error"]["step"] == "each" and str(MAX_FAN_OUT) in view["error"]["message"]


async def test_a_run_over_at_its_start_through_the_raw_starter_ends_at_once(env: Env) -> None:
    spec, _, run_input = at_start_dags(env.echo, env.unique)["empty"]
    dag = (await register(env.a, spec))["name"]
    run_id = f"raw-at-start-{env.unique}"
    async with raw_starter(env):
        await start_raw(env, DagStartMessage(dag=dag, input=run_input, run_id=run_id, tenant=env.tenant_a))
        async with asyncio.timeout(10):
            view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 10})).json()
            assert (view["state"], view["finished_at"] is not None) == ("succeeded", True)
            frames, code = await follow_ws(env.gw.base, env.keys["a"], run_id)
        assert [f["type"] for f in frames] == ["run", "result"] and code == 1000


# -- upgrade --------------------------------------------------------------------------------------------------
async def test_a_run_written_before_keys_and_namespaces_goes_on_with_its_old_ids(env: Env) -> None:
    """Mid-upgrade: a run document the old code wrote (under the bare run id, no key, its spec under the bare DAG
    name) is continued by the new worker with its old step ids, and its tenant reads, waits on and re-starts it."""
    dag, run_id = f"legacy-{env.unique}", f"legacy-run-{env.unique}"
    runner = DagRunner(env.broker, env.store, env.gw.app.state.gateway.stores.dags, env.gw.app.state.gateway.specs)
    await runner.register(echo_dag(dag, env.echo))  # the bare name: where every spec lived before namespaces
    version, compiled = await runner.compiled(dag)
    state, _ = evaluate.advance(compiled, evaluate.new_run(compiled, run_id, {"old": True}))
    old_doc = {"run": state.to_dict(), "version": version, "created_at": time.time(), "deadline": None}
    old_doc.update({"finished_at": None, "times": {}, "tenant": env.tenant_a})
    assert (await runner.dags.create_run(run_id, old_doc))[0]
    old_id = f"{run_id}.s.0"  # published as the old runner did
    context = DagContext(run=run_id, dag=dag, version=version, step="s", index=0)
    message = RequestMessage(job_id=old_id, model=env.echo, input={"old": True}, dag=context, tenant=env.tenant_a)
    await env.broker.publish(c.request_subject(env.echo), message.model_dump_json().encode(), msg_id=old_id)
    view = (await env.a.get(f"/v1/runs/{run_id}", params={"wait": 20})).json()
    assert (view["state"], view["output"], view["steps"]["s"]["job_ids"]) == ("succeeded", {"old": True}, [old_id])
    again = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {}, "run_id": run_id})
    assert again.status_code == 404  # the spec of the bare name is the default tenant's now: A registers its own
    await register(env.a, echo_dag(dag, env.echo))
    again = await env.a.post(f"/v1/dags/{dag}/runs", json={"input": {}, "run_id": run_id})
    assert again.status_code == 202 and again.json()["created"] is False, again.text
    assert (await env.b.get(f"/v1/runs/{run_id}")).status_code == 404


def test_fleet_publish_refuses_a_step_id_and_a_dag_context() -> None:
    """``fleet publish --requests`` lines go straight to the broker: a step's id shape or a ``dag`` context (the
    runner's alone) is an invalid line naming the rule."""
    spec = BUILTIN_SPECS["echo"]
    ctx = {"run": "nightly-9", "dag": "d", "version": 1, "step": "s", "index": 0}
    lines = [
        json.dumps({"job_id": "nightly-9.s.0", "model": "echo", "input": {}}),
        json.dumps({"job_id": "nightly-9.s.0.0123456789abcdef", "model": "echo", "input": {}}),
        json.dumps({"job_id": "mine-1", "model": "echo", "input": {}, "dag": ctx}),
        json.dumps({"job_id": "mine-2", "model": "echo", "input": {}}),
    ]
    prepared = prepare(lines, spec, requests=True)
    assert [m.job_id for m in prepared.messages] == ["mine-2"]
    messages = [e.message for e in prepared.errors]
    assert RESERVED in messages[0] and RESERVED in messages[1] and "dag context" in messages[2], messages
