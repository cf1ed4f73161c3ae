"""Waiting out a store outage: a call to the result store that fails is tried again with backoff, not given up.

A worker that cannot reach its store has computed nothing wrong: handing the message back would only burn one of
its deliveries and bring it back to a worker that cannot store it either. So the worker holds the message (its
ack deadline kept alive), tries again with backoff, and says it is ``degraded`` in its heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fleet.errors import StoreError
from fleet.tasks import wait_event

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class StoreOutage:
    """Retries store calls until they succeed; ``degraded`` while any call is failing."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._failing = 0

    @property
    def degraded(self) -> bool:
        return self._failing > 0

    async def call(self, make: Callable[[], Awaitable[T]], what: str, *, stop: asyncio.Event | None = None) -> T:
        """``await make()`` until it does not raise ``StoreError``.

        With ``stop``: once it is set, the next failure is raised instead of retried (a draining worker hands the
        message back rather than wait for a store that may be gone for good). Without it the caller's cancellation
        (a drain deadline) is the only way out.
        """
        delay_s = FIRST_BACKOFF_S
        attempt = 0
        try:
            while True:
                try:
                    return await make()
                except StoreError as exc:
                    if stop is not None and stop.is_set():
                        raise
                    attempt += 1
                    if attempt == 1:
                        self._failing += 1
                    if attempt == 1 or attempt % 10 == 0:
                        log.warning(
                            "%s: could not %s (%s); retrying (attempt %d)", self.owner, what, exc.message, attempt
                        )
                    if stop is not None:
                        await wait_event(stop, delay_s)
                    else:
                        await asyncio.sleep(delay_s)
                    delay_s = min(MAX_BACKOFF_S, delay_s * 2)
        finally:
            if attempt:
                self._failing -= 1
                log.info("%s: store reachable again after %d failed attempts to %s", self.owner, attempt, what)
