"""The in-memory broker: the embedded default of ``fleet up`` (gateway and workers share one instance).

It honours the same contract as NATS JetStream (see ``fleet.brokers.base``), inside one process:

* Each ``(subject, group)`` is a queue. A message published to a subject goes to every group on that subject.
  Groups exist from the first ``subscribe``/``ensure_model`` on. Messages published while a subject has no group at
  all are kept, like a stream, and handed to the first group created on it.
* Subscribers of one group compete: each message is out to at most one of them at a time.
* A fetched message that is not acked or terminated within ``ack_wait_s`` goes back to the head of its queue with
  ``delivery_count`` one higher; ``nak(delay_s)`` does the same after ``delay_s``; ``in_progress`` restarts the
  clock. ``Subscription.close()`` leaves its unsettled messages in flight, so they come back after the ack wait,
  exactly like a consumer that died. As on JetStream, a late ack (after the message went back) still settles it.
* ``msg_id`` de-duplicates within ``dedup_window_s``, scoped like the JetStream streams (requests, dead letters and
  inboxes each have their own window; any other subject is its own scope).

Everything runs on the event loop without locks: fetchers wait on futures that ``publish`` and a single timer per
group (for ack-wait expiry and delayed naks) resolve, so a waiting fetch wakes as soon as a message is available.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fleet import constants as c
from fleet.brokers.base import Delivery
from fleet.brokers.events import QueuedEvents
from fleet.brokers.subjects import check_group, check_subject, stream_for, subject_matches
from fleet.errors import BrokerUnavailable, ConfigError, PayloadTooLarge

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

log = logging.getLogger(__name__)


_WAITING, _IN_FLIGHT, _DELAYED, _DONE = range(4)


class _Message:
    __slots__ = ("data", "headers", "msg_id", "stored_at", "subject")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str], msg_id: str | None) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers
        self.msg_id = msg_id
        self.stored_at = time.time()  # unix seconds: when the broker took it (its queue age counts from here)


class _Entry:
    """One message in one group's queue."""

    __slots__ = ("deadline", "deliveries", "group", "key", "message", "state")

    def __init__(self, message: _Message, group: _Group, key: int) -> None:
        self.message = message
        self.group = group
        self.key = key
        self.deliveries = 0
        self.state = _WAITING
        self.deadline = 0.0


class MemoryDelivery:
    """A message handed out by ``MemorySubscription.fetch``."""

    __slots__ = ("_attempt", "_entry", "_settled", "data", "delivery_count", "headers", "msg_id", "subject")

    def __init__(self, entry: _Entry) -> None:
        message = entry.message
        self.subject = message.subject
        self.data = message.data
        self.headers = dict(message.headers) if message.headers else {}
        self.msg_id = message.msg_id
        self.delivery_count = entry.deliveries
        self._attempt = entry.deliveries  # which hand-out this is; callers may adjust delivery_count
        self._entry = entry
        self._settled = False

    def _current(self) -> _Entry | None:
        """The entry, when this delivery is still its current one (not settled, not timed out and handed out again)."""
        entry = self._entry
        if self._settled or entry.state != _IN_FLIGHT or entry.deliveries != self._attempt:
            return None
        return entry

    async def ack(self) -> None:
        """Done: never deliver again. Like JetStream, a late ack (after the ack wait) still counts."""
        if not self._settled:
            self._settled = True
            self._entry.group.finish(self._entry)

    async def term(self) -> None:
        """Give up: never deliver again."""
        await self.ack()

    async def nak(self, delay_s: float = 0.0) -> None:
        """Deliver again, to any subscriber of the group, after ``delay_s``."""
        entry = self._current()
        self._settled = True
        if entry is not None:
            entry.group.requeue(entry, delay_s)

    async def in_progress(self) -> None:
        """Restart the ack-wait clock."""
        entry = self._current()
        if entry is not None:
            entry.group.touch(entry)


