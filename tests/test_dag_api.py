"""The DAG routes through the ASGI app with a real worker, on memory and on NATS + Redis: register, list, show,
start and long-poll runs of the examples, idempotent run ids, cancel, 404s, and the WebSocket and SSE events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from websockets.asyncio.client import connect as ws_connect

from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner, UnknownDag, UnknownRun
from fleet.dags.spec import MAX_SPEC_BYTES
from fleet.dags.state import parse_job_id
from fleet.errors import DagInvalid
from fleet.producers.sdk import FleetClient, GatewayError, ws_url
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.gateway_helpers import WORKER_SETTINGS, asgi_gateway, error_of, model_refs, served, urls_for
from tests.infra import connected_pair, settings_for

EXAMPLES = Path(__file__).resolve().parent.parent / "dags" / "examples"
API_PAIRS = ["memory", "nats+redis"]
YAML = {"content-type": "application/yaml"}


def example(name: str, echo: str, unique: str) -> str:
    """An example spec named ``<name>-<unique>`` (Redis is shared by the tests) with its ``echo`` steps on this
    test's own echo model."""
    text = (EXAMPLES / f"{name}.yaml").read_text().replace("model: echo", f"model: {echo}")
    return text.replace(f"\nname: {name}\n", f"\nname: {name}-{unique}\n", 1)


@dataclass
class DagEnv:
    settings: FleetSettings
    broker: Broker
    store: ResultStore
    app: FastAPI
    client: httpx.AsyncClient
    echo: str
    unique: str

    def example(self, name: str) -> tuple[str, str]:
        """(the DAG's name, its spec text) of an example."""
        return f"{name}-{self.unique}", example(name, self.echo, self.unique)

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[Worker]:
        """A real echo worker that continues DAG runs from its settle hook."""
        runner = DagRunner(self.broker, self.store, self.app.state.gateway.stores.dags)
        worker = Worker(
            with_name(EchoHandler, self.echo)(),
            self.broker,
            self.store,
            settings=WORKER_SETTINGS,
            worker_id=f"dag-worker-{self.unique}",
            max_wait_ms=2,
            on_settled=[runner.on_settled],
        )
        async with worker:
            yield worker

    async def register_example(self, name: str) -> str:
        dag, text = self.example(name)
        assert (await self.register(text))["name"] == dag
        return dag

    async def register(self, text: str) -> dict[str, Any]:
        response = await self.client.post("/v1/dags", content=text, headers=YAML)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    async def start(self, name: str, **body: Any) -> dict[str, Any]:
        response = await self.client.post(f"/v1/dags/{name}/runs", json=body)
        assert response.status_code == 202, response.text
        started: dict[str, Any] = response.json()
        return started

    async def finished(self, run_id: str, wait_s: float = 20) -> dict[str, Any]:
        response = await self.client.get(f"/v1/runs/{run_id}", params={"wait": wait_s})
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view


@pytest.fixture(params=API_PAIRS)
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[DagEnv]:
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for(request.param, urls_for(request, request.param), models=refs)
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (app, client):
        yield DagEnv(settings, broker, store, app, client, echo, unique)


def fan_spec(echo: str, name: str) -> str:
    return f"""
name: {name}
steps:
  - id: split
    model: {echo}
    input: {{texts: "${{input.texts}}"}}
  - id: each
    model: {echo}
    for_each: "${{steps.split.output.texts}}"
    input: {{text: "${{item}}", i: "${{index}}"}}
  - id: collect
    model: {echo}
    input: {{n: "${{length(steps.each.outputs)}}", texts: "${{steps.each.outputs[*].text}}"}}
  - id: many
    model: {echo}
    when: "${{length(steps.each.outputs) > `2`}}"
    input: {{many: true}}
output: "${{steps.collect.output}}"
"""


