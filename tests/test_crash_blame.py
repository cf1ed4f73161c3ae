"""Crashes that are not a job's fault do not count against it; a job that kills its worker is still stopped
(issue 26 item 7, ``fleet.consumers.crashes``).

Real ``fleet worker`` processes over NATS + Redis with ``max_deliveries=2``:

* workers SIGKILLed again and again, each time while it computes a batch of several healthy jobs (as an OOM killer,
  a preemption or a scale-in would): every job succeeds, though some started more runs than ``max_deliveries``
  (counting runs, as Fleet did, dead-lettered them);
* a job that SIGKILLs every worker that computes it, published together with healthy jobs: the crashes split its
  batch until it runs alone, it is dead-lettered after ``max_deliveries`` runs alone, and its neighbours succeed.

And in one process (memory broker and store), the steps: records left ``running`` by a vanished run of many are
computed in smaller batches, one left by a run alone counts, and a worker told to stop marks the run it computes.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest

from fleet import constants as c
from fleet.consumers.crashes import Blame, after_vanished
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.wire import DeadLetter
from fleet.store.base import ResultStore, Start
from tests.handlers_for_tests import Items
from tests.infra import connected_pair, drain_subject, eventually, publish_requests, settings_for, wait_terminal
from tests.processes import fleet_process, stop

WORKER = "tests.handlers_for_tests:Items"
MAX_DELIVERIES = 2


def env_for(nats_url: str, redis_url: str, model: str) -> dict[str, str]:
    return {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_TEST_MODEL_NAME": model,
        "FLEET_ACK_WAIT_S": "2",
        "FLEET_MAX_DELIVERIES": str(MAX_DELIVERIES),
        "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
        "FLEET_MAX_BATCH": "8",
        "FLEET_MAX_WAIT_MS": "300",
    }


async def running_on(store: ResultStore, ids: list[str], proc: subprocess.Popen[bytes]) -> list[JobRecord]:
    """The jobs the worker process ``proc`` is computing now (its worker id holds its pid); none may have failed."""
    records = await store.get_many(ids)
    failed = {r.job_id: r.error for r in records if r is not None and r.state is JobState.failed}
    assert not failed, f"healthy jobs failed by crashes that were not theirs: {failed}"
    mark = f"-{proc.pid}-"
    return [r for r in records if r is not None and r.state is JobState.running and mark in (r.worker_id or "")]


@pytest.mark.slow
async def test_workers_killed_while_computing_batches_of_healthy_jobs_fail_none_of_them(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model = f"storm-{unique}"
    env = env_for(nats_url, redis_url, model)
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    async with connected_pair(settings) as (broker, store):
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 400} for i in range(8)], unique)
        killed_in: list[int] = []
        for kill in range(3):
            log = tmp_path / f"killed-{kill}.log"
            with fleet_process("worker", "--model", WORKER, env=env, log=log) as proc:

                async def batch_of_several(proc: subprocess.Popen[bytes] = proc) -> bool:
                    assert proc.poll() is None, f"the worker exited by itself ({proc.returncode})"
                    return len(await running_on(store, ids, proc)) >= 2

                await eventually(batch_of_several, timeout_s=60, what="a batch of several jobs computing")
                killed_in.append(len(await running_on(store, ids, proc)))
                proc.send_signal(signal.SIGKILL)  # the infrastructure's doing, not the jobs'
                proc.wait(10)
        with fleet_process("worker", "--model", WORKER, env=env, log=tmp_path / "last.log"):
            records = await wait_terminal(store, ids, timeout_s=90)
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-{unique}", timeout_s=1)
    print(f"killed while computing batches of {killed_in}; runs per job {[r.deliveries for r in records.values()]}")
    failed = {j: r.error for j, r in records.items() if r.state is not JobState.succeeded}
    assert not failed, f"healthy jobs failed by crashes that were not theirs: {failed}"
    assert letters == []
    assert max(r.deliveries for r in records.values()) > MAX_DELIVERIES, "a count of runs would have failed them"
    assert all(not r.strikes for r in records.values()), "no run alone was killed: nothing counts against a job"


@pytest.mark.slow
async def test_a_job_that_kills_every_worker_it_runs_on_is_dead_lettered_and_its_neighbours_succeed(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model = f"killer-{unique}"
    env = env_for(nats_url, redis_url, model)
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    async with connected_pair(settings) as (broker, store):
        inputs = [{"value": 0, "crash": True}] + [{"value": i, "sleep_ms": 50} for i in range(1, 4)]
        ids = await publish_requests(broker, model, inputs, unique)
        killer, healthy = ids[0], ids[1:]
        starts = 0
        while (record := await store.get(killer)) is None or not record.terminal:
            assert starts < 10, f"the killing job is not stopped after {starts} workers; its record: {record}"
            log = tmp_path / f"worker-{starts}.log"
            with fleet_process("worker", "--model", WORKER, env=env, log=log) as proc:
                starts += 1

                async def gone_or_done(proc: subprocess.Popen[bytes] = proc) -> bool:
                    done = all(r is not None and r.terminal for r in await store.get_many(ids))
                    return proc.poll() is not None or done

                await eventually(gone_or_done, timeout_s=60, what="the worker killed, or every job ended")
                if proc.poll() is None:  # every job ended: a drain lets its last letter out before it exits
                    assert await asyncio.to_thread(stop, proc) == 0, log.read_text()[-3000:]
        records = await wait_terminal(store, ids, timeout_s=30)
        letters = await drain_subject(broker, c.dlq_subject(model), f"dlq-{unique}", timeout_s=1)
    neighbours = {j: (records[j].state, records[j].error) for j in healthy}
    assert neighbours == dict.fromkeys(healthy, (JobState.succeeded, None)), "crashes that were not theirs"
    stopped = records[killer]
    assert stopped.state is JobState.failed and stopped.error is not None, stopped
    assert stopped.error.type == "max_deliveries", stopped.error
    assert f"{MAX_DELIVERIES} of those runs count against it" in stopped.error.message, "stopped by its runs alone"
    assert stopped.strikes == MAX_DELIVERIES - 1, "as of its last start: the crash of that run counted at admission"
    assert [DeadLetter.model_validate_json(d.data).job_id for d in letters] == [killer]
    assert all(not records[j].strikes for j in healthy), "crashes in the killer's batches do not count against them"


async def vanished(store: ResultStore, model: str, ids: list[str], batch_size: int, strikes: int = 0) -> None:
    """Records as a worker that died leaves them: ``running``, started in a run of ``batch_size`` jobs."""
    await store.start_many([Start(j, model, "gone-1", 1, False, None, batch_size, strikes) for j in ids])


async def test_jobs_whose_run_of_many_vanished_compute_in_batches_half_its_size(unique: str) -> None:
    settings = settings_for("memory", {}, max_deliveries=1)
    async with connected_pair(settings) as (broker, store):
        model = f"halves-{unique}"
        await broker.ensure_model(model)
        ids = [f"{unique}-{i}" for i in range(8)]
        await vanished(store, model, ids, batch_size=8)
        ids = await publish_requests(broker, model, [{"value": i} for i in range(8)], unique)
        async with Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=8, max_wait_ms=200):
            records = await wait_terminal(store, ids)
    assert {r.state for r in records.values()} == {JobState.succeeded}, "max_deliveries=1 and a second run: fine"
    assert {r.output["batch_size"] for r in records.values()} == {4}
    assert {(r.deliveries, r.strikes, r.batch_size) for r in records.values()} == {(2, None, 4)}


async def test_a_job_whose_last_allowed_run_alone_vanished_is_dead_lettered_without_running(unique: str) -> None:
    settings = settings_for("memory", {}, max_deliveries=3)
    async with connected_pair(settings) as (broker, store):
        model = f"alone-{unique}"
        await broker.ensure_model(model)
        killer, other = f"{unique}-0", f"{unique}-1"
        await vanished(store, model, [killer], batch_size=1, strikes=2)  # its third strike
        await vanished(store, model, [other], batch_size=0, strikes=2)  # its worker was draining: no strike
        ids = await publish_requests(broker, model, [{"value": 0}, {"value": 1}], unique)
        worker = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=8, max_wait_ms=50)
        async with worker:
            records = await wait_terminal(store, ids)
    assert records[killer].state is JobState.failed and records[killer].error is not None
    assert "3 of those runs count against it" in records[killer].error.message
    assert records[other].state is JobState.succeeded
    assert worker.handler.predicted == [1], "the job out of runs is not run again"


async def test_a_worker_told_to_stop_marks_the_run_it_computes_as_not_its_jobs_fault(unique: str) -> None:
    settings = settings_for("memory", {})
    async with connected_pair(settings) as (broker, store):
        model = f"drained-{unique}"
        # computing for longer than stop() may wait for a fetch in progress (IDLE_FETCH_TIMEOUT_S + 1), so the drain
        # deadline, not the end of the computation, ends the run
        (job_id,) = await publish_requests(broker, model, [{"value": 1, "sleep_ms": 5000}], unique)
        worker = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=1, max_wait_ms=0)
        await worker.start()

        async def computing() -> bool:
            return bool(worker.handler.calls)

        await eventually(computing, what="the job computing alone")
        await worker.stop(drain_timeout_s=0)  # the drain deadline passes at once: as a kill after the grace period
        record = await store.get(job_id)
    assert record is not None and record.state is JobState.running
    assert (record.batch_size, after_vanished(record.strikes or 0, record.batch_size)) == (0, Blame(0, None))
