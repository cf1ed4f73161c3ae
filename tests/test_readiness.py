"""Readiness means "can serve": workers are ready once warm, the gateway counts ready workers per model, and
``fleet up`` is ready only when every model has a warm worker."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from fleet import constants as c
from fleet.brokers.memory import MemoryBroker
from fleet.producers.gateway import create_app
from fleet.readiness import FRESH_INTERVALS, Beat, ReadyWorkers, WorkerTracker, parse_beat
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from fleet.store.memory import MemoryStore
from tests.processes import fleet_process, stop, wait_http_ready
from tests.services import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_a_fresh_ready_heartbeat_counts() -> None:
    clock = Clock()
    ready = ReadyWorkers(heartbeat_interval_s=2.0, clock=clock)
    for worker, state in [("a", "ready"), ("b", "starting"), ("c", "draining"), ("d", "degraded"), ("e", "new!")]:
        ready.observe(Beat(worker, "embed", state))
    ready.observe(Beat("x", "echo", "ready"))
    assert ready.counts(["embed", "echo", "sleep"]) == {"embed": 1, "echo": 1, "sleep": 0}
    assert not ready.all_ready(["embed", "sleep"]) and ready.all_ready(["embed", "echo"])
    ready.observe(Beat("b", "embed", "ready"))  # finished loading
    assert ready.count("embed") == 2
    ready.observe(Beat("a", "embed", "stopped"))
    assert ready.count("embed") == 1
    clock.now += FRESH_INTERVALS * 2.0 + 0.1  # b went silent (killed): it no longer counts
    assert ready.count("embed") == 0 and ready.count("echo") == 0


def test_heartbeats_are_read_leniently() -> None:
    beat = Heartbeat(worker_id="w1", model="echo", device="cpu", pid=1, max_batch=8, max_wait_ms=5, state="ready")
    assert parse_beat(beat.model_dump_json().encode()) == Beat("w1", "echo", "ready")
    newer = {"worker_id": "w2", "model": "echo", "state": "degraded", "field_of_tomorrow": 1}
    assert parse_beat(json.dumps(newer).encode()) == Beat("w2", "echo", "degraded")
    for junk in [b"", b"\xff", b"[]", b'{"worker_id": "w"}', b'{"worker_id": 1, "model": "m", "state": "ready"}']:
        assert parse_beat(junk) is None
    assert parse_beat(b"[" * 100_000) is None


def heartbeat(model: str, worker_id: str, state: str) -> bytes:
    beat = {"worker_id": worker_id, "model": model, "device": "cpu", "pid": 1, "max_batch": 1, "max_wait_ms": 1}
    return json.dumps({**beat, "state": state}).encode()


async def poll_readyz(client: httpx.AsyncClient, until, timeout_s: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get("/readyz")
        if until(response) or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.05)


def counts_of(response: httpx.Response) -> dict[str, int]:
    body = response.json()
    models = body["models"] if response.status_code == 200 else body["error"]["details"]["models"]
    return {name: m["ready_workers"] for name, m in models.items()}


@pytest.mark.parametrize("require_ready_workers", [False, True])
async def test_gateway_readyz_lists_ready_workers_per_model(require_ready_workers: bool) -> None:
    settings = FleetSettings.model_validate({"models": "echo,embed", "heartbeat_interval_s": 0.5})
    broker, store = MemoryBroker.from_settings(settings), MemoryStore(job_ttl_s=60)
    await broker.connect()
    await store.connect()
    app = create_app(settings, broker=broker, store=store, require_ready_workers=require_ready_workers)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            first = await client.get("/readyz")
            await broker.emit(c.heartbeat_subject("echo"), heartbeat("echo", "e1", "ready"))
            await broker.emit(c.heartbeat_subject("embed"), heartbeat("embed", "m1", "starting"))
            half = await poll_readyz(client, lambda r: counts_of(r)["echo"] == 1)
            await broker.emit(c.heartbeat_subject("embed"), heartbeat("embed", "m1", "ready"))
            await broker.emit(c.heartbeat_subject("embed"), heartbeat("embed", "m2", "ready"))
            full = await poll_readyz(client, lambda r: counts_of(r) == {"echo": 1, "embed": 2})
    await broker.close()
    await store.close()
    zero = {"echo": {"ready_workers": 0}, "embed": {"ready_workers": 0}}
    half_counts = {"echo": {"ready_workers": 1}, "embed": {"ready_workers": 0}}
    if require_ready_workers:  # fleet up: not ready until each model has a warm worker
        assert first.status_code == 503 and first.json()["error"]["details"]["models"] == zero
        assert half.status_code == 503 and half.json()["error"]["details"]["models"] == half_counts
        assert "'embed' has no ready worker" in half.json()["error"]["message"]
    else:  # a standalone gateway serves submissions (they queue) whatever the workers do, and says how many
        assert first.status_code == 200 and first.json()["models"] == zero
        assert half.status_code == 200 and half.json()["models"] == half_counts
    assert full.status_code == 200
    assert full.json() == {
        "status": "ready",
        "broker": "ok",
        "store": "ok",
        "models": {"echo": {"ready_workers": 1}, "embed": {"ready_workers": 2}},
    }


@pytest.mark.slow
def test_a_worker_is_ready_only_once_its_model_is_warm(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "worker.log"
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_TEST_MODEL_NAME": f"slowload-{port}",
        "FLEET_TEST_LOAD_S": "4",
    }
    base = f"http://127.0.0.1:{port}"
    args = ("worker", "--model", "tests.handlers_for_tests:SlowLoad", "--metrics-port", str(port))
    with fleet_process(*args, env=env, log=log) as proc:
        wait_http_ready(f"{base}/healthz", proc, log)
        seen: list[tuple[int, str]] = []
        while not seen or seen[-1][0] != 200:
            assert proc.poll() is None, log.read_text()[-3000:]
            response = httpx.get(f"{base}/readyz", timeout=2)
            body = response.json()
            state = body["state"] if response.status_code == 200 else body["error"]["details"]["state"]
            seen.append((response.status_code, state))
            time.sleep(0.2)
        assert "ready in" in log.read_text(), log.read_text()[-2000:]  # the worker logs when its model is warm
        assert seen[0] == (503, "starting") and seen[-1] == (200, "ready")
        assert {code for code, _ in seen[:-1]} == {503}
        assert len(seen) >= 5, seen  # it stayed unready through most of the 4 s load
        assert "fleet_worker" in httpx.get(f"{base}/metrics", timeout=2).text
        assert stop(proc) == 0, log.read_text()[-2000:]


@pytest.mark.slow
@pytest.mark.services
def test_the_first_embed_job_after_fleet_up_says_ready_runs_at_normal_latency(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{port}"
    with fleet_process("up", "--port", str(port), "--models", "echo,embed", log=log) as proc:
        wait_http_ready(f"{base}/readyz", proc, log, timeout_s=240)  # embed loads: minutes when loaded
        with httpx.Client(base_url=base, timeout=60) as http:
            latencies = []
            for text in ("the very first job", "a second job, for comparison"):
                t0 = time.monotonic()
                job = http.post("/v1/jobs", json={"model": "embed", "input": {"texts": [text]}})
                assert job.status_code == 202, job.text
                done = http.get(f"/v1/jobs/{job.json()['job_id']}", params={"wait": 60}).json()
                latencies.append(time.monotonic() - t0)
                assert done["state"] == "succeeded", done
            ready = http.get("/readyz").json()
        first_s, second_s = latencies
        assert first_s < 5 and first_s <= 3 * second_s + 1.0, latencies
        assert ready["models"]["embed"]["ready_workers"] >= 1 and ready["models"]["echo"]["ready_workers"] >= 1
        assert "fleet up: ready at" in log.read_text()
        assert stop(proc) == 0, log.read_text()[-2000:]


async def test_fleet_ready_workers_follows_fresh_ready_heartbeats(unique: str) -> None:
    """The gauge the shipped FleetNoReadyWorker alert reads: ready workers per model, stale ones dropped at scrape."""
    model = f"m{unique}"
    broker = MemoryBroker.from_settings(FleetSettings())
    await broker.connect()

    def exported() -> float | None:
        return REGISTRY.get_sample_value("fleet_ready_workers", {"model": model})

    async def reads(value: float) -> None:
        deadline = time.monotonic() + 10
        while exported() != value:
            assert time.monotonic() < deadline, f"fleet_ready_workers reads {exported()}, not {value}"
            await asyncio.sleep(0.02)

    try:
        async with WorkerTracker(broker, heartbeat_interval_s=0.5):
            assert exported() is None, "no series before the model's first heartbeat"
            await broker.emit(c.heartbeat_subject(model), heartbeat(model, "w1", "ready"))
            await broker.emit(c.heartbeat_subject(model), heartbeat(model, "w2", "starting"))
            await reads(1)
            await broker.emit(c.heartbeat_subject(model), heartbeat(model, "w1", "ready"))  # both fresh now
            await broker.emit(c.heartbeat_subject(model), heartbeat(model, "w2", "ready"))
            await reads(2)
            await reads(0)  # no heartbeat for FRESH_INTERVALS intervals: neither vouches for itself any more
    finally:
        await broker.close()
