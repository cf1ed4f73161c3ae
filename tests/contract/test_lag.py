"""Lag as the autoscaler and operators read it: through the seam and as the `fleet_queue_lag` gauge."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery
from fleet.lag import LagMonitor


def gauge(model: str) -> float | None:
    return REGISTRY.get_sample_value("fleet_queue_lag", {"model": model})


async def settles(monitor: LagMonitor, model: str, expected: int) -> None:
    """Acks may be unconfirmed (NATS), so the broker counts them within milliseconds rather than at once."""
    for _ in range(100):
        if (await monitor.refresh())[model] == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"lag of {model} stayed {monitor.last[model]}, expected {expected}")


async def test_lag_counts_waiting_and_in_flight_and_reaches_the_gauge(broker: Broker, model: str) -> None:
    await broker.ensure_model(model)
    sub = await broker.subscribe(c.request_subject(model), c.consumer_name(model))
    try:
        for i in range(5):
            await broker.publish(c.request_subject(model), b"{}", msg_id=f"{model}-{i}")
        monitor = LagMonitor(broker, [model])
        assert await monitor.refresh() == {model: 5}
        assert gauge(model) == 5

        got: list[Delivery] = []
        while len(got) < 3:
            got += await sub.fetch(3 - len(got), timeout_s=5)
        for delivery in got[:2]:
            await delivery.ack()
        await settles(monitor, model, 3)  # one in flight plus two waiting
        assert gauge(model) == 3
        await got[2].ack()
        rest: list[Delivery] = []
        while len(rest) < 2:
            rest += await sub.fetch(2, timeout_s=5)
        for delivery in rest:
            await delivery.ack()
        await settles(monitor, model, 0)
        assert gauge(model) == 0
    finally:
        await sub.close()
