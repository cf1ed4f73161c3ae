"""Real `fleet dispatcher` and `fleet worker --routing dispatch` processes on NATS JetStream and Kafka, with Redis:
SIGKILL a worker and a dispatcher mid-run; nothing is lost and no job completes twice."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
from pathlib import Path

import pytest

from fleet import constants as c
from fleet.brokers.base import EventStream
from fleet.brokers.events import validated
from fleet.schemas.jobs import JobState
from fleet.schemas.wire import DispatcherBeat
from fleet.store.base import ResultStore
from tests.infra import count_completions, eventually, publish_requests, wait_terminal
from tests.processes import fleet_process, run_fleet
from tests.test_processes import WORKER, infra, urls, worker_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


async def _done(store: ResultStore, ids: list[str], count: int) -> bool:
    records = [await store.get(j) for j in ids]
    return sum(1 for r in records if r is not None and r.state is JobState.succeeded) >= count


async def test_killing_a_worker_and_a_dispatcher_loses_nothing_and_completes_each_job_once(
    infra,  # noqa: F811 (the fixture imported above)
    urls,  # noqa: F811
    unique,
    tmp_path: Path,
) -> None:
    broker, store = infra
    model = f"dsp-kill-{unique}"
    counts: collections.Counter[str] = collections.Counter()
    ready = asyncio.Event()
    counter = asyncio.create_task(count_completions(urls["redis"], ready, counts))
    await ready.wait()
    env = worker_env(urls, model, FLEET_MAX_BATCH="1", FLEET_MAX_WAIT_MS="0")
    worker_args = ("worker", "--model", WORKER, "--routing", "dispatch")
    dispatcher_args = ("dispatcher", "--model", model, "--policy", "jiq-amnesia", "--port", "0")
    beats = await broker.listen(c.dispatcher_subject(model))
    seen: dict[str, DispatcherBeat] = {}
    watcher = asyncio.create_task(_watch(beats, seen))
    with contextlib.ExitStack() as stack:
        workers = {
            f"{model}-w{i}": stack.enter_context(
                fleet_process(*worker_args, "--worker-id", f"{model}-w{i}", env=env, log=tmp_path / f"w{i}.log")
            )
            for i in range(3)
        }
        dispatchers = [
            stack.enter_context(fleet_process(*dispatcher_args, env=env, log=tmp_path / f"d{i}.log")) for i in range(2)
        ]
        # Both dispatchers see all three workers before the load starts, so that the work spreads over them.
        await eventually(lambda: _all_live(seen, 2, 3), timeout_s=90, what="two dispatchers with three live workers")
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 60} for i in range(60)], unique)
        await eventually(lambda: _done(store, ids, 10), timeout_s=90, what="the first results")
        busy = await _a_worker_running_a_job(store, ids)
        for proc in (workers[busy], dispatchers[0]):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        records = await wait_terminal(store, ids, timeout_s=120)
        await asyncio.sleep(0.5)  # let a duplicate completion arrive before counting
        assert all(r.state is JobState.succeeded for r in records.values()), _logs(tmp_path)
        await eventually(lambda: _lag_is(broker, model, 0), timeout_s=60, what="every request acked")
    await beats.close()
    await asyncio.gather(watcher, return_exceptions=True)
    counter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await counter
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(60)]
    assert {j: counts[j] for j in ids} == dict.fromkeys(ids, 1), "exactly one terminal result per job"
    served_by = collections.Counter(r.worker_id for r in records.values())
    assert len(served_by) >= 2, f"work spread over the workers: {served_by}"


async def _watch(stream: EventStream, seen: dict[str, DispatcherBeat]) -> None:
    async for beat in validated(stream, DispatcherBeat, "dispatcher heartbeat"):
        seen[beat.dispatcher_id] = beat


async def _all_live(seen: dict[str, DispatcherBeat], dispatchers: int, workers: int) -> bool:
    return sum(1 for beat in seen.values() if beat.live_workers >= workers) >= dispatchers


async def _a_worker_running_a_job(store: ResultStore, ids: list[str]) -> str:
    for _ in range(200):
        for job_id in ids:
            record = await store.get(job_id)
            if record is not None and record.state is JobState.running and record.worker_id:
                return record.worker_id
        await asyncio.sleep(0.02)
    raise AssertionError("no job seen running")


def _logs(folder: Path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(folder.glob("*.log")))


async def _lag_is(broker, model: str, expected: int) -> bool:
    return await broker.lag(c.request_subject(model), c.consumer_name(model)) == expected


@pytest.mark.services
def test_dispatcher_cli_explains_itself_and_rejects_bad_settings() -> None:
    help_text = run_fleet("dispatcher", "--help").stdout
    assert "jiq-amnesia" in help_text and "--policy" in help_text and "--routing dispatch" in help_text
    bad = run_fleet("dispatcher", "--model", "sleep", "--policy", "fastest", env={"FLEET_BROKER_URL": "nats://x:1"})
    assert bad.returncode == 2 and "unknown dispatch policy 'fastest'" in bad.stderr
    embedded = run_fleet("dispatcher", "--model", "sleep")
    assert embedded.returncode == 2 and "needs a real broker" in embedded.stderr
    worker = run_fleet(
        "worker",
        "--model",
        "sleep",
        "--routing",
        "sideways",
        env={"FLEET_BROKER_URL": "nats://x:1", "FLEET_STORE_URL": "redis://x:1"},
    )
    assert worker.returncode == 2 and "--routing must be 'pull' or 'dispatch'" in worker.stderr
