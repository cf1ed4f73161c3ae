"""The NATS JetStream broker.

Streams (created, or brought in line, at ``connect``):

* ``FLEET_REQ`` on ``fleet.req.>`` and ``FLEET_INBOX`` on ``fleet.inbox.>``: **work-queue retention**. A message
  is kept until the one group (durable consumer) on its subject acks or terminates it, so storage is the backlog,
  not the history, and a message published before any group exists (say by a raw nats-py producer) waits for the
  group created later, which receives everything waiting. ``max_age`` is the job TTL (``FLEET_JOB_TTL_S``): an
  older request belongs to an expired job. JetStream forbids two consumers with overlapping subjects on a
  work-queue stream, so **a request or inbox subject has exactly one group on NATS**; a second group is a
  ``ConfigError`` naming the group that owns the subject. (Kafka and the in-memory broker give every group every
  message; Fleet's workers of a model all share the group ``consumer_name(model)``.) A stream left with another
  retention by an older Fleet is a ``ConfigError`` at ``connect`` that says how to remove it: JetStream cannot
  change a stream's retention.
* ``FLEET_DLQ`` on ``fleet.dlq.>``: limits retention with a 7-day ``max_age``, so dead letters stay readable for
  inspection by any number of groups, whether or not a reader existed when they were written. The first group on a
  dead-letter subject receives everything the stream still holds; a group added later starts with new messages.

All streams de-duplicate on ``Nats-Msg-Id`` within ``dedup_window_s`` and accept messages up to
``max_message_bytes`` (plus room for headers).

``FLEET_REQ`` also bounds each subject (each model's queue) to ``max_queued`` messages (waiting or in flight, as
the stream keeps a message until its group acks it), with discard-new per subject: a publish beyond the bound is
refused (JetStream error 10077) and raises ``QueueFull``, so direct publishers are bounded as the gateway is. A
duplicate of a stored message is still acknowledged as a duplicate. JetStream has one per-subject limit per
stream, so it is the largest of Fleet's per-model bounds (``FleetSettings.broker_max_queued``); 0 leaves the
subjects unbounded. Like the window and size limit, every Fleet process that connects brings the stream in line
with its own settings: give them all the same ``FLEET_MAX_QUEUED*``.

Groups are durable pull consumers, one per ``(subject, group)``, named ``durable_name(subject, group)``, with
explicit acks, ``ack_wait = ack_wait_s`` and unlimited deliveries (a group found with a ``max_deliver`` is given
unlimited ones): the worker dead-letters by itself (``fleet.consumers.crashes``: the runs its record counts against it,
and ``delivery_count`` for poison messages that crash it before they start), never JetStream.

Acked messages that a work-queue stream still holds after a server crash (nats-server 2.9 writes the deletes
lazily) are purged below the consumer's ack floor when a subject is subscribed to and after each reconnection
(``fleet.brokers.nats_leftovers``): they would hold places of the per-subject bound for the job TTL.

``publish`` waits for the JetStream PubAck (``fleet.brokers.nats_pubacks``: one reply subscription per connection
instead of a nats-py request per publish). ``fetch`` is in ``fleet.brokers.nats_pull``. ``emit``/``listen`` are
core NATS publish/subscribe. ``ping`` is a JetStream API request (account info), never ``flush``: see
``fleet.brokers.nats_pull`` for the nats-py failure that rules ``flush`` out and how a stuck client is revived.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from fleet import constants as c
from fleet.brokers.nats_client import FleetNatsClient
from fleet.brokers.nats_leftovers import purge_acked, purge_acked_until_answered
from fleet.brokers.nats_pubacks import PubAcks
from fleet.brokers.nats_pull import NatsEventStream, NatsSubscription, revive_if_stuck, round_trip
from fleet.brokers.subjects import INBOX_STREAM, check_group, check_subject, stream_for
from fleet.errors import BrokerError, BrokerUnavailable, ConfigError, PayloadTooLarge, PublishFailed, QueueFull
from fleet.links import link_error, nats_options
from fleet.redaction import redact
from fleet.tasks import cancel_and_wait

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 5.0  # JetStream API calls, PubAcks and ack confirmations
PING_TIMEOUT_S = 1.5  # a health probe; below the gateway's 2 s readiness deadline
RECONNECT_WAIT_S = 1.0
# nats-py's own keep-alive: after MAX_OUTSTANDING_PINGS unanswered pings it reconnects. That also revives a client
# whose read loop died while nobody calls the broker (its default, 2 x 120 s, takes minutes).
PING_INTERVAL_S = 20
MAX_OUTSTANDING_PINGS = 3
NATS_AUTH_SETTINGS = "FLEET_NATS_CREDS_FILE, FLEET_NATS_NKEY_SEED_FILE or FLEET_NATS_USER / FLEET_NATS_PASSWORD_FILE"
MAX_ACK_PENDING = 20_000  # per group: messages out to workers but not yet settled
HEADER_ALLOWANCE_BYTES = 16 * 1024  # stream max_msg_size = max_message_bytes + this, for headers
DLQ_MAX_AGE_S = 7 * 24 * 3600.0
_STREAM_NAME_IN_USE = 10058  # JetStream error code: stream exists with a different configuration
_MAX_MSGS_PER_SUBJECT = 10077  # JetStream error code: a discard-new subject holds its limit of messages
# JetStream error codes: a work-queue stream refuses a consumer whose subjects overlap another consumer's.
_WORK_QUEUE_OVERLAP = (10099, 10100)
WORK_QUEUE_STREAMS = frozenset({c.REQ_STREAM, INBOX_STREAM})


def durable_name(subject: str, group: str) -> str:
    """The durable consumer that holds ``group`` on ``subject``: ``fleet-echo__fleet_req_echo``."""
    return f"{check_group(group)}__{subject.replace('.', '_')}"


def group_of(durable: str, subject: str) -> str:
    """The group a durable consumer on ``subject`` stands for (the durable itself when Fleet did not name it)."""
    return durable.removesuffix(f"__{subject.replace('.', '_')}")


class NatsBroker:
    """Fleet's broker on NATS JetStream. Construct, ``await connect()``, use, ``await close()``."""

    scheme = "nats"

    def __init__(
        self,
        url: str,
        *,
        ack_wait_s: float,
        dedup_window_s: float,
        max_message_bytes: int,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        request_max_age_s: float = float(c.DEFAULT_JOB_TTL_S),
        ping_timeout_s: float = PING_TIMEOUT_S,
        max_queued: int = 0,
        link_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``url`` is ``nats://host:port`` or ``tls://host:port`` (comma-separate several servers of one cluster).

        ``link_options`` are nats-py ``connect`` keywords for credentials and TLS (``fleet.links.nats_options``).

        ``request_max_age_s`` is the ``max_age`` of the request and inbox streams (the job TTL); ``ping_timeout_s``
        bounds one ``ping``; ``max_queued`` bounds the messages of each request subject (0: unbounded).
        """
        self.url = redact(url)  # what messages and logs name: never a password written in the URL
        self.ack_wait_s = ack_wait_s
        self.dedup_window_s = dedup_window_s
        self.max_message_bytes = max_message_bytes
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.request_max_age_s = request_max_age_s
        self.ping_timeout_s = ping_timeout_s
        self.max_queued = max_queued
        self._servers = [s.strip() for s in url.split(",") if s.strip()]
        self._link_options = dict(link_options or {})
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._pubacks: PubAcks | None = None
        self._closed = False
        self._groups: set[tuple[str, str]] = set()
        self._subscriptions: set[NatsSubscription] = set()
        self._listeners: set[NatsEventStream] = set()
        self._purges: set[asyncio.Task[None]] = set()  # leftover checks after a reconnection

    @classmethod
    def from_settings(cls, settings: FleetSettings, **overrides: Any) -> NatsBroker:
        """Build from ``FleetSettings`` (keyword ``overrides`` win)."""
        kwargs: dict[str, Any] = {
            "ack_wait_s": settings.ack_wait_s,
            "dedup_window_s": settings.dedup_window_s,
            "max_message_bytes": settings.max_message_bytes,
            "request_max_age_s": float(settings.job_ttl_s),
            "max_queued": settings.broker_max_queued,
            "link_options": nats_options(settings),
        }
        kwargs.update(overrides)
        return cls(settings.broker_url, **kwargs)

    # -- connection -------------------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and create the streams; raise ``BrokerUnavailable`` naming the URL within ``connect_timeout_s``."""
        if self._closed:
            raise BrokerUnavailable(f"the NATS broker for {self.url} was closed; create a new one")
        if self._nc is not None:
            return
        nc = await self._open()
        js = nc.jetstream(timeout=self.request_timeout_s)
        try:
            for config in self._stream_configs():
                await self._ensure_stream(js, config)
        except BaseException:
            await nc.close()
            raise
        self._nc, self._js, self._pubacks = nc, js, PubAcks(nc)
        log.info("connected to NATS at %s", self.url)

    async def close(self) -> None:
        """Idempotent: close subscriptions and listeners, then the connection (one already lost is no error)."""
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(list(self._purges))
        for sub in list(self._subscriptions):
            await sub.close()
        for stream in list(self._listeners):
            await stream.close()
        nc, self._nc, self._js = self._nc, None, None
        pubacks, self._pubacks = self._pubacks, None
        if pubacks is not None:
            await pubacks.close()
        if nc is not None and not nc.is_closed:
            try:
                await nc.close()
            except OSError as exc:
                # nats-py flushes what it buffered while reconnecting onto the lost socket and raises
                # ``ConnectionResetError: Connection lost``: the connection is gone, which is what close wanted.
                log.info("NATS at %s: the connection was already lost when closed (%r)", self.url, exc)

    async def ping(self) -> None:
        """Raise ``BrokerUnavailable`` unless the server and JetStream answer a request within ``ping_timeout_s``.

        Also raises when the client is closed, disconnected, or no longer reading (it then reconnects). Safe to
        cancel, e.g. by a readiness probe's own deadline.
        """
        nc = await self._live_connection()
        try:
            answer = json.loads(await round_trip(nc, self.ping_timeout_s))
        except nats.errors.NoRespondersError as exc:
            raise BrokerUnavailable(f"JetStream does not answer on NATS at {self.url}; is it enabled (-js)?") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise BrokerUnavailable(
                f"NATS at {self.url} did not answer a ping within {self.ping_timeout_s}s: {exc!r}"
            ) from exc
        except ValueError as exc:
            raise BrokerUnavailable(f"NATS at {self.url} answered a ping with something other than JSON") from exc
        if isinstance(answer, dict) and "error" in answer:
            raise BrokerUnavailable(f"JetStream at {self.url} answered a ping with an error: {answer['error']}")

    async def _open(self) -> NATS:
        """Connect, failing fast once every server has refused once (nats-py alone would retry for minutes)."""
        nc = FleetNatsClient()
        gave_up: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failures: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            if not opened:
                failures.append(exc)
                if len(failures) >= len(self._servers) and not gave_up.done():
                    gave_up.set_result(None)
            elif nc.is_connected:
                log.warning("NATS at %s reported: %r", self.url, exc)
            else:
                log.debug("reconnecting to NATS at %s: %r", self.url, exc)

        opened = False
        connecting = asyncio.ensure_future(nc.connect(**self._connect_options(on_error)))
        await asyncio.wait({connecting, gave_up}, timeout=self.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
            opened = True
            return nc
        connecting.cancel()
        outcome = (await asyncio.gather(connecting, return_exceptions=True))[0]
        await asyncio.gather(nc.close(), return_exceptions=True)
        if isinstance(outcome, Exception) and not isinstance(outcome, asyncio.CancelledError):
            failures.append(outcome)
        for failure in failures:
            refused = link_error("NATS", self.url, failure, NATS_AUTH_SETTINGS)
            if refused is not None:
                raise refused from None
        reason = repr(failures[-1]) if failures else f"no answer within {self.connect_timeout_s}s"
        raise BrokerUnavailable(f"cannot connect to NATS at {self.url}: {reason}. Is nats-server running there?")

    def _connect_options(self, on_error: Callable[[Exception], Awaitable[None]]) -> dict[str, Any]:
        return {
            "servers": self._servers,
            "name": "fleet",
            "error_cb": on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "connect_timeout": max(1, int(self.connect_timeout_s)),
            "reconnect_time_wait": RECONNECT_WAIT_S,
            "max_reconnect_attempts": -1,  # keep reconnecting while running; publish raises meanwhile
            "allow_reconnect": True,
            "ping_interval": PING_INTERVAL_S,
            "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
            **self._link_options,
        }

    async def _on_disconnected(self) -> None:
        if self._nc is not None and not self._closed:  # not during a failing first connect
            log.warning("disconnected from NATS at %s; reconnecting", self.url)

    async def _on_reconnected(self) -> None:
        log.info("reconnected to NATS at %s", self.url)
        self._purge_after_reconnect()

    def _connection(self) -> NATS:
        nc = self._nc
        if nc is None or nc.is_closed:
            state = "closed" if self._closed or nc is not None else "not connected (call connect() first)"
            raise BrokerUnavailable(f"the NATS broker for {self.url} is {state}")
        if not nc.is_connected:
            raise BrokerUnavailable(f"disconnected from NATS at {self.url} (reconnecting); try again shortly")
        return nc

    async def _live_connection(self) -> NATS:
        """The connection, when it is open, connected and still reading; ``BrokerUnavailable`` otherwise."""
        nc = self._connection()
        await revive_if_stuck(nc, f"NATS at {self.url}")
        return nc

    async def _live_jetstream(self) -> JetStreamContext:
        await self._live_connection()
        assert self._js is not None
        return self._js

    # -- streams and groups -----------------------------------------------------------------------------------

    def _stream_configs(self) -> list[StreamConfig]:
        common: dict[str, Any] = {
            "duplicate_window": self.dedup_window_s,
            "max_msg_size": self.max_message_bytes + HEADER_ALLOWANCE_BYTES,
            "storage": StorageType.FILE,
        }
        queue, limits = RetentionPolicy.WORK_QUEUE, RetentionPolicy.LIMITS
        age = self.request_max_age_s
        return [
            StreamConfig(
                c.REQ_STREAM, subjects=[c.REQ_PREFIX + ".>"], retention=queue, max_age=age, **common, **self._bound()
            ),
            StreamConfig(INBOX_STREAM, subjects=[c.INBOX_PREFIX + ".>"], retention=queue, max_age=age, **common),
            StreamConfig(
                c.DLQ_STREAM, subjects=[c.DLQ_PREFIX + ".>"], retention=limits, max_age=DLQ_MAX_AGE_S, **common
            ),
        ]

    def _bound(self) -> dict[str, Any]:
        """The per-subject limit of the request stream: discard-new beyond ``max_queued``, or none."""
        if self.max_queued <= 0:
            return {"max_msgs_per_subject": -1, "discard": DiscardPolicy.OLD, "discard_new_per_subject": False}
        return {"max_msgs_per_subject": self.max_queued, "discard": DiscardPolicy.NEW, "discard_new_per_subject": True}

    async def _ensure_stream(self, js: JetStreamContext, config: StreamConfig) -> None:
        """Create the stream, or bring an existing one in line (``ConfigError`` when its retention differs)."""
        try:
            try:
                await js.add_stream(config)
                return
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
            await self._align_stream(js, config)
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
            raise BrokerUnavailable(
                f"JetStream is not enabled on NATS at {self.url}: start nats-server with -js"
            ) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise BrokerUnavailable(f"cannot create stream {config.name} on NATS at {self.url}: {exc!r}") from exc

    async def _align_stream(self, js: JetStreamContext, config: StreamConfig) -> None:
        """Update the window, size limit and max age of an existing stream; JetStream cannot change retention."""
        name = config.name or ""
        current = (await js.stream_info(name)).config
        if current.retention != config.retention:
            have, want = (str(getattr(p, "value", p)) for p in (current.retention, config.retention))  # str or enum
            raise ConfigError(
                f"stream {name} on NATS at {self.url} has {have} retention, but Fleet needs {want} retention "
                f"(an older Fleet created it). JetStream cannot change a stream's retention: delete the stream "
                f"with `nats stream rm {name}` (its waiting messages are lost) and start Fleet again to recreate it"
            )
        aligned = dataclasses.replace(
            current,
            duplicate_window=config.duplicate_window,
            max_msg_size=config.max_msg_size,
            max_age=config.max_age,
            max_msgs_per_subject=config.max_msgs_per_subject,
            discard=config.discard,
            discard_new_per_subject=config.discard_new_per_subject,
        )
        if aligned != current:
            log.info("stream %s: updating its duplicate window, limits and max age to Fleet's settings", name)
            await js.update_stream(aligned)

    def _stream_of(self, subject: str) -> str:
        stream = stream_for(check_subject(subject))
        if stream is None:
            raise ConfigError(
                f"subject {subject!r} is in no Fleet stream; durable subjects are {c.REQ_PREFIX}.<model>, "
                f"{c.DLQ_PREFIX}.<model> and {c.INBOX_PREFIX}.<worker>"
            )
        return stream

    async def _ensure_group(self, subject: str, group: str) -> tuple[str, str]:
        """Create (idempotently) the durable consumer of ``group`` on ``subject``; return (stream, durable)."""
        stream, durable = self._stream_of(subject), durable_name(subject, group)
        if (stream, durable) in self._groups:
            return stream, durable
        js = await self._live_jetstream()
        try:
            info = await self._consumer_info(js, stream, durable)
            if info is None:
                await self._create_group(js, stream, durable, subject)
            else:
                await self._align_group(js, stream, info, subject)
        except nats.errors.Error as exc:
            raise BrokerUnavailable(f"cannot create group {group} on {subject} at {self.url}: {exc!r}") from exc
        self._groups.add((stream, durable))
        return stream, durable

    async def _consumer_info(self, js: JetStreamContext, stream: str, durable: str) -> ConsumerInfo | None:
        try:
            return await js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            return None

    async def _create_group(self, js: JetStreamContext, stream: str, durable: str, subject: str) -> None:
        owners = await self._durables_on(js, stream, subject)
        if durable in owners:  # another process created this very group since we looked: nothing to do
            return
        if owners and stream in WORK_QUEUE_STREAMS:
            raise self._one_group_only(subject, durable, owners[0])
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=MAX_ACK_PENDING,
            deliver_policy=DeliverPolicy.NEW if owners else DeliverPolicy.ALL,
            description=f"Fleet group on {subject}",
        )
        try:
            await js.add_consumer(stream, config)
        except nats.js.errors.APIError as exc:
            if await self._consumer_info(js, stream, durable) is not None:  # lost a race with another process
                return
            if exc.err_code in _WORK_QUEUE_OVERLAP:  # another group took the subject meanwhile
                owners = await self._durables_on(js, stream, subject)
                raise self._one_group_only(subject, durable, owners[0] if owners else "(another consumer)") from exc
            raise

    async def _durables_on(self, js: JetStreamContext, stream: str, subject: str) -> list[str]:
        """The durable consumers of ``stream`` that filter exactly ``subject`` (the API lists them in pages)."""
        found: list[str] = []
        offset = 0
        while page := await js.consumers_info(stream, offset=offset):
            found += [ci.name for ci in page if ci.config.filter_subject == subject]
            offset += len(page)
        return found

    def _one_group_only(self, subject: str, durable: str, owner: str) -> ConfigError:
        group, owning = group_of(durable, subject), group_of(owner, subject)
        return ConfigError(
            f"cannot create group {group!r} on {subject}: group {owning!r} (consumer {owner}) already reads it, and "
            "on NATS a request subject (like an inbox subject) has exactly one group: its stream is a work queue, "
            f"where a message goes to one group and is deleted once acked. Subscribe with group {owning!r}, or "
            f"remove that consumer with `nats consumer rm {stream_for(subject)} {owner}`"
        )

    async def _align_group(self, js: JetStreamContext, stream: str, info: ConsumerInfo, subject: str) -> None:
        config = info.config
        if config.filter_subject != subject:
            raise ConfigError(
                f"consumer {config.durable_name} on {stream} filters {config.filter_subject!r}, "
                f"not {subject!r}; delete it or use another group name"
            )
        changes: dict[str, Any] = {}
        if config.ack_wait != self.ack_wait_s:
            log.info("group %s: ack wait %ss -> %ss", config.durable_name, config.ack_wait, self.ack_wait_s)
            changes["ack_wait"] = self.ack_wait_s
        if config.max_deliver not in (None, -1):  # JetStream would stop delivering before Fleet's rule decides
            log.info("group %s: max deliver %s -> unlimited", config.durable_name, config.max_deliver)
            changes["max_deliver"] = -1
        if changes:
            await js.add_consumer(stream, dataclasses.replace(config, **changes))

    # -- the Broker protocol ----------------------------------------------------------------------------------

    async def ensure_model(self, model: str) -> None:
        """Create the worker groups ``consumer_name(model, level)`` on ``request_subject(model, level)``, one per
        priority level (the streams exist already)."""
        if not c.MODEL_NAME_RE.match(model):
            raise ConfigError(f"model name {model!r} must match {c.MODEL_NAME_RE.pattern}")
        for level in c.PRIORITIES:
            await self._ensure_group(c.request_subject(model, level), c.consumer_name(model, level))

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Publish and wait for the PubAck; a repeated ``msg_id`` within the window is dropped by the server.

        Raises ``PayloadTooLarge``, ``BrokerUnavailable`` (closed or disconnected: nothing was sent),
        ``QueueFull`` (the subject holds ``max_queued`` messages: nothing was stored) or ``PublishFailed`` (no
        stream, no PubAck in time, or rejected: the message may or may not be stored).
        """
        if len(data) > self.max_message_bytes:
            raise PayloadTooLarge(len(data), self.max_message_bytes, what="message")
        await self._live_connection()
        assert self._pubacks is not None
        hdrs = dict(headers) if headers else {}
        if msg_id is not None:
            hdrs[c.HEADER_MSG_ID] = msg_id
        try:
            duplicate = await self._pubacks.publish(
                subject, data, headers=hdrs or None, timeout_s=self.request_timeout_s
            )
        except nats.js.errors.NoStreamResponseError as exc:
            raise PublishFailed(f"no JetStream stream on NATS at {self.url} stores subject {subject!r}") from exc
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLarge(len(data), self._connection().max_payload, what="message") from exc
        except nats.errors.TimeoutError as exc:
            raise PublishFailed(
                f"NATS at {self.url} did not acknowledge a publish to {subject} within {self.request_timeout_s}s"
            ) from exc
        except nats.js.errors.APIError as exc:
            if exc.err_code == _MAX_MSGS_PER_SUBJECT:
                model = subject.removeprefix(c.REQ_PREFIX + ".").split(".", 1)[0]  # echo.high -> echo
                raise QueueFull(model, self.max_queued or None) from exc
            raise PublishFailed(f"JetStream at {self.url} rejected a publish to {subject}: {exc.description}") from exc
        except nats.errors.Error as exc:
            raise BrokerUnavailable(f"cannot publish to {subject} on NATS at {self.url}: {exc!r}") from exc
        if duplicate:
            log.debug("NATS dropped a duplicate of %s on %s", msg_id, subject)

    async def subscribe(self, subject: str, group: str) -> NatsSubscription:
        """A competing consumer of ``group`` on ``subject`` (the durable consumer is created if needed)."""
        stream, durable = await self._ensure_group(subject, group)
        sub = NatsSubscription(
            await self._live_connection(),
            stream=stream,
            durable=durable,
            subject=subject,
            group=group,
            settle_timeout_s=self.request_timeout_s,
            ack_wait_s=self.ack_wait_s,
        )
        await sub.start()
        self._subscriptions = {s for s in self._subscriptions if not s.closed}
        self._subscriptions.add(sub)
        if stream in WORK_QUEUE_STREAMS:
            await self._purge_leftovers(stream, durable, subject)
        return sub

    async def _purge_leftovers(self, stream: str, durable: str, subject: str) -> None:
        """Purge acked messages a restarted server kept (``nats_leftovers``); a failure is logged, never raised."""
        try:
            await purge_acked(await self._live_jetstream(), stream, durable, subject)
        except (nats.errors.Error, BrokerError) as exc:
            log.warning("%s: acked leftovers of %s not checked (%r)", stream, subject, exc)

    def _purge_after_reconnect(self) -> None:
        """After a reconnection (the server may have restarted): check every work-queue subject subscribed to."""
        js = self._js
        if js is None or self._closed:
            return
        for sub in self._subscriptions:
            stream = self._stream_of(sub.subject)
            if not sub.closed and stream in WORK_QUEUE_STREAMS:
                task = asyncio.create_task(purge_acked_until_answered(js, stream, sub.durable, sub.subject))
                self._purges.add(task)
                task.add_done_callback(self._purges.discard)

    async def lag(self, subject: str, group: str) -> int:
        """Messages ``group`` has not acked: waiting (num_pending) plus in flight (num_ack_pending).

        Without that group: what it would receive if created now (the subject's stored messages while no group
        reads it, else 0), as on the in-memory broker.
        """
        stream, durable = self._stream_of(subject), durable_name(subject, group)
        js = await self._live_jetstream()
        try:
            info = await self._consumer_info(js, stream, durable)
            if info is None:
                return await self._unclaimed(js, stream, subject)
        except nats.errors.Error as exc:
            raise BrokerUnavailable(f"cannot read the lag of {durable} at {self.url}: {exc!r}") from exc
        return (info.num_pending or 0) + (info.num_ack_pending or 0)

    async def oldest_waiting_age_s(self, subject: str, group: str) -> float | None:
        """Seconds since the oldest message ``group`` has not acked was stored: the first message on ``subject``
        after the consumer's ack floor (``ack_floor.stream_seq + 1``, a direct ``STREAM.MSG.GET`` with
        ``next_by_subj``), by its stream timestamp. None when the group has nothing pending or in flight. Without
        that group: the subject's oldest stored message. Two JetStream API requests (one when idle)."""
        stream, durable = self._stream_of(subject), durable_name(subject, group)
        js = await self._live_jetstream()
        try:
            info = await self._consumer_info(js, stream, durable)
            floor = 0
            if info is not None:
                if not (info.num_pending or 0) + (info.num_ack_pending or 0):
                    return None
                floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            message = await js.get_msg(stream, seq=(floor or 0) + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        except nats.errors.Error as exc:
            raise BrokerUnavailable(f"cannot read the queue age of {durable} at {self.url}: {exc!r}") from exc
        if message.time is None:
            return None
        return max(0.0, time.time() - message.time.timestamp())

    async def _unclaimed(self, js: JetStreamContext, stream: str, subject: str) -> int:
        """What a first group created on ``subject`` now would receive: its stored messages, or 0 if it has a group."""
        if await self._durables_on(js, stream, subject):
            return 0
        state = (await js.stream_info(stream, subjects_filter=subject)).state
        return (state.subjects or {}).get(subject, 0)

    async def emit(self, subject: str, data: bytes) -> None:
        """Best effort core NATS publish (no stream, no ack)."""
        if len(data) > self.max_message_bytes:
            raise PayloadTooLarge(len(data), self.max_message_bytes, what="event")
        try:
            await (await self._live_connection()).publish(subject, data)
        except nats.errors.Error as exc:
            raise BrokerUnavailable(f"cannot emit on {subject} at {self.url}: {exc!r}") from exc

    async def listen(self, subject: str) -> NatsEventStream:
        """Events on subjects matching ``subject`` (NATS wildcards) from now on."""
        stream = NatsEventStream(
            await self._live_connection(), check_subject(subject, wildcards=True), timeout_s=self.request_timeout_s
        )
        await stream.start()
        self._listeners = {s for s in self._listeners if not s.closed}
        self._listeners.add(stream)
        return stream
