"""The gateway over real brokers and stores: submit, poll, cancel, WebSocket push, errors, readiness, metrics.

The worker is the real one (``ObservedWorker`` in tests/gateway_helpers.py wraps it); broker and store are real too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.producers.gateway import GatewayLimits, create_app
from fleet.producers.sdk import ws_url
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.gateway_helpers import (
    WORKER_ID,
    ObservedWorker,
    asgi_gateway,
    error_of,
    model_refs,
    private_server,
    served,
    urls_for,
)
from tests.infra import PAIRS, connected_pair, eventually, settings_for


@dataclass
class Env:
    settings: FleetSettings
    broker: Broker
    store: ResultStore
    app: FastAPI
    client: httpx.AsyncClient
    echo: str
    sleep: str
    embed: str

    async def submit(self, **body: Any) -> httpx.Response:
        return await self.client.post("/v1/jobs", json=body)

    def worker(self, model: str | None = None) -> ObservedWorker:
        return ObservedWorker(self.broker, self.store, model or self.echo)


@contextlib.asynccontextmanager
async def open_env(request: pytest.FixtureRequest, pair: str, unique: str, **overrides: Any) -> AsyncIterator[Env]:
    refs, (echo, sleep, embed) = model_refs(unique, "echo", "sleep", "embed")
    settings = settings_for(pair, urls_for(request, pair), models=refs, **overrides)
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (app, client):
        yield Env(settings, broker, store, app, client, echo, sleep, embed)


JSON = {"content-type": "application/json"}


@pytest.fixture(params=PAIRS)
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    """The gateway over each broker/store pair."""
    async with open_env(request, request.param, unique) as e:
        yield e


@pytest.fixture
async def menv(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    """The gateway over the in-memory pair: for request validation, which does not depend on the backends."""
    async with open_env(request, "memory", unique, max_body_bytes=4096, max_long_poll_s=5) as e:
        yield e


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def ws_json(ws: ClientConnection, timeout_s: float = 10) -> Any:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


# -- happy paths over every pair ------------------------------------------------------------------------------
async def test_submit_then_long_poll_returns_the_result(env: Env) -> None:
    submitted_before = metric("fleet_gateway_jobs_submitted_total", model=env.echo)
    response = await env.submit(model=env.echo, input={"x": [1, 2]})
    assert response.status_code == 202, response.text
    job_id = response.json()["job_id"]
    assert response.json() == {"job_id": job_id, "status": "queued"}
    assert len(job_id) == 32, "job ids default to uuid4 hex"
    record = await env.store.get(job_id)
    assert record is not None and record.state == JobState.queued and record.model == env.echo

    async with env.worker() as worker:
        polled = await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
    assert polled.status_code == 200
    body = polled.json()
    assert (body["state"], body["output"], body["worker_id"]) == ("succeeded", {"x": [1, 2]}, WORKER_ID)
    delivery = worker.seen[0]
    assert delivery.msg_id == job_id
    assert delivery.headers[c.HEADER_JOB_ID] == job_id and delivery.headers[c.HEADER_MODEL] == env.echo
    assert json.loads(delivery.data)["model"] == env.echo
    assert metric("fleet_gateway_jobs_submitted_total", model=env.echo) == submitted_before + 1


async def test_resubmitting_a_job_id_creates_one_job(env: Env, unique: str) -> None:
    job_id = f"order-{unique}"
    first = await env.submit(model=env.echo, input={"n": 1}, job_id=job_id)
    again = await env.submit(model=env.echo, input={"n": 1}, job_id=job_id)
    assert first.status_code == again.status_code == 202
    assert again.json() == {"job_id": job_id, "status": "queued"}
    async with env.worker() as worker:
        done = await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert done.json()["state"] == "succeeded"
        after = await env.submit(model=env.echo, input={"n": 1}, job_id=job_id)
        await asyncio.sleep(0.5)  # time for a duplicate to arrive, if one had been published
    assert after.status_code == 202 and after.json()["status"] == "succeeded"
    assert [d.msg_id for d in worker.seen] == [job_id], "the broker must deliver the job once"
    conflict = await env.submit(model=env.sleep, input={}, job_id=job_id)
    assert conflict.status_code == 409 and error_of(conflict)["type"] == "job_id_conflict"


async def test_long_poll_times_out_with_the_current_record(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={})).json()["job_id"]
    started = time.monotonic()
    response = await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 0.4})
    assert time.monotonic() - started >= 0.35
    assert response.status_code == 200 and response.json()["state"] == "queued"


async def test_cancel_a_queued_job_and_the_worker_skips_it(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={})).json()["job_id"]
    cancelled = await env.client.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled" and cancelled.json()["error"]["type"] == "cancelled"
    again = await env.client.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409
    error = error_of(again)
    assert error["type"] == "job_terminal" and "cancelled" in error["message"]
    assert error["details"]["state"] == "cancelled"
    async with env.worker() as worker:
        await worker.handled()
    record = (await env.client.get(f"/v1/jobs/{job_id}")).json()
    assert record["state"] == "cancelled" and record["output"] is None


async def test_websocket_pushes_a_result_finished_before_it_opened(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={"early": True})).json()["job_id"]
    async with env.worker():
        assert (await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json()["state"] == "succeeded"
    async with served(env.app) as base, ws_connect(ws_url(base, f"/v1/jobs/{job_id}/ws")) as ws:
        record = await ws_json(ws)
        await asyncio.wait_for(ws.wait_closed(), 5)
    assert (record["job_id"], record["state"], record["output"]) == (job_id, "succeeded", {"early": True})
    assert ws.close_code == 1000


async def test_websocket_pushes_a_result_finished_after_it_opened(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={"late": True})).json()["job_id"]
    async with served(env.app) as base, ws_connect(ws_url(base, f"/v1/jobs/{job_id}/ws")) as ws:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ws.recv(), 0.3)  # nothing until the job ends
        async with env.worker():
            record = await ws_json(ws)
        await asyncio.wait_for(ws.wait_closed(), 5)
    assert (record["state"], record["output"]) == ("succeeded", {"late": True})
    assert ws.close_code == 1000


async def test_multiplexed_websocket_survives_bad_frames(env: Env, unique: str) -> None:
    ids = [(await env.submit(model=env.echo, input={"i": i})).json()["job_id"] for i in range(3)]
    unknown = f"nope-{unique}"
    open_before = metric("fleet_gateway_websockets_open")
    async with served(env.app) as base, ws_connect(ws_url(base, "/v1/ws")) as ws:
        await ws.send(json.dumps({"subscribe": ids[:2]}))
        await ws.send("{not json")
        bad = await ws_json(ws)
        assert bad["type"] == "error" and bad["job_id"] is None and bad["error"]["type"] == "invalid_frame"
        assert "not valid JSON" in bad["error"]["message"]
        await ws.send(json.dumps({"subscribe": [ids[2], unknown, ids[0]]}))
        assert metric("fleet_gateway_websockets_open") == open_before + 1
        missing = await ws_json(ws)
        assert missing == {"type": "error", "job_id": unknown, "error": missing["error"]}
        assert missing["error"]["type"] == "job_not_found"
        async with env.worker():
            frames = [await ws_json(ws) for _ in ids]
        await ws.send(json.dumps({"subscribe": [ids[1]]}))  # already ended: sent again at once
        resent = await ws_json(ws)
    assert all(f["type"] == "result" and f["job"]["state"] == "succeeded" for f in frames)
    assert sorted(f["job"]["job_id"] for f in frames) == sorted(ids), "each result once"
    assert resent["job"]["job_id"] == ids[1]


async def sse_events(lines: AsyncIterator[str], count: int | None = None) -> list[tuple[str, Any]]:
    """``(event, data)`` pairs (``("comment", text)`` for a comment) from a stream's lines (``aiter_lines()``, which
    can be taken once per response) until ``count`` are read or the stream ends."""
    events: list[tuple[str, Any]] = []
    name = "message"
    async for line in lines:
        if line.startswith(":"):
            events.append(("comment", line[1:].strip()))
        elif line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
            name = "message"
        if count is not None and len(events) >= count:
            break
    return events


async def test_event_stream_of_a_job_that_ended_before_it_opened_is_one_result(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={"early": True})).json()["job_id"]
    async with env.worker():
        assert (await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json()["state"] == "succeeded"
    open_before = metric("fleet_gateway_sse_streams_open")
    async with served(env.app) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            events = await asyncio.wait_for(sse_events(response.aiter_lines()), 10)  # the server ends it
    assert [name for name, _ in events] == ["result"]
    record = events[0][1]
    assert (record["job_id"], record["state"], record["output"]) == (job_id, "succeeded", {"early": True})
    assert metric("fleet_gateway_sse_streams_open") == open_before


async def test_event_stream_sends_the_state_keep_alives_then_the_result(env: Env) -> None:
    job_id = (await env.submit(model=env.echo, input={"late": True})).json()["job_id"]
    async with served(env.app) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            lines = response.aiter_lines()
            first = await asyncio.wait_for(sse_events(lines, count=2), 10)
            async with env.worker():
                rest = await asyncio.wait_for(sse_events(lines), 10)
    assert first[0][0] == "job" and (first[0][1]["job_id"], first[0][1]["state"]) == (job_id, "queued")
    assert first[1] == ("comment", "keep-alive"), "a job with nothing new keeps the stream alive"
    names = [name for name, _ in rest]
    assert names[-1] == "result", rest
    assert set(names[:-1]) <= {"comment", "job"}, "only keep-alives and state changes come before the result"
    assert (rest[-1][1]["state"], rest[-1][1]["output"]) == ("succeeded", {"late": True})


async def test_event_stream_of_an_unknown_job_is_404_and_a_client_leaving_frees_its_stream(menv: Env) -> None:
    missing = await menv.client.get("/v1/jobs/ghost/events")
    assert missing.status_code == 404
    error = error_of(missing)
    assert error["type"] == "job_not_found" and "ghost" in error["message"]

    job_id = (await menv.submit(model=menv.echo, input={})).json()["job_id"]
    open_before = metric("fleet_gateway_sse_streams_open")
    async with served(menv.app) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            assert (await asyncio.wait_for(sse_events(response.aiter_lines(), count=1), 10))[0][0] == "job"
            assert metric("fleet_gateway_sse_streams_open") == open_before + 1
        # the client hung up; the server notices at its next keep-alive and ends the stream

        async def freed() -> bool:
            return metric("fleet_gateway_sse_streams_open") == open_before

        await eventually(freed, timeout_s=5, what="the event stream closed on the server")


async def test_bad_input_gets_the_same_clear_errors_on_every_pair(env: Env) -> None:
    """The validation cases below run on the in-memory pair in detail; here one of each kind per broker/store."""
    cases = [
        (await env.submit(model="gpt-9", input={}), 404, "unknown_model"),
        (await env.submit(model=env.embed, input={"texts": ["ok", 7]}), 422, "invalid_input"),
        (await env.client.post("/v1/jobs", content=b'{"model": ', headers=JSON), 400, "malformed_json"),
        (
            await env.client.post("/v1/jobs", content=b"x" * (env.settings.max_body_bytes + 1), headers=JSON),
            413,
            "payload_too_large",
        ),
        (await env.client.get("/v1/jobs/no-such-job"), 404, "job_not_found"),
        (await env.client.get("/v1/jobs/no-such-job", params={"wait": "-1"}), 422, "invalid_request"),
    ]
    assert [(r.status_code, error_of(r)["type"]) for r, _, _ in cases] == [(s, t) for _, s, t in cases]
    assert "input.texts.1" in error_of(cases[1][0])["message"]
    healthy = await env.submit(model=env.echo, input={"still": "serving"})
    assert healthy.status_code == 202


# -- request validation (in-memory pair) ----------------------------------------------------------------------
async def test_unknown_model_is_404_listing_the_known_models(menv: Env) -> None:
    errors_before = metric("fleet_gateway_submit_errors_total", type="unknown_model")
    response = await menv.submit(model="gpt-9", input={})
    assert response.status_code == 404
    error = error_of(response)
    assert error["type"] == "unknown_model" and "gpt-9" in error["message"] and menv.echo in error["message"]
    assert error["details"] == {"model": "gpt-9", "known": sorted([menv.echo, menv.sleep, menv.embed])}
    assert metric("fleet_gateway_submit_errors_total", type="unknown_model") == errors_before + 1


@pytest.mark.parametrize(
    ("model", "payload", "path"),
    [
        ("embed", {"texts": ["ok", 7]}, "input.texts.1"),
        ("embed", {"text": "a", "texts": ["b"]}, "input"),
        ("embed", {"txt": "typo"}, "input.txt"),
        ("sleep", {"mean_ms": "slow"}, "input.mean_ms"),
        ("sleep", {"mean_ms": -1}, "input.mean_ms"),
    ],
)
async def test_input_that_does_not_fit_the_model_is_422_naming_the_field(
    menv: Env, model: str, payload: dict[str, Any], path: str
) -> None:
    name = menv.embed if model == "embed" else menv.sleep
    response = await menv.submit(model=name, input=payload)
    assert response.status_code == 422
    error = error_of(response)
    assert error["type"] == "invalid_input" and f"{path}: " in error["message"]
    assert path in [e["loc"] for e in error["details"]]


async def test_body_over_the_limit_is_413_declared_or_chunked(menv: Env) -> None:
    big = json.dumps({"model": menv.echo, "input": {"pad": "x" * 5000}}).encode()
    declared = await menv.client.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    error = error_of(declared)
    assert error["type"] == "payload_too_large" and error["details"] == {"size": len(big), "limit": 4096}
    assert f"{len(big)} bytes" in error["message"] and "4096" in error["message"]

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    chunked = await menv.client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and error_of(chunked)["details"]["limit"] == 4096


@pytest.mark.parametrize(
    ("body", "status", "type_", "says"),
    [
        (b'{"model": "echo", "input": ', 400, "malformed_json", "not valid JSON"),
        (b"\xff\xfe", 400, "malformed_json", "not valid JSON"),
        (b"[1, 2]", 422, "invalid_request", "JSON object"),
        (b'{"input": {}}', 422, "invalid_request", "body.model"),
        (b'{"model": "echo", "input": [1]}', 422, "invalid_request", "body.input"),
        (b'{"model": "echo", "input": {}, "colour": 1}', 422, "invalid_request", "body.colour"),
        (b'{"model": "echo", "input": {}, "job_id": "has space"}', 422, "invalid_request", "body.job_id"),
        (b'{"model": "echo", "input": {}, "timeout_s": 0}', 422, "invalid_request", "body.timeout_s"),
    ],
)
async def test_malformed_bodies_are_refused_with_what_was_wrong(
    menv: Env, body: bytes, status: int, type_: str, says: str
) -> None:
    response = await menv.client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = error_of(response)
    assert error["type"] == type_ and says in error["message"], error


async def test_unknown_job_and_unknown_route_are_404(menv: Env) -> None:
    for response in (
        await menv.client.get("/v1/jobs/no-such-job"),
        await menv.client.get("/v1/jobs/no-such-job", params={"wait": 1}),
        await menv.client.post("/v1/jobs/no-such-job/cancel"),
    ):
        assert response.status_code == 404
        error = error_of(response)
        assert error["type"] == "job_not_found" and "no-such-job" in error["message"]
    route = await menv.client.get("/v2/whatever")
    assert route.status_code == 404 and error_of(route)["type"] == "not_found"
    method = await menv.client.delete("/v1/jobs")
    assert method.status_code == 405 and error_of(method)["type"] == "method_not_allowed"


@pytest.mark.parametrize("wait", ["0", "-1", "5.5", "abc"])
async def test_bad_wait_parameter_is_422(menv: Env, wait: str) -> None:
    job_id = (await menv.submit(model=menv.echo, input={})).json()["job_id"]
    response = await menv.client.get(f"/v1/jobs/{job_id}", params={"wait": wait})
    assert response.status_code == 422
    error = error_of(response)
    assert error["type"] == "invalid_request" and "query.wait" in error["message"]


async def test_models_lists_served_models_with_schemas(menv: Env) -> None:
    response = await menv.client.get("/v1/models")
    assert response.status_code == 200
    listed = response.json()
    assert listed["object"] == "list"
    models = {m["id"]: m for m in listed["data"]}
    assert set(models) == {menv.echo, menv.sleep, menv.embed}
    assert "texts" in models[menv.embed]["input_schema"]["properties"]
    assert "slept_ms" in models[menv.sleep]["output_schema"]["properties"]


async def test_openapi_documents_the_endpoints(menv: Env) -> None:
    spec = (await menv.client.get("/openapi.json")).json()
    submit = spec["paths"]["/v1/jobs"]["post"]
    assert submit["tags"] == ["jobs"] and "202" in submit["responses"] and "413" in submit["responses"]
    body = submit["requestBody"]["content"]["application/json"]["schema"]
    assert body["discriminator"]["propertyName"] == "model", "one body per served model"
    assert {
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/models",
        "/readyz",
    } <= set(spec["paths"])
    assert (await menv.client.get("/docs")).status_code == 200


# -- websockets: errors and limits ----------------------------------------------------------------------------
async def test_websocket_for_an_unknown_job_closes_with_4404(menv: Env) -> None:
    async with served(menv.app) as base, ws_connect(ws_url(base, "/v1/jobs/ghost/ws")) as ws:
        frame = await ws_json(ws)
        await asyncio.wait_for(ws.wait_closed(), 5)
    assert frame["error"]["type"] == "job_not_found" and "ghost" in frame["error"]["message"]
    assert ws.close_code == 4404


async def test_multiplexed_websocket_limits_answer_with_error_frames(menv: Env) -> None:
    limits = GatewayLimits(ws_max_frame_bytes=300, ws_max_ids_per_frame=3, ws_max_ids_per_connection=4)
    app = create_app(menv.settings, broker=menv.broker, store=menv.store, limits=limits)
    jobs = [(await menv.submit(model=menv.echo, input={"i": i})).json()["job_id"] for i in range(4)]
    bad_frames = {
        json.dumps({"subscribe": ["a", "b", "c", "d"]}): "too_many_ids",
        json.dumps({"subscribe": ["x" * 400]}): "frame_too_large",
        json.dumps({"watch": ["a"]}): "invalid_frame",
        json.dumps({"subscribe": "a"}): "invalid_frame",
        json.dumps({"subscribe": [1]}): "invalid_frame",
        json.dumps(["a"]): "invalid_frame",
    }
    async with served(app) as base, ws_connect(ws_url(base, "/v1/ws")) as ws:
        for frame, type_ in bad_frames.items():
            await ws.send(frame)
            answer = await ws_json(ws)
            assert answer["type"] == "error" and answer["error"]["type"] == type_, (frame, answer)
        await ws.send(json.dumps({"subscribe": jobs[:3]}))
        await ws.send(json.dumps({"subscribe": [jobs[3], "ghost"]}))  # 5 watched: over the limit of 4
        over = await ws_json(ws)
        await ws.send(json.dumps({"subscribe": ["ghost"]}))  # 4 watched: accepted, and unknown
        ghost = await ws_json(ws)
        await ws.send(json.dumps({"unsubscribe": [jobs[0]]}))
        await ws.send(json.dumps({"subscribe": ["sync"]}))  # its error frame proves the unsubscribe was read
        assert (await ws_json(ws))["job_id"] == "sync"
        async with ObservedWorker(menv.broker, menv.store, menv.echo) as worker:
            await worker.handled(4)
            results = [await ws_json(ws) for _ in range(2)]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ws.recv(), 0.5)  # jobs[0] unsubscribed, jobs[3] refused: nothing more
    assert over["job_id"] is None and over["error"]["type"] == "too_many_ids"
    assert "per connection" in over["error"]["message"]
    assert ghost["job_id"] == "ghost" and ghost["error"]["type"] == "job_not_found"
    assert sorted(r["job"]["job_id"] for r in results) == sorted(jobs[1:3])


# -- dependencies down, readiness, metrics --------------------------------------------------------------------
@pytest.mark.services
async def test_broker_down_is_503_and_leaves_no_queued_record(request: pytest.FixtureRequest, unique: str) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    with private_server("nats") as (nats_url, proc):
        settings = FleetSettings.model_validate({"broker_url": nats_url, "models": refs})
        async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
            assert (await client.get("/readyz")).status_code == 200
            proc.terminate()
            proc.wait(10)
            job_id = f"down-{unique}"
            response = await client.post("/v1/jobs", json={"model": echo, "input": {}, "job_id": job_id})
            assert response.status_code == 503, response.text
            assert error_of(response)["type"] == "broker_unavailable"
            assert response.headers["retry-after"].isdigit()
            assert await store.get(job_id) is None, "a job the broker never took must leave no record"
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            error = error_of(ready)
            assert error["type"] == "not_ready" and "broker (nats)" in error["message"]
            assert error["details"]["store"] == "ok"
            assert (await client.get("/healthz")).status_code == 200


@pytest.mark.services
async def test_store_down_is_503_store_unavailable(unique: str) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    with private_server("redis") as (redis_url, proc):
        settings = FleetSettings.model_validate({"store_url": redis_url, "models": refs})
        async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
            proc.terminate()
            proc.wait(10)
            response = await client.post("/v1/jobs", json={"model": echo, "input": {}})
            assert response.status_code == 503 and error_of(response)["type"] == "store_unavailable"
            assert response.headers["retry-after"].isdigit()
            polled = await client.get(f"/v1/jobs/{uuid.uuid4().hex}")
            assert polled.status_code == 503 and error_of(polled)["type"] == "store_unavailable"
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and "store (redis)" in error_of(ready)["message"]


async def test_app_builds_and_closes_its_own_clients(unique: str) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    settings = FleetSettings.model_validate({"models": refs})
    async with asgi_gateway(settings) as (app, client):
        ready = (await client.get("/readyz")).json()
        assert ready == {"status": "ready", "broker": "ok", "store": "ok", "models": {echo: {"ready_workers": 0}}}
        job_id = (await client.post("/v1/jobs", json={"model": echo, "input": {}})).json()["job_id"]
        assert (await app.state.gateway.store.get(job_id)).state == JobState.queued
        broker = app.state.gateway.broker
    with pytest.raises(Exception):  # noqa: B017 - any error: the broker was closed by the lifespan
        await broker.ping()


async def test_metrics_expose_submissions_errors_latency_and_websockets(menv: Env) -> None:
    await menv.submit(model=menv.echo, input={})
    await menv.submit(model="nope", input={})
    await menv.client.get("/v1/jobs/missing")
    text = (await menv.client.get("/metrics")).text
    assert f'fleet_gateway_jobs_submitted_total{{model="{menv.echo}"}}' in text
    assert 'fleet_gateway_submit_errors_total{type="unknown_model"}' in text
    assert 'fleet_gateway_http_request_duration_seconds_count{method="POST",route="/v1/jobs"}' in text
    assert 'fleet_gateway_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"}' in text
    assert "fleet_gateway_websockets_open" in text


async def test_healthz_and_readyz(env: Env) -> None:
    assert (await env.client.get("/healthz")).json() == {"status": "ok"}
    ready = await env.client.get("/readyz")
    body = ready.json()
    assert ready.status_code == 200 and body.pop("models").keys() == {env.echo, env.sleep, env.embed}
    assert body == {"status": "ready", "broker": "ok", "store": "ok"}
