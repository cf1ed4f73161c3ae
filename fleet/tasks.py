"""Stopping background tasks without trusting every library to honour a cancellation, and waiting in loops
without losing one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them at most ``timeout_s``.

    Bounded because a client library may swallow a cancellation (nats-py's publish path does, in
    ``Client._flush_pending``): the loops that run in such tasks must also watch a stop flag, and a shutdown must
    not hang on the one that missed its cancellation.
    """
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    done, still = await asyncio.wait(pending, timeout=timeout_s)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task %s ended with %r", task.get_name(), task.exception())
    for task in still:
        log.warning("background task %s did not stop within %.1fs after its cancellation", task.get_name(), timeout_s)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s``; whether it is set.

    For the loops that sleep on a stop or wake-up event. ``asyncio.wait_for(event.wait(), t)`` is not safe there
    on Python 3.11: a cancellation that arrives in the same loop iteration as the event is swallowed (CPython
    gh-86296), so the loop goes on and its ``cancel()`` never ends it. ``asyncio.timeout`` counts cancellations and
    lets an outside one through.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
