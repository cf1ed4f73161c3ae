"""Micro-batch collection: wait for the first message, then let the batch fill for at most ``max_wait_ms``."""

from __future__ import annotations

import asyncio

from fleet.brokers.base import Delivery, Subscription


async def collect_batch(sub: Subscription, max_batch: int, max_wait_s: float, idle_timeout_s: float) -> list[Delivery]:
    """Return up to ``max_batch`` deliveries, or ``[]`` when nothing arrived within ``idle_timeout_s``.

    The clock for ``max_wait_s`` starts with the first message, so an idle worker answers a lone request as soon
    as it arrives plus at most ``max_wait_s``; with ``max_wait_s == 0`` it takes only what is already waiting.
    """
    batch = list(await sub.fetch(max_batch, idle_timeout_s))
    if not batch:
        return batch
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    while len(batch) < max_batch:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        more = await sub.fetch(max_batch - len(batch), remaining)
        if not more:
            break
        batch.extend(more)
    return batch
