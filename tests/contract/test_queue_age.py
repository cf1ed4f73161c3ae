"""The queue age through the broker seam (``Broker.oldest_waiting_age_s``) on every broker kind, real NATS JetStream
and Kafka included: the age of the oldest message a group has not acked, waiting or in flight, by the broker's (or
the record's) time; it falls when the oldest is acked and is None once nothing waits. Also the autoscaler's read of
it over a model's priority levels, and an autoscaler tick that scales on it and shows it (gauge and status)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import REGISTRY

from fleet import constants as c
from fleet.autoscaler.backends.dry_run import DryRunBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.autoscaler.signals import SignalReader
from fleet.brokers.base import Broker, Delivery
from fleet.lag import read_queue_age
from fleet.scaling import MemoryScalingStore
from tests.infra import publish_requests

GAP_S = 0.6


async def age_becomes(broker: Broker, model: str, check: Callable[[float | None], bool], what: str) -> float | None:
    """Acks may be confirmed a little later (NATS): read until ``check(age)`` holds."""
    age = None
    for _ in range(100):
        age = await broker.oldest_waiting_age_s(c.request_subject(model), c.consumer_name(model))
        if check(age):
            return age
        await asyncio.sleep(0.05)
    raise AssertionError(f"queue age of {model} stayed {age}: expected {what}")


async def test_the_oldest_unacked_message_gives_the_queue_age(broker: Broker, model: str) -> None:
    await broker.ensure_model(model)
    subject, group = c.request_subject(model), c.consumer_name(model)
    sub = await broker.subscribe(subject, group)
    try:
        assert await broker.oldest_waiting_age_s(subject, group) is None  # nothing waits
        for i in range(3):
            await broker.publish(subject, f'{{"n": {i}}}'.encode(), msg_id=f"{model}-{i}")
            if i < 2:
                await asyncio.sleep(GAP_S)
        first = await broker.oldest_waiting_age_s(subject, group)
        assert first is not None and 2 * GAP_S - 0.1 <= first < 2 * GAP_S + 5, first

        got: list[Delivery] = []
        while len(got) < 3:
            got += await sub.fetch(3 - len(got), timeout_s=5)
        in_flight = await broker.oldest_waiting_age_s(subject, group)  # in flight still waits for its result
        assert in_flight is not None and in_flight >= first
        oldest = next(d for d in got if d.data == b'{"n": 0}')
        await oldest.ack()
        # the next oldest was published GAP_S later: the age drops by about that much
        await age_becomes(broker, model, lambda a: a is not None and a < in_flight - GAP_S + 0.3, "the age to drop")
        for delivery in got:
            if delivery is not oldest:
                await delivery.ack()
        await age_becomes(broker, model, lambda a: a is None, "None once every message is acked")
    finally:
        await sub.close()


async def test_the_autoscaler_reads_the_oldest_over_priority_levels_and_shows_it(broker: Broker, model: str) -> None:
    await broker.ensure_model(model)
    subs = [await broker.subscribe(c.request_subject(model, p), c.consumer_name(model, p)) for p in c.PRIORITIES]
    try:
        await broker.publish(c.request_subject(model, "low"), b"{}", msg_id=f"{model}-low")
        await asyncio.sleep(GAP_S)
        await broker.publish(c.request_subject(model, "high"), b"{}", msg_id=f"{model}-high")
        age = await read_queue_age(broker, model)
        assert age is not None and age >= GAP_S - 0.1  # the low one, the older
        signals = await SignalReader(broker).read(model, current_replicas=1)
        assert signals.queue_age_s is not None and signals.queue_age_s >= age
    finally:
        for sub in subs:
            await sub.close()


async def test_an_autoscaler_tick_scales_on_the_age_and_shows_it(broker: Broker, model: str) -> None:
    config = ScalingConfig(min_replicas=0, max_replicas=5, default_throughput_per_replica=1000, max_queue_age_s=0.3)
    await publish_requests(broker, model, [{}, {}], prefix=model)  # no worker: they wait
    await asyncio.sleep(GAP_S)
    backend = DryRunBackend()
    autoscaler = Autoscaler(broker, MemoryScalingStore(), backend, {model: config}, 60, "o")
    decision = (await autoscaler.tick())[model]
    assert decision.replicas == 1 and "max_queue_age_s 0.3s" in decision.reason, decision.reason
    gauge = REGISTRY.get_sample_value("fleet_autoscaler_queue_age_seconds", {"model": model})
    assert gauge is not None and gauge >= GAP_S - 0.1
    status = (await autoscaler.store.statuses())[0]
    assert status.queue_age_s is not None and status.queue_age_s >= GAP_S - 0.1
