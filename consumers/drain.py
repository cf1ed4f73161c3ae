"""An operator's drain request for one worker: a control event on ``fleet.ctl.drain.<worker_id>``
(``POST /v1/workers/{worker_id}/drain`` sends it).

``DrainListener`` listens on the worker's own subject and calls ``on_drain`` once, for the first request naming
this worker. What ``on_drain`` does is the owner's choice: ``fleet worker`` sets the same stop event SIGTERM sets,
so the process drains (stops fetching, finishes and settles what it holds) and exits; a worker without an owner's
callback runs its own ``stop``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fleet import constants as c
from fleet.brokers.base import Broker, EventStream
from fleet.brokers.events import Listener, validated
from fleet.schemas.wire import DrainRequest

log = logging.getLogger(__name__)


class DrainListener:
    def __init__(self, broker: Broker, worker_id: str, on_drain: Callable[[], object]) -> None:
        self.worker_id = worker_id
        self.on_drain = on_drain
        self.requested = False
        self._listener = Listener(broker, c.drain_subject(worker_id), self._listen, f"{worker_id}-drain")

    async def start(self) -> None:
        await self._listener.start()

    async def stop(self) -> None:
        """Idempotent; safe to call from ``on_drain``'s consequences (the listener has returned by then)."""
        await self._listener.stop()

    async def _listen(self, events: EventStream) -> None:
        async for request in validated(events, DrainRequest, "drain request"):
            if request.worker_id != self.worker_id:
                continue
            log.info("worker %s: drain requested by an operator; stopping gracefully", self.worker_id)
            self.requested = True
            self.on_drain()
            return
