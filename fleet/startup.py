"""Start-up that survives a broker or store that is not there yet.

A process that starts while nats-server, Kafka or Redis restarts (or before they are up, as in a Kubernetes
roll-out) retries each start-up step with exponential backoff until one start-up deadline
(``FLEET_STARTUP_TIMEOUT_S``, 60 s by default), logging each failed attempt at WARNING with its number and the next
delay, and then raises ``StartupTimeout``, whose message the CLI prints as one line. Only retriable errors
(``FleetError.retriable``: ``BrokerError``, ``StoreError``) are retried: a ``ConfigError`` means the process could
never start, so it fails at once.

An attempt in progress is never cut short (each client call has a timeout of its own, and a slow model load is not
a reason to give up), so giving up can come up to one attempt's timeout after the deadline.

Usage::

    deadline = Deadline.after(settings.startup_timeout_s)
    await retry_until(deadline, "connect to the broker", broker.connect)
    await retry_until(deadline, f"create the group of {model}", lambda: broker.ensure_model(model))
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fleet.errors import FleetError, StartupTimeout

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.25
MAX_DELAY_S = 5.0
JITTER = 0.2  # each delay is drawn within +-20 %, so workers started together do not retry in lock step

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on the monotonic clock by which start-up must have reached its broker and store."""

    at_s: float
    timeout_s: float
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def after(cls, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + timeout_s, timeout_s, clock)

    def remaining_s(self) -> float:
        return max(0.0, self.at_s - self.clock())


def backoff_s(attempt: int) -> float:
    """The pause after failed attempt ``attempt`` (1-based) before jitter: 0.25, 0.5, 1, 2, 4, 5, 5, ... seconds."""
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (attempt - 1))


async def retry_until(
    deadline: Deadline,
    what: str,
    fn: Callable[[], Awaitable[T]],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Await ``fn()`` until it succeeds; retry retriable ``FleetError``s with backoff until ``deadline``.

    Args:
        deadline: shared by every step of one process's start-up.
        what: the step, as it reads after "could not" (``"connect to the broker"``): it names the step in the
            WARNING of each failed attempt and in the final error.
        fn: one attempt; called again after each retriable failure, so it must be safe to call again.

    Returns:
        What the successful attempt returned.

    Raises:
        StartupTimeout: the step still failed with a retriable error when the deadline passed.
        FleetError: a non-retriable one (``ConfigError``, ...), at once.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except FleetError as exc:
            if not exc.retriable:
                raise
            remaining_s = deadline.remaining_s()
            if remaining_s <= 0:
                raise StartupTimeout(what, attempt, deadline.timeout_s, exc) from exc
            delay_s = min(remaining_s, backoff_s(attempt) * random.uniform(1 - JITTER, 1 + JITTER))
            log.warning(
                "start-up: could not %s (attempt %d): %s; next attempt in %.1fs (giving up in %.0fs)",
                what,
                attempt,
                exc.message,
                delay_s,
                remaining_s,
            )
            await sleep(delay_s)
