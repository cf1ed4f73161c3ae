"""Several models per worker, and replicas that share weights, against one model per worker process.

    python -m benchmarks.bench_multimodel [--parts replicas,pool] [--quick] [--counts 4,8] [--jobs N]
                                          [--sides pull,dispatch,dedicated] [--affinity-wait-s S]

Part ``replicas``: ``embed`` served by one ``fleet worker --model embed --replicas N`` process against N ``fleet worker
--model embed`` processes, for each N of ``--counts``, over NATS + Redis:

1. a backlog of ``--jobs`` one-text requests is published to ``fleet.req.embed`` before any worker runs;
2. the worker process(es) start; the drain rate is measured from the moment all report ``ready`` in their
   heartbeats until the backlog is down to a tenth (as ``bench_embed_fleet``), then it drains completely and every
   job's record is checked ``succeeded``;
3. with the work done and the processes still up, their memory is read from ``/proc/<pid>/smaps_rollup``: PSS
   (proportional set size: a page shared by k processes counts 1/k in each, so the sum over processes is what they
   take together) and RSS (shared pages counted in every process).

Both sides use the same cores the same way: every compute thread gets ``max(1, cores // N)`` intra-op threads (the
processes through ``OMP_NUM_THREADS``, the replicas through ``fleet.consumers.replicas.replica_threads``), so N
batches compute at once on either side. Targets: PSS of the replicas <= 0.3 of the N processes', jobs/s >= 0.9 of
theirs.

Part ``pool``: 8 models (the four task runtimes, MiniLM-sized with random weights, two seeds each; ``--quick``: the
tests' tiny models) in a model repository built in a temporary folder. Zipf traffic (exponent ``--zipf``, ranks in a
seeded random order of the models) arrives at ``--rate`` jobs/s, open loop, to each side of ``--sides`` in turn:

* ``pull``: 2 multi-model workers, ``fleet worker --models m0,...,m7 --memory-budget B``, where B holds 4 of the 8
  models (4.5 times one model's parameter bytes): models load on demand and the least recently used is evicted. In
  pull routing both workers compete for every model's requests, so each one's budget keeps turning over;
* ``dispatch``: the same 2 multi-model workers with ``--routing dispatch`` and one ``fleet dispatcher --model m0 ...
  --model m7 --policy jiq-amnesia`` process: affinity routing (``fleet.dispatcher.affinity``) sends a model's
  requests to a worker whose heartbeat lists it loaded, and to a cold one only when no warm one can start the job
  within ``--affinity-wait-s`` (``FLEET_AFFINITY_WAIT_S``);
* ``dedicated``: 8 dedicated workers, ``fleet worker --model mK``, one per model, each loaded at its start.

The first ``--warmup`` jobs of the traffic are served and not counted (a pool worker imports torch on its first
load, and its first loads are the budget filling up); then ``--pool-jobs`` are measured.

It reports, for each side, cold loads per 1,000 jobs (the multi-model workers' ``fleet_worker_model_loads_total`` on
their ``/metrics``, all of which happen under traffic; a dedicated worker's one load happens before traffic), p50 and
p99 of each job's time from publish to its record's ``finished_at``, and the resident memory (PSS) of its processes
(on side ``dispatch`` the dispatcher's included, and also given alone), then the ratios of the sides run: each pool
side against the dedicated workers, and the cold loads of pull against dispatch. This part needs the multi-model
worker (``fleet worker --models ... --memory-budget``), and side ``dispatch`` the dispatcher's affinity routing; on a
checkout without them, it stops with a message saying so, after part ``replicas`` has written its figures.

Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests. Each part writes its own file as it
ends: ``benchmarks/results/multimodel.json`` (replicas) and ``multimodel-pool.json`` (pool: the figures of side pull
under ``multi``, of dispatch under ``dispatch`` with its dispatcher's cold assignments and memory, of dedicated under
``dedicated``: a run of fewer ``--sides`` writes only theirs); ``--quick`` writes them under
``benchmarks/results/quick/`` (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench_embed import query_texts
from benchmarks.common import RESULTS_DIR, SHOWN, percentiles_ms, services, show, stop_processes, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.brokers.events import validated
from fleet.consumers.replicas import replica_threads, usable_cores
from fleet.producers.publish import publish_all
from fleet.schemas.wire import DispatcherBeat, Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from tests.processes import fleet_argv, fleet_env

EMBED = "embed"
LOG_DIR = RESULTS_DIR / "bench_multimodel_logs"
POOL_MODELS = 8
POOL_HOLDS = 4.5  # the budget in model sizes: 4 fit, a 5th does not
RUNTIMES = ("embeddings", "classification", "token-classification", "rerank")
SIDES = ("pull", "dispatch", "dedicated")  # the sides of part pool, in the order they run
DISPATCH_POLICY = "jiq-amnesia"


# -- processes and their memory ---------------------------------------------------------------------------------
@contextlib.contextmanager
def fleet_processes(argvs: list[list[str]], env: dict[str, str], tag: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One ``fleet`` process per argv, logs in ``LOG_DIR``; SIGTERM (drain) on the way out."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, argv in enumerate(argvs):
            with (LOG_DIR / f"{tag}-{i}.log").open("wb") as log:
                procs.append(subprocess.Popen(fleet_argv(*argv), env=env, stdout=log, stderr=subprocess.STDOUT))
        yield procs
        check_alive(procs)
    finally:
        stop_processes(procs, timeout_s=60)


def check_alive(procs: list[subprocess.Popen[bytes]]) -> None:
    dead = [p for p in procs if p.poll() is not None]
    if dead:
        raise SystemExit(f"a worker exited early (code {dead[0].returncode}); logs in {LOG_DIR}")


def smaps_rollup(pid: int) -> dict[str, int]:
    """``Pss`` and ``Rss`` of a process in bytes, from ``/proc/<pid>/smaps_rollup``."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Rss"):
            values[key.lower()] = int(rest.split()[0]) * 1024
    return values


