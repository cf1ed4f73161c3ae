"""Extending the ack deadline of deliveries a process holds, so that slow work is not redelivered meanwhile.

Workers hold a message from fetch to settle, dispatchers from fetch until its result is stored; both keep their
messages alive with ``keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from fleet.brokers.base import Delivery
from fleet.tasks import wait_event

log = logging.getLogger(__name__)


def keepalive_interval_s(ack_wait_s: float) -> float:
    """Three extensions per ack wait: one lost extension still leaves time for the next."""
    return max(0.2, ack_wait_s / 3)


async def keep_alive(
    held: Callable[[], Iterable[Delivery]], ack_wait_s: float, stop: asyncio.Event, owner: str
) -> None:
    """Until ``stop`` is set, tell the broker every ``ack_wait_s / 3`` that each held delivery is still in progress.

    A failed extension is logged and retried at the next tick: when the broker is away, the message may be
    redelivered, and the store's record makes that redelivery harmless.
    """
    interval_s = keepalive_interval_s(ack_wait_s)
    while not stop.is_set():
        await wait_event(stop, interval_s)
        failed = 0
        for delivery in list(held()):
            try:
                await delivery.in_progress()
            except Exception as exc:
                failed += 1
                last = exc
        if failed:
            log.warning("%s: could not extend %d ack deadlines: %s", owner, failed, last)
