"""Priorities under overload: latency of high, normal and low jobs on one worker offered more than it can do.

    python -m benchmarks.bench_priority [--broker nats|kafka|memory] [--seconds 6] [--overload 1.5] [--rounds 2]

One in-process ``Worker`` serves the ``sleep`` model (``--mean-ms`` per item, fixed) over the chosen broker and
Redis (the in-memory store with ``memory``). Its capacity is measured first (a burst of jobs, completions per
second, which is below ``1000 / mean_ms`` by the per-job overhead). An open-loop producer then publishes Poisson
arrivals at ``--overload`` x that measured capacity for ``--seconds``, a mix of
``--mix`` high / normal / low, each job on its level's subject; then every job is waited for. A job's latency is
its record's ``finished_at`` minus the time it was published.

Two setups alternate round by round (interleaved, so both see the same machine noise), each on a fresh model name:

* **priorities**: the jobs go to their levels, the worker takes higher levels first (weights ``6, 3, 1``);
* **fifo** (for comparison): the same arrivals, all published as ``normal``, labelled by the level they would have.

Target: with priorities, high p99 <= 0.2 x low p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import uuid
from typing import Any

from benchmarks.common import percentiles_ms, services, show, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobRecord
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore

LEVELS = c.PRIORITIES


def arrivals(rate_per_s: float, seconds: float, mix: tuple[float, ...], seed: int) -> list[tuple[float, str]]:
    """(offset in seconds, level) of Poisson arrivals at ``rate_per_s`` for ``seconds``; levels drawn by ``mix``."""
    rng, out, t = random.Random(seed), [], 0.0
    while (t := t + rng.expovariate(rate_per_s)) < seconds:
        out.append((t, rng.choices(LEVELS, weights=mix)[0]))
    return out


async def offer(
    broker: Broker, model: str, plan: list[tuple[float, str]], prioritised: bool, mean_ms: float
) -> dict[str, tuple[str, float]]:
    """Publish the plan open-loop (each job at its time, however far behind the worker is); job id -> (level, the
    unix time it was published)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    jobs: dict[str, tuple[str, float]] = {}
    sends: set[asyncio.Task[None]] = set()
    prefix = uuid.uuid4().hex[:8]
    for n, (at, level) in enumerate(plan):
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        job_id = f"{prefix}-{n}"
        published = level if prioritised else c.DEFAULT_PRIORITY
        body = RequestMessage(job_id=job_id, model=model, input={"mean_ms": mean_ms}, priority=published)
        jobs[job_id] = (level, body.submitted_at)
        data = body.model_dump_json().encode()
        task = asyncio.create_task(broker.publish(c.request_subject(model, published), data, msg_id=job_id))
        sends.add(task)
        task.add_done_callback(sends.discard)
    await asyncio.gather(*sends)
    return jobs


def new_worker(broker: Broker, store: ResultStore, settings: FleetSettings, args: argparse.Namespace) -> Worker:
    model = f"bprio-{uuid.uuid4().hex[:8]}"
    handler = with_name(SleepHandler, model)()
    return Worker(handler, broker, store, settings=settings, max_batch=args.max_batch, max_wait_ms=1)


async def wait_all(store: ResultStore, ids: list[str]) -> list[JobRecord]:
    records: list[JobRecord] = []
    for start in range(0, len(ids), 500):
        got = await asyncio.gather(*(store.wait(job_id, 600) for job_id in ids[start : start + 500]))
        for record in got:
            assert record is not None and record.state == "succeeded" and record.finished_at is not None, record
            records.append(record)
    return records


async def capacity(broker: Broker, store: ResultStore, settings: FleetSettings, args: argparse.Namespace) -> float:
    """Jobs per second the worker completes with a backlog: a burst's completion rate after its first fifth."""
    worker = new_worker(broker, store, settings, args)
    await worker.start()
    try:
        burst = int(3 * 1000 / args.mean_ms)
        jobs = await offer(broker, worker.model, [(0.0, "normal")] * burst, False, args.mean_ms)
        records = await wait_all(store, list(jobs))
    finally:
        await worker.stop()
    finished = sorted(r.finished_at or 0 for r in records)
    warm = len(finished) // 5  # the first fifth includes joining the group and the first fetches: not counted
    return (len(finished) - 1 - warm) / (finished[-1] - finished[warm])