def memory_of(procs: list[subprocess.Popen[bytes]]) -> dict[str, int]:
    """PSS and RSS summed over the processes (each a ``fleet`` interpreter: no children)."""
    rollups = [smaps_rollup(p.pid) for p in procs]
    return {"pss_bytes": sum(r["pss"] for r in rollups), "rss_bytes": sum(r["rss"] for r in rollups)}


# -- the fleet side -----------------------------------------------------------------------------------------------
async def connect(urls: dict[str, str]) -> tuple[Broker, ResultStore]:
    settings = FleetSettings(broker_url=urls["nats"], store_url=urls["redis"])
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    return broker, store


class Readiness:
    """Worker ids that said ``ready`` in their heartbeats, on the heartbeat subjects of ``models``."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self._streams: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, broker: Broker, models: list[str]) -> None:
        for model in models:
            stream = await broker.listen(c.heartbeat_subject(model))
            self._streams.append(stream)
            self._tasks.append(asyncio.create_task(self._track(stream)))

    async def _track(self, stream: Any) -> None:
        async for beat in validated(stream, Heartbeat, "worker heartbeat"):
            self.states[beat.worker_id] = beat.state

    async def wait(self, count: int, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
        started = time.monotonic()
        while sum(state == "ready" for state in self.states.values()) < count:
            check_alive(procs)
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"{count} workers not ready within {timeout_s}s; logs in {LOG_DIR}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for stream in self._streams:
            await stream.close()  # ends the readers (cancelling a NATS read is not reliable)
        await asyncio.gather(*self._tasks, return_exceptions=True)


class DispatcherWatch(Readiness):
    """The live workers each model's dispatcher sees, from its beats on ``fleet.ctl.dispatcher.<model>``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, int] = {}

    async def start(self, broker: Broker, models: list[str]) -> None:
        for model in models:
            stream = await broker.listen(c.dispatcher_subject(model))
            self._streams.append(stream)
            self._tasks.append(asyncio.create_task(self._watch(stream)))

    async def _watch(self, stream: Any) -> None:
        async for beat in validated(stream, DispatcherBeat, "dispatcher heartbeat"):
            self.live[beat.model] = beat.live_workers

    async def wait_live(
        self, models: list[str], workers: int, procs: list[subprocess.Popen[bytes]], timeout_s: float
    ) -> None:
        started = time.monotonic()
        while any(self.live.get(m, 0) < workers for m in models):
            check_alive(procs)
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"the dispatcher did not see {workers} workers of each model; logs in {LOG_DIR}")
            await asyncio.sleep(0.05)


