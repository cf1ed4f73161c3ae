"""NATS-only behaviour of ``NatsBroker``: health probing around a paused server, one group per request subject,
stream configuration, and buffered messages whose ack wait ran out.

Each test that pauses the server or reshapes streams gets a private nats-server (never ``FLEET_TEST_NATS_URL``):
pausing a shared server would stall every other test using it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Delivery, ack_all
from fleet.brokers.nats import NatsBroker, durable_name
from fleet.brokers.nats_client import FleetNatsClient
from fleet.brokers.nats_pull import NatsDelivery, NatsSubscription, reply_counts
from fleet.errors import BrokerError, BrokerUnavailable, ConfigError
from fleet.settings import FleetSettings
from tests.aof_redis import restartable
from tests.contract.conftest import ACK_WAIT_S, broker_settings
from tests.services import free_port, require_binary, wait_port

pytestmark = pytest.mark.timeout(60)

PING_TIMEOUT_S = 0.5


def thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (``T``: stopped), from /proc."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that just ended
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return states


@dataclass
class PrivateNats:
    url: str
    proc: subprocess.Popen[bytes]

    def pause(self) -> None:
        """SIGSTOP the server and return once all its threads are stopped (the signal takes a moment)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not all(state == "T" for state in thread_states(self.proc.pid)):
            assert time.monotonic() < deadline, "nats-server did not stop within 5 s of SIGSTOP"
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def private_nats_server() -> Iterator[PrivateNats]:
    """A nats-server with JetStream of this test alone (it may be paused), stopped afterwards."""
    binary = require_binary("nats-server", "nats-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-nats-private-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_port("127.0.0.1", port, proc, log, 20, "nats-server")
            yield PrivateNats(f"nats://127.0.0.1:{port}", proc)
        finally:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def server() -> Iterator[PrivateNats]:
    with private_nats_server() as private:
        yield private


def nats_broker(url: str, **settings: object) -> NatsBroker:
    built = make_broker(FleetSettings.model_validate({**broker_settings(url).model_dump(), **settings}))
    assert isinstance(built, NatsBroker)
    return built


@pytest.fixture
async def broker(server: PrivateNats) -> AsyncIterator[NatsBroker]:
    instance = nats_broker(server.url)
    instance.ping_timeout_s = PING_TIMEOUT_S
    await instance.connect()
    try:
        yield instance
    finally:
        await instance.close()


async def worker_queue(broker: NatsBroker, model: str) -> tuple[str, NatsSubscription]:
    await broker.ensure_model(model)
    subject = c.request_subject(model)
    return subject, await broker.subscribe(subject, c.consumer_name(model))


async def lag_becomes(broker: NatsBroker, subject: str, group: str, expected: int) -> None:
    deadline = time.monotonic() + 3.0
    while (lag := await broker.lag(subject, group)) != expected:
        assert time.monotonic() < deadline, f"lag stayed {lag}, expected {expected}"
        await asyncio.sleep(0.02)


async def round_trip_works(broker: NatsBroker, sub: NatsSubscription, subject: str, body: bytes) -> None:
    """Publish, fetch and ack one message on the same broker and subscription, and see the lag drop to 0."""
    await broker.publish(subject, body)
    got = await sub.fetch(1, timeout_s=5.0)
    assert [d.data for d in got] == [body]
    await got[0].ack()
    await lag_becomes(broker, subject, sub.group, 0)


async def ready_within(broker: NatsBroker, timeout_s: float) -> list[str]:
    """Ping until it passes; return the failures seen on the way."""
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await broker.ping()
            return failures
        except BrokerUnavailable as exc:
            failures.append(str(exc))
            assert time.monotonic() < deadline, f"still not ready after {timeout_s}s: {failures[-3:]}"
            await asyncio.sleep(0.1)


async def test_ping_fails_while_the_server_is_paused_and_the_broker_works_once_it_resumes(
    server: PrivateNats, broker: NatsBroker, unique: str
) -> None:
    subject, sub = await worker_queue(broker, f"p{unique}")
    await broker.ping()

    server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="did not answer a ping"):
            await broker.ping()
        own_timeout_s = time.monotonic() - started
        with pytest.raises(TimeoutError):  # a readiness probe's deadline cancels the ping, as /readyz does
            await asyncio.wait_for(broker.ping(), 0.2)
        await asyncio.sleep(PING_TIMEOUT_S)  # the server stays paused past every probe's deadline
    finally:
        server.resume()

    assert PING_TIMEOUT_S * 0.9 <= own_timeout_s < PING_TIMEOUT_S + 1.0
    assert await ready_within(broker, 5.0) == []  # late answers to the abandoned probes harm nothing
    await round_trip_works(broker, sub, subject, b"after the pause")


