"""Fleet's ``echo`` worker against a peer: a minimal FastStream NATS subscriber, side by side on the same servers.

    python -m benchmarks.bench_peers [--jobs 20000] [--batch 64] [--rounds 3]

Both sides drain the same prefilled backlog (``--jobs`` request messages of the same bytes: Fleet's wire
``RequestMessage`` for ``echo``, published with a ``Nats-Msg-Id``, to a file-backed work-queue JetStream stream)
from the same nats-server into the same redis-server, in this one process, in interleaved rounds (the order of the
two sides alternates from round to round; the best round of each is kept, and the median of the rounds' own
ratios is printed beside it: a round slowed by other load on the machine slows both of its sides):

* **peer**: FastStream's JetStream pull subscriber, ``PullSub(batch_size=64, batch=True)``: its handler gets 64
  decoded messages at once, builds each one's result record (the same fields and size as Fleet's terminal record:
  ids, state, the echoed input, times, worker id; orjson), writes them in one Redis pipeline (``SET`` with the
  job TTL, no transaction), and returns; FastStream then acks the batch. That is all: no running state, no
  duplicate or cancel check, no attempt count, no dead letters, no completion notice, no heartbeats.
* **fleet**: one in-process ``Worker`` for ``echo`` (``fleet worker --model echo`` minus the process), batch 64,
  every guarantee on: admission (parse, validate; the requests come from ``publish_all``, which says they have no
  record, so none is read first), the compare-and-set to ``running`` (it finds a record that exists after all), the
  terminal compare-and-set with its completion notice, acks only once the result is stored, dead letters.

Each round times the drain from the moment the side starts consuming until the last result is in Redis (the peer:
its handler stored ``--jobs`` results; Fleet: the group's backlog is 0 and the last record is terminal), and
the CPU time this process used meanwhile (``time.process_time``; the servers' CPU is not in it): on a shared
machine the CPU per job moves less than the wall clock. Bytes per result is ``STRLEN`` of the last job's key on
each side. Services come from FLEET_BENCH_{NATS,REDIS}_URL or
are started as in the tests. Writes ``benchmarks/results/peers.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import nats
import orjson
import redis.asyncio as aioredis
from faststream.nats import JStream, NatsBroker, PullSub
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType

from benchmarks.common import best_of, paired_median, pooled, services, show, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker, new_worker_id
from fleet.producers.publish import publish_all
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store

SIDES = ("peer", "fleet")
TITLES = {"peer": "FastStream batch subscriber (no guarantees)", "fleet": "Fleet echo worker (every guarantee)"}


def requests_for(model: str, n: int) -> list[RequestMessage]:
    """The payloads both sides drain: the same as ``bench_pipeline``'s."""
    return [
        RequestMessage(job_id=uuid.uuid4().hex, model=model, input={"i": i, "text": "hello fleet"}) for i in range(n)
    ]


def peer_record(request: dict[str, Any], worker_id: str, started_at: float) -> bytes:
    """The peer's result: the fields Fleet's terminal ``echo`` record has (nulls left out, as Fleet does)."""
    return orjson.dumps(
        {
            "job_id": request["job_id"],
            "model": request["model"],
            "state": "succeeded",
            "output": request["input"],
            "created_at": started_at,
            "started_at": started_at,
            "finished_at": time.time(),
            "deliveries": 1,
            "worker_id": worker_id,
        }
    )


async def peer_run(urls: dict[str, str], args: argparse.Namespace, redis: aioredis.Redis) -> dict[str, Any]:
    """Prefill a stream of our own, then drain it with the FastStream subscriber; jobs/s and bytes per result."""
    token = uuid.uuid4().hex[:8]
    model, stream, subject = f"echo-{token}", f"PEER_{token}", f"peer.{token}"
    messages = requests_for(model, args.jobs)
    nc = await nats.connect(urls["nats"])
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE)
    payloads = [(m.job_id, m.model_dump_json().encode()) for m in messages]

    async def publish_one(item: tuple[str, bytes]) -> None:
        await js.publish(subject, item[1], headers={c.HEADER_MSG_ID: item[0]})

    await pooled(payloads, 256, publish_one)
    stored, done = 0, asyncio.Event()
    worker_id = new_worker_id(model)  # the same form as a Fleet worker's id: records of the same size
    ttl = FleetSettings().job_ttl_s
    broker = NatsBroker(urls["nats"], logger=None)  # no log lines per batch (Fleet logs none either)
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=20_000)
    pull = PullSub(batch_size=args.batch, timeout=args.max_wait_ms / 1000, batch=True)

    @broker.subscriber(
        subject, stream=JStream(stream, declare=False), durable=f"peer-{token}", config=config, pull_sub=pull
    )
    async def handle(requests: list[dict[str, Any]]) -> None:
        nonlocal stored
        now = time.time()
        pipe = redis.pipeline(transaction=False)
        for request in requests:
            pipe.set(c.job_key(request["job_id"]), peer_record(request, worker_id, now), ex=ttl)
        await pipe.execute()
        stored += len(requests)
        if stored >= args.jobs:
            done.set()

    try:
        started, cpu0 = time.perf_counter(), time.process_time()
        await broker.start()
        async with asyncio.timeout(600):
            await done.wait()
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu0
    finally:
        await broker.stop()
    strlen = int(await redis.strlen(c.job_key(messages[-1].job_id)))
    await js.delete_stream(stream)
    await nc.close()
    return {"jobs_per_s": args.jobs / seconds, "cpu_us": 1e6 * cpu_s / args.jobs, "strlen": strlen}


