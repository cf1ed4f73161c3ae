"""(a) echo throughput through the fleet vs the broker's raw client doing the same delivery work, on NATS and on
Kafka, and (d) end-to-end p50/p99 latency through the fleet at about 70 % of its saturation throughput.

    python -m benchmarks.bench_pipeline [--brokers nats,kafka] [--messages 20000] [--batch 64]

The raw loops are the honest equivalent of what the fleet asks of each broker:

* NATS: a nats-py JetStream publish (with ``Nats-Msg-Id``) + pull fetch + ack per message.
* Kafka: an aiokafka idempotent producer (``acks=all``) awaiting each send, keyed by job id, and a consumer-group
  member that commits once per fetched batch, on a topic with as many partitions as Fleet's request topic.

Both sides run in this one process, on the same server, with the same payloads, batch size and number of publishes
in flight; the fleet side also moves every job to running and writes its result to Redis before acking. The fleet
side publishes with ``publish_all``, as ``fleet publish`` does: on Kafka that hands the same records to the same
idempotent ``acks=all`` producer in record batches (``KafkaBroker.publish_many``), and on NATS it awaits each
PubAck through one reply subscription (``fleet.brokers.nats_pubacks``). Each side runs once uncounted first
(``--warmups``), then the sides alternate who goes first in each of ``--repeats`` rounds; the ratio is printed of
the best runs, of the medians, and as the median of the rounds' own ratios (the two sides of a round share its
load). A single fleet run with the in-memory store shows what the broker path alone reaches (the gap to (a) is the
Redis store). Services come from FLEET_BENCH_{NATS,KAFKA,REDIS}_URL or are started locally as in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from typing import Any

import nats
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.common import (
    Timer,
    best_of,
    fetch_and_ack,
    paired_median,
    percentiles_ms,
    pooled,
    services,
    show,
    write_result,
)
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.kafka_names import bootstrap_servers
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.producers.publish import publish_all
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store

BROKERS = ("nats", "kafka")
BROKER_TITLES = {"nats": "NATS JetStream", "kafka": "Kafka"}
TARGETS = {"nats": 0.85, "kafka": 0.75}  # (a) fleet / raw client, issue 14
RAW_TITLES = {"nats": "raw nats-py pub+fetch+ack msgs/s", "kafka": "raw aiokafka prod+consume+commit msgs/s"}


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

    async def publish_one(i: int) -> None:
        await js.publish(subject, payloads[i], headers={"Nats-Msg-Id": f"{token}-{i}"})

    with Timer() as t:
        await asyncio.gather(fetch_and_ack(psub, n, batch), pooled(list(range(n)), concurrency, publish_one))
    await js.delete_stream(stream)
    await nc.close()
    return n / t.seconds


async def raw_kafka(kafka_url: str, n: int, batch: int, concurrency: int, partitions: int) -> float:
    """Messages per second of a bare aiokafka idempotent producer + consumer-group member committing per batch."""
    bootstrap = bootstrap_servers(kafka_url)
    token = uuid.uuid4().hex[:8]
    topic = f"raw.{token}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, partitions, 1)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"raw-{token}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=100,
    )
    await producer.start()
    await consumer.start()
    while not consumer.assignment():  # join the group first, as a fleet worker does before taking work
        await consumer.getmany(timeout_ms=100)
    messages = requests_for("raw", n)

    async def produce_one(message: RequestMessage) -> None:
        # The same record Fleet writes: value, the job id as key, and the job id and model as headers.
        headers = [(c.HEADER_JOB_ID, message.job_id.encode()), (c.HEADER_MODEL, message.model.encode())]
        data = message.model_dump_json().encode()
        sent = await producer.send(topic, data, key=message.job_id.encode(), headers=headers)
        await sent

    async def consume() -> None:
        done = 0
        while done < n:
            batches = await consumer.getmany(timeout_ms=1000, max_records=batch)
            got = sum(len(records) for records in batches.values())
            if got:
                await consumer.commit()
                done += got

    try:
        with Timer() as t:
            await asyncio.gather(consume(), pooled(messages, concurrency, produce_one))
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.delete_topics([topic])
        await admin.close()
    return n / t.seconds


async def raw_loop(kind: str, settings: FleetSettings, n: int, batch: int, concurrency: int) -> float:
    if kind == "kafka":
        return await raw_kafka(settings.broker_url, n, batch, concurrency, settings.kafka_partitions)
    return await raw_jetstream(settings.broker_url, n, batch, concurrency)


async def fleet_echo(settings: FleetSettings, n: int, concurrency: int) -> tuple[float, FleetSettings]:
    """Jobs per second through publish → worker (running, echo, result to Redis) → ack."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"echo-{uuid.uuid4().hex[:8]}"
    handler = with_name(EchoHandler, model)()
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