async def test_a_client_that_stopped_reading_is_reported_not_ready_and_reconnects(
    server: PrivateNats, broker: NatsBroker, unique: str
) -> None:
    subject, sub = await worker_queue(broker, f"r{unique}")
    connection = broker._nc  # reproduce nats-py 2.16's failure: a flush that timed out, then its late PONG
    assert connection is not None

    server.pause()
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await connection.flush(timeout=1)
    finally:
        server.resume()
    await asyncio.sleep(0.3)  # the late PONG arrives and ends nats-py's read loop

    with pytest.raises(BrokerUnavailable, match="stopped reading"):
        await broker.ping()
    await ready_within(broker, 10.0)
    await round_trip_works(broker, sub, subject, b"after the reconnect")


async def test_a_second_group_on_a_request_subject_is_a_config_error_naming_the_first(
    broker: NatsBroker, unique: str
) -> None:
    model = f"g{unique}"
    subject, _ = await worker_queue(broker, model)

    with pytest.raises(ConfigError) as second:
        await broker.subscribe(subject, f"audit-{unique}")

    message = str(second.value)
    assert subject in message
    assert repr(c.consumer_name(model)) in message
    assert "exactly one group" in message
    await broker.subscribe(subject, c.consumer_name(model))  # the owning group still subscribes


async def test_a_group_found_with_a_delivery_limit_gets_unlimited_deliveries(
    broker: NatsBroker, server: PrivateNats, unique: str
) -> None:
    """JetStream must never stop redelivering before Fleet's crash rule decides (fleet.consumers.crashes, issue 26)."""
    model = f"md{unique}"
    subject = c.request_subject(model)
    durable = durable_name(subject, c.consumer_name(model))
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        config = ConsumerConfig(
            durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, max_deliver=3
        )
        await js.add_consumer("FLEET_REQ", config)
        await broker.ensure_model(model)
        info = await js.consumer_info("FLEET_REQ", durable)
    finally:
        await nc.close()
    assert info.config.max_deliver == -1


async def test_dead_letter_subjects_take_several_groups_and_each_gets_every_message(
    broker: NatsBroker, unique: str
) -> None:
    subject = c.dlq_subject(f"d{unique}")
    readers = [await broker.subscribe(subject, f"reader{i}-{unique}") for i in range(2)]
    await broker.publish(subject, b"letter", msg_id=f"{unique}-letter")

    for reader in readers:
        got = await reader.fetch(1, timeout_s=5.0)
        assert [d.data for d in got] == [b"letter"]
        await got[0].ack()


async def stream_config(url: str, name: str) -> StreamConfig:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(name)).config
    finally:
        await nc.close()


async def test_job_ttl_is_the_max_age_of_the_request_and_inbox_streams(server: PrivateNats) -> None:
    for ttl_s in (1234, 4321):  # the second broker finds the streams and aligns them
        broker = nats_broker(server.url, job_ttl_s=ttl_s)
        await broker.connect()
        await broker.close()
        for name in (c.REQ_STREAM, "FLEET_INBOX"):
            config = await stream_config(server.url, name)
            assert (config.max_age, config.retention) == (ttl_s, RetentionPolicy.WORK_QUEUE)


async def test_a_request_stream_with_another_retention_is_a_config_error_saying_how_to_fix_it(
    server: PrivateNats,
) -> None:
    nc = await nats.connect(server.url)
    try:  # what an older Fleet left behind
        await nc.jetstream().add_stream(
            name=c.REQ_STREAM, subjects=[c.REQ_PREFIX + ".>"], retention=RetentionPolicy.INTEREST
        )
    finally:
        await nc.close()
    broker = nats_broker(server.url)

    with pytest.raises(ConfigError) as old:
        await broker.connect()

    assert "interest" in str(old.value)
    assert "workqueue" in str(old.value)
    assert f"nats stream rm {c.REQ_STREAM}" in str(old.value)
    await broker.close()


