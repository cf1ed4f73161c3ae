"""Live load-balancing benchmark: a real fleet of ``sleep`` workers, every policy side by side, open-loop load.

    python -m benchmarks.bench_dispatch [--policies all] [--loads 0.5,0.7,0.9] [--seconds 15] [--mean-ms 40]

By default 8 ``fleet worker --model sleep`` processes serve near-constant service times (lognormal, sigma 0.1,
mean ``--mean-ms``), two of them three times slower (``--slowness 3``). Capacity is the sum of the workers' rates.
Each policy runs with ``--dispatchers`` real ``fleet dispatcher`` processes and the workers in ``dispatch``
routing; ``pull`` is the baseline, the same workers competing on the broker. For each load, requests are published
open-loop at Poisson times (rate = load x capacity) for ``--seconds``; every result is awaited, the first 10 % of
each point is discarded as warm-up, and response time is the job's ``finished_at`` minus its publish time.

Writes ``benchmarks/results/bench_dispatch.json`` and ``bench_dispatch.png`` (P99 and P99/P50 against load).
Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started locally as in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from benchmarks.common import RESULTS_DIR, console, record, services, stop_processes, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.brokers.events import validated
from fleet.schemas.wire import DispatcherBeat, Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from tests.processes import fleet_argv, fleet_env

MODEL = "sleep"
DISPATCH_POLICIES = list(c.DISPATCH_POLICIES)
ALL_POLICIES = [*DISPATCH_POLICIES, "pull"]
LOG_DIR = RESULTS_DIR / "bench_dispatch_logs"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="all", help="comma list, or 'all': " + ", ".join(ALL_POLICIES))
    p.add_argument("--loads", default="0.5,0.7,0.9", help="fractions of capacity")
    p.add_argument("--seconds", type=float, default=15.0, help="length of the load at each point")
    p.add_argument("--mean-ms", type=float, default=40.0, help="mean service time of a normal-speed worker")
    p.add_argument("--sigma", type=float, default=0.1, help="lognormal shape of the service time")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slow", type=int, default=2, help="how many of the workers are slow")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--dispatchers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.policies = ALL_POLICIES if args.policies == "all" else [x.strip() for x in args.policies.split(",")]
    unknown = sorted(set(args.policies) - set(ALL_POLICIES))
    if unknown:
        p.error(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    args.loads = [float(x) for x in args.loads.split(",")]
    if any(not 0 < load < 1.2 for load in args.loads):
        p.error("loads are fractions of capacity, e.g. 0.5,0.7,0.9")
    return args


class Fleet:
    """Worker and dispatcher processes on one broker and store."""

    def __init__(self, urls: dict[str, str], args: argparse.Namespace) -> None:
        self.args = args
        self.env = {
            "FLEET_BROKER_URL": urls["nats"],
            "FLEET_STORE_URL": urls["redis"],
            "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
            "FLEET_ACK_WAIT_S": "10",
            "FLEET_LOG_LEVEL": "WARNING",
        }
        self.workers: list[subprocess.Popen[bytes]] = []
        self.dispatchers: list[subprocess.Popen[bytes]] = []
        LOG_DIR.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        with (LOG_DIR / f"{name}.log").open("wb") as log:
            return subprocess.Popen(fleet_argv(*argv), env=fleet_env(**self.env), stdout=log, stderr=subprocess.STDOUT)

    def start_workers(self, routing: str) -> None:
        a = self.args
        for i in range(a.workers):
            slow = i < a.slow
            worker_id = f"{'slow' if slow else 'fast'}-{i}-{routing}-{uuid.uuid4().hex[:4]}"
            argv = ["worker", "--model", MODEL, "--routing", routing, "--max-batch", "1", "--max-wait-ms", "0"]
            argv += ["--slowness", str(a.slow_factor if slow else 1.0), "--worker-id", worker_id]
            self.workers.append(self._spawn(worker_id, *argv))

    def start_dispatchers(self, policy: str) -> None:
        for i in range(self.args.dispatchers):
            argv = ["dispatcher", "--model", MODEL, "--policy", policy, "--port", "0"]
            self.dispatchers.append(self._spawn(f"dispatcher-{policy}-{i}", *argv))

    def stop_workers(self) -> None:
        stop_processes(self.workers)
        self.workers.clear()

    def stop_dispatchers(self) -> None:
        stop_processes(self.dispatchers)
        self.dispatchers.clear()

    def check_alive(self) -> None:
        dead = [p.args for p in (*self.workers, *self.dispatchers) if p.poll() is not None]
        if dead:
            raise SystemExit(f"a fleet process exited early; see {LOG_DIR}: {dead[0]!r}")


@contextlib.contextmanager
def fleet_of(urls: dict[str, str], args: argparse.Namespace) -> Iterator[Fleet]:
    fleet = Fleet(urls, args)
    try:
        yield fleet
    finally:
        fleet.stop_dispatchers()
        fleet.stop_workers()


async def wait_for(check: Any, what: str, fleet: Fleet, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        fleet.check_alive()
        await asyncio.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}; logs in {LOG_DIR}")


class Watch:
    """Worker and dispatcher heartbeats, to know when the fleet is ready."""

    def __init__(self) -> None:
        self.workers: dict[str, Heartbeat] = {}
        self.dispatchers: dict[str, DispatcherBeat] = {}
        self.streams: list[Any] = []

    async def run(self, broker: Broker) -> None:
        beats = await broker.listen(c.heartbeat_subject(MODEL))
        dbeats = await broker.listen(c.dispatcher_subject(MODEL))
        self.streams = [beats, dbeats]
        await asyncio.gather(self._workers(beats), self._dispatchers(dbeats))

    async def close(self) -> None:
        """Close the streams (their iterators end); cancelling a NATS read is not reliable."""
        for stream in self.streams:
            await stream.close()

    async def _workers(self, stream: Any) -> None:
        async for beat in validated(stream, Heartbeat, "worker heartbeat"):
            self.workers[beat.worker_id] = beat

    async def _dispatchers(self, stream: Any) -> None:
        async for dbeat in validated(stream, DispatcherBeat, "dispatcher heartbeat"):
            self.dispatchers[dbeat.dispatcher_id] = dbeat

    def ready_workers(self, routing: str) -> int:
        return sum(1 for b in self.workers.values() if b.state == "ready" and b.routing == routing)

    def ready_dispatchers(self, policy: str, workers: int) -> int:
        return sum(
            1
            for b in self.dispatchers.values()
            if b.state == "ready" and b.policy == policy and b.live_workers >= workers
        )


async def run_point(broker: Broker, store: ResultStore, args: argparse.Namespace, load: float, rng: random.Random):
    capacity = (args.workers - args.slow + args.slow / args.slow_factor) * 1000 / args.mean_ms  # jobs/s
    rate = load * capacity
    payload = {"mean_ms": args.mean_ms, "distribution": "lognormal", "sigma": args.sigma}
    sent: dict[str, float] = {}
    tasks: set[asyncio.Task[None]] = set()
    subject = c.request_subject(MODEL)

    async def publish(job_id: str) -> None:
        body = RequestMessage(job_id=job_id, model=MODEL, input=payload).model_dump_json().encode()
        sent[job_id] = time.time()
        await broker.publish(subject, body, msg_id=job_id)

    start = time.monotonic()
    next_at = start
    n = 0
    while next_at - start < args.seconds:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        task = asyncio.create_task(publish(f"bd-{uuid.uuid4().hex[:12]}-{n}"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    ids = list(sent)
    records = await asyncio.gather(*(store.wait(j, 300) for j in ids))
    done = [(j, r) for j, r in zip(ids, records, strict=True) if r is not None and r.finished_at is not None]
    if len(done) < len(ids):
        raise SystemExit(f"{len(ids) - len(done)} jobs did not finish at load {load}")
    kept = done[len(done) // 10 :]  # warm-up
    latencies = sorted((r.finished_at or 0) - sent[j] for j, r in kept)
    span = max(r.finished_at or 0 for _, r in done) - min(sent.values())
    by_worker: dict[str, int] = {}
    for _, r in kept:
        kind = (r.worker_id or "?").split("-")[0]
        by_worker[kind] = by_worker.get(kind, 0) + 1
    return summarize(latencies, len(done) / span, rate, by_worker)


def summarize(latencies_s: list[float], throughput: float, offered: float, by_worker: dict[str, int]) -> dict[str, Any]:
    def pct(q: float) -> float:
        return 1000 * latencies_s[min(len(latencies_s) - 1, round(q * (len(latencies_s) - 1)))]

    p50, p99 = pct(0.5), pct(0.99)
    total = sum(by_worker.values())
    return {
        "jobs": len(latencies_s),
        "offered_per_s": round(offered, 1),
        "throughput_per_s": round(throughput, 1),
        "mean_ms": round(1000 * statistics.fmean(latencies_s), 2),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
        "p99_over_p50": round(p99 / p50, 3),
        "slow_worker_share": round(by_worker.get("slow", 0) / total, 4) if total else None,
    }


async def run(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = FleetSettings(broker_url=urls["nats"], store_url=urls["redis"])
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    watch = Watch()
    watcher = asyncio.create_task(watch.run(broker))
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    try:
        with fleet_of(urls, args) as fleet:
            for routing, policies in (("dispatch", [p for p in args.policies if p != "pull"]), ("pull", ["pull"])):
                policies = [p for p in policies if p in args.policies]
                if not policies:
                    continue
                fleet.start_workers(routing)
                await wait_for(lambda r=routing: watch.ready_workers(r) >= args.workers, "workers", fleet)
                for policy in policies:
                    rows += await run_policy(fleet, watch, broker, store, args, policy, rng)
                fleet.stop_workers()
                watch.workers.clear()
    finally:
        await watch.close()
        await asyncio.wait_for(asyncio.gather(watcher, return_exceptions=True), 5)
        await store.close()
        await broker.close()
    return rows


async def run_policy(fleet: Fleet, watch: Watch, broker: Broker, store: ResultStore, args, policy: str, rng):
    rows = []
    if policy != "pull":
        watch.dispatchers.clear()
        fleet.start_dispatchers(policy)
        await wait_for(
            lambda: watch.ready_dispatchers(policy, args.workers) >= args.dispatchers, f"{policy} dispatchers", fleet
        )
    for load in args.loads:
        result = await run_point(broker, store, args, load, rng)
        row = {"policy": policy, "load": load, **result}
        rows.append(row)
        console.print(
            f"{policy:>18} load {load:.2f}: p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:8.1f} ms  "
            f"p99/p50 {row['p99_over_p50']:6.2f}  {row['throughput_per_s']:6.1f}/s  "
            f"slow share {row['slow_worker_share']}"
        )
    if policy != "pull":
        fleet.stop_dispatchers()
    return rows


def show_table(rows: list[dict[str, Any]]) -> None:
    table = Table(title="Response time per policy and load (ms)")
    for col in ("policy", "load", "mean", "p50", "p99", "p99/p50", "jobs/s", "slow share"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['load']:.2f}",
            f"{r['mean_ms']:.1f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['p99_over_p50']:.2f}",
            f"{r['throughput_per_s']:.1f}",
            f"{r['slow_worker_share']:.3f}",
        )
    console.print(table)
    points = [
        (f"{r['policy']} at {r['load']:.0%} load: p99 ms, p99/p50", f"{r['p99_ms']:.1f}, {r['p99_over_p50']:.2f}", "")
        for r in rows
    ]
    record("Response time per policy and load (ms)", points)


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def get(policy: str, load: float) -> dict[str, Any] | None:
        return next((r for r in rows if r["policy"] == policy and abs(r["load"] - load) < 1e-9), None)

    out: dict[str, Any] = {}
    amnesia70, amnesia90, random90 = get("jiq-amnesia", 0.7), get("jiq-amnesia", 0.9), get("random", 0.9)
    if amnesia70:
        out["jiq_amnesia_p99_over_p50_at_0.7"] = amnesia70["p99_over_p50"]
    if amnesia90 and random90:
        out["random_p99_over_jiq_amnesia_p99_at_0.9"] = round(random90["p99_ms"] / amnesia90["p99_ms"], 2)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        loads = [r["load"] for r in mine]
        left.plot(loads, [r["p99_ms"] for r in mine], marker="o", label=policy)
        right.plot(loads, [r["p99_over_p50"] for r in mine], marker="o", label=policy)
    left.set(xlabel="load (fraction of capacity)", ylabel="P99 response time (ms)", yscale="log", title="P99")
    right.set(xlabel="load (fraction of capacity)", ylabel="P99 / P50", yscale="log", title="Tail ratio")
    right.axhline(1.5, color="grey", linestyle="--", linewidth=1)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    with services(nats=True, redis=True) as urls:
        rows = asyncio.run(run(urls, args))
    show_table(rows)
    summary = targets(rows)
    console.print(summary)
    path = write_result("bench_dispatch", {"config": {**vars(args)}, "rows": rows, "targets": summary})
    plot(rows, path.with_suffix(".png"))
    console.print(f"results: {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