async def one_round(
    broker: Broker, store: ResultStore, settings: FleetSettings, args: argparse.Namespace, rate: float, seed: int
) -> dict[str, dict[str, list[float]]]:
    """Both setups on the same arrivals (each on a fresh model, in turn, the order alternating by ``seed``):
    latencies in seconds per setup and level."""
    plan = arrivals(rate, args.seconds, tuple(args.mix), seed)
    out: dict[str, dict[str, list[float]]] = {}
    for side in ("priorities", "fifo") if seed % 2 else ("fifo", "priorities"):
        worker = new_worker(broker, store, settings, args)
        await worker.start()
        try:
            jobs = await offer(broker, worker.model, plan, side == "priorities", args.mean_ms)
            records = await wait_all(store, list(jobs))
        finally:
            await worker.stop()
        out[side] = latencies(jobs, records)
        print(f"{side}: " + ", ".join(f"{lv} {len(out[side][lv])}" for lv in LEVELS), flush=True)
    return out


def latencies(jobs: dict[str, tuple[str, float]], records: list[JobRecord]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {level: [] for level in LEVELS}
    for job_id, record in zip(jobs, records, strict=True):
        level, sent_at = jobs[job_id]
        out[level].append((record.finished_at or 0) - sent_at)
    return out


async def measure(settings: FleetSettings, args: argparse.Namespace) -> dict[str, Any]:
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    sides: dict[str, dict[str, list[float]]] = {side: {lv: [] for lv in LEVELS} for side in ("priorities", "fifo")}
    try:
        measured = await capacity(broker, store, settings, args)
        rate = measured * args.overload
        print(f"capacity {measured:.0f} jobs/s; offering {rate:.0f} jobs/s", flush=True)
        for r in range(args.rounds):
            got = await one_round(broker, store, settings, args, rate, seed=args.seed + r)
            for side, by_level in got.items():
                for level in LEVELS:
                    sides[side][level] += by_level[level]
    finally:
        await store.close()
        await broker.close()
    result: dict[str, Any] = {"capacity_per_s": measured, "offered_per_s": rate}
    for side, by_level in sides.items():
        stats = {level: {**percentiles_ms(values), "jobs": len(values)} for level, values in by_level.items()}
        result[side] = {**stats, "high_low_p99_ratio": stats["high"]["p99_ms"] / stats["low"]["p99_ms"]}
    result["target"] = 0.2
    return result


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for side in ("priorities", "fifo"):
        for level in LEVELS:
            s = result[side][level]
            out.append(
                (f"{side}: {level} p50 / p99 ms ({s['jobs']} jobs)", f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f}", "")
            )
        target = "<= 0.2" if side == "priorities" else ""
        out.append((f"{side}: high p99 / low p99", f"{result[side]['high_low_p99_ratio']:.3f}", target))
    return out


async def main(args: argparse.Namespace) -> None:
    with services(nats=args.broker == "nats", redis=args.broker != "memory", kafka=args.broker == "kafka") as urls:
        broker_url = urls.get(args.broker, "memory://")
        settings = FleetSettings(
            broker_url=broker_url, store_url=urls.get("redis", "memory://"), ack_wait_s=60, max_queued=0
        )
        result = await measure(settings, args)
    show(
        f"Priorities under {args.overload:g}x overload ({result['offered_per_s']:.0f} jobs/s offered to a worker doing "
        f"{result['capacity_per_s']:.0f}/s), {args.broker} broker "
        f"(mix high/normal/low {'/'.join(f'{m:g}' for m in args.mix)})",
        rows(result),
    )
    print(json.dumps(result))
    result["params"] = vars(args)
    print(f"wrote {write_result('priority', result)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", choices=["nats", "kafka", "memory"], default="nats")
    parser.add_argument("--seconds", type=float, default=6.0, help="arrivals last this long in each round")
    parser.add_argument("--overload", type=float, default=1.5, help="offered load / the worker's capacity")
    parser.add_argument("--mean-ms", type=float, default=2.0, help="service time of one job (fixed)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--mix", type=float, nargs=3, default=[0.2, 0.4, 0.4], help="shares of high, normal, low")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each setup (interleaved)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