async def arrives_unasked(broker: NatsBroker, sub: NatsSubscription, subject: str, body: bytes) -> None:
    """Publish ``body`` so that it reaches ``sub`` outside any fetch and waits in its buffer."""
    fetching = asyncio.create_task(sub.fetch(1, timeout_s=5.0))
    await asyncio.sleep(0.2)  # its long-poll request is at the server
    fetching.cancel()  # e.g. a caller's deadline: the request still stands at the server
    with contextlib.suppress(asyncio.CancelledError):
        await fetching
    await broker.publish(subject, body)
    await asyncio.sleep(0.1)


async def test_a_buffered_message_is_handed_out_while_its_ack_wait_is_young_and_dropped_when_old(
    broker: NatsBroker, unique: str
) -> None:
    subject, sub = await worker_queue(broker, f"b{unique}")

    await arrives_unasked(broker, sub, subject, b"young")
    young = await sub.fetch(1, timeout_s=0.2)
    assert [(d.data, d.delivery_count) for d in young] == [(b"young", 1)]
    await young[0].ack()

    await arrives_unasked(broker, sub, subject, b"old")
    await asyncio.sleep(ACK_WAIT_S * 0.6)  # past half its ack wait, and no worker extends it
    assert await sub.fetch(1, timeout_s=0.05) == []  # short: over before the redelivery at 1x
    assert sub.dropped_stale == 1

    again = await sub.fetch(1, timeout_s=ACK_WAIT_S * 3)  # the server redelivers it once its ack wait ended
    assert [(d.data, d.delivery_count) for d in again] == [(b"old", 2)]
    await again[0].ack()


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.FLEET_REQ.fleet-echo.3.120.118.1733112345123456789.17",  # without a domain
        "$JS.ACK._.ACCHASH.FLEET_REQ.fleet-echo.1.120.118.1733112345123456789.0",  # domain form, 11 tokens
        "$JS.ACK.hub.ACCHASH.FLEET_REQ.fleet-echo.2.7.6.1733112345123456789.4.rand0m",  # domain form, 12 tokens
    ],
)
def test_reply_counts_reads_what_nats_py_metadata_reads(reply: str) -> None:
    meta = Msg(_client=None, subject="s", reply=reply).metadata  # type: ignore[arg-type]
    assert reply_counts(reply) == (meta.num_delivered, meta.num_pending)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc.1", "$JS.ACK.too.few", "$JS.ACK.S.C.x.1.1.1.1"])
def test_reply_counts_refuses_what_is_not_a_jetstream_ack_subject(reply: str) -> None:
    with pytest.raises(ValueError):
        reply_counts(reply)


async def test_ack_many_settles_a_batch_in_one_write_and_skips_what_is_settled(broker: NatsBroker, unique: str) -> None:
    subject, sub = await worker_queue(broker, f"m{unique}")
    for i in range(70):
        await broker.publish(subject, b"%d" % i)
    got: list[Delivery] = []
    while len(got) < 70:
        got += await sub.fetch(70 - len(got), timeout_s=5.0)
    deliveries = [d for d in got if isinstance(d, NatsDelivery)]
    assert len(deliveries) == 70 and {d.delivery_count for d in deliveries} == {1}
    await deliveries[0].nak(1.0)  # settled before: ack_many must not ack it too
    await NatsDelivery.ack_many(deliveries)
    await lag_becomes(broker, subject, sub.group, 1)  # the nak-ed one waits for its redelivery
    await NatsDelivery.ack_many(deliveries)  # all settled now: nothing is sent
    again = await sub.fetch(1, timeout_s=ACK_WAIT_S + 5.0)
    assert [(d.data, d.delivery_count) for d in again] == [(b"0", 2)]
    await ack_all(again)
    await lag_becomes(broker, subject, sub.group, 0)


