"""The worker's half of direct assignment: announce free slots to one dispatcher at a time (JIQ).

A worker in ``dispatch`` routing keeps at most one idle token out. When it has a free slot and no token out, it
announces itself (``IdleAnnouncement``) to one live dispatcher, picked by the rule the dispatchers advertise in
their heartbeats (random or SQ(d), ``fleet.routing.announce_to``). The token is used up when an assignment that
carries it arrives. When work arrives by another route and no slot is left, the worker retracts its token so
that nobody queues work behind a busy worker. The current token is repeated every ``refresh_s`` (the dispatcher
ignores repeats), so a lost announcement or a restarted dispatcher heals within that time; a token held by a
dispatcher that stopped heartbeating is given up and announced elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery, EventStream
from fleet.brokers.events import validated
from fleet.routing import announce_to
from fleet.schemas.wire import DispatcherBeat, IdleAnnouncement
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Token:
    dispatcher_id: str
    seq: int
    sent_at: float


class IdleAnnouncer:
    """Announces a worker's free slots. ``free_slots`` is read whenever something may have changed."""

    def __init__(
        self,
        broker: Broker,
        *,
        model: str,
        worker_id: str,
        free_slots: Callable[[], int],
        heartbeat_interval_s: float,
        rng: random.Random | None = None,
    ) -> None:
        self.broker = broker
        self.model = model
        self.worker_id = worker_id
        self._free_slots = free_slots
        self._stale_after_s = 3 * heartbeat_interval_s
        self.refresh_s = min(1.0, heartbeat_interval_s)
        self._rng = rng or random.Random()
        self._dispatchers: dict[str, tuple[float, DispatcherBeat]] = {}
        self._token: _Token | None = None
        self._seq = 0
        self._poke = asyncio.Event()
        self._stream: EventStream | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.announced = 0

    async def start(self) -> None:
        self._stream = await self.broker.listen(c.dispatcher_subject(self.model))
        self._tasks = [
            asyncio.create_task(self._read_beats(self._stream), name=f"{self.worker_id}-dispatcher-beats"),
            asyncio.create_task(self._announce_loop(), name=f"{self.worker_id}-announce"),
        ]

    async def stop(self) -> None:
        """Retract the token (best effort) and stop listening. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._poke.set()
        await cancel_and_wait(self._tasks)
        if self._token is not None:
            await self._emit(self._token.dispatcher_id, self._token.seq, 0)
            self._token = None
        if self._stream is not None:
            await self._stream.close()

    def poke(self) -> None:
        """Something changed (a slot freed up, work arrived): reconsider the token soon."""
        self._poke.set()

    def on_assigned(self, deliveries: Iterable[Delivery]) -> None:
        """Fetched assignments: the one that carries the current token uses it up."""
        token = self._token
        if token is not None:
            for delivery in deliveries:
                headers = delivery.headers
                if headers.get(c.HEADER_TOKEN) == str(token.seq) and headers.get(c.HEADER_DISPATCHER) == (
                    token.dispatcher_id
                ):
                    self._token = None
                    break
        self._poke.set()

    @property
    def token(self) -> tuple[str, int] | None:
        return None if self._token is None else (self._token.dispatcher_id, self._token.seq)

    @property
    def dispatchers(self) -> list[str]:
        return sorted(self._live_dispatchers())

    # -- loops ------------------------------------------------------------------------------------------------
    async def _read_beats(self, stream: EventStream) -> None:
        async for beat in validated(stream, DispatcherBeat, "dispatcher heartbeat"):
            if beat.model != self.model:
                continue
            if beat.state == "stopped":
                self._dispatchers.pop(beat.dispatcher_id, None)
            else:
                known = beat.dispatcher_id in self._dispatchers
                self._dispatchers[beat.dispatcher_id] = (time.monotonic(), beat)
                if not known:
                    self._poke.set()

    async def _announce_loop(self) -> None:
        while not self._stopping:
            await wait_event(self._poke, self.refresh_s)
            self._poke.clear()
            if self._stopping:
                return
            try:
                await self._reconsider()
            except Exception:
                log.exception("worker %s: idle announcement failed; retrying", self.worker_id)

    async def _reconsider(self) -> None:
        live = self._live_dispatchers()
        token, free = self._token, self._free_slots()
        if token is not None and token.dispatcher_id not in live:
            self._token = token = None  # its dispatcher is gone: the token went with it
        if token is not None and free <= 0:
            self._token = None
            await self._emit(token.dispatcher_id, token.seq, 0)  # retract: busy with work from elsewhere
        elif token is None and free > 0 and live:
            await self._announce(live, free)
        elif token is not None and time.monotonic() - token.sent_at >= self.refresh_s:
            token.sent_at = time.monotonic()
            await self._emit(token.dispatcher_id, token.seq, free)  # a repeat heals a lost announcement

    async def _announce(self, live: dict[str, DispatcherBeat], free: int) -> None:
        ids = list(live)
        newest = max(live.values(), key=lambda beat: beat.sent_at)
        choice = ids[announce_to([live[i].idle_length for i in ids], newest.announce, newest.d, self._rng)]
        self._seq += 1
        self._token = _Token(choice, self._seq, time.monotonic())
        live[choice].idle_length += 1  # until its next heartbeat, count our token in its queue
        await self._emit(choice, self._seq, free)
        self.announced += 1

    def _live_dispatchers(self) -> dict[str, DispatcherBeat]:
        horizon = time.monotonic() - self._stale_after_s
        for dispatcher_id in [d for d, (seen, _) in self._dispatchers.items() if seen < horizon]:
            del self._dispatchers[dispatcher_id]
        return {d: beat for d, (_, beat) in self._dispatchers.items() if beat.announce != "none"}

    async def _emit(self, dispatcher_id: str, seq: int, free: int) -> None:
        note = IdleAnnouncement(worker_id=self.worker_id, model=self.model, seq=seq, free_slots=free)
        try:
            await self.broker.emit(c.idle_subject(self.model, dispatcher_id), note.model_dump_json().encode())
        except Exception as exc:
            log.warning("worker %s: idle announcement not sent: %s", self.worker_id, exc)