async def drain(
    urls: dict[str, str], texts: list[str], argvs: list[list[str]], env: dict[str, str], ready: int, tag: str
) -> dict[str, Any]:
    """Publish ``texts`` as a backlog of ``embed`` jobs, start the processes, measure the drain rate and memory."""
    broker, store = await connect(urls)
    subject, group = c.request_subject(EMBED), c.consumer_name(EMBED)
    try:
        await broker.ensure_model(EMBED)
        if await broker.lag(subject, group):
            raise SystemExit(f"{subject} already has a backlog; drain or remove it before benchmarking")
        messages = [RequestMessage(job_id=uuid.uuid4().hex, model=EMBED, input={"text": t}) for t in texts]
        await publish_all(broker, messages, concurrency=512)
        readiness = Readiness()
        await readiness.start(broker, [EMBED])
        with fleet_processes(argvs, env, tag) as procs:
            await readiness.wait(ready, procs, timeout_s=300)
            t0, lag0 = time.perf_counter(), await broker.lag(subject, group)
            lag, t1 = lag0, t0
            while lag > len(texts) // 10:
                await asyncio.sleep(0.05)
                lag, t1 = await broker.lag(subject, group), time.perf_counter()
            while await broker.lag(subject, group) > 0:  # noqa: ASYNC110 - polled
                await asyncio.sleep(0.05)
            records = await wait_records(store, [m.job_id for m in messages], timeout_s=120)
            memory = memory_of(procs)
        await readiness.stop()
        failed = [r for r in records if r is None or r.state != "succeeded"]
        if failed:
            raise SystemExit(f"{len(failed)} of {len(records)} jobs did not succeed ({tag}); logs in {LOG_DIR}")
        if lag0 < len(texts) // 2:
            print(f"note: {tag}: only {lag0} of {len(texts)} jobs were left once all workers were ready")
        return {"jobs_per_s": (lag0 - lag) / (t1 - t0), "measured_jobs": lag0 - lag, **memory}
    finally:
        await store.close()
        await broker.close()