async def fleet_run(urls: dict[str, str], args: argparse.Namespace, redis: aioredis.Redis) -> dict[str, Any]:
    """Prefill the model's request subject, then drain it with one ``echo`` worker; jobs/s and bytes per result."""
    settings = FleetSettings(
        broker_url=urls["nats"], store_url=urls["redis"], max_batch=args.batch, max_wait_ms=args.max_wait_ms
    )
    model = f"echo-{uuid.uuid4().hex[:8]}"
    handler = with_name(EchoHandler, model)()
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        await broker.ensure_model(model)
        messages = requests_for(model, args.jobs)
        await publish_all(broker, messages, concurrency=256)
        started, cpu0 = time.perf_counter(), time.process_time()
        async with Worker(handler, broker, store, settings=settings):
            while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled
                await asyncio.sleep(0.02)
            record = await store.wait(messages[-1].job_id, 60)
            seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu0
        assert record is not None and record.state == "succeeded", record
        strlen = int(await redis.strlen(c.job_key(messages[-1].job_id)))
    finally:
        await store.close()
        await broker.close()
    return {"jobs_per_s": args.jobs / seconds, "cpu_us": 1e6 * cpu_s / args.jobs, "strlen": strlen}


RUNS = {"peer": peer_run, "fleet": fleet_run}


async def main(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with services(nats=True, redis=True) as urls:
        redis = aioredis.Redis.from_url(urls["redis"])
        try:
            warm = argparse.Namespace(**{**vars(args), "jobs": 2000})
            for side in SIDES:
                await RUNS[side](urls, warm, redis)
            for round_ in range(args.rounds):
                for side in SIDES if round_ % 2 == 0 else reversed(SIDES):
                    runs[side].append(await RUNS[side](urls, args, redis))
                    print(f"round {round_ + 1} {side}: {runs[side][-1]['jobs_per_s']:,.0f} jobs/s", flush=True)
        finally:
            with contextlib.suppress(Exception):
                await redis.aclose()
    rate = {side: best_of([r["jobs_per_s"] for r in rs]) for side, rs in runs.items()}
    medians = {side: sorted(r["jobs_per_s"] for r in rs)[len(rs) // 2] for side, rs in runs.items()}
    ratios = {
        "fleet_over_peer": rate["fleet"] / rate["peer"],
        "fleet_over_peer_medians": medians["fleet"] / medians["peer"],
        "fleet_over_peer_paired": paired_median(
            [r["jobs_per_s"] for r in runs["fleet"]], [r["jobs_per_s"] for r in runs["peer"]]
        ),
    }
    rows = [(f"{TITLES[s]}: jobs/s (best; median)", f"{rate[s]:,.0f}; {medians[s]:,.0f}", "") for s in SIDES]
    cpu = {side: min(r["cpu_us"] for r in rs) for side, rs in runs.items()}
    rows += [(f"{TITLES[s]}: process CPU µs / job (least)", f"{cpu[s]:.1f}", "") for s in SIDES]
    rows += [(f"{TITLES[s]}: bytes / result", f"{runs[s][-1]['strlen']:,}", "") for s in SIDES]
    rows += [
        ("ratio fleet / peer (best)", f"{ratios['fleet_over_peer']:.2f}", ">= 1.0 (issue 14)"),
        ("ratio fleet / peer (medians)", f"{ratios['fleet_over_peer_medians']:.2f}", ""),
        ("ratio fleet / peer (median of rounds)", f"{ratios['fleet_over_peer_paired']:.2f}", ""),
    ]
    show(f"Fleet vs FastStream over NATS + Redis ({args.jobs:,} jobs, batch {args.batch}, {args.rounds} rounds)", rows)
    results = {"runs": runs, "jobs_per_s": rate, "median_jobs_per_s": medians, "cpu_us": cpu, "ratios": ratios}
    results["params"] = vars(args)
    print(json.dumps({"jobs_per_s": rate, "median_jobs_per_s": medians, "ratios": ratios}))
    print(f"wrote {write_result('peers', results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="both sides' wait for a batch to fill")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both sides; the best is kept")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
