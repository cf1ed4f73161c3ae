"""Kafka-specific behaviour of ``KafkaBroker`` on a real Apache Kafka 4.x broker (see ``tests/kafka_service.py``).

The broker contract shared with NATS and the in-memory broker lives in ``tests/contract``; this file checks what only
Kafka has: topics and partitions, committed offsets and their metadata, consumer-group hand-over, lag from offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from fleet import constants as c
from fleet.brokers.kafka import KafkaBroker
from fleet.brokers.kafka_names import (
    bootstrap_servers,
    decode_deliveries,
    encode_deliveries,
    runs_of,
    topic_for,
)
from fleet.brokers.kafka_subscription import KafkaDelivery, KafkaSubscription
from fleet.errors import BrokerUnavailable, ConfigError, PayloadTooLarge
from fleet.settings import FleetSettings
from tests.infra import eventually
from tests.kafka_service import new_cluster_id
from tests.services import free_port

ROOT = Path(__file__).resolve().parent.parent
FAST = {"session_timeout_ms": 1500, "heartbeat_interval_ms": 200}  # quick hand-over between consumers

BrokerFactory = Callable[..., Awaitable[KafkaBroker]]


@pytest.fixture
async def make_broker(kafka_url: str) -> AsyncIterator[BrokerFactory]:
    """``await make_broker(kafka_partitions=2)``: a connected broker with test settings, closed after the test."""
    made: list[KafkaBroker] = []

    async def make(**overrides: object) -> KafkaBroker:
        settings = FleetSettings.model_validate({"broker_url": kafka_url, "ack_wait_s": 1.0, **overrides})
        broker = KafkaBroker(kafka_url, settings=settings, **FAST)  # type: ignore[arg-type]
        await broker.connect()
        made.append(broker)
        return broker

    yield make
    for broker in made:
        await broker.close()


@pytest.fixture
async def admin(kafka_url: str) -> AsyncIterator[AIOKafkaAdminClient]:
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(kafka_url))
    await client.start()
    yield client
    await client.close()


async def committed_offsets(admin: AIOKafkaAdminClient, group: str, topic: str, partitions: int) -> dict[int, int]:
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    found = await admin.list_consumer_group_offsets(group, partitions=tps)
    return {tp.partition: meta.offset for tp, meta in found.items()}


async def publish_jobs(broker: KafkaBroker, subject: str, count: int, prefix: str = "job") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for job_id in ids:
        await broker.publish(subject, job_id.encode(), msg_id=job_id, headers={c.HEADER_JOB_ID: job_id})
    return ids


async def fetch(sub: KafkaSubscription, count: int, timeout_s: float) -> list[KafkaDelivery]:
    return [cast(KafkaDelivery, d) for d in await sub.fetch(count, timeout_s)]


async def fetch_all(sub: KafkaSubscription, count: int, timeout_s: float = 10.0) -> list[KafkaDelivery]:
    got: list[KafkaDelivery] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += await fetch(sub, count - len(got), timeout_s=0.5)
    return got


# -- pure helpers -------------------------------------------------------------------------------------------------


def test_subjects_are_used_verbatim_as_topic_names() -> None:
    assert topic_for("fleet.req.my-model_2") == "fleet.req.my-model_2"
    with pytest.raises(ConfigError, match="Kafka topic name"):
        topic_for("fleet.req.caf\u00e9")
    with pytest.raises(ConfigError):
        topic_for("fleet.req.*")


def test_kafka_urls_name_bootstrap_servers() -> None:
    assert bootstrap_servers("kafka://a:1,b") == ["a:1", "b:9092"]
    with pytest.raises(ConfigError, match="names no broker"):
        bootstrap_servers("kafka://")


def test_delivery_record_round_trips_and_never_understates() -> None:
    runs = runs_of([(10, 2), (11, 2), (12, 1), (14, 3)])
    assert runs == [(10, 2), (12, 1), (14, 3)]
    prior = decode_deliveries(encode_deliveries(15, runs))
    assert prior is not None
    assert [prior.count(o) for o in (9, 10, 11, 12, 13, 14, 15)] == [0, 2, 2, 1, 1, 3, 0]
    many = [(o, o % 3 + 1) for o in range(1000)]
    shrunk = decode_deliveries(encode_deliveries(1000, many, max_runs=10))
    assert shrunk is not None and len(shrunk.starts) <= 10
    assert all(shrunk.count(o) >= n for o, n in many)
    assert decode_deliveries("written by another client") is None


# -- topics -------------------------------------------------------------------------------------------------------


async def test_ensure_model_creates_request_and_dead_letter_topics(
    make_broker: BrokerFactory, admin: AIOKafkaAdminClient, unique: str
) -> None:
    broker = await make_broker(kafka_partitions=3)
    model = f"k{unique}"
    await broker.ensure_model(model)
    await broker.ensure_model(model)  # idempotent
    levels = [f"fleet.req.{model}", f"fleet.req.{model}.high", f"fleet.req.{model}.low"]  # one per priority
    described: dict[str, Any] = {}

    async def all_described() -> bool:  # another client's metadata can trail a creation by a moment under load
        described.update({t["topic"]: t for t in await admin.describe_topics([*levels, f"fleet.dlq.{model}"])})
        return all(t["error_code"] == 0 for t in described.values())

    await eventually(all_described, what="the four topics described")
    assert [len(described[topic]["partitions"]) for topic in levels] == [3, 3, 3]

    await broker.publish(c.dlq_subject(model), b'{"why": "poison"}', msg_id="dead-1")
    sub = await broker.subscribe(c.dlq_subject(model), "dlq-readers")
    [dead] = await fetch_all(sub, 1)
    assert (dead.data, dead.msg_id) == (b'{"why": "poison"}', "dead-1")
    await dead.ack()
    await sub.close()


async def test_missing_topic_with_auto_create_off_is_a_config_error(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_auto_create=False)
    with pytest.raises(ConfigError, match=rf"fleet\.req\.k{unique}.*kafka_auto_create is off"):
        await broker.ensure_model(f"k{unique}")
    with pytest.raises(ConfigError, match="does not exist"):
        await broker.publish(f"fleet.req.k{unique}", b"{}", msg_id="x")
    with pytest.raises(ConfigError, match="does not exist"):
        await broker.subscribe(f"fleet.req.k{unique}", "g")


async def test_unreachable_broker_fails_fast_naming_the_url() -> None:
    url = f"kafka://127.0.0.1:{free_port()}"
    broker = KafkaBroker(url, settings=FleetSettings.model_validate({"broker_url": url}), connect_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=url):
        await broker.connect()
    assert time.monotonic() - started < 5
    await broker.close()


async def test_a_port_that_never_answers_times_out_and_leaves_no_client_behind() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"kafka://127.0.0.1:{silent.getsockname()[1]}"
        settings = FleetSettings.model_validate({"broker_url": url})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            broker = KafkaBroker(url, settings=settings, connect_timeout_s=0.5, request_timeout_ms=1500)
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match=r"no answer within 0\.5s"):
                await broker.connect()
            assert time.monotonic() - started < 1.5
            await broker.close()  # waits for the abandoned start to give up (the request timeout), then stops it
            del broker
            gc.collect()
    assert resource_warnings(caught) == []


async def test_oversized_message_is_refused_before_sending(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(max_message_bytes=2048)
    with pytest.raises(PayloadTooLarge, match="over the limit of 2048"):
        await broker.publish(f"fleet.req.k{unique}", b"x" * 2049, msg_id="big")


# -- publish, fetch, ack ------------------------------------------------------------------------------------------


async def test_publish_fetch_ack_carries_key_and_headers(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=2)
    model = f"k{unique}"
    await broker.ensure_model(model)
    ids = await publish_jobs(broker, c.request_subject(model), 6)
    sub = await broker.subscribe(c.request_subject(model), c.consumer_name(model))
    got = await fetch_all(sub, 6)
    assert sorted(d.msg_id or "" for d in got) == ids
    assert all(d.headers[c.HEADER_JOB_ID] == d.msg_id == d.data.decode() for d in got)
    assert {d.delivery_count for d in got} == {1}
    assert {d.subject for d in got} == {c.request_subject(model)}
    for delivery in got:
        await delivery.ack()
    assert await sub.fetch(10, timeout_s=0.3) == []
    assert await broker.lag(c.request_subject(model), c.consumer_name(model)) == 0
    await sub.close()


async def test_fetch_returns_as_soon_as_a_message_is_there(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=1)
    await broker.ensure_model(f"k{unique}")
    sub = await broker.subscribe(f"fleet.req.k{unique}", "g")

    async def publish_later() -> None:
        await asyncio.sleep(0.3)
        await publish_jobs(broker, sub.topic, 1)

    late = asyncio.create_task(publish_later())
    started = time.monotonic()
    got = await sub.fetch(32, timeout_s=8)
    assert len(got) == 1 and time.monotonic() - started < 3
    await late
    await got[0].ack()
    await sub.close()


async def test_republished_msg_id_is_dropped(make_broker: BrokerFactory, unique: str) -> None:
    broker, other = await make_broker(kafka_partitions=2), await make_broker(kafka_partitions=2)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    await publish_jobs(broker, subject, 3)
    await publish_jobs(broker, subject, 3)  # same process: dropped before sending
    await publish_jobs(other, subject, 3)  # another process: reaches the topic, dropped by the partition's owner
    sub = await broker.subscribe(subject, "g")
    got = await fetch_all(sub, 3)
    got += await fetch(sub, 10, timeout_s=0.5)
    assert sorted(d.msg_id or "" for d in got) == ["job-0", "job-1", "job-2"]
    for delivery in got:
        await delivery.ack()
    assert await broker.lag(subject, "g") == 0  # the dropped copies are committed too
    await sub.close()


# -- commits ------------------------------------------------------------------------------------------------------


async def test_out_of_order_acks_never_commit_past_unfinished_work(
    make_broker: BrokerFactory, admin: AIOKafkaAdminClient, unique: str
) -> None:
    broker = await make_broker(kafka_partitions=1, ack_wait_s=30.0)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    await publish_jobs(broker, subject, 5)
    sub = await broker.subscribe(subject, "g")
    got = sorted(await fetch_all(sub, 5), key=lambda d: d.offset)
    for delivery in (got[4], got[0], got[3], got[1]):  # offset 2 still running
        await delivery.ack()
    await sub.flush()
    await asyncio.sleep(0.3)  # give a wrong background commit the chance to happen
    assert await committed_offsets(admin, "g", subject, 1) == {0: 2}
    assert await broker.lag(subject, "g") == 3

    await got[2].ack()
    await sub.flush()
    assert await committed_offsets(admin, "g", subject, 1) == {0: 5}
    assert await broker.lag(subject, "g") == 0
    await sub.close()


async def test_lag_counts_waiting_and_in_flight_over_all_partitions(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=3)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    assert await broker.lag(subject, "g") == 0
    await publish_jobs(broker, subject, 9)
    assert await broker.lag(subject, "g") == 9  # nothing committed: whole partitions
    sub = await broker.subscribe(subject, "g")
    got = await fetch_all(sub, 4)
    assert await broker.lag(subject, "g") == 9  # in flight still counts
    for delivery in got:
        await delivery.ack()
    remaining = await broker.lag(subject, "g")
    assert 9 - len(got) <= remaining < 9
    got = await fetch_all(sub, 9 - len(got))
    for delivery in got:
        await delivery.ack()
    assert await broker.lag(subject, "g") == 0
    assert await broker.lag(subject, "another-group") == 9
    await sub.close()


async def test_a_stalled_commit_of_counts_pauses_one_batch_not_every_batch(
    kafka_url: str, admin: AIOKafkaAdminClient, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = FleetSettings.model_validate({"broker_url": kafka_url, "kafka_partitions": 1, "ack_wait_s": 30.0})
    broker = KafkaBroker(kafka_url, settings=settings, count_commit_wait_ms=500, **FAST)  # type: ignore[arg-type]
    await broker.connect()
    subject = f"fleet.req.k{unique}"
    sub: KafkaSubscription | None = None
    try:
        await broker.ensure_model(f"k{unique}")
        await publish_jobs(broker, subject, 2)
        sub = await broker.subscribe(subject, "g")
        real_commit = sub._consumer.commit

        async def stalled_commit(offsets: Any = None) -> None:  # a group coordinator that answers after 2 s
            await asyncio.sleep(2.0)
            await real_commit(offsets)

        sub._consumer.commit = stalled_commit  # type: ignore[method-assign]
        started = time.monotonic()
        first = await fetch_all(sub, 1)
        assert len(first) == 1 and 0.45 < time.monotonic() - started < 1.5  # waited for the commit, not for ever
        started = time.monotonic()
        second = await fetch(sub, 1, timeout_s=5)
        assert len(second) == 1 and time.monotonic() - started < 0.4  # the commit is still stuck: no new pause
        assert caplog.text.count("delivery counts not committed within 0.5s") == 1

        async def both_counts_committed() -> bool:  # as a next owner would read them
            found = await admin.list_consumer_group_offsets("g", partitions=[TopicPartition(subject, 0)])
            prior = decode_deliveries(found[TopicPartition(subject, 0)].metadata)
            return prior is not None and [prior.count(offset) for offset in (0, 1)] == [1, 1]

        await eventually(both_counts_committed, timeout_s=8, what="both batches' counts committed after the stall")
    finally:
        if sub is not None:
            await sub.close()
        await broker.close()


# -- redelivery ---------------------------------------------------------------------------------------------------


async def test_nak_and_ack_wait_redeliver_with_a_higher_count(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=1, ack_wait_s=0.5)
    await broker.ensure_model(f"k{unique}")
    subject = f"fleet.req.k{unique}"
    await publish_jobs(broker, subject, 2)
    sub = await broker.subscribe(subject, "g")
    first, second = sorted(await fetch_all(sub, 2), key=lambda d: d.offset)
    await first.nak(delay_s=0.2)
    await second.in_progress()
    [again] = await sub.fetch(5, timeout_s=2)
    assert (again.msg_id, again.delivery_count) == ("job-0", 2)
    await again.ack()
    await first.ack()  # settling a stale delivery is a no-op
    [expired] = await sub.fetch(5, timeout_s=2)  # nobody acked job-1 within the ack wait
    assert (expired.msg_id, expired.delivery_count) == ("job-1", 2)
    await expired.ack()
    assert await sub.fetch(5, timeout_s=0.7) == []
    await sub.close()


async def test_closed_consumer_hands_unacked_messages_to_the_group(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=2)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    await publish_jobs(broker, subject, 4)
    first = await broker.subscribe(subject, "g")
    got = await fetch_all(first, 4)
    await got[0].ack()
    await first.close()  # three left unacked

    second = await broker.subscribe(subject, "g")
    again = await fetch_all(second, 3)
    assert sorted(d.msg_id or "" for d in again) == sorted(d.msg_id or "" for d in got[1:])
    assert {d.delivery_count for d in again} == {2}
    for delivery in again:
        await delivery.ack()
    assert await broker.lag(subject, "g") == 0
    await second.close()


async def test_competing_consumers_share_partitions_without_overlap(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker(kafka_partitions=4)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    ids = await publish_jobs(broker, subject, 40)
    one = await broker.subscribe(subject, "g")
    two = await broker.subscribe(subject, "g")  # returns once the rebalance it started gave everyone a share
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + 10
    while len(seen) < 40 and time.monotonic() < deadline:
        for index, sub in enumerate((one, two)):
            for delivery in await fetch(sub, 40, timeout_s=0.2):
                seen.append((delivery.msg_id or "", index))
                await delivery.ack()
    assert sorted(job for job, _ in seen) == sorted(ids)
    assert {index for _, index in seen} == {0, 1}
    await one.close()
    await two.close()


async def test_rebalance_keeps_work_on_kept_partitions_and_hands_over_the_rest(
    make_broker: BrokerFactory, unique: str
) -> None:
    broker = await make_broker(kafka_partitions=2, ack_wait_s=30.0)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    await publish_jobs(broker, subject, 12)
    first = await broker.subscribe(subject, "g")
    held = await fetch_all(first, 12)
    assert {d.partition for d in held} == {0, 1}

    second = await broker.subscribe(subject, "g")  # rebalance: each member ends with one partition
    moved = await fetch(second, 12, timeout_s=5)
    moved += await fetch(second, 12, timeout_s=0.3)
    moved_partition = {d.partition for d in moved}
    assert len(moved_partition) == 1 and {d.delivery_count for d in moved} == {2}
    for delivery in held:  # acks on the partition that moved are no-ops; the others still count
        await delivery.ack()
    assert await broker.lag(subject, "g") == len(moved)
    assert await first.fetch(12, timeout_s=0.5) == []  # the kept partition's work was not redelivered
    for delivery in moved:
        await delivery.ack()
    assert await broker.lag(subject, "g") == 0
    await first.close()
    await second.close()


CRASHING_CONSUMER = """
import asyncio, os, sys
from fleet.brokers.kafka import KafkaBroker
from fleet.settings import FleetSettings

