"""Multi-model workers on NATS + Redis (issue 29): workers of several tiny repository models share one process's
``ModelPool`` within a memory budget, composed as ``fleet worker --models`` composes them (``plan_pool``,
``build_pool_worker``).

* A budget that holds one of two models: alternating jobs evict and reload them; every job succeeds and its record
  names the version that answered; loads and unloads are counted (pool, Prometheus, heartbeats).
* A repository entry whose weights are corrupt fails only its own jobs, with ``model_unavailable`` naming the model,
  the version and the file, fast during the back-off (one load tried), while the other model keeps serving.
* Versions side by side: an unpinned model serves each version its repository holds (the default for a job that
  names none) and fails a job for a version it does not hold, naming the ones it serves; a single-model worker
  started as today names its version in every record and refuses another, clearly.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.cli.pool_workers import build_pool_worker, plan_pool
from fleet.consumers import metrics
from fleet.consumers.handlers import entry_handler
from fleet.consumers.pool import ModelPool
from fleet.consumers.pool.budget import module_bytes
from fleet.consumers.worker import Worker
from fleet.repository.layout import Repository
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests import services
from tests.infra import connected_pair, request_bytes, settings_for, wait_terminal
from tests.processes import fleet_process, stop, wait_http_ready
from tests.tiny_models import add_entry

pytestmark = pytest.mark.services

TEXT = {"text": "fleet serves models"}


@pytest.fixture
def settings(nats_url: str, redis_url: str, tmp_path: Path) -> FleetSettings:
    return settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, model_repository=tmp_path)


@contextlib.asynccontextmanager
async def pool_workers(
    settings: FleetSettings, refs: list[str], budget: str | None
) -> AsyncIterator[tuple[Broker, ResultStore, ModelPool, list[Worker]]]:
    plan = plan_pool(settings, refs, budget)
    pool = ModelPool(plan.budget_bytes, retry_after_s=30)
    async with connected_pair(settings) as (broker, store):
        workers = [
            build_pool_worker(served, handler, pool, broker, store, settings, device=plan.device)
            for served, handler in zip(plan.served, plan.handlers, strict=True)
        ]
        try:
            for worker in workers:
                await worker.start()
            yield broker, store, pool, workers
        finally:
            for worker in workers:
                await worker.stop()
            await pool.close()


async def submit(broker: Broker, store: ResultStore, model: str, job_id: str, version: str | None = None) -> JobRecord:
    await broker.ensure_model(model)
    data = request_bytes(model, job_id, TEXT, version=version)
    await broker.publish(c.request_subject(model), data, msg_id=job_id)
    return (await wait_terminal(store, [job_id], timeout_s=60))[job_id]


async def test_an_evicted_model_reloads_on_its_next_job(settings: FleetSettings, unique: str) -> None:
    a, b = f"a{unique}", f"b{unique}"
    entry = add_entry(settings.model_repository, a, "embeddings", seed=1)
    add_entry(settings.model_repository, b, "embeddings", seed=2)
    probe = entry_handler(entry)()
    probe.load()
    size = module_bytes(probe)
    assert size is not None and size > 0
    budget = str(size * 3 // 2)  # holds one of the two, not both
    loads_before = metrics.MODEL_LOADS.labels(a, "1")._value.get()
    async with pool_workers(settings, [a, b], budget) as (broker, store, pool, workers):
        assert all(w.state == "ready" for w in workers) and pool.keys() == []  # ready before any load
        records = [await submit(broker, store, model, f"{unique}-{i}") for i, model in enumerate([a, b, a, b])]
        assert [r.state for r in records] == [JobState.succeeded] * 4, [r.error for r in records]
        assert [r.version for r in records] == ["1"] * 4
        assert [r.model for r in records] == [a, b, a, b]
        assert (pool.loads, pool.unloads) == (4, 3)  # a, b (a out), a (b out), b (a out)
        assert pool.keys() == [(b, "1")] and pool.used_bytes == size
        assert metrics.MODEL_LOADS.labels(a, "1")._value.get() == loads_before + 2
        assert metrics.MODEL_LOADED_BYTES.labels(b, "1")._value.get() == size
        assert metrics.MODEL_LOADED_BYTES.labels(a, "1")._value.get() == 0
        beats = {w.model: w.heartbeat() for w in workers}
        assert beats[a].loaded == [] and beats[b].loaded == ["1"]


async def test_a_failing_load_fails_only_its_models_jobs(settings: FleetSettings, unique: str) -> None:
    good, bad = f"good{unique}", f"bad{unique}"
    add_entry(settings.model_repository, good, "embeddings")
    entry = add_entry(settings.model_repository, bad, "embeddings")
    weights = entry.weights_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64] + b"\0" * 64)  # corrupt: no longer its sha256
    async with pool_workers(settings, [good, bad], None) as (broker, store, pool, _):
        first = await submit(broker, store, bad, f"{unique}-bad-0")
        served = await submit(broker, store, good, f"{unique}-good-0")
        second = await submit(broker, store, bad, f"{unique}-bad-1")  # within the back-off: fails at once
        again = await submit(broker, store, good, f"{unique}-good-1")
    for record in (first, second):
        assert record.state is JobState.failed and record.error is not None
        assert record.error.type == "model_unavailable" and not record.error.retriable
        assert f"model {bad!r} version '1' cannot be loaded" in record.error.message
        assert "model.safetensors does not match its sha256" in record.error.message
        assert record.version == "1"
    assert served.state is again.state is JobState.succeeded and served.version == "1"
    assert pool.failures == 1  # one load tried for the two jobs
    assert pool.loaded(good) == [] and pool.loaded(bad) == []  # closed with the pool


async def test_versions_side_by_side_and_a_version_not_served(settings: FleetSettings, unique: str) -> None:
    name, pinned = f"v{unique}", f"p{unique}"
    add_entry(settings.model_repository, name, "embeddings", version="1", seed=1)
    add_entry(settings.model_repository, name, "embeddings", version="2", seed=2)
    add_entry(settings.model_repository, pinned, "embeddings", version="1")
    add_entry(settings.model_repository, pinned, "embeddings", version="2")
    async with pool_workers(settings, [name, f"{pinned}@1"], None) as (broker, store, pool, workers):
        default = await submit(broker, store, name, f"{unique}-d")
        one = await submit(broker, store, name, f"{unique}-1", version="1")
        two = await submit(broker, store, name, f"{unique}-2", version="2")
        nine = await submit(broker, store, name, f"{unique}-9", version="9")
        pinned_other = await submit(broker, store, pinned, f"{unique}-p2", version="2")
        pinned_default = await submit(broker, store, pinned, f"{unique}-pd")
        assert workers[0].heartbeat().loaded == ["1", "2"]
    assert (default.state, default.version) == (JobState.succeeded, "2")  # the highest is the default
    assert (one.state, one.version) == (JobState.succeeded, "1")
    assert (two.state, two.version) == (JobState.succeeded, "2")
    assert default.output != one.output  # answered by another version's weights
    assert nine.state is JobState.failed and nine.error is not None and nine.error.type == "unserved_version"
    assert nine.error.message == f"model {name!r} has no version '9' on this worker; it serves version(s) 1, 2"
    assert pinned_other.state is JobState.failed and pinned_other.error is not None
    assert pinned_other.error.message.endswith("it serves version(s) 1") and not pinned_other.error.retriable
    assert (pinned_default.state, pinned_default.version) == (JobState.succeeded, "1")
    assert pool.loads == 3


async def test_a_single_model_worker_names_its_version_and_refuses_another(
    settings: FleetSettings, unique: str
) -> None:
    name = f"s{unique}"
    entry = add_entry(settings.model_repository, name, "embeddings", version="3")
    async with connected_pair(settings) as (broker, store):
        async with Worker(entry_handler(entry)(), broker, store, settings=settings) as worker:
            assert worker.pool is None and worker.heartbeat().loaded == ["3"]  # loaded at start, as before
            plain = await submit(broker, store, name, f"{unique}-a")
            same = await submit(broker, store, name, f"{unique}-b", version="3")
            other = await submit(broker, store, name, f"{unique}-c", version="4")
    assert (plain.state, plain.version) == (JobState.succeeded, "3")
    assert (same.state, same.version) == (JobState.succeeded, "3")
    assert other.state is JobState.failed and other.error is not None and other.error.type == "unserved_version"
    assert other.error.message == f"model {name!r} has no version '4' on this worker; it serves version(s) 3"


def test_plan_pool_refuses_bad_flags_in_one_line(settings: FleetSettings, unique: str) -> None:
    from fleet.errors import FleetError

    add_entry(settings.model_repository, f"m{unique}", "embeddings")
    cases = {
        (f"m{unique}", f"m{unique}@1"): f"model 'm{unique}' is named twice",
        ("echo", "echo"): "model 'echo' is named twice",
        (f"nosuch{unique}",): f"unknown model 'nosuch{unique}'",
        (f"m{unique}@7",): "has no version '7'",
    }
    for refs, words in cases.items():
        with pytest.raises(FleetError) as info:
            plan_pool(settings, list(refs), None)
        assert words in info.value.message and "\n" not in info.value.message, info.value.message
    with pytest.raises(FleetError, match="--memory-budget 'lots' is not a size"):
        plan_pool(settings, ["echo"], "lots")
    plan = plan_pool(settings, ["echo", f"m{unique}"], "0.5")
    assert (
        plan.budget_bytes is not None
        and plan.budget_bytes > 0
        and [s.name for s in plan.served] == ["echo", f"m{unique}"]
    )
    assert Repository.from_settings(settings).versions(f"m{unique}") == ["1"]


async def test_fleet_worker_models_serves_both_within_the_budget(
    settings: FleetSettings, unique: str, tmp_path: Path
) -> None:
    a, b = f"a{unique}", f"b{unique}"
    entry = add_entry(settings.model_repository, a, "embeddings", seed=1)
    add_entry(settings.model_repository, b, "embeddings", seed=2)
    probe = entry_handler(entry)()
    probe.load()
    budget = str((module_bytes(probe) or 0) * 3 // 2)
    port = services.free_port()
    argv = ["worker", "--models", f"{a},{b}@1", "--memory-budget", budget, "--metrics-port", str(port)]
    argv += ["--broker", settings.broker_url, "--store", settings.store_url, "--worker-id", f"w{unique}"]
    env = {"FLEET_MODEL_REPOSITORY": str(settings.model_repository), "FLEET_HEARTBEAT_INTERVAL_S": "0.2"}
    log = tmp_path / "worker.log"
    with fleet_process(*argv, env=env, log=log) as proc:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            ready = (await http.get("/readyz")).json()
            assert ready["status"] == "ready" and set(ready["models"]) == {a, b}
            assert ready["models"][a]["loaded"] == [] and ready["models"][a]["worker_id"] == f"w{unique}-{a}"
            async with connected_pair(settings) as (broker, store):
                records = [await submit(broker, store, m, f"{unique}-{i}") for i, m in enumerate([a, b, a])]
            assert [r.state for r in records] == [JobState.succeeded] * 3, [r.error for r in records]
            assert [r.version for r in records] == ["1"] * 3
            after = (await http.get("/readyz")).json()
            assert after["models"][a]["loaded"] == ["1"] and after["models"][b]["loaded"] == []  # b was evicted
            text = (await http.get("/metrics")).text
        assert f'fleet_worker_model_loads_total{{model="{a}",version="1"}} 2.0' in text
        assert f'fleet_worker_model_unloads_total{{model="{b}",version="1"}} 1.0' in text
        assert stop(proc) == 0, log.read_text()[-3000:]