# -- register, list, show -------------------------------------------------------------------------------------
async def test_register_answers_the_version_and_keeps_it_for_the_same_spec(env: DagEnv) -> None:
    chain, text = env.example("chain")
    assert await env.register(text) == {"name": chain, "version": 1}
    assert await env.register(text) == {"name": chain, "version": 1}
    changed = text.replace("a chain of five echo steps", "changed")
    assert await env.register(changed) == {"name": chain, "version": 2}
    as_json = await env.client.post("/v1/dags", json=_as_dict(env.echo, env.unique))
    assert as_json.status_code == 201 and as_json.json() == {"name": f"solo-{env.unique}", "version": 1}


async def test_register_refuses_a_cycle_and_an_unknown_model_naming_step_and_path(env: DagEnv) -> None:
    cycle = f"""
name: loop
steps:
  - {{id: a, model: {env.echo}, input: {{x: "${{steps.b.output}}"}}}}
  - {{id: b, model: {env.echo}, input: {{x: "${{steps.a.output}}"}}}}
output: "${{steps.b.output}}"
"""
    problems = await refused(env, cycle)
    assert any("cycle" in p["message"] and p["step"] in ("a", "b") for p in problems), problems
    unknown = f"""
name: unknown
steps:
  - {{id: a, model: {env.echo}, input: {{x: 1}}}}
  - {{id: c, model: nosuchmodel, input: {{}}}}
output: "${{steps.a.output}}"
"""
    problems = await refused(env, unknown)
    assert any(p["step"] == "c" and p["path"] == "model" and "nosuchmodel" in p["message"] for p in problems)
    assert (await env.client.get("/v1/dags/loop")).status_code == 404  # nothing was stored


async def refused(env: DagEnv, text: str) -> list[dict[str, Any]]:
    response = await env.client.post("/v1/dags", content=text, headers=YAML)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["type"] == "dag_invalid"
    problems: list[dict[str, Any]] = error["details"]
    assert problems and all(set(p) == {"step", "path", "message"} for p in problems)
    return problems


