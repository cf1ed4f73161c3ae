"""An operator's drain request for one worker: a control event on ``fleet.ctl.drain.<worker_id>``
(``POST /v1/workers/{worker_id}/drain`` sends it).

``DrainListener`` listens on the worker's own subject and calls ``on_drain`` once, for the first request naming
this worker. What ``on_drain`` does is the owner's choice: ``fleet worker`` sets the same stop event SIGTERM sets,
so the process drains (stops fetching, finishes and settles what it holds) and exits; a worker without an owner's
callback runs its own ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fleet import constants as c
from fleet.brokers.base import Broker, EventStream
from fleet.brokers.events import validated
from fleet.tasks import cancel_and_wait
from schemas.wire import DrainRequest

log = logging.getLogger(__name__)


class DrainListener:
    def __init__(self, broker: Broker, worker_id: str, on_drain: Callable[[], object]) -> None:
        self.broker = broker
        self.worker_id = worker_id
        self.on_drain = on_drain
        self.requested = False
        self._events: EventStream | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._events = await self.broker.listen(c.drain_subject(self.worker_id))
        self._task = asyncio.create_task(self._listen(self._events), name=f"{self.worker_id}-drain")

    async def stop(self) -> None:
        """Idempotent; safe to call from ``on_drain``'s consequences (the listener has returned by then)."""
        events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(Exception):
                await events.close()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait([task])

    async def _listen(self, events: EventStream) -> None:
        async for request in validated(events, DrainRequest, "drain request"):
            if request.worker_id != self.worker_id:
                continue
            log.info("worker %s: drain requested by an operator; stopping gracefully", self.worker_id)
            self.requested = True
            self.on_drain()
            return
