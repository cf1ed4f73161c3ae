"""The broker contract (``fleet.brokers.base``), run unchanged on every broker kind of ``BROKER_KINDS``.

Each test has its own model name, so its subjects and groups are its own. Ack waits are 1 s to keep this fast.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.brokers import make_broker
from fleet.brokers.base import Broker, Delivery, EventStream, Subscription
from fleet.constants import consumer_name, dlq_subject, request_subject
from fleet.errors import BrokerError, BrokerUnavailable, PayloadTooLarge
from tests.contract.conftest import (
    ACK_WAIT_S,
    FAN_OUT_KINDS,
    FIFO_KINDS,
    MAX_MESSAGE_BYTES,
    NETWORK_KINDS,
    broker_settings,
)
from tests.services import free_port

pytestmark = pytest.mark.timeout(60)


async def worker_queue(broker: Broker, model: str) -> tuple[str, Subscription]:
    """The model's request subject and a subscription of its worker group, as a Fleet worker sets them up."""
    await broker.ensure_model(model)
    subject = request_subject(model)
    return subject, await broker.subscribe(subject, consumer_name(model))


async def drain(sub: Subscription, want: int, *, timeout_s: float = 5.0, batch: int = 10) -> list[Delivery]:
    """Fetch until ``want`` messages came or ``timeout_s`` passed."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and (left := deadline - time.monotonic()) > 0:
        got += await sub.fetch(min(batch, want - len(got)), left)
    return got


async def ack_all(deliveries: list[Delivery]) -> None:
    await asyncio.gather(*(d.ack() for d in deliveries))


async def lag_becomes(broker: Broker, subject: str, group: str, expected: int, timeout_s: float = 3.0) -> None:
    """Acks may be sent without a confirmation (NATS), so lag reflects them within milliseconds, not at once."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (lag := await broker.lag(subject, group)) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"lag stayed {lag}, expected {expected}"
        await asyncio.sleep(0.02)


async def next_event(stream: EventStream, timeout_s: float) -> tuple[str, bytes] | None:
    try:
        return await asyncio.wait_for(anext(aiter(stream)), timeout_s)
    except TimeoutError:
        return None


