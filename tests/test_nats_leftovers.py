"""Acked requests that a SIGKILLed nats-server kept in ``FLEET_REQ`` are purged and free their places of the
queue bound (``fleet.brokers.nats_leftovers``).

nats-server 2.9 writes a work-queue stream's deletes lazily: acked a second before a SIGKILL, a message is back
after the restart, below the consumer's ack floor, so it is never delivered again and holds a place of the
per-subject bound for the job TTL. The test makes that happen on a server of its own, checks that it did (so the
test cannot pass for want of leftovers), then checks that subscribing, and reconnecting after a second crash, purge
them and that the bound counts only the live requests again.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from fleet import constants as c
from fleet.brokers.nats import NatsBroker, durable_name
from fleet.errors import QueueFull
from fleet.settings import FleetSettings
from tests.aof_redis import Restartable, restartable
from tests.infra import TEST_SETTINGS, eventually, request_bytes

pytestmark = pytest.mark.slow

BOUND = 300
ACKED = 200
FLUSHED_S = 1.0  # the consumer's ack floor is on disk after this, the stream's deletes not yet (2.9 file store)


async def held(url: str, subject: str, durable: str) -> tuple[int, int]:
    """(messages the stream stores on ``subject``, messages its consumer still has waiting or in flight)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        state = (await js.stream_info(c.REQ_STREAM, subjects_filter=subject)).state
        info = await js.consumer_info(c.REQ_STREAM, durable)
        return (state.subjects or {}).get(subject, 0), (info.num_pending or 0) + (info.num_ack_pending or 0)
    finally:
        await nc.close()


async def ack_some(broker: NatsBroker, subject: str, group: str, count: int) -> None:
    sub = await broker.subscribe(subject, group)
    acked = 0
    try:
        while acked < count:
            for delivery in await sub.fetch(min(32, count - acked), 1.0):
                await delivery.ack()
                acked += 1
    finally:
        await sub.close()


async def publish(broker: NatsBroker, model: str, subject: str, ids: range) -> None:
    for i in ids:
        await broker.publish(subject, request_bytes(model, f"{model}-{i}", {"i": i}), msg_id=f"{model}-{i}")


async def crash(server: Restartable) -> None:
    await asyncio.sleep(FLUSHED_S)  # a measured moment of the server's write-behind, not a synchronisation
    server.kill()
    server.start()


@pytest.mark.timeout(120)
@pytest.mark.services
async def test_acked_requests_a_killed_nats_server_kept_are_purged_and_free_their_places(unique: str) -> None:
    model = f"left-{unique}"
    subject, group = c.request_subject(model), c.consumer_name(model)
    durable = durable_name(subject, group)
    with restartable("nats") as server:
        settings = FleetSettings(**{**TEST_SETTINGS, "broker_url": server.url, "max_queued": BOUND})
        first = NatsBroker.from_settings(settings)
        await first.connect()
        try:
            await first.ensure_model(model)
            await publish(first, model, subject, range(BOUND))
            await ack_some(first, subject, group, ACKED)
        finally:
            await first.close()
        await crash(server)

        stored, live = await held(server.url, subject, durable)
        assert live == BOUND - ACKED, (stored, live)
        assert stored == BOUND, f"the server kept {stored - live} of {ACKED} acked requests, not all of them"

        broker = NatsBroker.from_settings(settings)
        await broker.connect()
        try:
            with pytest.raises(QueueFull):  # the leftovers hold the places (the subscription below frees them)
                await publish(broker, model, subject, range(BOUND, BOUND + 1))
            sub = await broker.subscribe(subject, group)  # a worker starting: its subject is checked
            await sub.close()
            assert await held(server.url, subject, durable) == (BOUND - ACKED, BOUND - ACKED)
            await publish(broker, model, subject, range(BOUND, BOUND + ACKED))  # the freed places are usable

            # A second crash while this broker stays connected: its reconnection checks its subscriptions.
            sub = await broker.subscribe(subject, group)
            for delivery in await sub.fetch(32, 1.0):
                await delivery.ack()
            await crash(server)

            async def purged() -> bool:
                stored, live = await held(server.url, subject, durable)
                return stored == live

            await eventually(purged, 30, "the leftovers of the second crash purged")
            await sub.close()
        finally:
            await broker.close()
