"""What ``POST /v1/jobs:batch`` saves: the time to submit N echo jobs as one batch against N single ``POST /v1/jobs``
(one at a time, as a plain loop does, and with ``--concurrency`` in flight).

    python -m benchmarks.bench_batch [--jobs 500] [--rounds 5] [--concurrency 32]

A real ``fleet gateway`` and a real ``fleet worker --model echo`` run on NATS + Redis (``FLEET_AUTH=off``). A client
in this process (the SDK, ``FleetClient``) submits ``--jobs`` jobs each way, every answer a 202 (the broker has the
request). Rounds interleave the three ways; the best round of each is compared. The ratio reported is the time of
the N single POSTs over the time of the batch (how many times faster the batch is).

Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests. Writes
``benchmarks/results/bench_batch.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from benchmarks.bench_dashboard import wait_ready
from benchmarks.common import RESULTS_DIR, services, show, stop_processes, write_result
from fleet.producers.sdk import FleetClient
from tests.processes import fleet_argv, fleet_env
from tests.services import die_with_parent, free_port

LOG_DIR = RESULTS_DIR / "bench_batch_logs"
WAYS = ("single, one at a time", "single, concurrent", "batch")


@contextlib.contextmanager
def fleet(urls: dict[str, str], port: int) -> Iterator[str]:
    """An echo worker and a gateway, as processes; yields the gateway's URL once it sees the worker."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {"FLEET_BROKER_URL": urls["nats"], "FLEET_STORE_URL": urls["redis"], "FLEET_MODELS": "echo"}
    env["FLEET_LOG_LEVEL"] = "WARNING"
    runs = [("worker", ["worker", "--model", "echo"], {}), ("gateway", ["gateway"], {"FLEET_PORT": str(port)})]
    procs = []
    try:
        for name, args, extra in runs:
            with (LOG_DIR / f"{name}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        fleet_argv(*args),
                        env=fleet_env(**env, **extra),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        preexec_fn=die_with_parent,
                    )
                )
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, procs, timeout_s=300)
        yield base
    finally:
        stop_processes(procs)


async def seconds(base: str, way: str, jobs: int, concurrency: int) -> float:
    """Wall time to have ``jobs`` echo jobs accepted ``way``."""
    run = uuid.uuid4().hex[:8]
    bodies = [{"model": "echo", "input": {"i": i}, "job_id": f"batch-{run}-{i}"} for i in range(jobs)]
    async with FleetClient(base, timeout_s=60) as client:
        started = time.perf_counter()
        if way == "batch":
            answer = await client.submit_many(bodies)
            assert answer.accepted == jobs, answer.items[0]
        else:
            pending = iter(bodies)

            async def one_at_a_time() -> None:
                for body in pending:
                    await client.submit(body["model"], body["input"], job_id=body["job_id"])

            await asyncio.gather(*(one_at_a_time() for _ in range(1 if way == WAYS[0] else concurrency)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with services() as urls, fleet(urls, free_port()) as base:
        for way in WAYS:  # warm up: connections, imports
            asyncio.run(seconds(base, way, min(100, args.jobs), args.concurrency))
        for _ in range(args.rounds):
            for way in WAYS:
                times[way].append(asyncio.run(seconds(base, way, args.jobs, args.concurrency)))
    best = {way: min(times[way]) for way in WAYS}
    sequential, concurrent, batch = (best[way] for way in WAYS)
    results = {
        "jobs": args.jobs,
        "concurrency": args.concurrency,
        "seconds": times,
        "best_seconds": best,
        "ratio_sequential_over_batch": sequential / batch,
        "ratio_concurrent_over_batch": concurrent / batch,
    }
    path = write_result("bench_batch", results, args.out)
    show(
        f"{args.jobs} echo jobs submitted: one batch against single POSTs (NATS + Redis, best of {args.rounds})",
        [
            ("single POSTs, one at a time", f"{sequential * 1000:.0f} ms", ""),
            (f"single POSTs, {args.concurrency} in flight", f"{concurrent * 1000:.0f} ms", ""),
            ("one POST /v1/jobs:batch", f"{batch * 1000:.0f} ms", ""),
            ("singles one at a time / batch", f"{sequential / batch:.1f}x", "> 1"),
            (f"singles {args.concurrency} in flight / batch", f"{concurrent / batch:.2f}x", ""),
        ],
    )
    print(f"all rounds (s): { {w: [round(t, 3) for t in ts] for w, ts in times.items()} }; {path}")


if __name__ == "__main__":
    main()
