"""(a) echo throughput through the fleet over NATS vs a raw nats-py JetStream publish + fetch + ack loop, and
(d) end-to-end p50/p99 latency through the fleet at about 70 % of its saturation throughput.

    python -m benchmarks.bench_pipeline [--messages 20000] [--batch 64]

Both sides run in this one process, on the same NATS server, with the same payloads, batch size and number of
publishes in flight; the fleet side also moves every job to running and writes its result to Redis before acking.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from typing import Any

import nats

from benchmarks.common import Timer, best_of, percentiles_ms, services, show, write_results
from consumers.handlers import with_name as renamed
from consumers.handlers.echo import EchoHandler
from consumers.worker import Worker
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.settings import FleetSettings
from fleet.store import make_store
from producers.publish import publish_all
from schemas.wire import RequestMessage


def requests_for(model: str, n: int) -> list[RequestMessage]:
    return [
        RequestMessage(job_id=uuid.uuid4().hex, model=model, input={"i": i, "text": "hello fleet"}) for i in range(n)
    ]


async def raw_jetstream(nats_url: str, n: int, batch: int, concurrency: int) -> float:
    """Messages per second of a bare JetStream producer + pull consumer that acks every message."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    token = uuid.uuid4().hex[:8]
    stream, subject = f"RAW_{token}", f"raw.{token}"
    await js.add_stream(name=stream, subjects=[subject])
    psub = await js.pull_subscribe(subject, durable=f"raw-{token}", stream=stream)
    payloads = [m.model_dump_json().encode() for m in requests_for("raw", n)]
    slots = asyncio.Semaphore(concurrency)

    async def publish_one(i: int) -> None:
        async with slots:
            await js.publish(subject, payloads[i], headers={"Nats-Msg-Id": f"{token}-{i}"})

    async def consume() -> None:
        done = 0
        while done < n:
            try:
                msgs = await psub.fetch(batch, timeout=1)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
            done += len(msgs)

    with Timer() as t:
        await asyncio.gather(consume(), *(publish_one(i) for i in range(n)))
    await js.delete_stream(stream)
    await nc.close()
    return n / t.seconds


async def fleet_echo(settings: FleetSettings, n: int, concurrency: int) -> tuple[float, FleetSettings]:
    """Jobs per second through publish → worker (running, echo, result to Redis) → ack."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"echo-{uuid.uuid4().hex[:8]}"
    handler = renamed(EchoHandler, model)()
    try:
        async with Worker(handler, broker, store, settings=settings):
            messages = requests_for(model, n)
            with Timer() as t:
                await publish_all(broker, messages, concurrency=concurrency)
                while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled: no event
                    await asyncio.sleep(0.02)
            last = await store.get(messages[-1].job_id)
            assert last is not None and last.state == "succeeded", last
    finally:
        await store.close()
        await broker.close()
    return n / t.seconds, settings


async def latency_at(settings: FleetSettings, rate_per_s: float, duration_s: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate_per_s``; end-to-end latency from the publish call to the stored result."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"echo-{uuid.uuid4().hex[:8]}"
    rng = random.Random(7)
    sent: dict[str, float] = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        async with Worker(renamed(EchoHandler, model)(), broker, store, settings=settings):
            loop = asyncio.get_running_loop()
            start = loop.time()
            next_at = start
            while next_at - start < duration_s:
                next_at += rng.expovariate(rate_per_s)
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                msg = requests_for(model, 1)[0]
                sent[msg.job_id] = time.time()
                data = msg.model_dump_json().encode()
                tasks.append(asyncio.create_task(broker.publish(c.request_subject(model), data, msg_id=msg.job_id)))
            await asyncio.gather(*tasks)
            records = await asyncio.gather(*(store.wait(job_id, 30) for job_id in sent))
    finally:
        await store.close()
        await broker.close()
    latencies = [r.finished_at - sent[r.job_id] for r in records if r is not None and r.finished_at]
    return {"rate_per_s": rate_per_s, "jobs": len(sent), "completed": len(latencies), **percentiles_ms(latencies)}


async def main(args: argparse.Namespace) -> None:
    with services() as urls:
        settings = FleetSettings(
            broker_url=urls["nats"], store_url=urls["redis"], max_batch=args.batch, max_wait_ms=args.max_wait_ms
        )
        raw_runs, fleet_runs = [], []
        for _ in range(args.repeats):
            raw_runs.append(await raw_jetstream(urls["nats"], args.messages, args.batch, args.concurrency))
            fleet_runs.append((await fleet_echo(settings, args.messages, args.concurrency))[0])
        raw, fleet = best_of(raw_runs), best_of(fleet_runs)
        latency = await latency_at(settings, 0.7 * fleet, args.latency_seconds)
    ratio = fleet / raw
    results = {
        "a_echo_over_nats": {
            "fleet_jobs_per_s": fleet,
            "raw_nats_msgs_per_s": raw,
            "ratio": ratio,
            "target": 0.5,
            "fleet_runs": fleet_runs,
            "raw_runs": raw_runs,
        },
        "d_latency_at_70pct": {**latency, "p99_over_p50": latency["p99_ms"] / latency["p50_ms"]},
        "params": vars(args),
    }
    show(
        "Fleet pipeline over NATS JetStream + Redis",
        [
            ("(a) fleet echo jobs/s", f"{fleet:,.0f}", ""),
            ("(a) raw nats-py publish+fetch+ack msgs/s", f"{raw:,.0f}", ""),
            ("(a) ratio fleet / raw", f"{ratio:.2f}", ">= 0.5"),
            ("(d) offered load jobs/s (70 % of (a))", f"{latency['rate_per_s']:,.0f}", ""),
            ("(d) p50 / p99 end-to-end ms", f"{latency['p50_ms']:.1f} / {latency['p99_ms']:.1f}", ""),
        ],
    )
    print(json.dumps(results["a_echo_over_nats"] | {"d": results["d_latency_at_70pct"]}, default=str))
    print(f"wrote {write_results('pipeline', results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=256, help="publishes awaiting their ack at once")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each side; the best is kept")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