async def test_the_pull_inbox_takes_messages_straight_from_the_read_loop(broker: NatsBroker, unique: str) -> None:
    subject, sub = await worker_queue(broker, f"d{unique}")
    nc = broker._nc
    assert isinstance(nc, FleetNatsClient) and sub._sub is not None
    for i in range(5):
        await broker.publish(subject, b"%d" % i, msg_id=f"{unique}-{i}", headers={"k": f"v{i}"})
    got: list[Delivery] = []
    while len(got) < 5:
        got += await sub.fetch(5 - len(got), timeout_s=5.0)
    assert [(d.data, d.msg_id, d.headers, d.delivery_count) for d in got] == [
        (b"%d" % i, f"{unique}-{i}", {"k": f"v{i}"}, 1) for i in range(5)
    ]
    assert sub._sub._received == 0  # nats-py's own path counts each message it queues: none went that way
    await ack_all(got)
    await lag_becomes(broker, subject, sub.group, 0)


async def test_a_pull_inbox_on_a_plain_nats_py_client_gets_its_messages_through_the_callback(
    broker: NatsBroker, server: PrivateNats, unique: str
) -> None:
    subject, fleet_sub = await worker_queue(broker, f"p{unique}")
    nc = await nats.connect(server.url)  # nats-py's own client: no direct hand-over
    sub = NatsSubscription(
        nc, stream=c.REQ_STREAM, durable=fleet_sub.durable, subject=subject, group=fleet_sub.group,
        settle_timeout_s=2.0, ack_wait_s=ACK_WAIT_S,
    )  # fmt: skip
    try:
        await sub.start()
        await broker.publish(subject, b"plain", msg_id=f"{unique}-p", headers={"k": "v"})
        got = await sub.fetch(1, timeout_s=5.0)
        assert [(d.data, d.msg_id, d.headers, d.delivery_count) for d in got] == [
            (b"plain", f"{unique}-p", {"k": "v"}, 1)
        ]
        assert sub._sub is not None and sub._sub._received >= 1  # it came the library's way
        await ack_all(got)
        await lag_becomes(broker, subject, fleet_sub.group, 0)
    finally:
        await sub.close()
        await nc.close()


async def test_a_direct_handler_that_raises_loses_its_message_but_the_client_keeps_reading(
    broker: NatsBroker, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    nc = broker._nc
    assert isinstance(nc, FleetNatsClient)
    seen: list[bytes] = []

    def handle(subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        if data == b"bad":
            raise RuntimeError("handler bug")
        seen.append(data)

    core = await nc.subscribe(f"direct.{unique}")
    nc.deliver_directly(core, handle)
    for body in (b"bad", b"good"):
        await nc.publish(f"direct.{unique}", body)
    deadline = time.monotonic() + 5.0
    while seen != [b"good"]:
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.02)
    assert "could not be handled" in caplog.text
    await broker.ping()  # a request round trip: the read loop is alive
    await core.unsubscribe()
    await nc.publish(f"direct.{unique}", b"after")  # no subscription now: the message is dropped, not handed
    await broker.ping()
    assert seen == [b"good"] and core._id not in nc._direct


@pytest.mark.services
async def test_the_direct_hand_over_outlives_a_server_killed_and_restarted(unique: str) -> None:
    # nats-py subscribes again under the same id after a reconnect: the inbox must keep its direct hand-over (and
    # its messages must not start going through the library's queue, nor be lost).
    with restartable("nats") as server:
        broker = nats_broker(server.url)
        await broker.connect()
        try:
            subject, sub = await worker_queue(broker, f"r{unique}")
            await round_trip_works(broker, sub, subject, b"before")
            server.kill()
            server.start()
            deadline = time.monotonic() + 20.0
            while True:  # reconnected once a publish is acknowledged by the new process
                try:
                    await broker.publish(subject, b"after", msg_id=f"{unique}-after")
                    break
                except BrokerError:  # unavailable, or no PubAck in time (a retry with the same id is de-duplicated)
                    assert time.monotonic() < deadline, "no reconnect within 20s"
                    await asyncio.sleep(0.2)
            got: list[Delivery] = []
            while not got:
                assert time.monotonic() < deadline, "nothing fetched after the restart"
                with contextlib.suppress(BrokerError):
                    got = await sub.fetch(1, timeout_s=1.0)
            assert [(d.data, d.msg_id) for d in got] == [(b"after", f"{unique}-after")]
            await ack_all(got)
            assert sub._sub is not None and sub._sub._received == 0
            assert sub._sub._id in cast(FleetNatsClient, broker._nc)._direct
        finally:
            await broker.close()