async def wait_records(store: ResultStore, ids: list[str], timeout_s: float) -> list[Any]:
    """The records of ``ids`` once all are terminal (or as they are at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records: list[Any] = []
        for i in range(0, len(ids), 500):
            records += await store.get_many(ids[i : i + 500])
        if all(r is not None and r.terminal for r in records) or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.2)


# -- part replicas ----------------------------------------------------------------------------------------------
def worker_env(urls: dict[str, str], threads: int | None = None) -> dict[str, str]:
    env = fleet_env(
        FLEET_BROKER_URL=urls["nats"],
        FLEET_STORE_URL=urls["redis"],
        FLEET_HEARTBEAT_INTERVAL_S="0.5",
        FLEET_LOG_LEVEL="INFO",
        FLEET_DEVICE="cpu",
    )
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


async def replicas_part(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    texts = query_texts(args.jobs, args.words)
    base = ["worker", "--model", EMBED, "--max-batch", str(args.batch), "--max-wait-ms", "5"]
    points = []
    rows: list[tuple[str, str, str]] = []
    for n in args.counts:
        threads = replica_threads(n)
        env = worker_env(urls, threads)
        procs = await drain(urls, texts, [base] * n, env, ready=n, tag=f"processes-{n}")
        reps = await drain(urls, texts, [[*base, "--replicas", str(n)]], env, ready=1, tag=f"replicas-{n}")
        point = {
            "n": n,
            "threads_per_compute": threads,
            "processes": procs,
            "replicas": reps,
            "pss_ratio": reps["pss_bytes"] / procs["pss_bytes"],
            "rss_ratio": reps["rss_bytes"] / procs["rss_bytes"],
            "throughput_ratio": reps["jobs_per_s"] / procs["jobs_per_s"],
        }
        points.append(point)
        rows += [
            (
                f"N={n}: PSS, 1 process of {n} replicas / {n} processes",
                f"{point['pss_ratio']:.2f} ({mib(reps['pss_bytes'])} vs {mib(procs['pss_bytes'])})",
                "<= 0.3",
            ),
            (
                f"N={n}: RSS, replicas / processes",
                f"{point['rss_ratio']:.2f} ({mib(reps['rss_bytes'])} vs {mib(procs['rss_bytes'])})",
                "",
            ),
            (
                f"N={n}: jobs/s, replicas / processes",
                f"{point['throughput_ratio']:.2f} ({reps['jobs_per_s']:,.0f} vs {procs['jobs_per_s']:,.0f})",
                ">= 0.9",
            ),
        ]
    show(
        f"embed: N replicas in one process against N processes, NATS + Redis, cpu, {usable_cores()} cores, "
        f"{args.jobs:,} jobs of {args.words} words, batch {args.batch}",
        rows,
    )
    return {"points": points}


def mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"


# -- part pool ----------------------------------------------------------------------------------------------------
def pool_available() -> str | None:
    """Why part ``pool`` cannot run on this checkout (None: it can)."""
    result = subprocess.run(fleet_argv("worker", "--help"), env=fleet_env(), capture_output=True, text=True)
    if "--memory-budget" not in result.stdout:
        return (
            "part pool needs the multi-model worker (fleet worker --models a,b --memory-budget B), which this "
            "checkout's `fleet worker` lacks; run it on a checkout that has it"
        )
    return None


def build_models(root: Path, quick: bool, batch: int) -> tuple[list[str], list[str], int]:
    """8 repository entries under ``root``: (names, runtimes, the parameter bytes of the largest)."""
    names, runtimes, sizes = [], [], []
    for i in range(POOL_MODELS):
        runtime = RUNTIMES[i % len(RUNTIMES)]
        if quick:
            from tests.tiny_models import add_entry

            name = f"mm{i}-{uuid.uuid4().hex[:4]}"
            entry = add_entry(root, name, runtime, seed=i)
        else:
            from benchmarks.bench_models import TASKS, build_entry

            entry = build_entry(TASKS[runtime], root, batch, seed=i)
            name = entry.name
        names.append(name)
        runtimes.append(runtime)
        sizes.append(sum(p.stat().st_size for p in entry.weights_dir.glob("*.safetensors")))
    return names, runtimes, max(sizes)


def job_input(runtime: str, texts: list[str], i: int) -> dict[str, Any]:
    if runtime == "rerank":
        return {"query": texts[i % len(texts)], "texts": [texts[(i + k + 1) % len(texts)] for k in range(4)]}
    return {"text": texts[i % len(texts)]}


def zipf_choices(models: int, jobs: int, exponent: float, seed: int) -> list[int]:
    """For each job the index of its model: Zipf over ranks, the ranks a seeded shuffle of the models."""
    rng = random.Random(seed)
    order = list(range(models))
    rng.shuffle(order)
    weights = [1 / (rank + 1) ** exponent for rank in range(models)]
    return [order[rank] for rank in rng.choices(range(models), weights=weights, k=jobs)]


COLD_ASSIGNMENTS = "fleet_dispatcher_cold_assignments_total"


def scrape(port: int, metric: str) -> float:
    """The sum of ``metric``'s samples on a worker's ``/metrics``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric + "{"))


