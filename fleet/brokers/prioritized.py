"""One subscription over a model's priority levels: it takes higher levels first, by ``fleet.priorities``'s rule.

Each level is an ordinary subscription of the broker (``fleet.req.<model>.high`` with group ``fleet-<model>-high``,
``fleet.req.<model>`` with ``fleet-<model>``, ``fleet.req.<model>.low`` with ``fleet-<model>-low``), so acks, naks,
redeliveries, ack waits and de-duplication are each level's own and exactly as without priorities: a delivery is
handed out as its level's subscription made it. ``PrioritySubscription`` only chooses which level to read:

1. Round ``r`` looks at the levels in ``serve_order(r)`` and returns the first level that has messages *now*
   (what a finished wait left over, else a fetch with no wait). So a waiting message of a higher level goes out
   before any lower one, except in the rounds that the weights give to a lower level (low never starves).
2. When no level has anything, it waits on every level at once (one fetch per level with the time left) and
   returns as soon as any of them has a message. A level's wait that is still running when another level
   answered is not cancelled: it stays outstanding and its messages are taken by a later round (in that round's
   order), so a long-poll on an empty high level never delays normal work, and nothing is lost to a cancellation
   half-way through a broker's fetch.

A level whose fetch fails (its consumer was deleted, its broker call timed out) rests for ``FAILED_LEVEL_REST_S``
while the other levels go on serving; the error is logged, and raised by a fetch that found nothing elsewhere (the
caller backs off as from a plain subscription).

Messages a finished wait fetched beyond what a round returns are kept for the next rounds (they were fetched for
this consumer; the worker's next fetch comes within one batch). ``close`` lets the outstanding waits end (each
lasts at most the timeout of the fetch that started it), hands back what they and earlier waits brought (``nak``)
and closes every level.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery, Subscription
from fleet.errors import BrokerError, BrokerUnavailable
from fleet.priorities import Weights, check_weights, serve_order
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FAILED_LEVEL_REST_S = 1.0  # a level whose fetch failed is not read again for this long
CLOSE_WAIT_S = 5.0  # how long close lets outstanding waits end by themselves (they last one fetch's timeout)


class PrioritySubscription:
    """A ``Subscription`` over one subscription per priority level (``levels``: level name -> subscription)."""

    def __init__(self, levels: dict[str, Subscription], weights: Weights = c.DEFAULT_PRIORITY_WEIGHTS) -> None:
        if set(levels) != set(c.PRIORITIES):
            raise ValueError(f"a priority subscription needs one subscription per level {c.PRIORITIES}")
        self.weights = check_weights(weights)
        self.levels = levels
        self.partitioned = all(sub.partitioned for sub in levels.values())
        self.rounds = 0
        self.served = dict.fromkeys(c.PRIORITIES, 0)  # messages handed out per level
        self._kept: dict[str, deque[Delivery]] = {level: deque() for level in c.PRIORITIES}
        self._waits: dict[str, asyncio.Task[list[Delivery]]] = {}
        self._resting: dict[str, float] = {}  # level -> loop time until which it is not read (its fetch failed)
        self._failure: BrokerError | None = None  # the latest failure of this fetch, raised if nothing else came
        self._lock = asyncio.Lock()
        self._closed = False

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        """Up to ``max_messages`` messages of one level as soon as any level has one, or ``[]`` after ``timeout_s``."""
        if max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {max_messages}")
        if self._closed:
            raise BrokerUnavailable("the priority subscription is closed")
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + max(0.0, timeout_s)
            order = serve_order(self.rounds, self.weights)
            self.rounds += 1
            self._failure = None
            for level in order:
                got = await self._now(level, max_messages)
                if got:
                    return self._hand_out(level, got)
            while not self._closed and (remaining := deadline - loop.time()) > 0:
                self._start_waits(order, max_messages, remaining)
                if self._waits:
                    await asyncio.wait(self._waits.values(), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                else:  # every level rests after a failure: wait for the first to come back (or the deadline)
                    await asyncio.sleep(max(0.0, min(remaining, min(self._resting.values()) - loop.time())))
                for level in order:
                    got = self._finished(level, max_messages)
                    if got:
                        return self._hand_out(level, got)
            if self._failure is not None:
                raise self._failure
            return []

    def _start_waits(self, order: tuple[str, ...], max_messages: int, remaining: float) -> None:
        now = asyncio.get_running_loop().time()
        for level in order:
            if level not in self._waits and self._resting.get(level, 0.0) <= now:
                self._waits[level] = asyncio.ensure_future(self.levels[level].fetch(max_messages, remaining))

    async def _now(self, level: str, max_messages: int) -> list[Delivery]:
        """What ``level`` has at once: kept messages, a finished wait's, else a fetch that does not wait."""
        got = self._finished(level, max_messages)
        if got or level in self._waits:  # a wait still running holds the level's fetch: it reports when it has some
            return got
        if self._resting.get(level, 0.0) > asyncio.get_running_loop().time():
            return []
        try:
            return list(await self.levels[level].fetch(max_messages, 0.0))
        except BrokerError as exc:
            self._rest(level, exc)
            return []

    def _finished(self, level: str, max_messages: int) -> list[Delivery]:
        """Kept messages of ``level``, after taking in its wait if that finished (a failed wait rests the level)."""
        wait = self._waits.get(level)
        if wait is not None and wait.done():
            del self._waits[level]
            try:
                self._kept[level].extend(wait.result())
            except BrokerError as exc:
                self._rest(level, exc)
        kept = self._kept[level]
        return [kept.popleft() for _ in range(min(max_messages, len(kept)))]

    def _rest(self, level: str, exc: BrokerError) -> None:
        log.warning(
            "fetch from the %s level failed (%s); reading the other levels, this one again in %.0fs",
            level,
            exc,
            FAILED_LEVEL_REST_S,
        )
        self._resting[level] = asyncio.get_running_loop().time() + FAILED_LEVEL_REST_S
        self._failure = exc

    def _hand_out(self, level: str, got: list[Delivery]) -> list[Delivery]:
        self.served[level] += len(got)
        return got

    async def close(self) -> None:
        """Stop the waits, hand kept messages back, close every level. Idempotent."""
        if self._closed:
            return
        self._closed = True
        waits = list(self._waits.values())
        if waits:  # let them end by their own timeout: a pull cut short could leave the server a request to fill
            await asyncio.wait(waits, timeout=CLOSE_WAIT_S)
        await cancel_and_wait(waits, timeout_s=2.0)
        for wait in waits:
            if wait.done() and not wait.cancelled() and wait.exception() is None:
                self._kept[self._level_of(wait)].extend(wait.result())
        self._waits.clear()
        for kept in self._kept.values():
            while kept:
                with contextlib.suppress(BrokerError):
                    await kept.popleft().nak()
        for sub in self.levels.values():
            with contextlib.suppress(Exception):
                await sub.close()

    def _level_of(self, wait: asyncio.Task[list[Delivery]]) -> str:
        return next(level for level, task in self._waits.items() if task is wait)


