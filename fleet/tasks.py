"""Stopping background tasks without trusting every library to honour a cancellation."""

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