async def traffic(
    urls: dict[str, str],
    names: list[str],
    runtimes: list[str],
    argvs: list[list[str]],
    ready: int,
    args: argparse.Namespace,
    tag: str,
    ports: list[int],
    dispatcher_port: int | None = None,
) -> dict[str, Any]:
    """Open-loop Zipf traffic to the models while the processes serve them: latencies, loads, memory.

    ``dispatcher_port``: the workers are in dispatch routing, and one ``fleet dispatcher`` of every model runs beside
    them with its ``/metrics`` on that port; its memory counts in the side's, and is also given alone."""
    texts = query_texts(512, args.words)
    choices = zipf_choices(len(names), args.warmup + args.pool_jobs, args.zipf, seed=7)
    env = worker_env(urls, replica_threads(len(argvs)))
    env["FLEET_MODEL_REPOSITORY"] = str(args.repo)
    env["FLEET_AFFINITY_WAIT_S"] = str(args.affinity_wait_s)
    helpers = []
    if dispatcher_port is not None:
        models = [arg for name in names for arg in ("--model", name)]
        helpers.append(["dispatcher", *models, "--policy", DISPATCH_POLICY, "--port", str(dispatcher_port)])
    broker, store = await connect(urls)
    try:
        for name in names:
            await broker.ensure_model(name)
        readiness, dispatchers = Readiness(), DispatcherWatch()
        await readiness.start(broker, names)
        await dispatchers.start(broker, names if helpers else [])
        with fleet_processes([*argvs, *helpers], env, tag) as procs:
            await readiness.wait(ready, procs, timeout_s=600)
            if helpers:  # every model's dispatcher sees both workers before traffic starts
                await dispatchers.wait_live(names, len(argvs), procs, timeout_s=120)
            # the warm-up (torch's import on a pool's first load, the first loads) is served, then not counted
            warm = await send(broker, names, runtimes, texts, choices[: args.warmup], args.rate)
            await wait_records(store, list(warm), timeout_s=600)
            loads_before = sum(scrape(p, "fleet_worker_model_loads_total") for p in ports)
            cold_before = scrape(dispatcher_port, COLD_ASSIGNMENTS) if dispatcher_port is not None else 0.0
            sent = await send(broker, names, runtimes, texts, choices[args.warmup :], args.rate)
            records = await wait_records(store, list(sent), timeout_s=300)
            loads = sum(scrape(p, "fleet_worker_model_loads_total") for p in ports) - loads_before
            cold = scrape(dispatcher_port, COLD_ASSIGNMENTS) - cold_before if dispatcher_port is not None else 0.0
            memory = memory_of(procs)
            helper_memory = memory_of(procs[len(argvs) :]) if helpers else None
        await readiness.stop()
        await dispatchers.stop()
        done = [r for r in records if r is not None and r.state == "succeeded" and r.finished_at]
        if len(done) < len(records):
            raise SystemExit(f"{len(records) - len(done)} of {len(records)} jobs did not succeed ({tag})")
        latencies = [r.finished_at - sent[r.job_id] for r in done]
        figures: dict[str, Any] = {
            "jobs": len(done),
            "cold_loads": loads,
            "cold_loads_per_1000": loads / len(done) * 1000,
            "latency": percentiles_ms(latencies),
            **memory,
        }
        if helper_memory is not None:
            figures["dispatcher"] = {"cold_assignments": cold, **helper_memory}
        return figures
    finally:
        await store.close()
        await broker.close()


async def send(
    broker: Broker, names: list[str], runtimes: list[str], texts: list[str], choices: list[int], rate: float
) -> dict[str, float]:
    """Publish one job per choice at about ``rate`` per second (jittered, open loop); each job's publish time."""
    sent: dict[str, float] = {}
    rng = random.Random(11)
    started = time.perf_counter()
    for i, k in enumerate(choices):
        message = RequestMessage(job_id=uuid.uuid4().hex, model=names[k], input=job_input(runtimes[k], texts, i))
        sent[message.job_id] = time.time()
        await publish_all(broker, [message])
        due = started + (i + 1 + rng.uniform(-0.5, 0.5)) / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    return sent


