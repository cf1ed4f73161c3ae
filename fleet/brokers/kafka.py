"""The Kafka broker (aiokafka): ``KafkaBroker("kafka://host:9092", settings=...)`` implements ``Broker``.

Names. A subject is its own topic name (``fleet.req.echo``; rules in ``kafka_names``). ``ensure_model`` creates
the request topic with ``settings.kafka_partitions`` partitions and the dead-letter topic with one partition; any
other topic Fleet publishes or subscribes to is created with one partition on first use. Creation needs
``settings.kafka_auto_create`` (the default); with it off a missing topic is a ``ConfigError`` that names it and
the ``kafka-topics.sh`` command that creates it (``ensure_model`` names all of a model's missing topics at once).
Control events (``emit``/``listen``) share the one-partition topic ``fleet.ctl`` with the subject as record key.
A consumer group is the ``group`` given to ``subscribe`` (``fleet-<model>`` for workers).

Guarantees (the contract in ``fleet.brokers.base``, as Kafka can give it):

* ``publish`` uses an idempotent producer with ``acks=all`` and returns once the record is written; the job id
  (``msg_id``) is the record key and the other metadata rides in headers. ``publish_many`` writes a list of
  messages the same way, in record batches (``kafka_batches``): one produce future per batch of a partition.
  Both wait for the acknowledgement at most ``request_timeout_ms`` (aiokafka alone retries for as long as the
  partition's leader is known, a whole outage of a one-broker cluster), then raise ``BrokerUnavailable``: the
  record may or may not be written, and publishing the same id again is safe.
* De-duplication: Kafka's idempotent producer only removes its own retries. A republish of a ``msg_id`` that this
  broker object published within ``dedup_window_s`` is dropped before it is sent; a copy that still reaches the
  topic (published by another process) is dropped by the consumer that owns the partition when its record
  timestamp is within the window of the first copy's. Copies that escape both (after a partition hand-over) are
  made harmless by the worker: a job already terminal in the store is acked without recomputing. Records are
  placed by key with the Java client's murmur2 hash (aiokafka's default); a producer outside Fleet must hash the
  same way for its copies to meet Fleet's (librdkafka and kcat: ``-X partitioner=murmur2_random``).
* Delivery is at least once. Each partition belongs to one member of the group, so a member gets only the
  messages of its partitions (members beyond the partition count idle). ``nak`` and an expired ack wait
  redeliver to the same member; its partitions move to others when it leaves or its session times out.
  ``delivery_count`` survives those hand-overs and crashes: it is stored in the metadata of the commit that
  ``fetch`` makes before it hands a batch out, waiting for it at most ``count_commit_wait_ms``. Only a batch whose
  commit failed (in a rebalance) or was still unanswered then, and whose counts no later commit carried before the
  crash, restarts from the counts committed before it (see ``kafka_subscription``).
* Order: first deliveries of a partition come in offset order; redeliveries come before new records; there is
  no order across partitions (records are spread by job id).
* ``lag`` is, summed over the partitions, the end offset minus the group's committed offset (the log start when
  the group has committed nothing), so it counts waiting and in-flight messages; acks this process has not
  committed yet count as committed. Partition counts are described again at most every ``PARTITIONS_TTL_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from aiokafka.structs import OffsetAndMetadata

from fleet import constants as c
from fleet.brokers.base import Outgoing
from fleet.brokers.kafka_batches import KeyPartitioner, Record, send_batches
from fleet.brokers.kafka_events import EVENTS_TOPIC, KafkaEventStream
from fleet.brokers.kafka_names import bootstrap_servers, start_client, stop_client, stopping_clients, topic_for
from fleet.brokers.kafka_peek import Peeker
from fleet.brokers.kafka_subscription import KafkaSubscription
from fleet.brokers.recent import RecentKeys
from fleet.brokers.subjects import check_group, check_subject
from fleet.errors import BrokerUnavailable, ConfigError, LinkRefused, PayloadTooLarge, PublishFailed
from fleet.links import kafka_options, link_error
from fleet.redaction import redact
from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

TOPIC_EXISTS = 36  # Kafka error code TOPIC_ALREADY_EXISTS
HEADROOM_BYTES = 64 * 1024  # record and batch overhead above max_message_bytes
EVENTS_RETENTION_MS = 3_600_000
RETRY_BACKOFF_S = 0.1
RECENT_IDS = 200_000  # message ids this process published that it remembers for de-duplication
PARTITIONS_TTL_S = 5.0  # how long lag() trusts a topic's partition count
KAFKA_AUTH_SETTINGS = "FLEET_KAFKA_SASL_MECHANISM, FLEET_KAFKA_USER and FLEET_KAFKA_PASSWORD_FILE"
MAX_TOPIC_NAMES = 4096  # subjects whose topic name is remembered (inbox subjects come and go with workers)


class KafkaBroker:
    """Fleet's broker seam over Apache Kafka. Construct, ``await connect()``, use, ``await close()``.

    Args:
        url: ``kafka://host:port[,host:port...]``.
        settings: SASL and SSL (``kafka_*``, through ``fleet.links``), partitions, auto-creation, ack wait,
            de-duplication window and message size limit.
        session_timeout_ms, heartbeat_interval_ms: consumer-group liveness; a dead member's partitions move after
            the session timeout, a live member learns of a rebalance within a heartbeat.
        request_timeout_ms: for every Kafka request and a publish's acknowledgement; ``connect_timeout_s`` bounds
            ``connect`` and ``ping``.
        replication_factor: of the topics Fleet creates; ``None`` takes min(3, brokers in the cluster).
        count_commit_wait_ms: how long ``fetch`` waits for the commit of a batch's delivery counts before it hands
            the batch out anyway (see ``kafka_subscription``).
    """

    scheme = "kafka"

    def __init__(
        self,
        url: str,
        *,
        settings: FleetSettings,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 500,
        request_timeout_ms: int = 10_000,
        connect_timeout_s: float = 5.0,
        replication_factor: int | None = None,
        count_commit_wait_ms: int = 1_000,
    ) -> None:
        self.url = redact(url)  # what messages and logs name
        self.settings = settings
        self._bootstrap = bootstrap_servers(url)
        self._link_options = kafka_options(settings)  # SASL and SSL (fleet.links): every client gets them
        self._session_timeout_ms = session_timeout_ms
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._request_timeout_ms = request_timeout_ms
        self._connect_timeout_s = connect_timeout_s
        self._replication_factor = replication_factor
        self._count_commit_wait_ms = count_commit_wait_ms
        self._admin: AIOKafkaAdminClient | None = None
        self._producer: AIOKafkaProducer | None = None
        self._offsets: AIOKafkaConsumer | None = None  # group-less consumer for end/beginning offsets
        self._offsets_lock = asyncio.Lock()
        self._peeker = Peeker(self._client_options("peek"), self.url)  # reads the oldest waiting records' times
        self._topics: set[str] = set()
        self._recent = RecentKeys(settings.dedup_window_s, RECENT_IDS)  # msg id -> monotonic time of its publish
        self._publishing: dict[str, list[asyncio.Future[None]] | None] = {}  # msg id -> waiters of its publish
        self._topic_names: dict[str, str] = {}
        self._partition_counts: dict[str, tuple[float, int]] = {}  # topic -> (monotonic time described, count)
        self._subscriptions: set[KafkaSubscription] = set()
        self._streams: set[KafkaEventStream] = set()

    @classmethod
    def from_settings(cls, settings: FleetSettings, **options: Any) -> KafkaBroker:
        """The broker for ``settings.broker_url``; ``options`` are the keyword arguments of the constructor."""
        return cls(settings.broker_url, settings=settings, **options)

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect the admin client and the idempotent producer; ``BrokerUnavailable`` naming the URL if not."""
        if self._producer is not None:
            return
        try:
            self._admin, self._producer = await self._start_clients()
        except (KafkaError, OSError, TimeoutError) as exc:
            refused = link_error("Kafka", self.url, exc, KAFKA_AUTH_SETTINGS) or await self._refused_link()
            if refused is not None:
                raise refused from None
            reason = f"no answer within {self._connect_timeout_s}s" if isinstance(exc, TimeoutError) else str(exc)
            raise BrokerUnavailable(
                f"cannot reach Kafka at {self.url} ({reason}): is the broker running and is the URL right?"
            ) from exc
        log.info("connected to Kafka at %s", self.url)

    async def _refused_link(self) -> LinkRefused | None:
        """Why a secured bootstrap failed, when the server refused the login or the TLS handshake.

        aiokafka's bootstrap only logs the cause and raises "Unable to bootstrap", so one connection is opened
        directly to the first server with the same options to read the real error.
        """
        if not self._link_options:
            return None
        host, _, port = self._bootstrap[0].rpartition(":")
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn = await create_conn(
                    host.strip("[]"), int(port), request_timeout_ms=self._request_timeout_ms, **self._link_options
                )
            conn.close()
        except (KafkaError, OSError, TimeoutError) as exc:
            return link_error("Kafka", self.url, exc, KAFKA_AUTH_SETTINGS)
        return None

    async def _start_clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaProducer]:
        admin = AIOKafkaAdminClient(**self._client_options("admin"))
        await start_client(admin.start, admin.close, timeout_s=self._connect_timeout_s)
        try:
            producer = AIOKafkaProducer(
                enable_idempotence=True,
                acks="all",
                partitioner=KeyPartitioner(),
                max_request_size=self.settings.max_message_bytes + HEADROOM_BYTES,
                **self._client_options("producer"),
            )
            await start_client(producer.start, producer.stop, timeout_s=self._connect_timeout_s)
        except BaseException:
            await stop_client(admin.close)
            raise
        return admin, producer

    async def close(self) -> None:
        """Close subscriptions and event streams left open (with a warning), the producer (what it still holds is
        dropped after ``request_timeout_ms``) and the admin client."""
        for sub in list(self._subscriptions):
            log.warning("Kafka subscription on %r (group %r) was not closed; closing it", sub.topic, sub.group)
            await sub.close()
        for stream in list(self._streams):
            await stream.close()
        async with self._offsets_lock:  # a lag() starting the offsets reader finishes that first
            producer, admin, offsets = self._producer, self._admin, self._offsets
            self._producer = self._admin = self._offsets = None
        if producer is not None:
            await self._flush_or_drop(producer)
            await stop_client(producer.stop)
        if offsets is not None:
            await stop_client(offsets.stop)
        await self._peeker.close()
        if admin is not None:
            await stop_client(admin.close)
        await stopping_clients()  # clean-ups of starts that timed out or were cancelled

    async def _flush_or_drop(self, producer: AIOKafkaProducer) -> None:
        """Give what the producer still holds (control events: every publish waited for its own acknowledgement)
        ``request_timeout_ms`` to be delivered, then fail it: aiokafka's ``stop`` would otherwise retry it for as
        long as the broker is down, and a process told to stop during an outage would never exit."""
        try:
            async with asyncio.timeout(self._request_timeout_ms / 1000):
                await producer.flush()
        except TimeoutError:
            log.warning("Kafka at %s: control events not delivered before closing; dropped", self.url)
            # aiokafka has no public way to drop them; its ``stop`` goes on at once when the sender task has ended.
            sender = getattr(getattr(producer, "_sender", None), "sender_task", None)
            if sender is not None:
                sender.cancel()

    async def ping(self) -> None:
        """Raise ``BrokerUnavailable`` unless a metadata request answers within the connect timeout."""
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self._require_admin().describe_cluster()
        except (KafkaError, OSError, TimeoutError) as exc:
            raise BrokerUnavailable(f"Kafka at {self.url} does not answer: {exc!r}") from exc

    def _client_options(self, role: str) -> dict[str, Any]:
        return {
            "bootstrap_servers": self._bootstrap,
            "client_id": f"fleet-{role}",
            "request_timeout_ms": self._request_timeout_ms,
            **self._link_options,
        }

    def _require_admin(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            raise BrokerUnavailable(f"Kafka broker {self.url} is not connected: call connect() first")
        return self._admin

    # -- topics -----------------------------------------------------------------------------------------------

    async def ensure_model(self, model: str) -> None:
        """Create the model's request topics (one per priority level, ``kafka_partitions`` each), its dead-letter
        topic and the events topic.

        With ``kafka_auto_create`` off nothing is created: a ``ConfigError`` names every missing topic and the
        ``kafka-topics.sh`` command that creates it.
        """
        if not c.MODEL_NAME_RE.match(model):
            raise ConfigError(f"model name {model!r} must match {c.MODEL_NAME_RE.pattern}")
        partitions = self.settings.kafka_partitions
        wanted = {topic_for(c.request_subject(model, level)): partitions for level in c.PRIORITIES}
        wanted |= {
            topic_for(c.dlq_subject(model)): 1,
            EVENTS_TOPIC: 1,
        }
        if not self.settings.kafka_auto_create:  # name every missing topic at once, not one per restart
            missing = {
                t: p for t, p in wanted.items() if t not in self._topics and await self._partition_count(t) is None
            }
            if missing:
                raise self._missing_topics(missing)
        for topic, partitions in wanted.items():
            await self._ensure_topic(topic, partitions)

    async def _ensure_topic(self, topic: str, partitions: int = 1) -> None:
        if topic in self._topics:
            return
        found = await self._partition_count(topic)
        if found is None:
            if not self.settings.kafka_auto_create:
                raise self._missing_topics({topic: partitions})
            await self._create_topic(topic, partitions)
        elif found < partitions:
            log.warning("Kafka topic %r has %d partitions, fewer than the %d configured", topic, found, partitions)
        self._topics.add(topic)

    def _missing_topics(self, missing: dict[str, int]) -> ConfigError:
        names = ", ".join(repr(t) for t in missing)
        them, verb = ("them", "do not exist") if len(missing) > 1 else ("it", "does not exist")
        bootstrap = ",".join(self._bootstrap)
        commands = "; ".join(
            f"kafka-topics.sh --bootstrap-server {bootstrap} --create --topic {t} --partitions {p}"
            for t, p in missing.items()
        )
        return ConfigError(
            f"Kafka topic{'s' if len(missing) > 1 else ''} {names} {verb} on {self.url} and kafka_auto_create is "
            f"off: create {them} ({commands}) or set FLEET_KAFKA_AUTO_CREATE=true"
        )

    async def _partition_count(self, topic: str) -> int | None:
        try:
            described = await self._require_admin().describe_topics([topic])
        except KafkaError as exc:
            raise BrokerUnavailable(f"Kafka at {self.url}: describing topic {topic!r} failed: {exc!r}") from exc
        for info in described:
            if info["topic"] == topic and info["error_code"] == 0:
                return len(info["partitions"])
        return None

    async def _create_topic(self, topic: str, partitions: int) -> None:
        admin = self._require_admin()
        configs = {"max.message.bytes": str(self.settings.max_message_bytes + HEADROOM_BYTES)}
        if topic == EVENTS_TOPIC:
            configs["retention.ms"] = str(EVENTS_RETENTION_MS)
        new = NewTopic(topic, partitions, await self._replicas(), topic_configs=configs)
        try:
            response = await admin.create_topics([new])
        except KafkaError as exc:
            raise BrokerUnavailable(f"Kafka at {self.url}: creating topic {topic!r} failed: {exc!r}") from exc
        for name, code, *rest in response.topic_errors:
            if name == topic and code not in (0, TOPIC_EXISTS):
                raise ConfigError(f"Kafka at {self.url} refused to create topic {topic!r}: error {code} {rest}")
        log.info("created Kafka topic %r with %d partitions", topic, partitions)

    async def _replicas(self) -> int:
        if self._replication_factor is not None:
            return self._replication_factor
        cluster = await self._require_admin().describe_cluster()
        return max(1, min(3, len(cluster.get("brokers", []))))

    # -- publish ----------------------------------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Write one record (key ``msg_id``) and wait for ``acks=all``; a ``msg_id`` seen in the window is dropped.

        Raises ``PayloadTooLarge``, ``ConfigError`` (missing topic, auto-creation off), ``BrokerUnavailable`` or
        ``PublishFailed``.
        """
        if len(data) > self.settings.max_message_bytes:
            raise PayloadTooLarge(len(data), self.settings.max_message_bytes, what="message")
        topic = self._topic_names.get(subject) or self._topic_name(subject)
        if self._producer is None:
            raise BrokerUnavailable(f"Kafka broker {self.url} is not connected: call connect() first")
        if topic not in self._topics:
            await self._ensure_topic(topic)
        if msg_id is None:
            await self._send(topic, data, None, headers)
            return
        if self._recent.seen(msg_id, time.monotonic()):
            log.debug("dropping duplicate publish of %r on %r", msg_id, topic)
            return
        if msg_id in self._publishing:  # the same id is being published right now: share its outcome
            await self._outcome_of(msg_id)
            return
        # Nobody waits on most publishes: the list of waiters is made only when a second publish of the id arrives.
        self._publishing[msg_id] = None
        outcome: BaseException | None = None
        try:
            await self._send(topic, data, msg_id, headers)
            self._recent.add(msg_id, time.monotonic())
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            waiters = self._publishing.pop(msg_id)
            if waiters:
                _settle_waiters(waiters, outcome)

    def _topic_name(self, subject: str) -> str:
        """``topic_for`` remembered: a publish to a known subject skips checking its name again."""
        topic = topic_for(subject)
        if len(self._topic_names) >= MAX_TOPIC_NAMES:
            self._topic_names.clear()
        self._topic_names[subject] = topic
        return topic

    async def _outcome_of(self, msg_id: str) -> None:
        """Wait for the publish of ``msg_id`` in progress and share its outcome (its error, its cancellation)."""
        waiters = self._publishing[msg_id]
        if waiters is None:
            waiters = self._publishing[msg_id] = []
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        await waiter  # cancelling this only cancels this waiter, never the publish it waits for

    async def _send(self, topic: str, data: bytes, key: str | None, headers: Mapping[str, str] | None) -> None:
        producer = self._producer
        if producer is None:
            raise BrokerUnavailable(f"Kafka broker {self.url} is not connected: call connect() first")
        try:
            sent = await producer.send(topic, data, key=key.encode() if key else None, headers=_encoded(headers))
            await _acknowledged(sent, self._request_timeout_ms / 1000)
        except KafkaError as exc:
            raise self._publish_error(topic, exc) from exc

    def _publish_error(self, topic: str, exc: Exception) -> Exception:
        """Fleet's error for a record Kafka did not take: unreachable (retriable) or refused."""
        if isinstance(exc, KafkaTimeoutError):
            return BrokerUnavailable(
                f"Kafka at {self.url} did not acknowledge the record on {topic!r} ({exc}): it may or may not be "
                "written; publishing it again with the same id is safe"
            )
        if isinstance(exc, KafkaConnectionError):
            return BrokerUnavailable(f"Kafka at {self.url} did not take the record on {topic!r}: {exc!r}")
        if isinstance(exc, KafkaError):
            return PublishFailed(f"Kafka at {self.url} refused the record on {topic!r}: {exc!r}")
        return exc

    async def publish_many(self, messages: Sequence[Outgoing]) -> None:
        """Publish each message as ``publish`` does (the same records, de-duplication and errors), in record batches.

        Returns once every message is written with ``acks=all``. Nothing is sent when a message is too large
        (``PayloadTooLarge``); otherwise every message is tried and the first error is raised at the end: messages
        written before it stay written, and publishing the same ids again is de-duplicated.
        """
        for message in messages:
            if len(message.data) > self.settings.max_message_bytes:
                raise PayloadTooLarge(len(message.data), self.settings.max_message_bytes, what="message")
        producer = self._producer
        if producer is None:
            raise BrokerUnavailable(f"Kafka broker {self.url} is not connected: call connect() first")
        by_topic, shared, mine = await self._claim(messages)
        failures: list[Exception] = []
        interrupted: BaseException | None = None
        try:
            for topic, batch in by_topic.items():
                records = [Record(m.msg_id.encode() if m.msg_id else None, m.data, _encoded(m.headers)) for m in batch]
                outcomes = await send_batches(producer, topic, records, timeout_s=self._request_timeout_ms / 1000)
                now = time.monotonic()
                for message, outcome in zip(batch, outcomes, strict=True):
                    error = None if outcome is None else self._publish_error(topic, outcome)
                    if error is not None:
                        failures.append(error)
                    if message.msg_id is not None:
                        if error is None:
                            self._recent.add(message.msg_id, now)
                        mine.discard(message.msg_id)
                        _settle_waiters(self._publishing.pop(message.msg_id) or [], error)
        except BaseException as exc:
            interrupted = exc
            raise
        finally:  # cancelled or failed before every outcome was known: the ids still claimed share that
            for msg_id in mine:
                _settle_waiters(self._publishing.pop(msg_id, None) or [], interrupted)
        for msg_id in shared:
            try:
                await self._outcome_of(msg_id)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _claim(self, messages: Sequence[Outgoing]) -> tuple[dict[str, list[Outgoing]], list[str], set[str]]:
        """Sort ``messages`` into what to send per topic, dropping ids published within the window or earlier in
        the list: returns (messages per topic, ids another publish is sending now, ids claimed for this one)."""
        by_topic: dict[str, list[Outgoing]] = {}
        shared: list[str] = []
        mine: set[str] = set()
        now = time.monotonic()
        try:
            for message in messages:
                topic = self._topic_names.get(message.subject) or self._topic_name(message.subject)
                if topic not in self._topics:
                    await self._ensure_topic(topic)
                self._sort(message, topic, now, by_topic, shared, mine)
        except BaseException as exc:  # nothing was sent: publishes that joined a claimed id meanwhile share the error
            for msg_id in mine:
                _settle_waiters(self._publishing.pop(msg_id, None) or [], exc)
            raise
        return by_topic, shared, mine

    def _sort(
        self,
        message: Outgoing,
        topic: str,
        now: float,
        by_topic: dict[str, list[Outgoing]],
        shared: list[str],
        mine: set[str],
    ) -> None:
        msg_id = message.msg_id
        if msg_id is not None:
            if msg_id in mine or self._recent.seen(msg_id, now):
                return
            if msg_id in self._publishing:
                if msg_id not in shared:
                    shared.append(msg_id)
                return
            mine.add(msg_id)
            self._publishing[msg_id] = None
        by_topic.setdefault(topic, []).append(message)

    # -- consume ----------------------------------------------------------------------------------------------

    async def subscribe(self, subject: str, group: str) -> KafkaSubscription:
        """Join consumer group ``group`` on the subject's topic; returns after the first partition assignment."""
        topic = topic_for(subject)
        check_group(group)
        self._require_admin()
        await self._ensure_topic(topic)
        sub = KafkaSubscription(
            topic,
            group,
            consumer_options=self._consumer_options(group),
            read_committed=lambda tps: self._committed(group, tps),
            ack_wait_s=self.settings.ack_wait_s,
            dedup_window_s=self.settings.dedup_window_s,
            commit_timeout_s=self._request_timeout_ms / 1000,
            count_commit_wait_s=self._count_commit_wait_ms / 1000,
            on_close=self._subscriptions.discard,
        )
        self._subscriptions.add(sub)
        try:
            await sub.start(join_timeout_s=max(10.0, 3 * self._session_timeout_ms / 1000))
        except KafkaError as exc:
            await sub.close()
            raise BrokerUnavailable(f"Kafka at {self.url}: joining group {group!r} failed: {exc!r}") from exc
        except BaseException:
            await sub.close()
            raise
        return sub

    def _consumer_options(self, group: str) -> dict[str, Any]:
        fetch_bytes = max(1 << 20, self.settings.max_message_bytes + HEADROOM_BYTES)
        return {
            **self._client_options(f"consumer-{group}"),
            "auto_offset_reset": "earliest",
            "session_timeout_ms": self._session_timeout_ms,
            "heartbeat_interval_ms": self._heartbeat_interval_ms,
            "max_partition_fetch_bytes": fetch_bytes,
            "fetch_max_bytes": max(fetch_bytes, 50 << 20),
            "fetch_max_wait_ms": 100,
        }

    async def _committed(self, group: str, tps: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        admin = self._require_admin()
        deadline = time.monotonic() + self._request_timeout_ms / 1000
        while True:
            try:
                return await admin.list_consumer_group_offsets(group, partitions=sorted(tps))
            except KafkaError as exc:  # e.g. the coordinator is still loading __consumer_offsets
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(RETRY_BACKOFF_S)

    async def lag(self, subject: str, group: str) -> int:
        """Messages the group has not settled: end offset minus committed offset, summed over partitions.

        Acks of this process's members of the group that are not committed yet count as committed (they are
        within ``kafka_subscription.COMMIT_DELAY_S``): read from the members rather than committed first, so that
        polling lag adds no commits to the group's (serialised) commits.
        """
        return sum(end - done for done, end in (await self._unsettled(topic_for(subject), group)).values())

    async def oldest_waiting_age_s(self, subject: str, group: str) -> float | None:
        """Seconds since the oldest record the group has not settled was written: the records at the group's
        committed offsets (as ``lag`` counts them) of the partitions with a backlog, read by a group-less consumer
        (``fleet.brokers.kafka_peek``), by their timestamps. None when no partition has a backlog."""
        waiting = {tp: done for tp, (done, _end) in (await self._unsettled(topic_for(subject), group)).items()}
        stamps = await self._peeker.first_timestamps_ms(waiting, self._request_timeout_ms / 1000)
        return max(0.0, time.time() - min(stamps) / 1000) if stamps else None

    async def _unsettled(self, topic: str, group: str) -> dict[TopicPartition, tuple[int, int]]:
        """Per partition with a backlog: (the group's first unsettled offset, the end offset)."""
        count = await self._partition_count_for_lag(topic)
        tps = [TopicPartition(topic, p) for p in range(count)]
        offsets = await self._offsets_reader()
        try:
            end = await offsets.end_offsets(tps)
            start = await offsets.beginning_offsets(tps)
            committed = await self._committed(group, set(tps))
        except KafkaError as exc:
            raise BrokerUnavailable(f"Kafka at {self.url}: reading offsets of {topic!r} failed: {exc!r}") from exc
        local: dict[TopicPartition, int] = {}
        for sub in list(self._subscriptions):
            if sub.topic == topic and sub.group == group:
                local.update(sub.settled_offsets())
        out = {}
        for tp in tps:
            done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else start[tp]
            done = max(done, local.get(tp, done), start[tp])
            if end[tp] > done:
                out[tp] = (done, end[tp])
        return out

    async def _partition_count_for_lag(self, topic: str) -> int:
        """The topic's partition count, described again at most every PARTITIONS_TTL_S: ``lag`` is polled often (by
        autoscalers, benchmarks, drain loops) and partitions are only ever added, rarely."""
        now = time.monotonic()
        cached = self._partition_counts.get(topic)
        if cached is not None and now - cached[0] < PARTITIONS_TTL_S:
            return cached[1]
        count = await self._partition_count(topic)
        if count is None:
            self._partition_counts.pop(topic, None)
            raise ConfigError(f"Kafka topic {topic!r} does not exist on {self.url}")
        if len(self._partition_counts) >= MAX_TOPIC_NAMES:
            self._partition_counts.clear()
        self._partition_counts[topic] = (now, count)
        return count

    async def _offsets_reader(self) -> AIOKafkaConsumer:
        async with self._offsets_lock:  # one reader, even when lag() calls overlap
            if self._offsets is None:
                self._require_admin()
                reader = AIOKafkaConsumer(enable_auto_commit=False, **self._client_options("offsets"))
                try:
                    await start_client(reader.start, reader.stop)  # stopped again on any error or cancellation
                except KafkaError as exc:
                    raise BrokerUnavailable(f"Kafka at {self.url} does not answer: {exc!r}") from exc
                self._offsets = reader
            return self._offsets

    # -- control events ---------------------------------------------------------------------------------------

    async def emit(self, subject: str, data: bytes) -> None:
        """Best effort: queue an event on ``fleet.ctl`` keyed by ``subject``; failures are only logged."""
        check_subject(subject)
        producer = self._producer
        if producer is None:
            raise BrokerUnavailable(f"Kafka broker {self.url} is not connected: call connect() first")
        await self._ensure_topic(EVENTS_TOPIC)
        try:
            sent = await producer.send(EVENTS_TOPIC, data, key=subject.encode())
        except KafkaError as exc:
            log.warning("control event on %r not sent: %r", subject, exc)
            return
        sent.add_done_callback(_log_event_failure)

    async def listen(self, subject: str) -> KafkaEventStream:
        """Events whose subject matches the NATS-style pattern ``subject``, from now on."""
        check_subject(subject, wildcards=True)
        self._require_admin()
        await self._ensure_topic(EVENTS_TOPIC)
        partitions = await self._partition_count(EVENTS_TOPIC) or 1
        stream = KafkaEventStream(subject, self._client_options("events"), on_close=self._streams.discard)
        self._streams.add(stream)
        try:
            await stream.start(partitions)
        except BaseException:
            await stream.close()
            raise
        return stream


async def _acknowledged(sent: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait for a record's acknowledgement at most ``timeout_s``: aiokafka retries a record for as long as its
    partition's leader is known (a whole outage of a one-broker cluster), and a publish must say it failed."""
    done, _ = await asyncio.wait({sent}, timeout=timeout_s)  # the future is not cancelled: it may still succeed
    if not done:
        raise KafkaTimeoutError(f"no acknowledgement within {timeout_s:g}s")
    sent.result()


def _encoded(headers: Mapping[str, str] | None) -> list[tuple[str, bytes]]:
    return [(k, v.encode()) for k, v in (headers or {}).items()]


def _settle_waiters(waiters: list[asyncio.Future[None]], outcome: BaseException | None) -> None:
    """Hand the outcome of a publish to the publishes of the same id that waited for it."""
    for waiter in waiters:
        if waiter.done():
            continue
        if outcome is None:
            waiter.set_result(None)
        elif isinstance(outcome, Exception):
            waiter.set_exception(outcome)
        else:  # cancelled (or interrupted): so are the publishes that shared it
            waiter.cancel()


def _log_event_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("control event not delivered: %r", sent.exception())