async def test_publish_then_fetch_in_batches_with_ids_and_headers(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    for i in range(5):
        await broker.publish(subject, f"m{i}".encode(), msg_id=f"{model}-{i}", headers={"k": f"v{i}"})

    first = await sub.fetch(3, timeout_s=2.0)
    got = first + await drain(sub, 5 - len(first))

    assert 1 <= len(first) <= 3
    assert sorted(d.data for d in got) == [f"m{i}".encode() for i in range(5)]
    for d in got:
        i = int(d.data[1:])
        assert (d.subject, d.msg_id, d.headers.get("k"), d.delivery_count) == (subject, f"{model}-{i}", f"v{i}", 1)
    await ack_all(got)


async def test_acked_message_is_never_redelivered_and_settling_twice_is_a_no_op(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"once", msg_id=f"{model}-1")
    [delivery] = await drain(sub, 1)

    await delivery.ack()
    await delivery.ack()
    await delivery.nak()

    assert await sub.fetch(10, timeout_s=ACK_WAIT_S + 0.5) == []
    assert await broker.lag(subject, consumer_name(model)) == 0


async def test_message_of_a_dead_consumer_is_redelivered_after_the_ack_wait(broker: Broker, model: str) -> None:
    subject, dying = await worker_queue(broker, model)
    await broker.publish(subject, b"job", msg_id=f"{model}-1")
    [first] = await drain(dying, 1)
    await dying.close()  # dies holding the message, without settling it

    survivor = await broker.subscribe(subject, consumer_name(model))
    again = await survivor.fetch(1, timeout_s=ACK_WAIT_S * 4)

    assert [(d.data, d.msg_id, d.delivery_count) for d in again] == [(b"job", f"{model}-1", 2)]
    assert first.delivery_count == 1
    await ack_all(again)


async def test_nak_redelivers_without_waiting_for_the_ack_wait(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"retry me")
    [delivery] = await drain(sub, 1)

    started = time.monotonic()
    await delivery.nak()
    again = await sub.fetch(1, timeout_s=ACK_WAIT_S * 3)

    assert [(d.data, d.delivery_count) for d in again] == [(b"retry me", 2)]
    assert time.monotonic() - started < ACK_WAIT_S * 0.8
    await ack_all(again)


async def test_nak_with_delay_holds_the_message_back(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"later")
    [delivery] = await drain(sub, 1)

    started = time.monotonic()
    await delivery.nak(delay_s=0.6)
    early = await sub.fetch(1, timeout_s=0.2)
    again = await sub.fetch(1, timeout_s=3.0)

    assert early == []
    assert [(d.data, d.delivery_count) for d in again] == [(b"later", 2)]
    assert time.monotonic() - started >= 0.5
    await ack_all(again)


async def test_terminated_message_is_never_redelivered(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"poison")
    [delivery] = await drain(sub, 1)

    await delivery.term()

    assert await sub.fetch(1, timeout_s=ACK_WAIT_S + 0.5) == []
    await lag_becomes(broker, subject, consumer_name(model), 0)


async def test_in_progress_restarts_the_ack_wait(broker: Broker, model: str) -> None:
    subject, one = await worker_queue(broker, model)
    two = await broker.subscribe(subject, consumer_name(model))
    await broker.publish(subject, b"long job")
    holder, other = one, two
    got: list[Delivery] = []
    for _ in range(20):  # either member may get it (on Kafka, only the owner of the message's partition)
        if got := await holder.fetch(1, timeout_s=0.1):
            break
        holder, other = other, holder
    [delivery] = got

    await asyncio.sleep(ACK_WAIT_S * 0.6)
    await delivery.in_progress()
    await asyncio.sleep(ACK_WAIT_S * 0.6)  # past the first ack wait, inside the restarted one

    assert await other.fetch(1, timeout_s=0.1) == []
    assert await holder.fetch(1, timeout_s=0.1) == []
    await delivery.ack()
    await lag_becomes(broker, subject, consumer_name(model), 0)


async def test_same_msg_id_is_stored_once(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"a", msg_id=f"{model}-a")
    await broker.publish(subject, b"a again", msg_id=f"{model}-a")
    await broker.publish(subject, b"b", msg_id=f"{model}-b")

    got = await drain(sub, 2)
    extra = await sub.fetch(10, timeout_s=0.5)

    assert sorted(d.data for d in got) == [b"a", b"b"]
    assert extra == []
    await ack_all(got)


async def test_competing_consumers_split_the_messages(broker: Broker, model: str) -> None:
    subject, sub_a = await worker_queue(broker, model)
    sub_b = await broker.subscribe(subject, consumer_name(model))
    total = 20
    seen: dict[str, list[bytes]] = {"a": [], "b": []}

    async def consume(name: str, sub: Subscription) -> None:
        deadline = time.monotonic() + 10
        while sum(map(len, seen.values())) < total and time.monotonic() < deadline:
            batch = await sub.fetch(5, timeout_s=0.3)
            seen[name] += [d.data for d in batch]
            await ack_all(batch)

    consumers = [asyncio.create_task(consume("a", sub_a)), asyncio.create_task(consume("b", sub_b))]
    await asyncio.sleep(0.2)  # both are waiting in fetch
    for i in range(total):
        await broker.publish(subject, f"{i}".encode(), msg_id=f"{model}-{i}")
    await asyncio.gather(*consumers)

    assert sorted(seen["a"] + seen["b"], key=int) == [f"{i}".encode() for i in range(total)]
    assert seen["a"] and seen["b"]


async def test_message_published_before_any_group_exists_reaches_the_first_group(broker: Broker, model: str) -> None:
    subject = request_subject(model)  # a raw producer publishes before any worker or gateway set the model up
    await broker.publish(subject, b"early", msg_id=f"{model}-early")
    waiting = await broker.lag(subject, consumer_name(model))

    _, sub = await worker_queue(broker, model)
    got = await drain(sub, 1)

    assert waiting == 1
    assert [(d.data, d.msg_id, d.delivery_count) for d in got] == [(b"early", f"{model}-early", 1)]
    await ack_all(got)
    await lag_becomes(broker, subject, consumer_name(model), 0)


@pytest.mark.parametrize("broker", FAN_OUT_KINDS, indirect=True)
async def test_every_group_gets_every_message(broker: Broker, model: str) -> None:
    subject, workers = await worker_queue(broker, model)
    audit = await broker.subscribe(subject, f"audit-{model}")
    await broker.publish(subject, b"one", msg_id=f"{model}-1")
    await broker.publish(subject, b"two", msg_id=f"{model}-2")

    for sub in (workers, audit):
        got = await drain(sub, 2)
        assert sorted(d.data for d in got) == [b"one", b"two"]
        await ack_all(got)


async def test_lag_counts_waiting_and_in_flight_messages(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    group = consumer_name(model)
    assert await broker.lag(subject, group) == 0
    for i in range(3):
        await broker.publish(subject, f"{i}".encode(), msg_id=f"{model}-{i}")
    assert await broker.lag(subject, group) == 3

    fetched = await drain(sub, 2, batch=2)
    assert len(fetched) == 2
    assert await broker.lag(subject, group) == 3  # 1 waiting + 2 in flight

    await ack_all(fetched)
    await lag_becomes(broker, subject, group, 1)
    await ack_all(await drain(sub, 1))
    await lag_becomes(broker, subject, group, 0)


async def test_fetch_on_an_empty_queue_returns_nothing_after_its_timeout(broker: Broker, model: str) -> None:
    _, sub = await worker_queue(broker, model)

    started = time.monotonic()
    got = await sub.fetch(5, timeout_s=0.5)
    elapsed = time.monotonic() - started

    assert got == []
    assert 0.45 <= elapsed < 2.0


async def test_fetch_returns_as_soon_as_a_message_arrives(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    waiting = asyncio.create_task(sub.fetch(10, timeout_s=10.0))
    await asyncio.sleep(0.3)

    published = time.monotonic()
    await broker.publish(subject, b"now")
    got = await asyncio.wait_for(waiting, 5.0)

    assert [d.data for d in got] == [b"now"]
    assert time.monotonic() - published < 1.0  # not the 10 s timeout, not a full batch
    await ack_all(got)


async def test_emit_reaches_the_listeners_whose_wildcard_matches(broker: Broker, unique: str) -> None:
    prefix = f"fleet.ctl.t{unique}"
    one_token = await broker.listen(f"{prefix}.*")
    any_tail = await broker.listen(f"{prefix}.>")

    await broker.emit(f"{prefix}.a", b"1")
    await broker.emit(f"{prefix}.a.b", b"2")
    await broker.emit(f"fleet.ctl.x{unique}.a", b"3")

    assert await next_event(one_token, 5.0) == (f"{prefix}.a", b"1")
    assert await next_event(any_tail, 5.0) == (f"{prefix}.a", b"1")
    assert await next_event(any_tail, 5.0) == (f"{prefix}.a.b", b"2")
    assert await next_event(one_token, 0.3) is None
    assert await next_event(any_tail, 0.3) is None
    await one_token.close()
    assert [event async for event in one_token] == []
    await any_tail.close()


async def test_message_over_the_size_limit_raises_and_one_at_the_limit_passes(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)

    with pytest.raises(PayloadTooLarge) as too_large:
        await broker.publish(subject, b"x" * (MAX_MESSAGE_BYTES + 1))
    await broker.publish(subject, b"y" * MAX_MESSAGE_BYTES)

    assert (too_large.value.size, too_large.value.limit) == (MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES)
    got = await drain(sub, 1)
    assert [d.data for d in got] == [b"y" * MAX_MESSAGE_BYTES]
    await ack_all(got)


async def test_publish_after_close_raises(broker: Broker, model: str) -> None:
    subject, _ = await worker_queue(broker, model)
    await broker.close()
    await broker.close()

    with pytest.raises(BrokerError):
        await broker.publish(subject, b"too late")
    with pytest.raises(BrokerUnavailable):
        await broker.ping()


@pytest.mark.parametrize("kind", NETWORK_KINDS)
async def test_connect_to_a_closed_port_fails_fast_naming_the_url(kind: str) -> None:
    url = f"{kind}://127.0.0.1:{free_port()}"
    unreachable = make_broker(broker_settings(url))

    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as failure:
        await unreachable.connect()

    assert time.monotonic() - started < 10.0
    assert url.split("://")[1] in str(failure.value)
    await unreachable.close()


@pytest.mark.parametrize("broker", FIFO_KINDS, indirect=True)
async def test_single_consumer_receives_a_subject_in_publish_order(broker: Broker, model: str) -> None:
    subject, sub = await worker_queue(broker, model)
    for i in range(50):
        await broker.publish(subject, f"{i}".encode(), msg_id=f"{model}-{i}")

    got = await drain(sub, 50, batch=7)

    assert [d.data for d in got] == [f"{i}".encode() for i in range(50)]
    await ack_all(got)


async def test_dead_letters_wait_for_readers_that_come_later_and_keep_their_headers(broker: Broker, model: str) -> None:
    """What a worker does after the last failed delivery: publish to the dead-letter subject, then terminate."""
    subject, sub = await worker_queue(broker, model)
    await broker.publish(subject, b"poison", msg_id=f"{model}-p")
    [delivery] = await drain(sub, 1)
    dlq = dlq_subject(model)
    headers = {"fleet-error": "model_error", "fleet-job-id": f"{model}-p"}
    await broker.publish(dlq, b"letter", msg_id=f"{model}-p.dlq", headers=headers)
    await broker.publish(dlq, b"letter again", msg_id=f"{model}-p.dlq", headers=headers)  # a repeat is dropped
    await delivery.term()

    reader = await broker.subscribe(dlq, "ops-readers")  # the reader subscribes after the letter was written
    try:
        [letter] = await drain(reader, 1)
        assert letter.data == b"letter" and letter.headers["fleet-error"] == "model_error"
        await letter.ack()
        assert await reader.fetch(5, timeout_s=0.5) == []
    finally:
        await reader.close()
    assert await sub.fetch(1, timeout_s=ACK_WAIT_S + 0.5) == [], "a terminated request never comes back"