def dispatch_available() -> str | None:
    """Why side ``dispatch`` cannot run on this checkout (None: it can)."""
    try:
        from fleet.dispatcher import affinity  # noqa: F401 (a probe)
    except ImportError:
        return (
            "side dispatch needs the dispatcher's affinity routing (fleet.dispatcher.affinity), which this checkout "
            "lacks; run it on a checkout that has it, or leave dispatch out of --sides"
        )
    return None


async def pool_part(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    why = pool_available() if {"pull", "dispatch"} & set(args.sides) else None
    why = why or (dispatch_available() if "dispatch" in args.sides else None)
    if why is not None:
        raise SystemExit(why)
    root = Path(tempfile.mkdtemp(prefix="bench-multimodel-"))
    sides: dict[str, dict[str, Any]] = {}
    try:
        args.repo = root
        names, runtimes, size = build_models(root, args.quick, args.batch)
        budget = int(POOL_HOLDS * size)
        base = ["--max-batch", str(args.batch), "--max-wait-ms", "5"]
        for side in args.sides:
            if side == "dedicated":
                dedicated = [["worker", "--model", name, *base] for name in names]
                sides[side] = await traffic(urls, names, runtimes, dedicated, len(names), args, side, [])
                print(f"8 dedicated workers: {sides[side]}")
                continue
            ports = [free_port(), free_port()]
            pool = ["worker", "--models", ",".join(names), "--memory-budget", str(budget), "--routing", side, *base]
            pooled = [[*pool, "--metrics-port", str(p)] for p in ports]
            tag = "pool" if side == "pull" else "pool-dispatch"
            sides[side] = await traffic(
                urls,
                names,
                runtimes,
                pooled,
                2 * len(names),
                args,
                tag,
                ports,
                dispatcher_port=free_port() if side == "dispatch" else None,
            )
            print(f"2 multi-model workers, {side} routing: {sides[side]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kind = "tiny" if args.quick else "MiniLM-sized"
    against = " against ".join(SIDE_TITLES[side] for side in args.sides)
    show(
        f"8 {kind} models, Zipf {args.zipf} at {args.rate:g} jobs/s ({args.pool_jobs:,} jobs): {against} "
        f"(budget {mib(budget)}, holds 4; affinity wait {args.affinity_wait_s:g} s)",
        pool_rows(sides),
    )
    figures: dict[str, Any] = {"budget_bytes": budget, "model_bytes": size, "models": names}
    for side, key in (("pull", "multi"), ("dispatch", "dispatch"), ("dedicated", "dedicated")):
        if side in sides:
            figures[key] = sides[side]
    return figures


SIDE_TITLES = {
    "pull": "2 multi-model workers (pull)",
    "dispatch": "2 multi-model workers (dispatch, affinity)",
    "dedicated": "8 dedicated workers",
}
SIDE_NAMES = {"pull": "pool-pull", "dispatch": "pool-dispatch", "dedicated": "dedicated"}


def pool_rows(sides: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The table of part pool: each side's figures, then the ratios of the sides that ran."""
    rows: list[tuple[str, str, str]] = []
    for side, figures in sides.items():
        loads = (
            "0 (each loads its model before traffic)"
            if side == "dedicated"
            else f"{figures['cold_loads_per_1000']:.1f}"
        )
        rows.append((f"cold loads per 1,000 jobs, {SIDE_TITLES[side]}", loads, ""))
    for side, figures in sides.items():
        latency = figures["latency"]
        rows.append((f"p50 / p99 ms, {SIDE_TITLES[side]}", f"{latency['p50_ms']:,.0f} / {latency['p99_ms']:,.0f}", ""))
    for side, figures in sides.items():
        extra = ""
        if "dispatcher" in figures:
            extra = f" (the dispatcher's {mib(figures['dispatcher']['pss_bytes'])} included)"
        rows.append((f"PSS, {SIDE_TITLES[side]}", mib(figures["pss_bytes"]) + extra, ""))
    dedicated = sides.get("dedicated")
    for side in ("pull", "dispatch"):
        if side not in sides or dedicated is None:
            continue
        mine, name = sides[side], SIDE_NAMES[side]
        for measure in ("p50_ms", "p99_ms"):
            rows.append(
                (
                    f"{measure.removesuffix('_ms')} ms, {name} / dedicated",
                    f"{mine['latency'][measure] / dedicated['latency'][measure]:.1f}x "
                    f"({mine['latency'][measure]:,.0f} vs {dedicated['latency'][measure]:,.0f})",
                    "",
                )
            )
        rows.append(
            (
                f"PSS, {name} / dedicated",
                f"{mine['pss_bytes'] / dedicated['pss_bytes']:.2f} ({mib(mine['pss_bytes'])} vs "
                f"{mib(dedicated['pss_bytes'])})",
                "",
            )
        )
    if "pull" in sides and "dispatch" in sides:
        pull, dispatch = sides["pull"]["cold_loads_per_1000"], sides["dispatch"]["cold_loads_per_1000"]
        ratio = f"{pull / dispatch:.1f}x fewer with dispatch" if dispatch else "none with dispatch"
        rows.append(
            ("cold loads per 1,000 jobs, pool-pull vs pool-dispatch", f"{pull:.1f} vs {dispatch:.1f} ({ratio})", "")
        )
        for measure in ("p50_ms", "p99_ms"):
            a, b = sides["pull"]["latency"][measure], sides["dispatch"]["latency"][measure]
            rows.append((f"{measure.removesuffix('_ms')} ms, pool-pull vs pool-dispatch", f"{a:,.0f} vs {b:,.0f}", ""))
    return rows


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- main ---------------------------------------------------------------------------------------------------------
RESULT_OF = {"replicas": "multimodel", "pool": "multimodel-pool"}  # one result file per part


async def main(args: argparse.Namespace) -> None:
    params = {k: v for k, v in vars(args).items() if k != "repo"}
    parts = {"replicas": replicas_part, "pool": pool_part}
    with services() as urls:
        for part in args.parts:
            figures = {"params": params, part: await parts[part](urls, args)}
            name = RESULT_OF[part]
            out = RESULTS_DIR / "quick" / f"{name}.json" if args.quick else None  # a smoke run's: not committed
            print(f"wrote {write_result(name, figures, out)}")
            SHOWN.clear()  # the next part's file holds its own tables


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="replicas,pool", help="replicas, pool or both (comma-separated)")
    p.add_argument("--quick", action="store_true", help="a smoke run: N=2, 200 jobs, tiny models, 150 pool jobs")
    p.add_argument("--counts", default="4,8", help="the N of part replicas (comma-separated)")
    p.add_argument("--jobs", type=int, default=3000, help="backlog of part replicas, per run")
    p.add_argument("--words", type=int, default=12, help="words per text")
    p.add_argument("--batch", type=int, default=16, help="largest micro-batch of every worker")
    p.add_argument("--pool-jobs", type=int, default=2000, help="jobs of part pool, per side")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second of part pool")
    p.add_argument("--warmup", type=int, default=200, help="jobs of part pool served first and not counted")
    p.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of part pool's model popularity")
    p.add_argument("--sides", default=",".join(SIDES), help="the sides of part pool: pull, dispatch, dedicated")
    p.add_argument(
        "--affinity-wait-s", type=float, default=2.0, help="FLEET_AFFINITY_WAIT_S of part pool's side dispatch"
    )
    args = p.parse_args(argv)
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not args.sides or set(args.sides) - set(SIDES):
        p.error(f"--sides: use one or more of {', '.join(SIDES)}, not {','.join(args.sides) or 'nothing'}")
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = set(args.parts) - {"replicas", "pool"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; use replicas, pool")
    args.counts = [int(n) for n in args.counts.split(",")]
    if args.quick:
        args.counts, args.jobs, args.pool_jobs, args.rate, args.warmup = [2], 200, 150, 30.0, 60
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
