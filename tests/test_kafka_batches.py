"""Kafka publishing in record batches (``fleet.brokers.kafka_batches``, ``KafkaBroker.publish_many``) on a real
Kafka broker, and the key hash that must place a job id where every Java-compatible producer places it."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import constants as c
from fleet.brokers.base import Outgoing
from fleet.brokers.kafka import KafkaBroker
from fleet.brokers.kafka_batches import KeyPartitioner, Record, murmur2, murmur2_many, partition_of, send_batches
from fleet.brokers.kafka_subscription import KafkaDelivery, KafkaSubscription
from fleet.errors import BrokerUnavailable, PayloadTooLarge
from fleet.producers.publish import publish_all
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from tests.aof_redis import restartable

BrokerFactory = Callable[..., Awaitable[KafkaBroker]]


@pytest.fixture
async def make_broker(kafka_url: str) -> AsyncIterator[BrokerFactory]:
    made: list[KafkaBroker] = []

    async def make(**overrides: object) -> KafkaBroker:
        settings = FleetSettings.model_validate({"broker_url": kafka_url, "ack_wait_s": 5.0, **overrides})
        broker = KafkaBroker(kafka_url, settings=settings, session_timeout_ms=1500, heartbeat_interval_ms=200)
        await broker.connect()
        made.append(broker)
        return broker

    yield make
    for broker in made:
        await broker.close()


async def drain(sub: KafkaSubscription, at_least: int, settle_s: float = 0.5) -> list[KafkaDelivery]:
    """Everything the subscription hands out: at least ``at_least``, then whatever else comes within ``settle_s``."""
    got: list[KafkaDelivery] = []
    deadline = time.monotonic() + 20
    while len(got) < at_least and time.monotonic() < deadline:
        got += [cast(KafkaDelivery, d) for d in await sub.fetch(500, timeout_s=0.5)]
    got += [cast(KafkaDelivery, d) for d in await sub.fetch(500, timeout_s=settle_s)]
    for delivery in got:
        await delivery.ack()
    return got


async def model_on(make_broker: BrokerFactory, unique: str, **overrides: object) -> tuple[KafkaBroker, str]:
    """A broker with a fresh model's topics created, and the model's request subject."""
    broker = await make_broker(**overrides)
    model = f"k{unique}"
    await broker.ensure_model(model)
    return broker, c.request_subject(model)


def outgoing(subject: str, ids: list[str]) -> list[Outgoing]:
    return [Outgoing(subject, f"body of {i}".encode(), i, {c.HEADER_JOB_ID: i, "n": str(n)}) for n, i in enumerate(ids)]


# -- the key hash -------------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_murmur2_is_the_java_clients_hash_bit_for_bit(data: bytes) -> None:
    assert murmur2(data) == aiokafka_murmur2(data)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([b"a" * 32, b"b" * 32, b"abcdefg"])), max_size=40))
def test_hashing_many_keys_at_once_gives_each_keys_hash(keys: list[bytes]) -> None:
    keys += [uuid.uuid4().hex.encode() for _ in range(len(keys) % 20)]  # a run of one length: the numpy path
    assert murmur2_many(keys) == [aiokafka_murmur2(key) for key in keys]


def test_hashing_runs_of_every_tail_length_at_once_gives_each_keys_hash() -> None:
    rng = random.Random(14)
    keys = [rng.randbytes(length) for length in range(14) for _ in range(12)]  # numpy runs, tails of 0-3 bytes
    rng.shuffle(keys)
    assert murmur2_many(keys) == [aiokafka_murmur2(key) for key in keys]


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=80), st.integers(min_value=1, max_value=64))
def test_keyed_records_go_where_aiokafkas_default_partitioner_puts_them(key: bytes, count: int) -> None:
    partitions = list(range(count))
    expected = DefaultPartitioner()(key, partitions, partitions)
    assert KeyPartitioner()(key, partitions, partitions) == expected == partition_of(key, partitions)


# -- publish_many on a real broker --------------------------------------------------------------------------------


async def test_publish_many_writes_each_message_once_with_its_key_headers_and_partition(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker, subject = await model_on(make_broker, unique, kafka_partitions=4)
    ids = [f"job-{unique}-{i}" for i in range(700)]  # several record batches on each of the 4 partitions
    await broker.publish_many(outgoing(subject, ids))
    sub = await broker.subscribe(subject, "g")
    got = await drain(sub, len(ids))
    assert sorted(d.msg_id or "" for d in got) == sorted(ids)
    by_id = {d.msg_id: d for d in got}
    for n, job_id in enumerate(ids):
        delivery = by_id[job_id]
        assert delivery.data == f"body of {job_id}".encode()
        assert delivery.headers == {c.HEADER_JOB_ID: job_id, "n": str(n)}
        assert delivery.partition == DefaultPartitioner()(job_id.encode(), [0, 1, 2, 3], [0, 1, 2, 3])
    offsets: dict[int, list[int]] = {}
    for delivery in sorted(got, key=lambda d: d.offset):
        offsets.setdefault(delivery.partition, []).append(int(by_id[delivery.msg_id].headers["n"]))
    assert all(order == sorted(order) for order in offsets.values())  # list order kept within a partition
    await sub.close()


async def test_publish_many_drops_ids_repeated_in_the_list_or_published_in_the_window(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker, subject = await model_on(make_broker, unique, kafka_partitions=2)
    await broker.publish(subject, b"first", msg_id="a")
    await broker.publish_many(outgoing(subject, ["a", "b", "b", "c"]))
    await broker.publish_many(outgoing(subject, ["c", "d"]))
    assert await broker.lag(subject, "g") == 4  # records on the topic: no copy was sent, none left to the consumer
    sub = await broker.subscribe(subject, "g")
    got = await drain(sub, 4)
    assert sorted(d.msg_id or "" for d in got) == ["a", "b", "c", "d"]
    assert next(d for d in got if d.msg_id == "a").data == b"first"
    await sub.close()


async def test_a_single_publish_of_an_id_in_flight_in_publish_many_shares_its_outcome(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker, subject = await model_on(make_broker, unique, kafka_partitions=2)
    ids = [f"j{i}" for i in range(300)]
    many = asyncio.create_task(broker.publish_many(outgoing(subject, ids)))
    await asyncio.sleep(0)  # publish_many has claimed its ids
    await asyncio.gather(broker.publish(subject, b"again", msg_id="j7"), many)
    assert await broker.lag(subject, "g") == len(ids)  # records on the topic: the second j7 was never sent
    sub = await broker.subscribe(subject, "g")
    got = await drain(sub, len(ids))
    assert sorted(d.msg_id or "" for d in got) == sorted(ids)
    await sub.close()


async def test_a_message_larger_than_a_record_batch_is_sent_on_its_own(make_broker: BrokerFactory, unique: str) -> None:
    broker, subject = await model_on(make_broker, unique, kafka_partitions=1, max_message_bytes=200_000)
    big = Outgoing(subject, b"x" * 100_000, "big")  # past the producer's 16 KB batch size
    await broker.publish_many([*outgoing(subject, ["s1", "s2"]), big, *outgoing(subject, ["s3"])])
    sub = await broker.subscribe(subject, "g")
    got = await drain(sub, 4)
    assert [d.msg_id for d in sorted(got, key=lambda d: d.offset)] == ["s1", "s2", "big", "s3"]
    assert len(next(d for d in got if d.msg_id == "big").data) == 100_000
    await sub.close()


async def test_an_oversized_message_fails_the_call_before_anything_is_sent(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker, subject = await model_on(make_broker, unique, kafka_partitions=1, max_message_bytes=2048)
    with pytest.raises(PayloadTooLarge, match="over the limit of 2048"):
        await broker.publish_many([*outgoing(subject, ["ok"]), Outgoing(subject, b"x" * 2049, "big")])
    assert await broker.lag(subject, "g") == 0
    await broker.publish_many(outgoing(subject, ["ok"]))  # not remembered as published: it goes out now
    assert await broker.lag(subject, "g") == 1


async def test_records_a_closed_producer_did_not_take_are_reported_failed(kafka_url: str, unique: str) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from fleet.brokers.kafka_names import bootstrap_servers

    bootstrap = bootstrap_servers(kafka_url)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    topic = f"batches.{unique}"
    await admin.create_topics([NewTopic(topic, 2, 1)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    records = [Record(f"r{i}".encode(), b"v", []) for i in range(10)]
    assert await send_batches(producer, topic, records, timeout_s=10) == [None] * 10
    await producer.partitions_for(topic)
    await producer.stop()
    outcomes = await send_batches(producer, topic, records, timeout_s=10)
    assert len(outcomes) == 10 and all(isinstance(o, Exception) for o in outcomes)
    await admin.delete_topics([topic])
    await admin.close()


async def test_publish_many_on_a_closed_broker_is_a_clear_error(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker()
    await broker.close()
    with pytest.raises(BrokerUnavailable, match="not connected"):
        await broker.publish_many(outgoing(f"fleet.req.k{unique}", ["a"]))


async def test_publish_all_on_kafka_publishes_in_slices_and_reports_each_message(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker = await make_broker(kafka_partitions=3)
    model = f"k{unique}"
    await broker.ensure_model(model)
    messages = [RequestMessage(job_id=f"p{unique}{i}", model=model, input={"i": i}) for i in range(1000)]
    progress: list[int] = []
    ids = await publish_all(broker, messages, concurrency=64, on_published=lambda: progress.append(1))
    assert ids == [m.job_id for m in messages] and len(progress) == 1000
    sub = await broker.subscribe(c.request_subject(model), c.consumer_name(model))
    got = await drain(sub, 1000)
    assert sorted(RequestMessage.model_validate_json(d.data).job_id for d in got) == sorted(ids)
    assert all(d.headers[c.HEADER_JOB_ID] == d.msg_id for d in got)
    await sub.close()


@pytest.mark.timeout(300)
@pytest.mark.services
async def test_publish_many_through_a_kafka_kill_and_restart_says_so_in_time_and_loses_nothing(unique: str) -> None:
    with restartable("kafka") as server:
        settings = FleetSettings.model_validate({"broker_url": server.url, "kafka_partitions": 2})
        broker = KafkaBroker(server.url, settings=settings, request_timeout_ms=3000, heartbeat_interval_ms=200)
        await broker.connect()
        try:
            model = f"k{unique}"
            await broker.ensure_model(model)
            subject = c.request_subject(model)
            ids = [f"job-{i}" for i in range(1000)]
            await broker.publish_many(outgoing(subject, ids[:500]))
            server.kill()
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="did not acknowledge"):  # aiokafka alone would wait it out
                await asyncio.wait_for(broker.publish_many(outgoing(subject, ids[500:])), 60)
            with pytest.raises(BrokerUnavailable, match="did not acknowledge"):
                await asyncio.wait_for(broker.publish(subject, b"one", msg_id="single"), 60)
            assert time.monotonic() - started < 20, "each publish said it failed within about its 3 s timeout"
            server.start()
            # The same list again, as a re-run of `fleet publish` would: what Kafka acknowledged is not sent again,
            # and what it may have written without acknowledging is dropped by the partition's consumer.
            await broker.publish_many(outgoing(subject, ids))
            assert await broker.lag(subject, "g") >= len(ids), "no record lost"
            sub = await broker.subscribe(subject, "g")
            got = await drain(sub, len(ids) + 1)
            assert sorted(d.msg_id or "" for d in got) == sorted([*ids, "single"])
            await sub.close()
        finally:
            await broker.close()


@settings(max_examples=8, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["normal", "high", "low"]),
            st.one_of(st.none(), st.sampled_from(["a", "b", "job-1", "ré.7", "x:y"]), st.text(min_size=1, max_size=6)),
            st.binary(max_size=300),
        ),
        max_size=60,
    )
)
async def test_generated_lists_land_once_per_id_on_their_own_topics(
    kafka_url: str, published: list[tuple[str, str | None, bytes]]
) -> None:
    """Any mix of levels (topics), repeated ids, messages without an id and bodies: each id lands once, on the topic
    of its first message, with that message's body; each message without an id lands once."""
    settings = FleetSettings.model_validate({"broker_url": kafka_url, "kafka_partitions": 3})
    broker = KafkaBroker(kafka_url, settings=settings)
    await broker.connect()
    try:
        model = f"g{uuid.uuid4().hex[:10]}"
        await broker.ensure_model(model)
        messages = [Outgoing(c.request_subject(model, level), body, msg_id) for level, msg_id, body in published]
        await broker.publish_many(messages)
        expected: dict[str, list[bytes]] = {}
        first: set[str] = set()
        for message in messages:
            if message.msg_id is None or message.msg_id not in first:
                expected.setdefault(message.subject, []).append(message.data)
                if message.msg_id is not None:
                    first.add(message.msg_id)
        for level in c.PRIORITIES:
            subject = c.request_subject(model, level)
            want = sorted(expected.get(subject, []))
            assert await broker.lag(subject, "g") == len(want)
            if want:
                sub = await broker.subscribe(subject, "g")
                assert sorted(d.data for d in await drain(sub, len(want), settle_s=0.2)) == want
                await sub.close()
    finally:
        await broker.close()
