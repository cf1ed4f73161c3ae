"""Drain one worker from the operator API: ``POST /v1/workers/{id}/drain`` makes a real ``fleet worker`` process
on NATS + Redis run its SIGTERM path (the jobs it holds end succeeded, it exits 0, nothing is computed twice); an
in-process worker without an owner stops itself; unknown and malformed ids get 404 / 422."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleet import constants as c
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.producers.gateway import create_app
from fleet.settings import FleetSettings
from tests.gateway_helpers import FAST_LIMITS, error_of, model_refs
from tests.infra import connected_pair, eventually, settings_for, wait_terminal
from tests.processes import fleet_process

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def gateway(settings: FleetSettings) -> AsyncIterator[tuple[httpx.AsyncClient, object, object]]:
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=20) as client:
                yield client, broker, store


async def worker_seen(client: httpx.AsyncClient, worker_id: str, **want: object) -> bool:
    workers = (await client.get("/v1/operator/snapshot")).json()["workers"]
    return any(w["worker_id"] == worker_id and all(w[k] == v for k, v in want.items()) for w in workers)


async def test_drain_runs_the_sigterm_path_of_a_worker_process(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    ref = f"tests.test_autoscaler_service:sleep_{unique}"
    model = f"sleep-{unique}"
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, models=[ref], ack_wait_s=30)
    worker_id = f"drained-{unique}"
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_HEARTBEAT_INTERVAL_S": "0.2",
        "FLEET_MAX_BATCH": "3",
        "FLEET_DRAIN_TIMEOUT_S": "30",
        "FLEET_ACK_WAIT_S": "30",
    }
    log = tmp_path / "worker.log"
    async with gateway(settings) as (client, broker, store):
        with fleet_process("worker", "--model", ref, "--worker-id", worker_id, env=env, log=log) as proc:
            await eventually(lambda: worker_seen(client, worker_id, state="ready"), 60, "the worker ready")
            ids = []
            for i in range(12):
                body = {"model": model, "input": {"mean_ms": 400, "seed": i}}
                response = await client.post("/v1/jobs", json=body)
                assert response.status_code == 202, response.text
                ids.append(response.json()["job_id"])

            async def holding() -> bool:
                return any(r and r.state.value == "running" for r in await store.get_many(ids))

            await eventually(holding, 20, "the worker computing")
            response = await client.post(f"/v1/workers/{worker_id}/drain")
            assert response.status_code == 202, response.text
            assert response.json() == {"worker_id": worker_id, "state": "draining"}
            code = await asyncio.to_thread(proc.wait, 60)
        output = log.read_text()
        assert code == 0, output[-3000:]
        assert "drain requested" in output
        records = await store.get_many(ids)
        started = [r for r in records if r is not None and r.worker_id == worker_id]
        assert started, "the worker had started jobs when it was drained"
        assert all(r.state.value == "succeeded" for r in started), [(r.job_id, r.state) for r in started]
        assert all(r is not None and r.state.value in ("queued", "succeeded") for r in records)

        # The jobs it handed back are there for the next worker, and nothing runs twice.
        handler = with_name(SleepHandler, model)()
        async with Worker(handler, broker, store, settings=settings, max_wait_ms=2):
            done = await wait_terminal(store, ids, 30)
        assert {r.state.value for r in done.values()} == {"succeeded"}
        assert {r.deliveries for r in done.values()} == {1}


@pytest.mark.parametrize("pair", ["memory", "nats+redis", "kafka+redis"])
async def test_an_in_process_worker_stops_itself(request: pytest.FixtureRequest, pair: str, unique: str) -> None:
    refs, (model,) = model_refs(unique, "echo")
    urls = {k: request.getfixturevalue(f"{k}_url") for k in pair.split("+") if k != "memory"}
    settings = settings_for(pair, urls, models=refs)
    async with gateway(settings) as (client, broker, store):
        worker = Worker(with_name(EchoHandler, model)(), broker, store, settings=settings, worker_id=f"w-{unique}")
        await worker.start()
        try:
            await eventually(lambda: worker_seen(client, f"w-{unique}"), 10, "the worker heard")
            # Garbage on its drain subject (not JSON, deep nesting, wrong types, another worker's id) changes nothing.
            subject = c.drain_subject(f"w-{unique}")
            for junk in (b"\xffnot json", b"[" * 100_000, b'{"worker_id": 5}', b'{"worker_id": "someone-else"}'):
                await broker.emit(subject, junk)
            await asyncio.sleep(1.0)
            assert worker.state == "ready", worker.state
            assert (await client.post(f"/v1/workers/w-{unique}/drain")).status_code == 202

            async def stopped() -> bool:
                return worker.state == "stopped"

            await eventually(stopped, 10, "the worker stopped")
            await eventually(lambda: _gone(client, f"w-{unique}"), 10, "the stopped worker leaves the snapshot")
        finally:
            await worker.stop()


async def _gone(client: httpx.AsyncClient, worker_id: str) -> bool:
    return not await worker_seen(client, worker_id)


@pytest.mark.parametrize(
    ("worker_id", "status"),
    [("never-heard-of", 404), ("a.b", 422), ("a*", 422), ("%20x", 422), ("x" * 300, 422)],
)
async def test_unknown_and_malformed_ids(unique: str, worker_id: str, status: int) -> None:
    refs, _ = model_refs(unique, "echo")
    async with gateway(FleetSettings(models=refs)) as (client, _, _):
        response = await client.post(f"/v1/workers/{worker_id}/drain")
        assert response.status_code == status, response.text
        assert error_of(response)["type"] == ("worker_not_found" if status == 404 else "invalid_request")


async def test_drain_needs_the_operator(unique: str) -> None:
    refs, _ = model_refs(unique, "echo")
    async with gateway(FleetSettings(models=refs, operator_token="tok")) as (client, _, _):
        assert (await client.post("/v1/workers/any/drain")).status_code == 401
        wrong = await client.post("/v1/workers/any/drain", headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 403
