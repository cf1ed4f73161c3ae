"""Writes of finished records on a 3-primary Redis Cluster against one Redis, side by side in one run.

    python -m benchmarks.bench_cluster [--writers 4] [--seconds 5] [--batch 64] [--repeats 2]

Each writer is a process of its own with one ``RedisStore`` doing what a worker's settle path does to the store, as
fast as it can: for each micro-batch of ``--batch`` new jobs, ``start_many`` (the running records, written without
a read as for a job published straight to the broker) then ``finish_many`` with an ``embed`` output in base64 (one
384-float vector: 2,048 characters), so each result costs the two compare-and-set scripts and its completion
notice. ``--concurrency`` batches are in flight per writer. The writers start together (a common start time) and
count the results written in ``--seconds``; a target's figure is the sum over its writers.

The two targets run interleaved, ``--repeats`` times each, with every key flushed before each run; the best run
of each is kept and the ratio cluster / one Redis printed. Redis CPU per result is the growth of ``used_cpu_sys +
used_cpu_user`` summed over the nodes. Servers come from FLEET_BENCH_REDIS_URL / FLEET_BENCH_REDIS_CLUSTER_URL or
are started as in the tests. Writes ``benchmarks/results/cluster.json``.

The figure says how far the store's writes scale with the nodes; on a machine with fewer cores than nodes plus
writers, every process shares the same cores and the ratio measures the machine, not the cluster (the README says
what was measured where).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis
from redis.cluster import RedisCluster

from benchmarks.common import best_of, show, write_result
from fleet.schemas.jobs import JobState
from fleet.store.base import Finish, Start
from fleet.store.cluster import seed_nodes
from fleet.store.redis import RedisStore

OUTPUT = {"embedding": "A" * 2048, "dim": 384}  # the size of one base64 embedding (its content does not matter)
TARGETS = ("redis", "cluster")


async def write(url: str, seconds: float, batch: int, concurrency: int, start_at: float | None = None) -> int:
    """Write finished records from ``start_at`` (None: read from stdin once warm) for ``seconds``; returns how many
    were written in that window."""
    store = RedisStore(url, job_ttl_s=60)
    await store.connect()
    warm = asyncio.Event()
    go = asyncio.Event()
    prefix = uuid.uuid4().hex[:8]
    counter = 0
    written = 0

    async def one_batch() -> int:
        nonlocal counter
        ids = [f"{prefix}-{counter + i}" for i in range(batch)]
        counter += batch
        await store.start_many([Start(j, "embed", "bench-writer", 1, unread=True) for j in ids])
        done = await store.finish_many([Finish(j, JobState.succeeded, "embed", output=OUTPUT) for j in ids])
        return sum(1 for won, _ in done if won)

    async def loop() -> None:
        nonlocal written
        await one_batch()  # warm: connections open, scripts cached
        warm.set()
        await go.wait()
        assert start_at is not None
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds
        while time.time() < end:
            n = await one_batch()
            if time.time() <= end:
                written += n

    async def starter() -> None:
        nonlocal start_at
        await warm.wait()
        if start_at is None:
            print("ready", flush=True)
            start_at = float(await asyncio.to_thread(sys.stdin.readline))
        go.set()

    try:
        await asyncio.gather(starter(), *(loop() for _ in range(concurrency)))
    finally:
        await store.close()
    return written


def run_writers(url: str, writers: int, seconds: float, batch: int, concurrency: int) -> int:
    argv = [sys.executable, "-m", "benchmarks.bench_cluster", "--writer", url, "--seconds", str(seconds)]
    argv += ["--batch", str(batch), "--concurrency", str(concurrency)]
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(writers)]
    for proc in procs:  # every writer connected and warm
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("a writer failed to start")
    start_at = f"{time.time() + 0.2}\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(start_at)
        proc.stdin.flush()
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise SystemExit(f"a writer failed (exit {proc.returncode})")
        total += int(json.loads(out)["written"])
    return total


def clients(url: str) -> list[redis.Redis]:
    """One plain client per node (a cluster's primaries, or the one Redis)."""
    if url.startswith("redis+cluster://"):
        nodes, _, _ = seed_nodes(url)
        cluster = RedisCluster(host=nodes[0].host, port=nodes[0].port)
        found = [redis.Redis(host=n.host, port=n.port) for n in cluster.get_primaries()]
        cluster.close()
        return found
    return [redis.Redis.from_url(url)]


def cpu_s(nodes: list[redis.Redis]) -> float:
    total = 0.0
    for node in nodes:
        info = node.info("cpu")
        total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    nodes = clients(url)
    for node in nodes:
        node.flushall()
    before = cpu_s(nodes)
    written = run_writers(url, args.writers, args.seconds, args.batch, args.concurrency)
    used = cpu_s(nodes) - before
    for node in nodes:
        node.close()
    return {"results_per_s": written / args.seconds, "redis_cpu_us_per_result": 1e6 * used / max(written, 1)}


@contextlib.contextmanager
def servers() -> Iterator[dict[str, str]]:
    from tests import services as svc

    with contextlib.ExitStack() as stack:
        single = os.environ.get("FLEET_BENCH_REDIS_URL") or stack.enter_context(svc.redis_server())
        cluster = os.environ.get("FLEET_BENCH_REDIS_CLUSTER_URL") or stack.enter_context(svc.redis_cluster())
        yield {"redis": single, "cluster": cluster}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, default=4, help="writer processes per target")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one run")
    parser.add_argument("--batch", type=int, default=64, help="jobs per micro-batch")
    parser.add_argument("--concurrency", type=int, default=2, help="batches in flight per writer")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--writer", help=argparse.SUPPRESS)  # internal: run as one writer against this URL
    args = parser.parse_args()
    if args.writer:
        written = asyncio.run(write(args.writer, args.seconds, args.batch, args.concurrency))
        print(json.dumps({"written": written}))
        return
    runs: dict[str, list[dict[str, float]]] = {target: [] for target in TARGETS}
    with servers() as urls:
        for _ in range(args.repeats):
            for target in TARGETS:
                runs[target].append(measure(urls[target], args))
    best = {t: max(runs[t], key=lambda r: r["results_per_s"]) for t in TARGETS}
    ratio = best["cluster"]["results_per_s"] / best["redis"]["results_per_s"]
    rows = [(f"{t}: results/s ({args.writers} writers)", f"{best[t]['results_per_s']:,.0f}", "") for t in TARGETS]
    rows += [(f"{t}: Redis CPU per result", f"{best[t]['redis_cpu_us_per_result']:.1f} µs", "") for t in TARGETS]
    rows.append(("cluster / one Redis", f"{ratio:.2f}", ">= 2.0"))
    show("finished-record writes: 3-primary cluster vs one Redis", rows)
    results: dict[str, Any] = {"args": vars(args), "runs": runs, "best": best, "ratio": ratio}
    results["best_of"] = {t: best_of([r["results_per_s"] for r in runs[t]]) for t in TARGETS}
    print(f"wrote {write_result('cluster', results)}")


if __name__ == "__main__":
    main()