class _Group:
    """The queue of one (subject, group): waiting, in flight (ordered by deadline) and delayed messages."""

    def __init__(self, subject: str, name: str, ack_wait_s: float) -> None:
        self.subject = subject
        self.name = name
        self.ack_wait_s = ack_wait_s
        self.ready: deque[_Entry] = deque()
        # Deadlines are now + ack_wait_s, so insertion order is deadline order; in_progress re-inserts at the end.
        self.in_flight: OrderedDict[int, _Entry] = OrderedDict()
        self.delayed: list[tuple[float, int, _Entry]] = []
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.acked_in_ready = 0
        self._next_key = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def lag(self) -> int:
        return len(self.ready) - self.acked_in_ready + len(self.in_flight) + len(self.delayed)

    def oldest_stored_at(self) -> float | None:
        """When the oldest message not acked yet (waiting, delayed or in flight) was stored; None: none."""
        entries = [e for e in self.ready if e.state != _DONE]
        entries.extend(self.in_flight.values())
        entries.extend(e for _, _, e in self.delayed)
        return min((e.message.stored_at for e in entries), default=None)

    def add(self, message: _Message) -> None:
        self._next_key += 1
        self.ready.append(_Entry(message, self, self._next_key))
        self._wake_one()

    def take(self, max_messages: int, now: float) -> list[Delivery]:
        """Hand out up to ``max_messages`` waiting messages (after moving expired ones back)."""
        self._expire(now)
        out: list[Delivery] = []
        ready, in_flight = self.ready, self.in_flight
        deadline = now + self.ack_wait_s
        while ready and len(out) < max_messages:
            entry = ready.popleft()
            if entry.state == _DONE:  # acked late, after it went back to the queue
                self.acked_in_ready -= 1
                continue
            entry.deliveries += 1
            entry.state = _IN_FLIGHT
            entry.deadline = deadline
            in_flight[entry.key] = entry
            out.append(MemoryDelivery(entry))
        return out

    def finish(self, entry: _Entry) -> None:
        """Settle for good. A late ack of a message back in the queue marks it; ``take`` skips it."""
        if entry.state == _IN_FLIGHT:
            del self.in_flight[entry.key]
        elif entry.state == _WAITING:
            self.acked_in_ready += 1
        else:
            return  # already done, or delayed by a nak of its current holder, which wins
        entry.state = _DONE

    def requeue(self, entry: _Entry, delay_s: float) -> None:
        del self.in_flight[entry.key]
        if delay_s > 0:
            entry.state = _DELAYED
            heapq.heappush(self.delayed, (time.monotonic() + delay_s, entry.key, entry))
            self._arm()
        else:
            entry.state = _WAITING
            self.ready.appendleft(entry)
            self._wake_one()

    def touch(self, entry: _Entry) -> None:
        entry.deadline = time.monotonic() + self.ack_wait_s
        self.in_flight.move_to_end(entry.key)

    async def wait(self, timeout_s: float) -> None:
        """Wait until a message may be available (or ``timeout_s`` passed). Spurious wake-ups are allowed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiters.append(fut)
        self._arm()
        handle = loop.call_later(timeout_s, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()
            if not fut.done():
                fut.cancel()
            if fut in self.waiters:
                self.waiters.remove(fut)

    def wake_all(self) -> None:
        while self.waiters:
            _resolve(self.waiters.popleft())

    def _wake_one(self) -> None:
        waiters = self.waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _expire(self, now: float) -> None:
        """Move timed-out in-flight and due delayed messages back to the head of the queue, oldest first."""
        back: list[_Entry] = []
        in_flight = self.in_flight
        while in_flight:
            entry = next(iter(in_flight.values()))
            if entry.deadline > now:
                break
            del in_flight[entry.key]
            back.append(entry)
        while self.delayed and self.delayed[0][0] <= now:
            back.append(heapq.heappop(self.delayed)[2])
        if back:
            back.sort(key=lambda e: e.key)
            for entry in back:
                entry.state = _WAITING
            self.ready.extendleft(reversed(back))

    def _next_deadline(self) -> float | None:
        times = []
        if self.in_flight:
            times.append(next(iter(self.in_flight.values())).deadline)
        if self.delayed:
            times.append(self.delayed[0][0])
        return min(times) if times else None

    def _arm(self) -> None:
        """Make sure a timer fires at the next expiry while someone waits, so waiting fetchers see redeliveries."""
        when = self._next_deadline()
        if when is None or not self.waiters:
            return
        if self._timer is not None and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._expire(time.monotonic())
        if self.ready:
            self.wake_all()
        self._arm()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Topic:
    """All groups of one subject, and the messages kept for the first group while there is none."""

    __slots__ = ("backlog", "groups")

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.backlog: deque[_Message] = deque()

    def deliver(self, message: _Message) -> None:
        if not self.groups:
            self.backlog.append(message)
            return
        for group in self.groups.values():
            group.add(message)

    def group(self, subject: str, name: str, ack_wait_s: float) -> _Group:
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = _Group(subject, name, ack_wait_s)
            while self.backlog:
                group.add(self.backlog.popleft())
        return group


class MemorySubscription:
    """One competing consumer of a group."""

    partitioned = False

    def __init__(self, group: _Group, broker: MemoryBroker) -> None:
        self._group = group
        self._broker = broker
        self._closed = False

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        """Up to ``max_messages`` messages as soon as one is available, or ``[]`` after ``timeout_s``."""
        if max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {max_messages}")
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._group.take(max_messages, time.monotonic())
            if out or self._closed:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            await self._group.wait(remaining)

    async def close(self) -> None:
        """Stop receiving; fetched but unsettled messages come back after the ack wait."""
        if not self._closed:
            self._closed = True
            self._broker.forget(self)
            self._group.wake_all()

    def _check_open(self) -> None:
        if self._closed or self._broker.closed:
            raise BrokerUnavailable(
                f"subscription to {self._group.subject!r} (group {self._group.name!r}) is closed; subscribe again"
            )


class MemoryEventStream(QueuedEvents):
    """Control events matching one pattern, as an async iterator of ``(subject, data)``."""

    def __init__(self, pattern: str, broker: MemoryBroker) -> None:
        super().__init__(pattern)
        self._broker = broker

    async def close(self) -> None:
        if self._closed:
            return
        self._broker.forget(self)
        self._finish()


class MemoryBroker:
    """In-process broker with JetStream semantics (durable groups, acks, redelivery, de-duplication)."""

    scheme = "memory"

    def __init__(self, *, ack_wait_s: float, dedup_window_s: float, max_message_bytes: int) -> None:
        if ack_wait_s <= 0 or dedup_window_s <= 0 or max_message_bytes < 1:
            raise ConfigError("ack_wait_s and dedup_window_s must be > 0 and max_message_bytes >= 1")
        self.ack_wait_s = ack_wait_s
        self.dedup_window_s = dedup_window_s
        self.max_message_bytes = max_message_bytes
        self.closed = False
        self._topics: dict[str, _Topic] = {}
        # (scope, msg_id) -> expiry; insertion order is expiry order because the window is constant.
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._subscriptions: set[MemorySubscription] = set()
        self._listeners: set[MemoryEventStream] = set()

    @classmethod
    def from_settings(cls, settings: FleetSettings, **overrides: Any) -> MemoryBroker:
        """Build from ``FleetSettings`` (keyword ``overrides`` win)."""
        kwargs: dict[str, Any] = {
            "ack_wait_s": settings.ack_wait_s,
            "dedup_window_s": settings.dedup_window_s,
            "max_message_bytes": settings.max_message_bytes,
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    async def connect(self) -> None:
        """Nothing to connect to; a closed broker stays closed."""
        self._check_open()

    async def close(self) -> None:
        """Idempotent. Wakes waiting fetches and ends listeners."""
        if self.closed:
            return
        self.closed = True
        for sub in list(self._subscriptions):
            await sub.close()
        for stream in list(self._listeners):
            await stream.close()

    async def ping(self) -> None:
        self._check_open()

    async def ensure_model(self, model: str) -> None:
        """Create the request queues of ``model``, one per priority level, each with its worker group."""
        self._check_open()
        if not c.MODEL_NAME_RE.match(model):
            raise ConfigError(f"model name {model!r} must match {c.MODEL_NAME_RE.pattern}")
        for level in c.PRIORITIES:
            subject = c.request_subject(model, level)
            self._topic(subject).group(subject, c.consumer_name(model, level), self.ack_wait_s)

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Enqueue ``data`` for every group of ``subject``; a repeated ``msg_id`` inside the window is dropped."""
        self._check_open()
        if len(data) > self.max_message_bytes:
            raise PayloadTooLarge(len(data), self.max_message_bytes, what="message")
        topic = self._topics.get(subject) or self._topic(subject)
        if msg_id is not None and self._duplicate(subject, msg_id):
            log.debug("dropped duplicate of %s on %s", msg_id, subject)
            return
        topic.deliver(_Message(subject, data, dict(headers) if headers else {}, msg_id))

    async def subscribe(self, subject: str, group: str) -> MemorySubscription:
        """A competing consumer of ``group`` on ``subject`` (the group is created if needed)."""
        self._check_open()
        check_group(group)
        sub = MemorySubscription(self._topic(subject).group(subject, group, self.ack_wait_s), self)
        self._subscriptions.add(sub)
        return sub

    async def lag(self, subject: str, group: str) -> int:
        """Messages the group has not acked yet: waiting, delayed and in flight."""
        topic = self._topics.get(subject)
        if topic is None:
            return 0
        found = topic.groups.get(group)
        if found is not None:
            return found.lag()
        return len(topic.backlog)  # what a first group created now would receive

    async def oldest_waiting_age_s(self, subject: str, group: str) -> float | None:
        """Seconds since the oldest message the group has not acked was stored (waiting, delayed or in flight);
        None when there is none. Without that group: the oldest a first group created now would receive."""
        topic = self._topics.get(subject)
        if topic is None:
            return None
        found = topic.groups.get(group)
        oldest = (
            found.oldest_stored_at() if found is not None else min((m.stored_at for m in topic.backlog), default=None)
        )
        return None if oldest is None else max(0.0, time.time() - oldest)

    async def emit(self, subject: str, data: bytes) -> None:
        """Best effort: hand the event to every current listener whose pattern matches."""
        self._check_open()
        if len(data) > self.max_message_bytes:
            raise PayloadTooLarge(len(data), self.max_message_bytes, what="event")
        for stream in self._listeners:
            if subject_matches(stream.pattern, subject):
                stream.push(subject, data)

    async def listen(self, subject: str) -> MemoryEventStream:
        """Events on subjects matching ``subject`` (NATS wildcards) from now on."""
        self._check_open()
        stream = MemoryEventStream(check_subject(subject, wildcards=True), self)
        self._listeners.add(stream)
        return stream

    def forget(self, item: MemorySubscription | MemoryEventStream) -> None:
        if isinstance(item, MemorySubscription):
            self._subscriptions.discard(item)
        else:
            self._listeners.discard(item)

    def _topic(self, subject: str) -> _Topic:
        topic = self._topics.get(subject)
        if topic is None:
            check_subject(subject)
            topic = self._topics[subject] = _Topic()
        return topic

    def _duplicate(self, subject: str, msg_id: str) -> bool:
        now = time.monotonic()
        seen = self._seen
        while seen:
            key, expiry = next(iter(seen.items()))
            if expiry > now:
                break
            del seen[key]
        key = (stream_for(subject) or subject, msg_id)
        if key in seen:
            return True
        seen[key] = now + self.dedup_window_s
        return False

    def _check_open(self) -> None:
        if self.closed:
            raise BrokerUnavailable("the in-memory broker is closed; create a new one")
