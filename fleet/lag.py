"""Topic lag per model, read through the broker seam and exported as the Prometheus gauge ``fleet_queue_lag``.

Lag is what the group has not finished: JetStream ``num_pending + num_ack_pending`` of the durable consumer,
Kafka ``end offset - committed offset`` summed over partitions, the in-memory broker's waiting plus in-flight.
A model's lag is the sum over its priority levels (each level is a subject and group of its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import Gauge

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

QUEUE_LAG = Gauge(
    "fleet_queue_lag", "Requests not yet finished by the model's workers (waiting + in flight)", ["model"]
)


async def read_lag(broker: Broker, model: str) -> int:
    """The model's lag: every priority level's, summed. Raises what the broker's ``lag`` raises."""
    return sum((await read_lag_by_priority(broker, model)).values())


async def read_lag_by_priority(broker: Broker, model: str) -> dict[str, int]:
    """The lag of each priority level of ``model`` (``high``, ``normal``, ``low``).

    Read one level after the other: a broker client that swallows a cancellation (nats-py's can) then still
    finishes the read it was in, as with one subject, instead of ``gather`` turning it into a cancelled read.
    """
    return {
        level: await broker.lag(c.request_subject(model, level), c.consumer_name(model, level))
        for level in c.PRIORITIES
    }


async def read_queue_age(broker: Broker, model: str) -> float | None:
    """Seconds the model's oldest unfinished request has waited: the oldest over its priority levels (each level's
    ``Broker.oldest_waiting_age_s``); None when none waits. Raises what the broker raises."""
    ages = [
        await broker.oldest_waiting_age_s(c.request_subject(model, level), c.consumer_name(model, level))
        for level in c.PRIORITIES
    ]
    known = [age for age in ages if age is not None]
    return max(known) if known else None


class LagMonitor:
    """Refreshes ``fleet_queue_lag`` for ``models`` every ``interval_s``; ``async with`` starts and stops it."""

    def __init__(self, broker: Broker, models: Iterable[str], interval_s: float = 5.0) -> None:
        self.broker = broker
        self.models = list(models)
        self.interval_s = interval_s
        self.last: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def refresh(self) -> dict[str, int]:
        for model in self.models:
            try:
                self.last[model] = lag = await read_lag(self.broker, model)
            except Exception as exc:
                log.warning("lag of %s not read: %s", model, exc)
                continue
            QUEUE_LAG.labels(model).set(lag)
        return dict(self.last)

    async def _run(self) -> None:
        while not self._stop.is_set():
            await self.refresh()
            await wait_event(self._stop, self.interval_s)

    async def __aenter__(self) -> LagMonitor:
        self._task = asyncio.create_task(self._run(), name="lag-monitor")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task])
