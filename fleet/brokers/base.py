"""The broker seam: a small Protocol that NATS JetStream, Kafka and the in-memory broker all implement.

Contract (checked by ``tests/contract/test_broker_contract.py`` on every implementation):

* ``publish`` is durable: it returns only after the broker acknowledged the message, and raises
  ``PublishFailed``/``BrokerUnavailable`` otherwise. A second publish with the same ``msg_id`` inside the
  de-duplication window is dropped (NATS: ``Nats-Msg-Id``; Kafka: idempotent producer keyed by the job id;
  memory: a window of seen ids).
* ``subscribe(subject, group)`` is a durable pull subscription shared by every subscriber of the same group
  (competing consumers). Each message goes to one subscriber at a time. Messages published before the group
  existed are kept for it. Several groups on one subject each get every message on Kafka and in memory; on NATS
  a request or inbox subject has exactly one group (work-queue retention) and a second is refused.
* ``Subscription.fetch(n, timeout_s)`` returns as soon as at least one message is available (up to ``n`` of those
  immediately available), or ``[]`` after ``timeout_s``. Batch filling is the caller's job
  (``fleet.consumers.batcher``).
* A fetched message that is neither acked nor terminated within ``ack_wait_s`` (or that is ``nak``-ed) is
  delivered again, with ``delivery_count`` one higher. Delivery is at-least-once.
* ``lag(subject, group)`` counts messages not yet acked by the group: waiting plus in flight. Acks may be sent
  without waiting for a confirmation (NATS), so lag reflects an ack within milliseconds rather than at once.
* ``publish_many(messages)`` (optional: Kafka has it) publishes a list of ``Outgoing`` messages with ``publish``'s
  guarantees, de-duplication and errors, in fewer broker round trips; ``fleet.producers.publish.publish_all`` uses it
  where a broker has it.
* ``emit``/``listen`` carry best-effort control events (heartbeats, idle announcements): no durability, no acks.
  Subjects use NATS wildcards in ``listen``: ``*`` one token, ``>`` the rest.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(slots=True)  # not frozen: built for every message published, and a frozen __init__ costs 3x
class Outgoing:
    """One message for ``publish_many``: what ``Broker.publish`` takes, as one value."""

    subject: str
    data: bytes
    msg_id: str | None = None
    headers: Mapping[str, str] | None = None


@runtime_checkable
class Delivery(Protocol):
    """One delivered message. Exactly one of ack/nak/term settles it; settling twice is a no-op."""

    subject: str
    data: bytes
    headers: dict[str, str]
    msg_id: str | None
    delivery_count: int  # 1 on the first delivery

    async def ack(self) -> None:
        """Done: never deliver again."""

    async def nak(self, delay_s: float = 0.0) -> None:
        """Not done: deliver again (to any subscriber of the group) after ``delay_s``."""

    async def term(self) -> None:
        """Give up: never deliver again (after the caller dead-lettered it)."""

    async def in_progress(self) -> None:
        """Still working: restart the ack-wait clock."""


async def ack_all(deliveries: Sequence[Delivery]) -> None:
    """``ack`` every delivery. A delivery class with an ``ack_many`` static method (NATS: one write for the batch)
    acks its run of the list at once; the rest are acked one by one, in order. An ack that fails does not stop
    the others: the first exception is raised once all were tried."""
    failure: Exception | None = None
    i = 0
    while i < len(deliveries):
        kind = type(deliveries[i])
        j = i + 1
        while j < len(deliveries) and type(deliveries[j]) is kind:
            j += 1
        ack_many = getattr(kind, "ack_many", None)
        run = list(deliveries[i:j])
        calls = [functools.partial(ack_many, run)] if ack_many is not None else [delivery.ack for delivery in run]
        for call in calls:
            try:
                await call()
            except Exception as exc:
                failure = failure or exc
        i = j
    if failure is not None:
        raise failure


class Subscription(Protocol):
    # True when a message this subscriber fetched could not have gone to another member of its group anyway
    # (Kafka: a partition has one reader per group), so a consumer fetching ahead keeps no work from its peers.
    partitioned: bool

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]: ...

    async def close(self) -> None:
        """Stop receiving. Fetched but unsettled messages are redelivered after the ack wait."""


class EventStream(Protocol):
    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]: ...

    async def close(self) -> None: ...


class Broker(Protocol):
    """A message broker as Fleet uses it. Construct, ``await connect()``, use, ``await close()``."""

    scheme: str  # "memory", "nats" or "kafka"

    async def connect(self) -> None:
        """Connect; raise ``BrokerUnavailable`` with a message naming the URL when it cannot."""

    async def close(self) -> None:
        """Idempotent."""

    async def ensure_model(self, model: str) -> None:
        """Create (idempotently) what a model needs: request and dead-letter subjects/topics and the group."""

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None: ...

    async def subscribe(self, subject: str, group: str) -> Subscription: ...

    async def lag(self, subject: str, group: str) -> int: ...

    async def oldest_waiting_age_s(self, subject: str, group: str) -> float | None:
        """Seconds since the oldest message ``group`` has not acked on ``subject`` was stored by the broker (waiting
        or in flight: the queue age the autoscaler may target); None when there is none. Raises
        ``BrokerUnavailable`` when the broker cannot be asked."""

    async def emit(self, subject: str, data: bytes) -> None: ...

    async def listen(self, subject: str) -> EventStream: ...

    async def ping(self) -> None:
        """Raise ``BrokerUnavailable`` when the broker cannot be reached now."""