async def fleet_rate(settings: FleetSettings, n: int, concurrency: int) -> float:
    return (await fleet_echo(settings, n, concurrency))[0]


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
        async with Worker(with_name(EchoHandler, model)(), broker, store, settings=settings):
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
            while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled
                await asyncio.sleep(0.05)
            records: list[Any] = []

            async def read(job_id: str) -> None:
                records.append(await store.get(job_id))

            await pooled(list(sent), 64, read)  # finished_at is stored with each result: read them back afterwards
    finally:
        await store.close()
        await broker.close()
    latencies = [r.finished_at - sent[r.job_id] for r in records if r is not None and r.finished_at]
    return {"rate_per_s": rate_per_s, "jobs": len(sent), "completed": len(latencies), **percentiles_ms(latencies)}


async def compare(kind: str, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """(a) and (d) on one broker: interleaved raw and fleet runs, the order alternating (best and median of each),
    then latency at 70 % of (a)."""
    settings = FleetSettings(
        broker_url=urls[kind], store_url=urls["redis"], max_batch=args.batch, max_wait_ms=args.max_wait_ms
    )
    for _ in range(args.warmups):  # both sides once, uncounted: the broker's JVM (Kafka) compiles its hot paths
        await raw_loop(kind, settings, args.messages, args.batch, args.concurrency)
        await fleet_echo(settings, args.messages, args.concurrency)
    raw_runs: list[float] = []
    fleet_runs: list[float] = []
    for repeat in range(args.repeats):
        order = [
            (raw_runs, lambda: raw_loop(kind, settings, args.messages, args.batch, args.concurrency)),
            (fleet_runs, lambda: fleet_rate(settings, args.messages, args.concurrency)),
        ]
        if repeat % 2:  # alternate who goes first: a server slowing down over the run weighs on both sides alike
            order.reverse()
        for runs, side in order:
            runs.append(await side())
    in_memory = settings.model_copy(update={"store_url": "memory://"})
    broker_path = (await fleet_echo(in_memory, args.messages, args.concurrency))[0]
    raw, fleet = best_of(raw_runs), best_of(fleet_runs)
    latency = await latency_at(settings, 0.7 * fleet, args.latency_seconds)
    return {
        "a": {
            "fleet_jobs_per_s": fleet,
            "raw_msgs_per_s": raw,
            "ratio": fleet / raw,
            "median_ratio": statistics.median(fleet_runs) / statistics.median(raw_runs),
            "paired_ratio": paired_median(fleet_runs, raw_runs),
            "target": TARGETS[kind],
            "fleet_runs": fleet_runs,
            "raw_runs": raw_runs,
            "fleet_memory_store_jobs_per_s": broker_path,
            "memory_store_ratio": broker_path / raw,
        },
        "d": {**latency, "p99_over_p50": latency["p99_ms"] / latency["p50_ms"]},
    }


def rows_for(kind: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    a, d = result["a"], result["d"]
    return [
        (f"(a) {kind}: fleet echo jobs/s", f"{a['fleet_jobs_per_s']:,.0f}", ""),
        (f"(a) {kind}: {RAW_TITLES[kind]}", f"{a['raw_msgs_per_s']:,.0f}", ""),
        (f"(a) {kind}: ratio fleet / raw (best)", f"{a['ratio']:.2f}", f">= {TARGETS[kind]}"),
        (f"(a) {kind}: ratio fleet / raw (medians)", f"{a['median_ratio']:.2f}", ""),
        (f"(a) {kind}: ratio fleet / raw (median of rounds)", f"{a['paired_ratio']:.2f}", ""),
        (
            f"    {kind}: in-memory store jobs/s (ratio)",
            f"{a['fleet_memory_store_jobs_per_s']:,.0f} ({a['memory_store_ratio']:.2f})",
            "",
        ),
        (f"(d) {kind}: offered jobs/s (70 % of (a))", f"{d['rate_per_s']:,.0f}", ""),
        (f"(d) {kind}: p50 / p99 end-to-end ms", f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f}", ""),
    ]


async def main(args: argparse.Namespace) -> None:
    kinds: list[str] = args.brokers
    measured: dict[str, dict[str, Any]] = {}
    with services(nats="nats" in kinds, kafka="kafka" in kinds) as urls:
        for kind in kinds:
            measured[kind] = await compare(kind, urls, args)
    results: dict[str, Any] = {}
    for kind, result in measured.items():
        results[f"a_echo_over_{kind}"] = result["a"]
        results[f"d_latency_at_70pct_over_{kind}"] = result["d"]
    results["params"] = vars(args)
    titles = " and ".join(BROKER_TITLES[k] for k in kinds)
    show(f"Fleet pipeline over {titles}, Redis store", [row for k in kinds for row in rows_for(k, measured[k])])
    for kind, result in measured.items():
        print(json.dumps({"broker": kind, **result["a"], "d": result["d"]}, default=str))
    print(f"wrote {write_result('pipeline', results)}")


def broker_list(value: str) -> list[str]:
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(BROKERS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(BROKERS)}, got {value!r}")
    return list(dict.fromkeys(kinds))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--brokers", type=broker_list, default=list(BROKERS), help="comma-separated: nats,kafka (default both)"
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=256, help="publishes awaiting their ack at once")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds of both sides: the ratio of the best runs, of the medians and of the median round",
    )
    parser.add_argument(
        "--warmups", type=int, default=1, help="uncounted runs of each side first (a cold Kafka runs slower)"
    )
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