async def subscribe_priorities(
    broker: Broker, model: str, weights: Weights = c.DEFAULT_PRIORITY_WEIGHTS
) -> PrioritySubscription:
    """Every priority level of ``model``'s requests, in its workers' groups (``request_subject``, ``consumer_name``)."""
    return await subscribe_levels(
        broker, lambda level: (c.request_subject(model, level), c.consumer_name(model, level)), weights
    )


async def subscribe_inbox(
    broker: Broker, worker_id: str, weights: Weights = c.DEFAULT_PRIORITY_WEIGHTS
) -> PrioritySubscription:
    """Every priority level of a worker's inbox (``inbox_subject``, ``inbox_group``): what dispatchers assigned it."""
    return await subscribe_levels(
        broker, lambda level: (c.inbox_subject(worker_id, level), c.inbox_group(worker_id, level)), weights
    )


async def subscribe_levels(
    broker: Broker, names: Callable[[str], tuple[str, str]], weights: Weights = c.DEFAULT_PRIORITY_WEIGHTS
) -> PrioritySubscription:
    """Subscribe to ``names(level)`` = (subject, group) of every level, at once, and combine them; on failure none
    is left open."""
    levels = c.PRIORITIES
    opened = await asyncio.gather(*(broker.subscribe(*names(level)) for level in levels), return_exceptions=True)
    subs = {level: sub for level, sub in zip(levels, opened, strict=True) if not isinstance(sub, BaseException)}
    failure = next((sub for sub in opened if isinstance(sub, BaseException)), None)
    if failure is None:
        return PrioritySubscription(subs, weights)
    for sub in subs.values():
        with contextlib.suppress(Exception):
            await sub.close()
    raise failure