async def main(url, subject, want):
    settings = FleetSettings(broker_url=url)
    broker = KafkaBroker(url, settings=settings, session_timeout_ms=1000, heartbeat_interval_ms=200)
    await broker.connect()
    sub = await broker.subscribe(subject, "g")
    got = 0
    while got < want:
        got += len(await sub.fetch(want, timeout_s=1))
    print("fetched", got, flush=True)
    os._exit(0)  # dies holding every message: no ack, no close, no leave-group

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_consumer_that_dies_without_acking_hands_its_messages_over(
    make_broker: BrokerFactory, kafka_url: str, unique: str
) -> None:
    broker = await make_broker(kafka_partitions=2)
    model = f"k{unique}"
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    ids = await publish_jobs(broker, subject, 5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", CRASHING_CONSUMER, kafka_url, subject, "5"]
    proc = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "fetched 5", proc.stderr[-2000:]

    survivor = await broker.subscribe(subject, "g")  # joins once the dead member's session (1 s) ran out
    again = await fetch_all(survivor, 5, timeout_s=15)
    assert sorted(d.msg_id or "" for d in again) == ids
    assert {d.delivery_count for d in again} == {2}  # the count survived in the commit metadata
    for delivery in again:
        await delivery.ack()
    assert await broker.lag(subject, "g") == 0
    await survivor.close()


# -- cancellation -------------------------------------------------------------------------------------------------

# Where to cancel a call: after 0-117 turns of the event loop (the first few milliseconds, where a first lag read
# starts its offsets reader), then after 10-100 ms (where it waits for offsets).
CANCEL_POINTS = [(turns, 0.0) for turns in range(0, 120, 3)] + [(0, ms / 1000) for ms in range(10, 101, 10)]


async def cancel_after(call: Coroutine[Any, Any, object], turns: int, delay_s: float) -> None:
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    await asyncio.sleep(delay_s)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def resource_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_cancelled_lag_reads_leave_no_kafka_client_behind(kafka_url: str, unique: str) -> None:
    """The gateway's lag monitor is cancelled wherever it is when the app stops; no aiokafka client may leak."""
    settings = FleetSettings.model_validate({"broker_url": kafka_url})
    subject = f"fleet.req.k{unique}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, (turns, delay_s) in enumerate(CANCEL_POINTS):
            broker = KafkaBroker(kafka_url, settings=settings, **FAST)  # type: ignore[arg-type]
            await broker.connect()
            await broker.ensure_model(f"k{unique}")
            await cancel_after(broker.lag(subject, "g"), turns, delay_s)
            await cancel_after(broker.lag(subject, "g"), turns // 2, delay_s / 2)
            if index % 4 == 0:  # (a first full read takes 0.1 s)
                assert await broker.lag(subject, "g") == 0  # still usable: a half-started reader was replaced
            await broker.close()
        del broker
        gc.collect()
    assert resource_warnings(caught) == []


async def test_cancelled_connect_subscribe_and_listen_leave_no_kafka_client_behind(kafka_url: str, unique: str) -> None:
    settings = FleetSettings.model_validate({"broker_url": kafka_url})
    subject = f"fleet.req.k{unique}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, (turns, delay_s) in enumerate(CANCEL_POINTS[::3]):
            broker = KafkaBroker(kafka_url, settings=settings, **FAST)  # type: ignore[arg-type]
            await cancel_after(broker.connect(), turns, delay_s)
            await broker.connect()
            await broker.ensure_model(f"k{unique}")
            await cancel_after(broker.subscribe(subject, f"g{index}"), turns, delay_s)
            await cancel_after(broker.listen(f"fleet.ctl.{unique}.*"), turns, delay_s)
            await broker.close()
        del broker
        gc.collect()
    assert resource_warnings(caught) == []


# -- control events -----------------------------------------------------------------------------------------------


async def test_listen_gets_matching_events_emitted_after_it(make_broker: BrokerFactory, unique: str) -> None:
    broker = await make_broker()
    stream = await broker.listen(f"fleet.ctl.{unique}.*")
    await broker.emit(f"fleet.ctl.{unique}.a", b"one")
    await broker.emit(f"fleet.ctl.other{unique}.a", b"not for us")
    await broker.emit(f"fleet.ctl.{unique}.a.deeper", b"not for us either")
    await broker.emit(f"fleet.ctl.{unique}.b", b"two")
    events = stream.__aiter__()
    got = [await asyncio.wait_for(events.__anext__(), 5) for _ in range(2)]
    assert got == [(f"fleet.ctl.{unique}.a", b"one"), (f"fleet.ctl.{unique}.b", b"two")]
    await stream.close()


def test_kraft_cluster_ids_never_look_like_an_option() -> None:
    # One random id in 64 starts with "-"; the storage tool would read it as a flag and refuse to format.
    ids = {new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert not any(cluster_id.startswith("-") for cluster_id in ids)
