"""DAG runs under crashes: 100 runs of split -> 8 echo items -> join on three ``fleet worker --model echo``
processes over NATS + Redis; every 2 s the worker that has served longest is SIGKILLed and restarted (a tick
with no worker serving yet kills nothing: a restart takes ~8 s on a 2-core machine, and a kill must land on a
worker that is working).

Runs are started by a ``DagRunner`` in the test process (register + start), paced over 40 s, while the kills go
on; then the kills stop and the workers restarted last finish what is left. What must hold:
every run is terminal once with the right output; every step job is terminal once (one done notification per job
id on Redis); the join is launched once per run (in the run document's whole history, read from its change
events) and its one job is terminal once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from fleet import constants as c
from fleet.dags.runner import DagRunner
from fleet.schemas.jobs import JobState
from fleet.schemas.models import BUILTIN_SPECS
from fleet.store.bundle import Stores
from tests.infra import connected_pair, count_completions, settings_for
from tests.processes import ROOT, fleet_argv, fleet_env

RUNS = 100
FAN_OUT = 8
KILL_EVERY_S = 2.0
START_EVERY_S = 0.4  # the starts span 40 s, so kills land all along


def spec(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "steps": [
            {"id": "split", "model": "echo", "input": {"items": "${input.items}"}},
            {"id": "each", "model": "echo", "for_each": "${steps.split.output.items}", "input": {"v": "${item}"}},
            {"id": "join", "model": "echo", "input": {"vs": "${steps.each.outputs[*].v}"}},
        ],
        "output": {"n": "${length(steps.join.output.vs)}", "vs": "${steps.join.output.vs}"},
    }


class Workers:
    """Three ``fleet worker --model echo`` processes. ``tick`` SIGKILLs the serving worker that has served longest
    and restarts it: a restart takes several seconds on a small machine (imports, connections), and a kill must land
    on a worker that is working, not on one that is still starting."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.kills = 0
        self._spawned = 0
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = [self._spawn() for _ in range(3)]
        self._serving_since: dict[int, float] = {}

    def _spawn(self) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.logs / f"worker-{self._spawned}.log"
        self._spawned += 1
        with log.open("wb") as out:
            proc = subprocess.Popen(
                fleet_argv("worker", "--model", "echo"),
                env=fleet_env(**self.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        return proc, log

    def serving(self) -> list[int]:
        """The slots whose worker says it is serving, longest-serving first."""
        now = time.monotonic()
        for proc, log in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"a worker exited by itself ({proc.returncode}):\n{log.read_text()[-3000:]}")
            if id(proc) not in self._serving_since and "serving echo" in log.read_text(errors="replace"):
                self._serving_since[id(proc)] = now
        ready = [slot for slot, (proc, _) in enumerate(self.procs) if id(proc) in self._serving_since]
        return sorted(ready, key=lambda slot: self._serving_since[id(self.procs[slot][0])])

    def tick(self) -> None:
        ready = self.serving()
        if not ready:
            return
        proc, _ = self.procs[ready[0]]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        self.kills += 1
        self.procs[ready[0]] = self._spawn()

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


async def record_events(redis_url: str, ready: asyncio.Event, events: dict[str, list[dict[str, Any]]]) -> None:
    """Every run document published on a DAG events channel, per run, in order (the CAS script publishes each)."""
    client = aioredis.from_url(redis_url)
    pubsub = client.pubsub()
    await pubsub.psubscribe(c.dag_events_channel("*"))
    ready.set()
    try:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                doc = json.loads(message["data"])
                events[doc["run"]["run_id"]].append(doc)
    finally:
        await pubsub.aclose()
        await client.aclose()


async def test_a_hundred_fan_out_runs_survive_a_worker_killed_every_two_seconds(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    counts: collections.Counter[str] = collections.Counter()
    events: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    ready_counts, ready_events = asyncio.Event(), asyncio.Event()
    listeners = [
        asyncio.create_task(count_completions(redis_url, ready_counts, counts)),
        asyncio.create_task(record_events(redis_url, ready_events, events)),
    ]
    await ready_counts.wait()
    await ready_events.wait()
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_ACK_WAIT_S": "2",
        "FLEET_MAX_DELIVERIES": "10",
        "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
    }
    run_ids = [f"crash-{unique}-{i}" for i in range(RUNS)]
    inputs = {run: [f"{i}-{j}" for j in range(FAN_OUT)] for i, run in enumerate(run_ids)}
    workers = Workers(env, tmp_path)
    stop_killing = asyncio.Event()

    async def killer() -> None:
        while not stop_killing.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILL_EVERY_S):
                    await stop_killing.wait()
            if not stop_killing.is_set():
                await asyncio.to_thread(workers.tick)

    started = time.monotonic()
    try:
        async with connected_pair(settings) as (broker, store):
            runner = DagRunner(broker, store, Stores.beside(store).dags, BUILTIN_SPECS)
            await broker.ensure_model("echo")
            name, _, _ = await runner.register(spec(f"crash-{unique}"))
            deadline = time.monotonic() + 60
            while len(workers.serving()) < 3:
                assert time.monotonic() < deadline, "the workers did not start within 60 s"
                await asyncio.sleep(0.2)
            killing = asyncio.create_task(killer())
            for run in run_ids:
                await runner.start(name, {"items": inputs[run]}, run_id=run)
                await asyncio.sleep(START_EVERY_S)
            stop_killing.set()  # the workers restarted last then finish what is left
            await killing
            docs = await asyncio.gather(*(runner.wait(run, 60) for run in run_ids))
            views = [await runner.view(run) for run in run_ids]
            job_ids = [j for view in views for step in view["steps"].values() for j in step["job_ids"]]
            records = dict(zip(job_ids, await store.get_many(job_ids), strict=True))
            await asyncio.sleep(1.0)  # let a late duplicate notification arrive before counting
    finally:
        workers.stop()
        for task in listeners:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    elapsed = time.monotonic() - started

    redelivered = sum(1 for r in records.values() if r is not None and r.deliveries > 1)
    print(f"{RUNS} runs, {len(job_ids)} jobs, {workers.kills} kills, {redelivered} jobs run twice, {elapsed:.1f} s")
    unfinished = [doc["run"]["run_id"] for doc in docs if doc.get("finished_at") is None]
    assert not unfinished, f"{len(unfinished)} runs not over after 60 s, e.g. {unfinished[:3]}"
    expected = {run: {"n": FAN_OUT, "vs": inputs[run]} for run in run_ids}
    wrong = {v["run_id"]: (v["state"], v["output"]) for v in views if v["output"] != expected[v["run_id"]]}
    assert not wrong, f"runs with a wrong outcome: {dict(list(wrong.items())[:3])}"
    assert all(v["state"] == "succeeded" for v in views)
    assert len(job_ids) == RUNS * (FAN_OUT + 2)
    assert all(r is not None and r.state is JobState.succeeded for r in records.values())
    not_once = {j: counts[j] for j in job_ids if counts[j] != 1}
    assert not not_once, f"{len(not_once)} jobs not terminal exactly once, e.g. {dict(list(not_once.items())[:5])}"
    for run in run_ids:
        history = events[run]
        joins = [doc["run"]["steps"]["join"]["state"] for doc in history]
        launches = sum(1 for a, b in itertools.pairwise(joins) if a == "pending" and b != "pending")
        assert launches == 1, f"run {run}: the join was launched {launches} times"
        finishes = {doc["finished_at"] for doc in history if doc["finished_at"] is not None}
        assert len(finishes) == 1, f"run {run} finished {len(finishes)} times"
    assert workers.kills >= 3, f"only {workers.kills} kills in {elapsed:.0f} s"
