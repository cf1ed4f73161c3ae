"""Real `fleet` processes on NATS JetStream or Kafka, with Redis: crashes, graceful drain, raw producers, the CLI."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import signal
from pathlib import Path

import httpx
import nats
import pytest

from fleet import constants as c
from fleet.brokers.nats import durable_name
from fleet.schemas.jobs import JobState
from fleet.store.base import ResultStore
from tests.infra import connected_pair, count_completions, eventually, publish_requests, settings_for, wait_terminal
from tests.processes import fleet_process, run_fleet, stop
from tests.services import free_port

pytestmark = pytest.mark.slow

WORKER = "tests.handlers_for_tests:Items"


@pytest.fixture(params=["nats", "kafka"])
def urls(request: pytest.FixtureRequest, redis_url: str) -> dict[str, str]:
    """A real broker of each kind, with Redis."""
    kind = request.param
    return {"kind": kind, "broker": request.getfixturevalue(f"{kind}_url"), "redis": redis_url}


@pytest.fixture
def nats_urls(nats_url: str, redis_url: str) -> dict[str, str]:
    return {"kind": "nats", "broker": nats_url, "redis": redis_url}


@contextlib.asynccontextmanager
async def pair_for(urls: dict[str, str]):
    settings = settings_for(f"{urls['kind']}+redis", {urls["kind"]: urls["broker"], "redis": urls["redis"]})
    async with connected_pair(settings) as pair:
        yield pair


@pytest.fixture
async def infra(urls):
    async with pair_for(urls) as pair:
        yield pair


@pytest.fixture
async def nats_infra(nats_urls):
    async with pair_for(nats_urls) as pair:
        yield pair


def worker_env(urls: dict[str, str], model: str, **extra: str) -> dict[str, str]:
    return {
        "FLEET_BROKER_URL": urls["broker"],
        "FLEET_STORE_URL": urls["redis"],
        "FLEET_TEST_MODEL_NAME": model,
        "FLEET_ACK_WAIT_S": "2",
        "FLEET_MAX_DELIVERIES": "5",
        "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
        **extra,
    }


async def _any_running(store: ResultStore, ids: list[str]) -> bool:
    records = [await store.get(j) for j in ids]
    return any(r is not None and r.state is JobState.running for r in records)


async def test_sigkill_mid_batch_loses_nothing_and_finishes_each_job_once(infra, urls, unique, tmp_path: Path) -> None:
    broker, store = infra
    model = f"kill-{unique}"
    counts: collections.Counter[str] = collections.Counter()
    ready = asyncio.Event()
    counter = asyncio.create_task(count_completions(urls["redis"], ready, counts))
    await ready.wait()
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 60} for i in range(40)], unique)
    env = worker_env(urls, model, FLEET_MAX_BATCH="8", FLEET_MAX_WAIT_MS="20")
    with fleet_process("worker", "--model", WORKER, env=env, log=tmp_path / "w1.log") as first:
        await eventually(lambda: _any_running(store, ids), timeout_s=60, what="a batch in flight")
        await asyncio.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    interrupted = [j for j in ids if (r := await store.get(j)) is not None and r.state is JobState.running]
    assert interrupted, "the kill must land while a batch is running"
    with fleet_process("worker", "--model", WORKER, env=env, log=tmp_path / "w2.log") as second:
        records = await wait_terminal(store, ids, timeout_s=60)
        await asyncio.sleep(0.5)  # let any duplicate completion arrive before counting
        assert stop(second) == 0, (tmp_path / "w2.log").read_text()[-2000:]
    counter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await counter
    assert all(r.state is JobState.succeeded for r in records.values())
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(40)]
    assert {j: counts[j] for j in ids} == dict.fromkeys(ids, 1), "exactly one terminal result per job"
    assert any(records[j].deliveries >= 2 for j in interrupted), "interrupted jobs were delivered again"
    await eventually(lambda: _lag_is(broker, model, 0), what="every message acked")


async def test_sigterm_drains_the_batch_in_flight(infra, urls, unique, tmp_path: Path) -> None:
    broker, store = infra
    model = f"drain-{unique}"
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 100} for i in range(12)], unique)
    env = worker_env(urls, model, FLEET_MAX_BATCH="4", FLEET_MAX_WAIT_MS="0")
    log = tmp_path / "w.log"
    with fleet_process("worker", "--model", WORKER, env=env, log=log) as proc:
        await eventually(lambda: _any_running(store, ids), timeout_s=60, what="a batch in flight")
        running = [j for j in ids if (r := await store.get(j)) is not None and r.state is JobState.running]
        assert await asyncio.to_thread(stop, proc) == 0, log.read_text()[-2000:]
    after = {j: await store.get(j) for j in ids}
    # "running" covers the batch computing and the one admitted behind it; the first must finish before exit.
    finished = [j for j in running if after[j].state is JobState.succeeded]
    assert len(finished) >= 4, "the batch in flight (max_batch=4) finishes before exit"
    assert all(r.state is JobState.succeeded for r in after.values() if r is not None and r.terminal)
    assert any(r is None or not r.terminal for r in after.values()), "work not started is left for redelivery"
    assert "stopped after" in log.read_text()
    unfinished = sum(1 for r in after.values() if r is None or not r.terminal)
    await eventually(lambda: _lag_is(broker, model, unfinished), what="lag equal to the unfinished jobs")


async def test_a_raw_nats_py_producer_following_the_documented_schema_is_served(
    nats_infra, nats_urls, unique, tmp_path
) -> None:
    _, store = nats_infra
    urls = nats_urls
    model = f"raw-{unique}"
    env = worker_env(urls, model)
    metrics_port = free_port()
    argv = ("worker", "--model", WORKER, "--metrics-port", str(metrics_port))
    with fleet_process(*argv, env=env, log=tmp_path / "w.log"):
        nc = await nats.connect(urls["broker"])
        try:
            js = nc.jetstream()
            await eventually(lambda: _stream_ready(js, model), timeout_s=60, what="the worker's stream")
            for i in range(3):
                body = {"job_id": f"{unique}-{i}", "model": model, "input": {"value": i}}
                ack = await js.publish(
                    f"fleet.req.{model}", json.dumps(body).encode(), headers={"Nats-Msg-Id": f"{unique}-{i}"}
                )
                assert ack.stream == "FLEET_REQ"
            dup = await js.publish(
                f"fleet.req.{model}", json.dumps(body).encode(), headers={"Nats-Msg-Id": f"{unique}-2"}
            )
            assert dup.duplicate
        finally:
            await nc.close()
        records = await wait_terminal(store, [f"{unique}-{i}" for i in range(3)], timeout_s=30)
        async with httpx.AsyncClient() as http:
            scraped = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    assert [records[f"{unique}-{i}"].output["value"] for i in range(3)] == [0, 2, 4]
    assert f'fleet_worker_items_total{{model="{model}",outcome="succeeded"}} 3.0' in scraped


async def _stream_ready(js, model: str) -> bool:
    try:
        info = await js.consumer_info("FLEET_REQ", durable_name(c.request_subject(model), c.consumer_name(model)))
    except Exception:
        return False
    return info is not None


async def test_fleet_publish_sends_a_jsonl_file_and_reports_bad_lines(infra, urls, unique, tmp_path) -> None:
    broker, store = infra
    model = f"pub-{unique}"
    lines = [json.dumps({"value": i}) for i in range(20)] + ['{"value": "x"}', "not json"]
    source = tmp_path / "inputs.jsonl"
    source.write_text("\n".join(lines) + "\n")
    env = {"FLEET_BROKER_URL": urls["broker"], "FLEET_TEST_MODEL_NAME": model}
    result = await asyncio.to_thread(run_fleet, "publish", "--model", WORKER, str(source), env=env)
    assert result.returncode == 1, result.stderr
    ids = result.stdout.split()
    assert len(ids) == 20 and len(set(ids)) == 20
    assert "inputs.jsonl:21:" in result.stderr and "input.value" in result.stderr
    assert "inputs.jsonl:22:" in result.stderr and "not valid JSON" in result.stderr
    assert "published 20 requests" in result.stderr
    assert await broker.lag(c.request_subject(model), c.consumer_name(model)) == 20
    with fleet_process("worker", "--model", WORKER, env=worker_env(urls, model), log=tmp_path / "w.log"):
        records = await wait_terminal(store, ids, timeout_s=60)
    assert sorted(r.output["value"] for r in records.values()) == [2 * i for i in range(20)]


async def _lag_is(broker, model: str, expected: int) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == expected