async def test_malformed_yaml_and_json_are_400_with_line_and_column(env: DagEnv) -> None:
    response = await env.client.post("/v1/dags", content="name: x\nsteps: [\n  - a: b\n", headers=YAML)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "malformed_spec" and "line" in error["message"] and "column" in error["message"]
    bad_json = await env.client.post("/v1/dags", content='{"name": ', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "line 1" in error_of(bad_json)["message"]
    other = await env.client.post("/v1/dags", content="x", headers={"content-type": "image/png"})
    assert other.status_code == 415


async def test_list_and_show_give_the_graph_and_mermaid(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    fanout = await env.register_example("fanout")
    listed = (await env.client.get("/v1/dags")).json()
    assert {"name": chain, "version": 1} in listed["dags"] and {"name": fanout, "version": 1} in listed["dags"]
    shown = (await env.client.get(f"/v1/dags/{fanout}")).json()
    assert (shown["name"], shown["version"], shown["versions"]) == (fanout, 1, [1])
    assert [n["id"] for n in shown["graph"]["nodes"]] == ["each", "join"]
    assert shown["graph"]["nodes"][0]["for_each"] == "${input.items}"
    assert shown["graph"]["edges"] == [{"from": "each", "to": "join", "kind": "data"}]
    assert shown["mermaid"].startswith("flowchart TD") and "s0 --> s1" in shown["mermaid"]
    assert shown["spec"]["steps"][1]["id"] == "join"
    assert (await env.client.get(f"/v1/dags/{fanout}", params={"version": 1})).status_code == 200
    for path, params in (("/v1/dags/nope", {}), (f"/v1/dags/{fanout}", {"version": 7})):
        missing = await env.client.get(path, params=params)
        assert missing.status_code == 404 and error_of(missing)["type"] == "dag_not_found"


# -- runs -----------------------------------------------------------------------------------------------------
async def test_chain_run_succeeds_with_its_output(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    async with env.worker():
        started = await env.start(chain, input={"value": 42})
        assert started["state"] == "running" and started["created"] is True
        view = await env.finished(started["run_id"])
    assert view["state"] == "succeeded", view
    assert view["output"] == {"value": 42, "hops": 5}
    assert list(view["steps"]) == ["s1", "s2", "s3", "s4", "s5"]
    for sid, step in view["steps"].items():
        assert step["state"] == "succeeded" and step["items"] == {"total": 1, "done": 1}
        (jid,) = step["job_ids"]  # <run>.<step>.<index>.<the run's key>
        assert parse_job_id(jid) == (started["run_id"], sid, 0) and jid.startswith(f"{started['run_id']}.{sid}.0.")
        assert step["started_at"] <= step["finished_at"]
    assert view["finished_at"] >= view["created_at"]


async def test_fan_out_and_join_run(env: DagEnv) -> None:
    fan = f"fan-{env.unique}"
    await env.register(fan_spec(env.echo, fan))
    texts = [f"t{i}" for i in range(8)]
    async with env.worker():
        run_id = (await env.start(fan, input={"texts": texts}))["run_id"]
        view = await env.finished(run_id)
    assert view["state"] == "succeeded", view
    assert view["output"] == {"n": 8, "texts": texts}
    assert view["steps"]["each"]["items"] == {"total": 8, "done": 8}
    assert view["steps"]["many"]["state"] == "succeeded"
    fanout = await env.register_example("fanout")
    async with env.worker():
        run_id = (await env.start(fanout, input={"items": ["a", "b"]}))["run_id"]
        view = await env.finished(run_id)
    assert (view["state"], view["output"]) == ("succeeded", {"count": 2, "items": ["a", "b"]})


async def test_start_is_idempotent_on_run_id(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = f"r-{env.unique}"
    first = await env.start(chain, input={"value": 1}, run_id=run_id)
    again = await env.start(chain, input={"value": 2}, run_id=run_id)
    assert (first["run_id"], first["created"]) == (run_id, True)
    assert (again["run_id"], again["created"]) == (run_id, False)
    async with env.worker():
        view = await env.finished(run_id)
    assert view["output"] == {"value": 1, "hops": 5}


async def test_start_refuses_unknown_dags_bad_input_and_bad_run_ids(env: DagEnv) -> None:
    unknown = await env.client.post("/v1/dags/nope/runs", json={"input": {}})
    assert unknown.status_code == 404 and error_of(unknown)["type"] == "dag_not_found"
    fanout = await env.register_example("fanout")
    bad_input = await env.client.post(f"/v1/dags/{fanout}/runs", json={"input": {"items": "no"}})
    assert bad_input.status_code == 422 and error_of(bad_input)["type"] == "invalid_input"
    bad_id = await env.client.post(f"/v1/dags/{fanout}/runs", json={"input": {"items": []}, "run_id": "a.b"})
    assert bad_id.status_code == 422, bad_id.text
    bad_body = await env.client.post(f"/v1/dags/{fanout}/runs", content=b"{nope")
    assert bad_body.status_code == 400 and error_of(bad_body)["type"] == "malformed_json"


async def test_cancel_ends_a_running_run_and_409_after(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = (await env.start(chain, input={"value": 1}))["run_id"]  # no worker: it stays running
    cancelled = await env.client.post(f"/v1/runs/{run_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    view = cancelled.json()
    assert view["state"] == "cancelled"
    assert {s["state"] for s in view["steps"].values()} <= {"cancelled", "running"}
    assert view["steps"]["s5"]["state"] == "cancelled"
    again = await env.client.post(f"/v1/runs/{run_id}/cancel")
    assert again.status_code == 409 and error_of(again)["type"] == "run_terminal"
    async with env.worker():  # the outstanding job was cancelled in the store: nothing more starts
        await asyncio.sleep(0.5)
    assert (await env.client.get(f"/v1/runs/{run_id}")).json()["steps"]["s2"]["state"] == "cancelled"


async def test_unknown_runs_are_404(env: DagEnv) -> None:
    for method, path in (("GET", "/v1/runs/nope"), ("POST", "/v1/runs/nope/cancel"), ("GET", "/v1/runs/nope/events")):
        response = await env.client.request(method, path)
        assert response.status_code == 404 and error_of(response)["type"] == "run_not_found", (path, response.text)
    long_poll = await env.client.get("/v1/runs/nope", params={"wait": 0.2})
    assert long_poll.status_code == 404
    too_long = await env.client.get("/v1/runs/nope", params={"wait": 10_000})
    assert too_long.status_code == 422


async def test_long_poll_returns_a_running_run_after_wait(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = (await env.start(chain, input={"value": 1}))["run_id"]
    view = (await env.client.get(f"/v1/runs/{run_id}", params={"wait": 0.3})).json()
    assert view["state"] == "running" and view["steps"]["s1"]["state"] == "running"


# -- events ---------------------------------------------------------------------------------------------------
def check_event_sequence(events: list[dict[str, Any]], steps: list[str]) -> None:
    """First the run, last the result; each step runs then settles, in the DAG's order."""
    assert events[0]["type"] == "run" and events[-1]["type"] == "result", [e["type"] for e in events]
    assert events[-1]["run"]["state"] == "succeeded"
    middle = events[1:-1]
    assert all(e["type"] == "step" for e in middle)
    succeeded = [e["step"] for e in middle if e["state"] == "succeeded"]
    assert succeeded == steps, succeeded
    for e in middle:
        assert e["run"]["steps"][e["step"]]["state"] == e["state"]


async def test_websocket_sends_the_run_each_step_and_the_result(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = (await env.start(chain, input={"value": 7}))["run_id"]
    async with served(env.app) as base, ws_connect(ws_url(base, f"/v1/runs/{run_id}/ws")) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 5))
        events = [first]
        async with env.worker():
            async for frame in ws:
                events.append(json.loads(frame))
        assert ws.close_code == 1000
    check_event_sequence(events, ["s1", "s2", "s3", "s4", "s5"])
    assert events[-1]["run"]["output"] == {"value": 7, "hops": 5}


async def test_websocket_of_an_unknown_run_closes_4404(env: DagEnv) -> None:
    async with served(env.app) as base, ws_connect(ws_url(base, "/v1/runs/nope/ws")) as ws:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
        await asyncio.wait_for(ws.wait_closed(), 5)
    assert frame["type"] == "error" and frame["error"]["type"] == "run_not_found"
    assert ws.close_code == 4404


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if not lines:
            continue
        name = lines[0].removeprefix("event: ")
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name
        events.append(data)
    return events


async def test_sse_streams_the_run_step_by_step(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = (await env.start(chain, input={"value": 3}))["run_id"]
    async with served(env.app) as base, httpx.AsyncClient(base_url=base, timeout=20) as http:
        async with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            body = response.aiter_text()
            chunks = [await anext(body)]  # the run as it is, before any worker: every step event comes after it
            async with env.worker():
                async for chunk in body:
                    chunks.append(chunk)
    check_event_sequence(parse_sse("".join(chunks)), ["s1", "s2", "s3", "s4", "s5"])
    done = await env.client.get(f"/v1/runs/{run_id}/events")  # over already: run then result at once
    assert [e["type"] for e in parse_sse(done.text)] == ["run", "result"]


# -- SDK ------------------------------------------------------------------------------------------------------
async def test_sdk_registers_starts_waits_follows_and_cancels(env: DagEnv) -> None:
    async with served(env.app) as base, FleetClient(base) as fleet:
        chain, text = env.example("chain")
        assert await fleet.register_dag(text) == (chain, 1)
        assert await fleet.register_dag(_as_dict(env.echo, env.unique)) == (f"solo-{env.unique}", 1)
        run_id = await fleet.start_run(chain, {"value": 5}, run_id=f"sdk-{env.unique}")
        assert run_id == f"sdk-{env.unique}"
        assert (await fleet.get_run(run_id))["state"] == "running"
        stream = aiter(fleet.run_events(run_id))
        events = [await anext(stream)]  # the run as it is, before any worker: every step event comes after it
        async with env.worker():
            async for event in stream:
                events.append(event)
            view = await fleet.wait_run(run_id, timeout_s=20)
        check_event_sequence(events, ["s1", "s2", "s3", "s4", "s5"])
        assert (view["state"], view["output"]) == ("succeeded", {"value": 5, "hops": 5})
        other = await fleet.start_run(chain, {"value": 6})
        with pytest.raises(TimeoutError):
            await fleet.wait_run(other, timeout_s=0.3)
        assert (await fleet.cancel_run(other))["state"] == "cancelled"
        with pytest.raises(GatewayError) as ended:
            await fleet.cancel_run(other)
        assert ended.value.status == 409
        assert (await fleet.get_dag(chain))["graph"]["nodes"][4]["id"] == "s5"


async def test_sdk_raises_the_refusals_as_fleet_errors(env: DagEnv) -> None:
    async with FleetClient("http://gateway", transport=httpx.ASGITransport(app=env.app)) as fleet:
        with pytest.raises(DagInvalid) as invalid:
            await fleet.register_dag({"name": "x", "steps": [{"id": "a", "model": "nosuchmodel"}], "output": 1})
        assert invalid.value.problems[0]["step"] == "a" and invalid.value.problems[0]["path"] == "model"
        with pytest.raises(DagInvalid) as malformed:
            await fleet.register_dag("name: x\nsteps: [\n")
        assert "line" in malformed.value.problems[0]["message"]
        with pytest.raises(UnknownDag):
            await fleet.start_run("nope", {})
        with pytest.raises(UnknownRun):
            await fleet.get_run("nope")
        with pytest.raises(UnknownRun):
            await fleet.wait_run("nope", timeout_s=1)


async def test_a_spec_over_the_size_limit_is_413(env: DagEnv) -> None:
    huge = "name: big\ndescription: " + "x" * (MAX_SPEC_BYTES + 1) + "\n"
    response = await env.client.post("/v1/dags", content=huge, headers=YAML)
    assert response.status_code == 413 and error_of(response)["type"] == "payload_too_large"


def _as_dict(echo: str, unique: str) -> dict[str, Any]:
    return {
        "name": f"solo-{unique}",
        "steps": [{"id": "a", "model": echo, "input": {"x": 1}}],
        "output": "${steps.a.output}",
    }


def test_every_dag_route_is_tagged_and_documented() -> None:
    from fleet.producers.gateway import create_app

    spec = create_app(FleetSettings()).openapi()
    routes = {p: ops for p, ops in spec["paths"].items() if p.startswith(("/v1/dags", "/v1/runs"))}
    assert set(routes) >= {
        "/v1/dags",
        "/v1/dags/{name}",
        "/v1/dags/{name}/runs",
        "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/cancel",
        "/v1/runs/{run_id}/events",
    }
    for ops in routes.values():
        for op in ops.values():
            assert op["tags"] == ["dags"] and op["summary"]
    assert "dags" in {t["name"] for t in spec["tags"]}


async def test_event_stream_ends_expired_when_the_run_timeout_passes(env: DagEnv) -> None:
    chain = await env.register_example("chain")
    run_id = (await env.start(chain, input={"value": 1}, timeout_s=0.5))["run_id"]  # no worker: it cannot finish
    async with asyncio.timeout(10):
        response = await env.client.get(f"/v1/runs/{run_id}/events")
    events = parse_sse(response.text)
    assert events[0]["type"] == "run" and events[-1]["type"] == "result"
    assert events[-1]["run"]["state"] == "expired"
    assert (await env.client.get(f"/v1/runs/{run_id}")).json()["state"] == "expired"
