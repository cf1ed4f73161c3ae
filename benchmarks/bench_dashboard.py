"""What open operator streams cost the gateway: job throughput with 0 and with 50 ``/v1/operator/stream`` readers.

    python -m benchmarks.bench_dashboard [--jobs N] [--streams 50] [--rounds 3] [--concurrency 32]

A real ``fleet gateway`` process and a real ``fleet worker --model echo`` process run on NATS + Redis. A client
in this process (the SDK, ``FleetClient``) submits ``--jobs`` echo jobs (``POST /v1/jobs``) and long-polls each
result (``GET /v1/jobs/{id}?wait=``) with ``--concurrency`` in flight; the rate is jobs per second from the first
submit to the last result. Each round runs once without streams and once with ``--streams`` dashboard streams
held open and read by a separate process (so reading them costs this client nothing), interleaved; the best of the
rounds of each side is compared. The target: the streams cost under 5 % of the throughput.

Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests. Writes
``benchmarks/results/bench_dashboard.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, best_of, services, show, stop_processes, write_result
from fleet.producers.sdk import FleetClient, GatewayUnreachable
from tests.processes import fleet_argv, fleet_env
from tests.services import die_with_parent, free_port

LOG_DIR = RESULTS_DIR / "bench_dashboard_logs"
TARGET_COST = 0.05


@contextlib.contextmanager
def fleet(urls: dict[str, str], port: int) -> Iterator[str]:
    """A gateway and an echo worker as processes; yields the gateway's URL once a worker is ready."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = fleet_env(
        FLEET_BROKER_URL=urls["nats"],
        FLEET_STORE_URL=urls["redis"],
        FLEET_MODELS="echo",
        FLEET_PORT=str(port),
        FLEET_LOG_LEVEL="WARNING",
    )
    procs = []
    for name, args in (("gateway", ["gateway"]), ("worker", ["worker", "--model", "echo"])):
        with (LOG_DIR / f"{name}.log").open("wb") as out:
            procs.append(
                subprocess.Popen(
                    fleet_argv(*args), env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                )
            )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, procs)
        yield base
    finally:
        stop_processes(procs)


def wait_ready(base: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a fleet process exited; see {LOG_DIR}")
        with contextlib.suppress(httpx.HTTPError):
            ready = httpx.get(f"{base}/readyz", timeout=1).json()
            if ready.get("models", {}).get("echo", {}).get("ready_workers", 0) > 0:
                return
        time.sleep(0.3)
    raise SystemExit(f"the gateway or the worker did not get ready within {timeout_s:.0f}s; see {LOG_DIR}")


RETRIES = 3


TRANSPORT_RETRIES = [0]


async def _retried(call: Callable[[], Awaitable[Any]]) -> Any:
    """One SDK call, retried on a dropped connection (the bench's job ids make a repeated submit idempotent)."""
    for attempt in range(RETRIES):
        try:
            return await call()
        except GatewayUnreachable:
            TRANSPORT_RETRIES[0] += 1
            if attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")


async def throughput(base: str, jobs: int, concurrency: int) -> float:
    """Jobs per second, submit to result, with ``concurrency`` jobs in flight, through the SDK (``FleetClient``:
    its aiohttp connections cost the client little, so the gateway is what bounds the rate)."""
    run = uuid.uuid4().hex[:8]
    async with FleetClient(base, timeout_s=30) as client:
        pending = iter(range(jobs))

        async def one_at_a_time() -> None:
            for i in pending:
                job_id = f"bench-{run}-{i}"
                await _retried(lambda: client.submit("echo", {"i": i}, job_id=job_id))  # noqa: B023
                record = await _retried(lambda: client.wait(job_id, 30))  # noqa: B023
                if record.state != "succeeded":
                    raise SystemExit(f"job {job_id} ended {record.state}: {record}")

        started = time.perf_counter()
        await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))
        return jobs / (time.perf_counter() - started)


@contextlib.contextmanager
def streams_open(base: str, count: int) -> Iterator[None]:
    """``count`` dashboard streams held open and read by a child process (``--hold-streams``)."""
    argv = [sys.executable, "-m", "benchmarks.bench_dashboard", "--hold-streams", str(count), "--url", base]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if line != f"open {count}":
            raise SystemExit(f"the stream holder said {line!r}")
        yield
    finally:
        proc.terminate()
        proc.wait(10)


async def hold_streams(base: str, count: int) -> None:
    """Open ``count`` streams, say so once each has its first snapshot, and read them until killed."""
    opened = asyncio.Event()
    ready = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal ready
        async with client.stream("GET", "/v1/operator/stream") as response:
            response.raise_for_status()
            first = True
            async for _chunk in response.aiter_bytes():
                if first:
                    first = False
                    ready += 1
                    if ready == count:
                        opened.set()

    limits = httpx.Limits(max_connections=count + 1)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(count)]
        await opened.wait()
        print(f"open {count}", flush=True)
        await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hold-streams", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.hold_streams:
        asyncio.run(hold_streams(args.url, args.hold_streams))
        return
    without, with_streams = [], []
    with services() as urls, fleet(urls, free_port()) as base:
        asyncio.run(throughput(base, min(500, args.jobs), args.concurrency))  # warm up: connections, caches
        for _ in range(args.rounds):
            without.append(asyncio.run(throughput(base, args.jobs, args.concurrency)))
            with streams_open(base, args.streams):
                with_streams.append(asyncio.run(throughput(base, args.jobs, args.concurrency)))
    base_rate, streamed_rate = best_of(without), best_of(with_streams)
    cost = 1 - streamed_rate / base_rate
    results = {
        "jobs": args.jobs,
        "streams": args.streams,
        "concurrency": args.concurrency,
        "without_streams_jobs_per_s": without,
        "with_streams_jobs_per_s": with_streams,
        "best_without": base_rate,
        "best_with": streamed_rate,
        "ratio_with_over_without": streamed_rate / base_rate,
        "median_ratio": statistics.median(with_streams) / statistics.median(without),
        "cost": cost,
        "target_cost": TARGET_COST,
        "transport_retries": TRANSPORT_RETRIES[0],
    }
    path = write_result("bench_dashboard", results, args.out)
    show(
        f"gateway job throughput with {args.streams} open dashboard streams (NATS + Redis, echo)",
        [
            ("without streams (best of rounds)", f"{base_rate:.0f} jobs/s", ""),
            (f"with {args.streams} streams (best of rounds)", f"{streamed_rate:.0f} jobs/s", ""),
            ("ratio with / without", f"{streamed_rate / base_rate:.3f}", f">= {1 - TARGET_COST:.2f}"),
            ("ratio of the medians", f"{statistics.median(with_streams) / statistics.median(without):.3f}", ""),
            ("cost", f"{100 * cost:.1f} %", f"< {100 * TARGET_COST:.0f} %"),
        ],
    )
    print(
        f"all rounds: without {[round(r) for r in without]}, with {[round(r) for r in with_streams]}; "
        f"{TRANSPORT_RETRIES[0]} requests retried after a dropped connection; {path}"
    )


if __name__ == "__main__":
    main()
