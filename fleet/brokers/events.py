"""The queue half of an ``EventStream``, shared by the brokers whose events arrive by callback; ``validated``,
which every listener uses to read typed control events; and ``Listener``, the start / stop of one listening task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from fleet.brokers.base import Broker, EventStream
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

EVENT_QUEUE_SIZE = 10_000  # per listener; control events beyond this are dropped (they are best effort)


class QueuedEvents:
    """An async iterator of ``(subject, data)`` fed by ``push``. A listener that falls behind loses the newest
    events (counted in ``dropped``, logged now and then) rather than growing memory; ``_finish`` ends iteration."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._closed = False
        self.dropped = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, subject: str, data: bytes) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((subject, data))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("listener on %s is not keeping up: %d control events dropped", self.pattern, self.dropped)

    def __aiter__(self) -> QueuedEvents:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def _finish(self) -> None:
        """Stop: drop what is queued and wake the iterator with the end marker."""
        self._closed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)


M = TypeVar("M", bound=BaseModel)


async def validated(stream: AsyncIterable[tuple[str, bytes]], schema: type[M], what: str) -> AsyncIterator[M]:
    """The events of ``stream`` parsed as ``schema``; a malformed one is logged (naming ``what``) and skipped, so
    one bad publisher cannot stop a listener."""
    async for _subject, data in stream:
        try:
            yield schema.model_validate_json(data)
        except ValidationError as exc:
            log.warning("ignoring a malformed %s: %s", what, exc)


class Listener:
    """``broker.listen(pattern)`` consumed by ``consume(events)`` in one task named ``name``.

    ``async with`` (or ``start`` / ``stop``) runs it; ``stop`` is idempotent: it closes the stream, which ends the
    consumer's iteration, then cancels the task if it is still running (not when ``stop`` is called from it).
    """

    def __init__(
        self, broker: Broker, pattern: str, consume: Callable[[EventStream], Awaitable[None]], name: str
    ) -> None:
        self.broker = broker
        self.pattern = pattern
        self.consume = consume
        self.name = name
        self._events: EventStream | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Listener:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self._events = await self.broker.listen(self.pattern)
        self._task = asyncio.create_task(self._run(self._events), name=self.name)

    async def _run(self, events: EventStream) -> None:
        await self.consume(events)

    async def stop(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(Exception):
                await events.close()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():  # stop() may run from the consumer itself
            await cancel_and_wait([task])
