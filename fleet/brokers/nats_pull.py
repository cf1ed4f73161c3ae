"""The receiving side of the NATS broker: pull subscriptions, deliveries and control-event listeners.

Why not nats-py's ``PullSubscription.fetch``: once it has issued a long-poll request it waits for the *whole*
batch (or the timeout) before returning, while Fleet's contract is "return as soon as one message is there; the
batcher fills batches". So each ``fetch`` here talks the pull protocol directly, on one inbox per subscription and
a fresh reply subject per request (so a late status from an old request is never mistaken for the current one):

1. a ``no_wait`` request for ``max_messages``: the server sends what is available now, then a 404/408 status
   (skipped by a fetch that may wait when the latest message said nothing more was pending: the long-poll of 2.
   answers at once if something came since);
2. if nothing came, one long-poll request for a single message with ``expires`` = the time left: it completes
   when a message arrives (or with a 408 at expiry), so no request outlives the fetch and "reserves" messages
   for a worker that is not asking;
3. after a long-poll hit, one more ``no_wait`` request tops the batch up with whatever else is available, unless
   the message said the consumer had nothing more pending (its ``num_pending``): a lone message costs no extra
   round trip.

Messages that arrive outside a request (a late delivery racing a timeout) are kept and returned by the next fetch,
unless they waited so long that their ack wait is (nearly) over: no worker extends the ack wait of a buffered
message, so the server may already be redelivering it to another worker. Such a message is dropped, neither acked
nor nak-ed (a late nak could cut short the other worker's delivery); the server redelivers it when its ack wait
ends. Closing the subscription naks the fresh ones so they are redelivered at once.

Connection health. nats-py 2.16 ends its read loop on any unexpected exception without changing the client's
status (a PONG that answers a ``flush`` which already timed out raises ``InvalidStateError``): the client then
claims to be connected while nothing is received. So Fleet never calls ``flush``; its round trips are requests,
which are safe to time out or cancel (``round_trip``), and ``revive_if_stuck`` detects a dead read loop and makes
nats-py reconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as CoreSubscription
from nats.errors import Error as NatsError
from nats.errors import StaleConnectionError

from fleet import constants as c
from fleet.brokers.base import Delivery
from fleet.brokers.events import QueuedEvents
from fleet.brokers.nats_client import FleetNatsClient
from fleet.errors import BrokerUnavailable

log = logging.getLogger(__name__)

API_PREFIX = "$JS.API"
ACCOUNT_INFO_SUBJECT = f"{API_PREFIX}.INFO"  # answered by JetStream itself: the round trip of ping and listen
REPLY_GRACE_S = 0.25  # how long past a request's expiry we wait for the server's answer
MIN_LONG_POLL_S = 0.001  # below this, a long-poll is not worth a round trip (and the server's least expiry)
# A buffered message is handed out only within this share of its ack wait, leaving the worker time to extend it.
BUFFERED_SHARE_OF_ACK_WAIT = 0.5
_V1_TOKENS, _V2_TOKENS = 9, 12  # tokens of a JetStream ack subject without and with a domain (nats-py's names)
_NO_MORE = ("404", "408")  # "no messages" (no_wait) and "request timeout" (expires) end a pull normally
# 409s that end a pull because the server is going away or moving: the fetch returns [] and the next one waits.
_TRANSIENT = ("Server Shutdown", "Leadership Change")


async def round_trip(nc: NATS, timeout_s: float) -> bytes:
    """Ask JetStream for the account info and return its answer (JSON) within ``timeout_s``.

    The reply proves the server has processed everything sent before. Unlike ``nc.flush``, a request that times
    out or is cancelled leaves nothing behind in nats-py. Raises nats-py's ``TimeoutError`` or ``NoRespondersError``
    (JetStream is not enabled) or another ``nats.errors.Error``.
    """
    reply = await nc.request(ACCOUNT_INFO_SUBJECT, b"", timeout=timeout_s)
    return reply.data


async def revive_if_stuck(nc: NATS, where: str) -> None:
    """Raise ``BrokerUnavailable`` after starting a reconnect when nats-py stopped reading a connected client.

    nats-py has no public health check: its read loop task is private. Reconnecting restarts the loop and renews
    every subscription, so subscriptions and listeners carry on once the client is connected again.
    """
    reading: asyncio.Task[None] | None = getattr(nc, "_reading_task", None)
    if not nc.is_connected or (reading is not None and not reading.done()):
        return
    log.error("the NATS client stopped reading from %s while connected; reconnecting", where)
    await nc._process_op_err(StaleConnectionError())
    raise BrokerUnavailable(f"the NATS client had stopped reading from {where}; reconnecting, try again shortly")


def reply_counts(reply: str) -> tuple[int, int]:
    """``(num_delivered, num_pending)`` of a JetStream message, read from its ack subject as nats-py's
    ``Msg.metadata`` reads them, without building its metadata objects (two dataclasses and a datetime) per message.

    Both forms of the subject are read: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``
    and the one with a domain and an account hash before the stream (11 or 12 tokens). Raises ``ValueError`` for a
    subject that is neither.
    """
    tokens = reply.split(".")
    if len(tokens) < _V1_TOKENS or tokens[0] != "$JS" or tokens[1] != "ACK":
        raise ValueError(f"not a JetStream ack subject: {reply!r}")
    if len(tokens) == _V1_TOKENS:
        return int(tokens[4]), int(tokens[8])
    if len(tokens) >= _V2_TOKENS - 1:
        return int(tokens[6]), int(tokens[10])
    raise ValueError(f"not a JetStream ack subject: {reply!r}")


class NatsDelivery:
    """A JetStream message. ``nak`` and ``term`` wait for the server's confirmation; ``ack`` and ``in_progress``
    are sent without one; ``ack_many`` acks a batch in one write."""

    __slots__ = (
        "_nc",
        "_reply",
        "_settled",
        "_timeout_s",
        "arrived_at",
        "data",
        "delivery_count",
        "headers",
        "msg_id",
        "pending",
        "subject",
    )

    def __init__(
        self,
        subject: str,
        reply: str,
        data: bytes,
        headers: dict[str, str] | None,
        nc: NATS,
        timeout_s: float,
        arrived_at: float = 0.0,
    ) -> None:
        """A message as the pull inbox received it; ``headers`` becomes its own (``msg_id`` taken out of it)."""
        headers = headers if headers is not None else {}
        self.msg_id: str | None = headers.pop(c.HEADER_MSG_ID, None)
        self.headers: dict[str, str] = headers
        self.subject = subject
        self.data = data
        self.arrived_at = arrived_at  # loop time
        self.pending: int | None = None  # the consumer's num_pending when the server sent it (None: unknown)
        try:  # the ack subject, read once
            delivered, self.pending = reply_counts(reply)
        except (ValueError, AttributeError):  # not a subject we know: let nats-py say what it makes of it
            delivered = Msg(_client=nc, subject=subject, reply=reply, data=data).metadata.num_delivered
        self.delivery_count: int = delivered or 1
        self._reply = reply
        self._nc = nc
        self._timeout_s = timeout_s
        self._settled = False

    async def ack(self) -> None:
        """Done: never deliver again. Sent without waiting for a confirmation, like nats-py's ``Msg.ack``: an ack
        lost in transit only means a redelivery, which Fleet's worker acks without recomputing (the job is already
        terminal in the store), and a batch of acks then costs no round trip per message."""
        if self._settled:
            return
        try:
            await self._nc.publish(self._reply, b"+ACK")
        except NatsError as exc:
            raise BrokerUnavailable(f"could not ack a message on {self.subject}: {exc!r}") from exc
        self._settled = True

    @staticmethod
    async def ack_many(deliveries: list[NatsDelivery]) -> None:
        """``ack`` each of ``deliveries`` (settled ones are skipped), all in one write to the connection: the same
        bytes as one ``ack`` after the other, without a publish call, a flush request and a future per message.
        While the client is not connected (or is closing, or the deliveries came on several connections) it falls
        back to ``ack`` one by one, which buffers or raises as nats-py does."""
        todo = [d for d in deliveries if not d._settled]
        if not todo:
            return
        nc = todo[0]._nc
        if not nc.is_connected or nc.is_draining_pubs or any(d._nc is not nc for d in todo):
            for delivery in todo:
                await delivery.ack()
            return
        command = b"".join([b"PUB %s 4\r\n+ACK\r\n" % d._reply.encode() for d in todo])
        try:
            await nc._send_command(command)  # what nats-py's publish does, once for the batch
            await nc._flush_pending()
        except NatsError as exc:
            raise BrokerUnavailable(f"could not ack {len(todo)} messages on {todo[0].subject}: {exc!r}") from exc
        nc.stats["out_msgs"] += len(todo)
        nc.stats["out_bytes"] += 4 * len(todo)
        for delivery in todo:
            delivery._settled = True

    async def nak(self, delay_s: float = 0.0) -> None:
        """Deliver again, to any subscriber of the group, after ``delay_s``."""
        body = b"-NAK" if delay_s <= 0 else b"-NAK " + json.dumps({"delay": int(delay_s * 1e9)}).encode()
        await self._settle(body, "nak")

    async def term(self) -> None:
        """Give up: never deliver again."""
        await self._settle(b"+TERM", "term")

    async def in_progress(self) -> None:
        """Restart the ack-wait clock (fire and forget)."""
        if self._settled:
            return
        try:
            await self._nc.publish(self._reply, b"+WPI")
        except NatsError as exc:
            raise BrokerUnavailable(f"could not extend the ack wait of a message on {self.subject}: {exc!r}") from exc

    async def _settle(self, body: bytes, what: str) -> None:
        if self._settled:
            return
        try:
            await self._nc.request(self._reply, body, timeout=self._timeout_s)
        except (TimeoutError, NatsError) as exc:
            raise BrokerUnavailable(
                f"NATS did not confirm the {what} of a message on {self.subject} ({exc!r}); "
                "it will be redelivered after the ack wait"
            ) from exc
        self._settled = True


class _Pull:
    """One outstanding pull request."""

    __slots__ = ("batch", "done", "failure", "got", "reply")

    def __init__(self, reply: str, batch: int, done: asyncio.Future[None]) -> None:
        self.reply = reply
        self.batch = batch
        self.got = 0
        self.done = done
        self.failure: str | None = None  # a status other than "no messages" / "request timeout"

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class NatsSubscription:
    """A competing consumer of a durable pull consumer (one per group)."""

    partitioned = False

    def __init__(
        self,
        nc: NATS,
        *,
        stream: str,
        durable: str,
        subject: str,
        group: str,
        settle_timeout_s: float,
        ack_wait_s: float,
    ) -> None:
        self.subject = subject
        self.group = group
        self.durable = durable
        self.dropped_stale = 0  # buffered messages dropped because their ack wait was (nearly) over
        self._nc = nc
        self._next_subject = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = nc.new_inbox()
        self._settle_timeout_s = settle_timeout_s
        self._max_buffered_s = ack_wait_s * BUFFERED_SHARE_OF_ACK_WAIT
        self._ready: deque[NatsDelivery] = deque()  # received, not handed out yet; in arrival order
        self._pull: _Pull | None = None
        self._seq = 0
        self._last_pending: int | None = None  # num_pending of the latest message received (None: unknown)
        self._lock = asyncio.Lock()
        self._sub: CoreSubscription | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._inbox + ".*", cb=self._on_msg)
        if isinstance(self._nc, FleetNatsClient):  # each message straight to _on_message, not through a queue
            self._nc.deliver_directly(self._sub, self._on_message)

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        """Up to ``max_messages`` messages as soon as one is available, or ``[]`` after ``timeout_s``."""
        if max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {max_messages}")
        self._check_open()
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + max(0.0, timeout_s)
            self._drop_stale()
            if not self._ready and await self._wait_connected(deadline):
                if not (self._drained and timeout_s > MIN_LONG_POLL_S):  # else the long-poll below asks as soon
                    await self._request(max_messages, None, timeout_s + REPLY_GRACE_S)
                remaining = deadline - loop.time()
                if not self._ready and remaining > MIN_LONG_POLL_S and not self._closed:
                    await self._request(1, remaining, remaining + REPLY_GRACE_S)
                    if 0 < len(self._ready) < max_messages and not self._closed and self._more_pending():
                        await self._request(max_messages - len(self._ready), None, REPLY_GRACE_S)
            return self._take(max_messages)

    async def close(self) -> None:
        """Stop receiving. Messages handed out but unsettled come back after the ack wait; buffered ones at once."""
        if self._closed:
            return
        self._closed = True
        if self._pull is not None:
            self._pull.finish()
        self._drop_stale()
        pending, self._ready = [arrived._reply for arrived in self._ready], deque()
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
            for reply in pending:
                await self._nc.publish(reply, b"-NAK")
        except NatsError as exc:
            log.debug("closing subscription %s/%s: %r", self.subject, self.group, exc)

    def _more_pending(self) -> bool:
        """Whether the consumer had more messages when the server sent the latest one (its ``num_pending``)."""
        if not self._ready:
            return True
        pending = self._ready[-1].pending
        return pending is None or pending > 0  # None: not a JetStream delivery we can read: ask

    @property
    def _drained(self) -> bool:
        """The latest message this subscription received left nothing pending: a fetch that may wait can go
        straight to its long-poll, which answers at once if something came since."""
        return self._last_pending == 0

    def _take(self, max_messages: int) -> list[Delivery]:
        out: list[Delivery] = []
        if self._closed:
            return out
        self._drop_stale()
        while self._ready and len(out) < max_messages:
            out.append(self._ready.popleft())
        return out

    def _drop_stale(self) -> None:
        """Forget buffered messages whose ack wait is (nearly) over: the server redelivers them, maybe elsewhere."""
        arrived_before = asyncio.get_running_loop().time() - self._max_buffered_s
        while self._ready and self._ready[0].arrived_at < arrived_before:
            self._ready.popleft()
            self.dropped_stale += 1
            log.info(
                "dropped a message of %s (group %s) buffered over %.1fs, too close to its ack wait; "
                "the server redelivers it",
                self.subject,
                self.group,
                self._max_buffered_s,
            )

    async def _request(self, batch: int, expires_s: float | None, wait_s: float) -> None:
        """Send one pull request and wait until it is complete (batch full or a status) or ``wait_s`` passed."""
        self._seq += 1
        pull = _Pull(f"{self._inbox}.{self._seq}", batch, asyncio.get_running_loop().create_future())
        body: dict[str, object] = {"batch": batch}
        if expires_s is None:
            body["no_wait"] = True  # the server ignores no_wait when expires is set
        else:
            body["expires"] = max(1_000_000, int(expires_s * 1e9) - 100_000)
        self._pull = pull
        try:
            await self._nc.publish(self._next_subject, json.dumps(body).encode(), reply=pull.reply)
            await asyncio.wait({pull.done}, timeout=wait_s)
        except NatsError as exc:
            raise BrokerUnavailable(f"pull request for {self.subject} (group {self.group}) failed: {exc!r}") from exc
        finally:
            self._pull = None
        if pull.failure is not None and not self._ready and not self._closed:
            # Raise rather than return [] at once: a persistent failure (consumer deleted) would spin the caller.
            raise BrokerUnavailable(f"pull from {self.subject} (group {self.group}) failed: {pull.failure}")

    async def _on_msg(self, msg: Msg) -> None:
        """nats-py's callback, where the client cannot hand messages over directly (not a ``FleetNatsClient``)."""
        self._on_message(msg.subject, msg.reply, msg.data, dict(msg.headers) if msg.headers else None)

    def _on_message(self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        pull = self._pull
        if subject.startswith(self._inbox):  # a status for one of our requests: 404, 408, 409, 100
            if pull is not None and subject == pull.reply:
                status = headers.get("Status") if headers else None
                if status == "100":  # idle heartbeat
                    return
                description = headers.get("Description", "") if headers else ""
                if description in _TRANSIENT:
                    log.info("pull on %s (group %s) ended: %s", self.subject, self.group, description)
                elif status not in _NO_MORE:
                    pull.failure = f"status {status} {description}".strip()
                pull.finish()
            return
        arrived = NatsDelivery(
            subject, reply, data, headers, self._nc, self._settle_timeout_s, asyncio.get_running_loop().time()
        )
        self._ready.append(arrived)
        self._last_pending = arrived.pending
        if pull is not None:
            pull.got += 1
            if pull.got >= pull.batch:
                pull.finish()

    async def _wait_connected(self, deadline: float) -> bool:
        """True when the connection can carry a request; while reconnecting, wait out the fetch and say False."""
        if self._nc.is_connected:
            await revive_if_stuck(self._nc, f"the server of {self.subject}")
            return True
        if self._nc.is_closed:
            raise BrokerUnavailable(f"the NATS connection is closed; cannot fetch from {self.subject}")
        await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable(f"subscription to {self.subject!r} (group {self.group!r}) is closed")


class NatsEventStream(QueuedEvents):
    """Core NATS messages matching one pattern, as an async iterator of ``(subject, data)``."""

    def __init__(self, nc: NATS, pattern: str, *, timeout_s: float) -> None:
        super().__init__(pattern)
        self._nc = nc
        self._timeout_s = timeout_s
        self._sub: CoreSubscription | None = None

    async def start(self) -> None:
        """Subscribe; return once the server knows the interest (a round trip), or raise ``BrokerUnavailable``."""
        self._sub = await self._nc.subscribe(self.pattern, cb=self._on_msg)
        try:
            await round_trip(self._nc, self._timeout_s)
        except (TimeoutError, NatsError) as exc:
            await self.close()
            raise BrokerUnavailable(f"NATS did not confirm a listener on {self.pattern}: {exc!r}") from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
        except NatsError as exc:
            log.debug("closing listener on %s: %r", self.pattern, exc)
        self._finish()

    async def _on_msg(self, msg: Msg) -> None:
        self.push(msg.subject, msg.data)
